"""
The run folder: what train.py writes in out_dir/run_name/ and how, and the one reader of it that the analysis
uses. None of it needs reading to change the science.

    config.json                  every setting as resolved, the torch version, device, git commit, data checksum
    metrics.jsonl                one JSON record per logged iteration (read_metrics survives a cut last line)
    snapshots/qk_NNNNNNN.npz     W_Q and W_K (float32) of every layer at every logged iteration
    models/model_NNNNNNN.pt      model weights at log-spaced iterations, for the token-level analysis
    ckpt.pt                      the latest training state (model, optimizer, RNG states, W(0), control state)
    done.json                    the final numbers, written last: the run is complete
    .lock                        held (fcntl.flock) by the one process training there

Every file is written whole (a temporary name, then a rename), so a kill never leaves half of one; a failed
write is one line naming the path and the cause. Also here: devices and DDP, and the clean exit on a signal.
"""
import contextlib
import errno
import fcntl
import io
import json
import os
import random
import re
import signal
import sys

import numpy as np
import torch

from configurator import Stop

LOCK_FILE = '.lock'
# what train.py writes in a run folder (with snapshots/ and models/): starting over deletes these, nothing else
RUN_FILE = re.compile(r'(done\.json|ckpt\.pt|metrics\.jsonl|config\.json)(\.tmp)?')
SNAPSHOT = re.compile(r'(?:\.tmp_|qk_)(\d{7,})\.npz')
MODEL = re.compile(r'model_(\d{7,})\.pt(?:\.tmp)?')


# ----------------------------------------------------------------------------- names and listings

def file_path(run_dir, sub, it):
    """The snapshot (sub='snapshots') or model checkpoint (sub='models') of iteration it."""
    return os.path.join(run_dir, sub, f'qk_{it:07d}.npz' if sub == 'snapshots' else f'model_{it:07d}.pt')


def iteration_of(name):
    """The iteration in a snapshot or model file name (qk_0000100.npz, model_0000100.pt), or None."""
    match = SNAPSHOT.fullmatch(name) or MODEL.fullmatch(name)
    return int(match.group(1)) if match else None


def listing(run_dir, sub):
    """[(iteration, path)] of the finished snapshots (sub='snapshots') or model checkpoints (sub='models')."""
    folder = os.path.join(run_dir, sub)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    prefix = 'qk_' if sub == 'snapshots' else 'model_'
    return sorted((iteration_of(n), os.path.join(folder, n)) for n in names
                  if n.startswith(prefix) and not n.endswith('.tmp') and iteration_of(n) is not None)


# ----------------------------------------------------------------------------- writing

RUN_FIX = ('choose another --out_dir. Files already written are intact: the same command resumes from the last '
           'checkpoint')
# what a failed write means, by errno: the first half of the fix (the place to choose instead follows)
WHY = {errno.ENOSPC: 'the disk is full: free some space or', errno.EDQUOT: 'the disk quota is used up: free some '
       'space or', errno.EFBIG: 'the file would be larger than this system allows: free some space or',
       errno.ENOTDIR: 'a part of that path is a file, not a folder: move it away or', errno.EEXIST: 'a file of '
       'that name is in the way: move it away or', errno.ENAMETOOLONG: 'the name is too long:',
       errno.EROFS: 'the file system is read-only:', errno.EACCES: 'no permission to write there:',
       errno.EPERM: 'no permission to write there:'}


def disk_error(path, e, fix=RUN_FIX):
    """One line naming the path, what the OSError is, and the fix."""
    why = WHY.get(e.errno)
    return Stop(f"cannot write {path}: {e.strerror or e}; {why + ' ' if why else ''}{fix}")


@contextlib.contextmanager
def writing(path, fix=RUN_FIX):
    """A failed write (a full disk, a read-only or missing folder) as one line naming the path and the cause."""
    try:
        yield
    except OSError as e:
        raise disk_error(path, e, fix) from None


