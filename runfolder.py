"""
The run folder out_dir/run_name/ (the README lists its files), its lock, the checkpoint with the RNG states,
devices and DDP. Files are written to a temporary name and renamed: a kill never leaves half of one.
"""
import fcntl
import glob
import json
import os
import random
import re

import numpy as np
import torch

from configurator import Stop

# what train.py writes in a run folder: starting over deletes these and nothing else
OWN = re.compile(r'(done\.json|ckpt\.pt|metrics\.jsonl|config\.json|\.lock)(\.tmp)?'
                 r'|snapshots/qk_\d{7}\.npz(\.tmp)?|models/model_\d{7}\.pt(\.tmp)?')
# settings that may change between a run and its resumption: where things are, not what is computed
RESUMABLE = ('overwrite', 'device', 'threads', 'compile', 'out_dir', 'data_file', 'data_dir', 'cache_dir', 'data_url')


def file_path(run_dir, sub, it):
    """The snapshot (sub='snapshots') or model checkpoint (sub='models') of iteration it."""
    return os.path.join(run_dir, sub, f'qk_{it:07d}.npz' if sub == 'snapshots' else f'model_{it:07d}.pt')


def atomic_save(obj, path, save=torch.save):
    """obj (bytes as they are, anything else by save(obj, file)) to path + '.tmp', then renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'wb') as f:
        f.write(obj) if isinstance(obj, bytes) else save(obj, f)
    os.replace(path + '.tmp', path)


def write_json(obj, path):
    atomic_save(json.dumps(obj, indent=1).encode(), path)


def git_commit():
    import subprocess
    return subprocess.run('git rev-parse HEAD', shell=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                          capture_output=True, text=True).stdout.strip() or None


def read_metrics(path):
    """The records of a metrics.jsonl; a last line cut short by a kill mid-write is dropped."""
    lines = open(path, 'rb').read().splitlines() if os.path.exists(path) else []
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise Stop(f'{path} line {i + 1} is not JSON; pass --overwrite=True to start the run over') from None
    return rows


def open_folder(cfg):
    """out_dir/run_name, refused when it resolves outside out_dir or holds a finished run (without overwrite)."""
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    out, real = os.path.realpath(cfg['out_dir']), os.path.realpath(run_dir)
    if os.path.dirname(real) != out:
        raise Stop(f'run folder {run_dir} resolves to {real}, outside out_dir={cfg["out_dir"]}')
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise Stop(f'{run_dir} holds a finished run; pass --overwrite=True to train it again, or another --run_name')
    return run_dir


def lock(run_dir):
    """Hold run_dir/.lock (the OS releases it however the process ends), or refuse naming the holder's PID."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # a file, a dangling link or a link loop on the way, a name too long
        raise Stop(f'cannot make the run folder {run_dir} (out_dir, run_name): {e.strerror}') from None
    f = open(os.path.join(run_dir, '.lock'), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise Stop(f'another train.py (PID {f.read().strip()}) is training in {run_dir}') from None
    f.truncate(0)
    print(os.getpid(), file=f, flush=True)
    return f


def unlock(f):
    """Remove .lock while still holding it, so that a finished or stopped run leaves none."""
    if f:
        os.remove(f.name)
        f.close()


def own_files(run_dir):  # glob leaves out .lock, which stays held
    return [n for n in glob.glob('**', root_dir=run_dir, recursive=True) if OWN.fullmatch(n)]


def start_over(run_dir):
    """Delete what train.py wrote in run_dir, and only where its config.json says train.py wrote it."""
    found = own_files(run_dir)
    try:
        ours = 'git_commit' in json.load(open(os.path.join(run_dir, 'config.json')))
    except (OSError, ValueError):
        ours = all(n.endswith('.tmp') for n in found)  # a kill during the first config.json write
    if found and not ours:
        raise Stop(f'{run_dir} holds {found[0]}, not written by train.py; move it away or choose another --run_name')
    for name in sorted(found, key=lambda n: n == 'config.json'):  # config.json last
        os.remove(os.path.join(run_dir, name))
    return found


def trim(run_dir, keep_below):
    """Drop the records and files of iterations from keep_below on, which the resumed run writes again."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [r for r in read_metrics(path) if r['iter'] < keep_below]
    atomic_save(''.join(json.dumps(r) + '\n' for r in rows).encode(), path)
    for name in own_files(run_dir):
        it = re.search(r'_(\d{7})\.', name)
        if it and int(it[1]) >= keep_below:
            os.remove(os.path.join(run_dir, name))


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


def load_checkpoint(path, cfg, meta, model, optimizer, data_gen):
    """Restore the model, optimizer and RNG states from ckpt.pt (refused if its settings or text differ); returns it."""
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    changed = [k for k in cfg if k not in RESUMABLE + ('data_sha256',) and ckpt['config'].get(k) != cfg[k]]
    changed += ['dtype and threads, which an older train.py did not record'] * ('numerics' not in ckpt)
    changed += ['the training text'] * (ckpt['data_sha256'] != meta['sha256'])
    if changed:
        raise Stop(f"{path} was written with other settings ({', '.join(changed)}); use the same settings to "
                   f"resume, or --overwrite=True to start over")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    set_rng_state(ckpt['rng'], data_gen)
    return ckpt


def start(name):
    """(ddp, rank, world size, device): the device asked for, checked, or (empty) cuda, then mps, then cpu; under
    torchrun, a process group, with one GPU per process."""
    cuda = [f'cuda:{i}' for i in range(torch.cuda.device_count())]
    here = ['cpu'] + ['cuda'] * bool(cuda) + cuda + ['mps'] * torch.backends.mps.is_available()
    if name and name not in here:
        raise Stop(f"--device={name} is not available here (available: {', '.join(here)})")
    dev = name or ('cuda' if cuda else 'mps' if 'mps' in here else 'cpu')
    if int(os.environ.get('RANK', -1)) == -1:
        return False, 0, 1, dev
    if dev.startswith('cuda') and int(os.environ.get('LOCAL_WORLD_SIZE', 1)) > len(cuda):
        raise Stop(f"torchrun started {os.environ['LOCAL_WORLD_SIZE']} processes on a machine with {len(cuda)} GPUs: "
                   f"use --nproc_per_node={len(cuda)}")
    import torch.distributed as dist
    dist.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
    if dev.startswith('cuda'):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(dev)
    return True, int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), dev
