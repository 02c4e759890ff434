"""The run folder out_dir/run_name/ (README lists its files), its lock, the checkpoint, the random streams, devices
and DDP. Files are written to a temporary name and renamed: a kill never leaves half of one."""
import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import subprocess
import time

import numpy as np
import torch

from plumbing.configurator import NOT_IN_NAME, Stop

# what train.py writes in a run folder (its .lock aside): starting over deletes these and nothing else
OWN = re.compile(r'(done\.json|ckpt\.pt|metrics\.jsonl|config\.json)(\.tmp)?'
                 r'|snapshots/qk_\d{7}\.npz(\.tmp)?|models/model_\d{7}\.pt(\.tmp)?')


def atomic_save(obj, path, save=torch.save):
    """obj (bytes as they are, anything else by save(obj, file)) to path + '.tmp', then renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'wb') as f:
        f.write(obj) if isinstance(obj, bytes) else save(obj, f)
    os.replace(path + '.tmp', path)


def claim(cfg, master):
    """(out_dir/run_name, its .lock held by rank 0), unless it leaves out_dir, is finished or another train.py's."""
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    real = os.path.realpath(run_dir)
    if os.path.dirname(real) != os.path.realpath(cfg['out_dir']):
        raise Stop(f"run folder {run_dir} resolves to {real}, not a folder of out_dir={cfg['out_dir']}")
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise Stop(f'{run_dir} holds a finished run; pass --overwrite=True to train it again, or another --run_name')
    if not master:
        return run_dir, None
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # a file, a dangling link or a link loop on the way, a name too long
        raise Stop(f'cannot make the run folder {run_dir} (out_dir, run_name): {e.strerror}') from None
    lock = open(os.path.join(run_dir, '.lock'), 'a')
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Stop(f'another train.py is training in {run_dir}') from None
    return run_dir, lock


@contextlib.contextmanager
def held(run):
    """Around a run: its .lock removed while still held; a full disk or an allocation that fails is one line."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        at = 'the start' if run.saved_at is None else f'iteration {run.saved_at}'
        msg = f'no space left for {e.filename or run.dir}: free some; the same command resumes from {at}'
        raise Stop(msg) from None
    except (RuntimeError, MemoryError) as e:  # out of memory, of the device or of the host
        if 'allocate' not in str(e):
            raise
        sizes = [f'{k}={run.cfg[k]}' for k in ('n_layer', 'n_embd', 'block_size', 'batch_size', 'grad_accum')]
        raise Stop(f"{', '.join(sizes)} do not fit on {run.dev}: {str(e).splitlines()[0]}") from None
    finally:
        if run.lock:
            with contextlib.suppress(OSError):  # the folder may be gone
                os.remove(run.lock.name)
            run.lock.close()


def begin(run, resuming):
    """Only once the run is built: the old run's files deleted (where its config.json says train.py wrote
    them) or trimmed to ckpt.pt's iteration; config.json written, metrics.jsonl opened."""
    found = [n for n in glob.glob('**', root_dir=run.dir, recursive=True) if OWN.fullmatch(n)]
    path = os.path.join(run.dir, 'metrics.jsonl')
    if resuming:  # the records and files of iterations from ckpt.pt's on, which the resumed run writes again
        lines = open(path, 'rb').read().split(b'\n')[:-1]  # a last line that a kill cut short is left out
        rows = [r for r in map(json.loads, lines) if r['iter'] < run.start]
        atomic_save(''.join(json.dumps(r) + '\n' for r in rows).encode(), path)
        found = [n for n in found if any(int(it) >= run.start for it in re.findall(r'\d{7}', n))]
        print(f'resuming {run.dir} from iteration {run.start}', flush=True)
    else:
        try:
            ours = 'git_commit' in json.load(open(os.path.join(run.dir, 'config.json')))
        except (OSError, ValueError):
            ours = all(n.endswith('.tmp') for n in found)  # a kill during the first config.json write
        if found and not ours:
            raise Stop(f'{run.dir} holds {found[0]}, not written by train.py: move it, or another --run_name')
        fresh = ': no ckpt.pt, starting at iteration 0' if found and not run.cfg['overwrite'] else ''
        print(f'run folder {run.dir}{fresh}', flush=True)
    for name in sorted(found, key=lambda n: n == 'config.json'):  # config.json last
        os.remove(os.path.join(run.dir, name))
    meta, n_params = run.meta, sum(p.numel() for p in run.model.parameters())
    commit = subprocess.run('git rev-parse HEAD', shell=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                            capture_output=True, text=True).stdout.strip() or None
    config = dict(run.cfg, dtype=run.dtype, torch=torch.__version__, device=run.dev, world_size=run.world,
                  git_commit=commit, vocab_size=meta['vocab_size'], n_params=n_params, data_sha256=meta['sha256'],
                  n_chars=meta['n_train'] + meta['n_val'], data_cache=meta['cache_key'])
    atomic_save(json.dumps(config, indent=1).encode(), os.path.join(run.dir, 'config.json'))
    run.metrics = open(path, 'a')


def seed_all(seed, rank, it, data_gen=None):
    """Every random stream of step it from (seed, rank, it) alone: torch's (dropout) per DDP rank, data_gen alike."""
    mix = lambda *key: int(np.random.SeedSequence((seed, it, *key)).generate_state(1)[0])
    torch.manual_seed(mix(rank + 1))
    if data_gen is not None:
        data_gen.manual_seed(mix(0))