def atomic_save(obj, path):
    """torch.save to a temporary name, flushed, then renamed: a kill never leaves half a file. Serialised in
    memory first, so a failed write is the OSError it is (torch.save's writer turns it into a RuntimeError)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    tmp = path + '.tmp'
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, 'wb') as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise disk_error(path, e) from None


def write_json(obj, path):
    with writing(path):
        with open(path + '.tmp', 'w') as f:
            json.dump(obj, f, indent=1)
        os.replace(path + '.tmp', path)


def save_snapshot(run_dir, it, q, k, n_head):
    """W_Q and W_K of every layer, (n_layer, C, C) float32 arrays, at iteration it."""
    folder = os.path.join(run_dir, 'snapshots')
    tmp = os.path.join(folder, f'.tmp_{it:07d}.npz')
    with writing(folder):
        os.makedirs(folder, exist_ok=True)
        np.savez(tmp, q=q, k=k, n_head=n_head)
        os.replace(tmp, file_path(run_dir, 'snapshots', it))


def git_commit():
    import subprocess  # only here
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------- reading

def read_json(path):
    """The JSON object a file holds; OSError or ValueError when it cannot be read or holds no object."""
    with open(path) as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f'{path} does not hold a JSON object')
    return obj


def read_metrics(path, warn=None):
    """Records of a metrics.jsonl: the one tolerant reader (the analysis uses it too). The last line may have
    been cut short by a kill mid-write: if it does not parse, it is dropped silently. Any other line that is
    not a JSON object with an integer 'iter' stops with one line, or, given warn, is skipped after
    warn(a message naming the file and the line)."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, 'rb') as f:
        lines = f.read().split(b'\n')
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    for i in nonempty:
        try:
            row = json.loads(lines[i].decode('utf-8'))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            if i == nonempty[-1]:  # cut short by a kill mid-write: named when asked to warn
                if warn is not None:
                    warn(f'{path} line {i + 1} is cut short (a kill while it was written?): that record is lost')
                continue
            problem = 'is not valid JSON'
        else:
            if isinstance(row, dict) and type(row.get('iter')) is int:
                rows.append(row)
                continue
            problem = "is not a record (a JSON object with an integer 'iter')"
        msg = f'{path} line {i + 1} {problem}'
        if warn is None:
            raise Stop(f'{msg}; delete the run folder or pass --overwrite=True')
        warn(msg)
    return rows


# ----------------------------------------------------------------------------- the folder, its lock, start-over

def run_folder(cfg):
    """out_dir/run_name, checked before anything is written: inside out_dir (a symlink out of it is refused)
    and not a finished run (unless --overwrite=True)."""
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    out, real = os.path.realpath(cfg['out_dir']), os.path.realpath(run_dir)
    if real == out or os.path.commonpath([real, out]) != out:
        raise Stop(f'the run folder {run_dir} resolves to {real}, outside out_dir={cfg["out_dir"]}; '
                   f'choose another --run_name')
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise Stop(f'{run_dir} holds a finished run; pass --overwrite=True to train it again '
                   f'(that deletes it) or choose another --run_name / --out_dir')
    return run_dir


def lock_run(run_dir):
    """Make the run folder and hold its lock file (fcntl.flock: the OS releases it when the process ends,
    however it ends), or refuse, naming the PID of the process that holds it."""
    with writing(run_dir):
        os.makedirs(run_dir, exist_ok=True)
        f = open(os.path.join(run_dir, LOCK_FILE), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or '?'
        f.close()
        raise Stop(f'another train.py (PID {pid}) is running on {run_dir}; wait for it to finish, or stop it '
                   f'(kill {pid}: it checkpoints and exits), then run the same command again') from None
    f.seek(0)
    f.truncate()
    f.write(f'{os.getpid()}\n')
    f.flush()
    return f


def unlock(lock, run_dir, made):
    """Release the lock; a folder this process made that holds nothing but the lock goes too (a refused start)."""
    lock.close()
    with contextlib.suppress(OSError):
        if made and os.listdir(run_dir) == [LOCK_FILE]:
            os.remove(os.path.join(run_dir, LOCK_FILE))
            os.rmdir(run_dir)


def train_py_wrote(run_dir):
    """Whether the folder's config.json is one train.py wrote (it holds what only train.py adds)."""
    try:
        cfg = read_json(os.path.join(run_dir, 'config.json'))
    except (OSError, ValueError):
        return False
    return all(k in cfg for k in ('run_name', 'torch', 'n_params', 'data_sha256'))


def own_files(run_dir):
    """The paths in run_dir that train.py writes, present now; config.json last (see start_over)."""
    found = [n for n in os.listdir(run_dir) if RUN_FILE.fullmatch(n) and n != 'config.json']
    for sub, pattern in (('snapshots', SNAPSHOT), ('models', MODEL)):
        folder = os.path.join(run_dir, sub)
        found += [os.path.join(sub, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                  if pattern.fullmatch(n)]
    found += ['config.json'] * os.path.exists(os.path.join(run_dir, 'config.json'))
    return found


def start_over(run_dir):
    """Remove what train.py writes in run_dir, and nothing else; refuse where those files are not train.py's
    (no config.json of its own). config.json goes last: a folder cleared halfway is still recognised."""
    found = own_files(run_dir)
    # temporary files alone are what a kill during the first config.json write leaves: train.py's own names
    if found and not train_py_wrote(run_dir) and not all(n.endswith('.tmp') for n in found):
        raise Stop(f"{run_dir} holds {', '.join(found[:4])}{' ...' * (len(found) > 4)} not written by train.py "
                   f"(no config.json of its own); starting over would delete them: move them away or choose "
                   f"another --run_name")
    with writing(run_dir):
        for name in found:
            os.remove(os.path.join(run_dir, name))
        for sub in ('snapshots', 'models'):
            with contextlib.suppress(OSError):  # kept where it holds something of the user's
                os.rmdir(os.path.join(run_dir, sub))


def trim_run(run_dir, keep_below, expected):
    """Drop records, snapshots and model checkpoints from iteration keep_below on, so that a resumed
    run rewrites them exactly once; refuse when a record of the iterations expected is missing below it.
    Files train.py did not write are left alone."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [r for r in read_metrics(path) if r['iter'] < keep_below]
    lost = sorted(set(expected) - {r['iter'] for r in rows})
    if lost:
        what = 'metrics.jsonl is gone' if not os.path.exists(path) else 'metrics.jsonl lacks the records of ' + (
            f"iteration{'s' * (len(lost) > 1)} {', '.join(map(str, lost[:5]))}{' ...' * (len(lost) > 5)}")
        raise Stop(f'{what}, before the checkpoint at iteration {keep_below}; they cannot be measured again from '
                   f'ckpt.pt: pass --overwrite=True to start the run over')
    with writing(path):
        with open(path + '.tmp', 'w') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
        os.replace(path + '.tmp', path)
        for name in own_files(run_dir):
            it = iteration_of(os.path.basename(name))
            if it is not None and it >= keep_below:
                os.remove(os.path.join(run_dir, name))


# ----------------------------------------------------------------------------- checkpoints

def rng_state(data_gen):
    np_state = np.random.get_state()
    return {'torch': torch.get_rng_state(), 'data': data_gen.get_state(), 'python': random.getstate(),
            'numpy': (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state, data_gen):
    torch.set_rng_state(state['torch'])
    data_gen.set_state(state['data'])
    random.setstate(state['python'])
    n = state['numpy']
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    if state['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


# settings that may differ between a run and its resumption: where things are, not what is computed
RESUMABLE_CHANGES = ('overwrite', 'device', 'threads', 'compile', 'out_dir', 'data_file', 'data_dir', 'cache_dir',
                     'data_url')
CKPT_KEYS = ('model', 'optimizer', 'iter', 'elapsed', 'config', 'rng', 'data_sha256', 'data_cache', 'control', 'w0')


def load_checkpoint(path, cfg, meta, model, optimizer, data_gen):
    """Restore everything that decides the rest of the run, or say why this checkpoint cannot do it.
    Returns (iteration, elapsed seconds, control state, W(0) as a list per layer of (W_Q(0), W_K(0)))."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # a truncated or foreign file
        # torch's own message would advise weights_only=False: loading code from a damaged file
        raise Stop(f'cannot resume from {path}: it is not a checkpoint torch can read ({type(e).__name__}; '
                   f'truncated or damaged); pass --overwrite=True to start the run over') from None
    lacking = [k for k in CKPT_KEYS if k not in ckpt] if isinstance(ckpt, dict) else list(CKPT_KEYS)
    lacking = lacking or [f'the setting {k}' for k in cfg if k not in ckpt['config']]
    if lacking:
        raise Stop(f"{path} lacks {', '.join(lacking[:3])}: another version of train.py wrote it; pass "
                   f"--overwrite=True to start the run over")
    changed = [k for k in ckpt['config'] if k not in RESUMABLE_CHANGES and ckpt['config'][k] != cfg.get(k)]
    if (ckpt['data_sha256'], ckpt['data_cache']) != (meta['sha256'], meta['cache_key']):
        changed.append('the training text or its encoding')
    if changed:
        raise Stop(f"{path} was written with other settings ({', '.join(changed)}); run with the same settings "
                   f"to resume, or pass --overwrite=True to start over")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    set_rng_state(ckpt['rng'], data_gen)
    return ckpt['iter'], ckpt['elapsed'], ckpt['control'], [tuple(pair) for pair in ckpt['w0']]


# ----------------------------------------------------------------------------- devices and DDP

def available_devices():
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available()
    return ', '.join(['cpu'] + [f'cuda ({cuda} device{"s" * (cuda > 1)}: cuda:0..cuda:{cuda - 1})'] * (cuda > 0)
                     + ['mps'] * mps)


def pick_device(cfg):
    """cfg['device'] checked against what this machine has, or (empty) the best available."""
    name, here = cfg['device'], available_devices()
    if not name:
        return 'cuda' if 'cuda' in here else 'mps' if 'mps' in here else 'cpu'
    kind, _, index = name.partition(':')
    fix = f'available here: {here}; pass one of them (--device=cpu always works) or leave --device= empty'
    if kind not in ('cpu', 'cuda', 'mps') or (index and not index.isdigit()):
        raise Stop(f'--device={name}: {name!r} is not a device train.py can use; {fix}')
    if kind == 'cuda' and not torch.cuda.is_available():
        build = 'is a CPU-only build' if torch.version.cuda is None else 'finds no CUDA GPU'
        raise Stop(f'--device={name}: torch {torch.__version__} here {build}; {fix}, or install a CUDA '
                   f'build of torch on a GPU machine')
    if kind == 'cuda' and index and int(index) >= torch.cuda.device_count():
        raise Stop(f'--device={name}: there is no CUDA device {index}; {fix}')
    if kind == 'mps' and 'mps' not in here:
        raise Stop(f'--device={name}: MPS (Apple GPUs) is not available here; {fix}')
    return name


def start_ddp(dev):
    """(ddp, rank, world size, device) from torchrun's environment; one plain process without it."""
    if int(os.environ.get('RANK', -1)) == -1:
        return False, 0, 1, dev
    import torch.distributed as dist
    dist.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
    if dev.startswith('cuda'):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(dev)
    return True, int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), dev


# ----------------------------------------------------------------------------- signals and exit

class Stopped(BaseException):
    """SIGTERM outside the training loop (which checkpoints instead): unwinds like Ctrl-C, cleaning up. Its one
    argument is the signal number."""


def stopped(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def clean_exit():
    """A Stop as its one line on stderr, exit status 2; Ctrl-C or SIGTERM as one line, exit 128 + signal."""
    signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    except Stop as e:
        print(e.code, file=sys.stderr, flush=True)
        sys.exit(2)
    except (KeyboardInterrupt, Stopped) as e:
        sig = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
        print(f'error: stopped by {signal.Signals(sig).name}; nothing half-written was kept. Run the same command '
              f'again to continue.', file=sys.stderr, flush=True)
        sys.exit(128 + sig)