def load_checkpoint(path, cfg, meta, model, optimizer):
    """Restore the model and optimizer from ckpt.pt (refused if its settings or text differ)."""
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    changed = [k for k in cfg if k not in NOT_IN_NAME + ('data_sha256',) and ckpt['config'].get(k) != cfg[k]]
    changed += ['dtype and threads, which an older train.py did not record'] * ('numerics' not in ckpt)
    changed += ['the training text'] * (ckpt['data_sha256'] != meta['sha256'])
    if changed:
        raise Stop(f"{path} was written with other settings ({', '.join(changed)}); use the same settings to "
                   f"resume, or --overwrite=True to start over")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    return ckpt


def set_numerics(run, dtype, threads):
    """The autocast dtype and the CPU threads: both change the numbers, so a resumed run keeps its checkpoint's."""
    torch.set_num_threads(threads)
    run.dtype, run.threads = dtype, threads
    run.ctx = torch.autocast(run.dev.split(':')[0], torch.bfloat16) if dtype == 'bfloat16' else contextlib.nullcontext()


def save_weights(run, it, model_too):
    """The record's snapshot of every W_Q, W_K (float32), and the model checkpoint (model_too)."""
    t0 = time.time()
    if run.cfg['geom_interval'] and run.cfg['save_snapshots']:
        q, k = (np.stack([w[side].detach().float().cpu().numpy() for w in run.model.qk_weights()]) for side in (0, 1))
        atomic_save(dict(q=q, k=k, n_head=run.cfg['n_head']), f'{run.dir}/snapshots/qk_{it:07d}.npz',
                    lambda arrays, f: np.savez(f, **arrays))
    if model_too:
        atomic_save({'model': run.model.state_dict(), 'model_config': run.model.config.__dict__, 'iter': it},
                    f'{run.dir}/models/model_{it:07d}.pt')
    run.t_geom += time.time() - t0


# Significant digits of a record's geometry in metrics.jsonl: the values are computed in float64, and
# float32's 7 digits are more than any analysis reads. The spectra whole (sv_*, 3 x C values a
# layer) keep 4 (a relative 5e-5), which keeps a compact log within 1.5 times one without them.
DIGITS, SPECTRUM_DIGITS = 7, 4


def rounded(v, digits):
    """A float, list or list of lists with each number at `digits` significant digits."""
    if isinstance(v, list):
        return [rounded(x, digits) for x in v]
    return float(f'{v:.{digits}g}')


def logged(layer):
    """One layer's geometry as metrics.jsonl keeps it (DIGITS)."""
    return {key: rounded(v, SPECTRUM_DIGITS if key.startswith('sv_') else DIGITS)
            for key, v in layer.items()}


def log_line(row):
    """The record as one line of metrics.jsonl, its geometry rounded (DIGITS)."""
    layers = [logged(layer) for layer in row.get('layers') or []]
    return json.dumps({**row, 'layers': layers} if 'layers' in row else row)


def print_record(row, ms, run):
    """A record on one line: losses, speed, the training time left (evaluations aside), the mean geometry."""
    losses = f"train {row['train_loss']:.4f}, val {row['val_loss']:.4f}, " if 'val_loss' in row else ''
    speed = f", {ms:.1f} ms/iter, ETA {fmt_time(ms * (run.cfg['max_iters'] - row['iter']) / 1000)}" if ms else ''
    geometry = ''
    if row.get('layers'):
        mean = lambda key: np.mean([layer[key] for layer in row['layers']])
        geometry = f" | pr_q {mean('pr_q'):.1f} pr_k {mean('pr_k'):.1f} entropy {mean('entropy'):.3f}"
    print(f"iter {row['iter']}: {losses}lr {row['lr']:.2e}{speed}{geometry}", flush=True)


def fmt_time(s):
    return f'{s / 3600:.1f}h' if s > 5400 else f'{s / 60:.1f}m' if s > 90 else f'{s:.0f}s'


def start(name):
    """(ddp, rank, world size, device): --device checked, or cuda, mps, cpu; under torchrun one GPU a process."""
    cuda = [f'cuda:{i}' for i in range(torch.cuda.device_count())]
    here = ['cpu'] + ['cuda'] * bool(cuda) + cuda + ['mps'] * torch.backends.mps.is_available()
    if name and name not in here:
        raise Stop(f"--device={name} is not available here (available: {', '.join(here)})")
    dev = name or ('cuda' if cuda else 'mps' if 'mps' in here else 'cpu')
    ddp = 'RANK' in os.environ
    if ddp and dev.startswith('cuda'):
        if int(os.environ.get('LOCAL_WORLD_SIZE', 1)) > len(cuda):
            raise Stop(f"torchrun started {os.environ['LOCAL_WORLD_SIZE']} processes on a machine with "
                       f"{len(cuda)} GPUs: use --nproc_per_node={len(cuda)}")
        dev = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if dev.startswith('cuda:'):  # the current device, which synchronize without a device means
        torch.cuda.set_device(dev)
    if ddp:
        torch.distributed.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
    return ddp, int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1)), dev
