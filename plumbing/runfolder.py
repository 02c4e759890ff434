"""The run folder out_dir/run_name/ (README lists its files): its lock, what train.py writes there
(ckpt.pt, the records, done.json) and how it resumes; the random streams, signals, devices and DDP.
Files are written to a temporary name and renamed: a kill never leaves half of one."""
import contextlib
import errno
import fcntl
import glob
import io
import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import torch

from plumbing.configurator import NOT_IN_NAME, Stop

# what train.py writes in a run folder (.lock aside): starting over deletes these and nothing else
OWN = re.compile(r'(done\.json|ckpt\.pt|metrics\.jsonl|config\.json)(\.tmp)?'
                 r'|snapshots/qk_\d{7}\.npz(\.tmp)?|models/model_\d{7}\.pt(\.tmp)?')


def atomic_save(obj, path):
    """obj (bytes as they are, anything else by torch.save) to path + '.tmp', then renamed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'wb') as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
    os.replace(path + '.tmp', path)


def claim(cfg, master):
    """(out_dir/run_name, its .lock held by rank 0).
    A Stop if the folder leaves out_dir, holds a finished run or is another train.py's."""
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    real = os.path.realpath(run_dir)
    if os.path.dirname(real) != os.path.realpath(cfg['out_dir']):
        raise Stop(f"run folder {run_dir} resolves to {real}, "
                   f"not a folder of out_dir={cfg['out_dir']}")
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise Stop(f'{run_dir} holds a finished run; '
                   'pass --overwrite=True to train it again, or another --run_name')
    if not master:
        return run_dir, None
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:  # a file, a dangling link or a link loop on the way, a name too long
        raise Stop(f'cannot make the run folder {run_dir} (out_dir, run_name): '
                   f'{e.strerror}') from None
    try:
        if not os.access(run_dir, os.W_OK):  # a read-only file system too, whoever runs it
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        lock = open(os.path.join(run_dir, '.lock'), 'a')
    except OSError as e:
        raise Stop(f'cannot write in the run folder {run_dir}: {e.strerror}; '
                   'make it writable, or another --out_dir') from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Stop(f'another train.py is training in {run_dir}') from None
    return run_dir, lock


@contextlib.contextmanager
def held(run):
    """Around a run: its .lock removed while still held.
    A full disk or an allocation that fails is one line."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        at = 'the start' if run.saved_at is None else f'iteration {run.saved_at}'
        raise Stop(f'no space left for {e.filename or run.dir}: free some; '
                   f'the same command resumes from {at}') from None
    except (RuntimeError, MemoryError) as e:  # out of memory, of the device or of the host
        if 'allocate' not in str(e):
            raise
        keys = ('n_layer', 'n_embd', 'block_size', 'batch_size', 'grad_accum')
        sizes = ', '.join(f'{k}={run.cfg[k]}' for k in keys)
        raise Stop(f"{sizes} do not fit on {run.dev}: {str(e).splitlines()[0]}") from None
    finally:
        if run.lock:
            with contextlib.suppress(OSError):  # the folder may be gone
                os.remove(run.lock.name)
            run.lock.close()


def begin(run, resuming):
    """Only once the run is built: the old run's files deleted (where its config.json says train.py
    wrote them) or trimmed to ckpt.pt's iteration; config.json written, metrics.jsonl opened.
    A wandb run (wandb_log) starts first: it may refuse."""
    commit = subprocess.run('git rev-parse HEAD', shell=True, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    meta, n_params = run.meta, sum(p.numel() for p in run.model.parameters())
    config = dict(run.cfg, dtype=run.dtype, torch=torch.__version__, device=run.dev,
                  world_size=run.world, git_commit=commit or None, vocab_size=meta['vocab_size'],
                  n_params=n_params, data_sha256=meta['sha256'],
                  n_chars=meta['n_train'] + meta['n_val'], data_cache=meta['cache_key'])
    if run.wandb:
        start_wandb(run, config)
    found = [n for n in glob.glob('**', root_dir=run.dir, recursive=True) if OWN.fullmatch(n)]
    path = os.path.join(run.dir, 'metrics.jsonl')
    if resuming:  # the records and files from ckpt.pt's iteration on, which the run writes again
        lines = open(path, 'rb').read().split(b'\n')[:-1]  # a line a kill cut short is left out
        rows = [r for r in map(json.loads, lines) if r['iter'] < run.start]
        atomic_save(''.join(json.dumps(r) + '\n' for r in rows).encode(), path)
        found = [n for n in found if any(int(it) >= run.start for it in re.findall(r'\d{7}', n))]
        print(f'resuming {run.dir} from iteration {run.start}', flush=True)
    else:
        try:
            ours = 'git_commit' in json.load(open(os.path.join(run.dir, 'config.json')))
        except (OSError, ValueError):
            ours = all(n.endswith('.tmp') for n in found)  # killed in the first config.json write
        if found and not ours:
            raise Stop(f'{run.dir} holds {found[0]}, not written by train.py: '
                       'move it, or another --run_name')
        restart = found and not run.cfg['overwrite']  # a run killed before its first ckpt.pt
        note = ': no ckpt.pt, starting at iteration 0' if restart else ''
        print(f'run folder {run.dir}{note}', flush=True)
    for name in sorted(found, key=lambda n: n == 'config.json'):  # config.json last
        os.remove(os.path.join(run.dir, name))
    atomic_save(json.dumps(config, indent=1).encode(), os.path.join(run.dir, 'config.json'))
    run.metrics = open(path, 'a')


def import_wandb(cfg):
    """wandb, imported only with wandb_log, or one line naming its install."""
    if not cfg['wandb_log']:
        return None
    try:
        import wandb
    except ImportError as e:
        raise Stop(f'wandb_log=True needs wandb ({e}): pip install wandb') from None
    return wandb


def start_wandb(run, config):
    """The wandb run of this run's records, given the config once; a refusal is one line."""
    try:
        run.wandb.init(project=run.cfg['wandb_project'], config=config,
                       name=run.cfg['wandb_run_name'] or run.cfg['run_name'])
    except Exception as e:  # not logged in, no network, a bad project name: whatever wandb raised
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Stop(f'wandb.init failed ({why}): '
                   'wandb login, or WANDB_MODE=offline, or --wandb_log=False') from None


def wandb_row(row):
    """A record under wandb's keys: loss/train, loss/val, loss/eval, lr, tokens, time and
    geometry/L0/pr_q, ... for each layer's numbers (its per-head lists and spectra left out)."""
    out = {f"loss/{key.split('_')[0]}": row[key] for key in ('train_loss', 'val_loss', 'eval_loss')
           if key in row}
    out.update({key: row[key] for key in ('lr', 'tokens', 'time')})
    for i, layer in enumerate(row.get('layers', [])):
        out.update({f'geometry/L{i}/{key}': v for key, v in layer.items()
                    if isinstance(v, (int, float))})
    return out


def seed_all(seed, rank, it, data_gen=None):
    """Every random stream of step it from (seed, rank, it) alone, so that a resumed run draws
    as an uninterrupted one: torch's (dropout) per DDP rank, data_gen's alike on every rank."""
    torch.manual_seed(stream_seed(seed, it, rank + 1))
    if data_gen is not None:
        data_gen.manual_seed(stream_seed(seed, it, 0))


def stream_seed(*key):
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def set_numerics(run, dtype, threads):
    """The autocast dtype (auto: bfloat16 where CUDA supports it) and the CPU threads (0: torch's
    default). Both change the numbers, so a resumed run keeps its checkpoint's."""
    device_type = run.dev.split(':')[0]
    if dtype == 'auto':
        bf16 = device_type == 'cuda' and torch.cuda.is_bf16_supported()
        dtype = 'bfloat16' if bf16 else 'float32'
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    run.dtype, run.threads = dtype, threads
    run.ctx = contextlib.nullcontext()
    if dtype == 'bfloat16':
        run.ctx = torch.autocast(device_type, torch.bfloat16)


def save_checkpoint(run, it):
    """ckpt.pt: everything that decides the rest of the run."""
    atomic_save({'model': run.model.state_dict(), 'optimizer': run.optimizer.state_dict(),
                 'iter': it, 'elapsed': run.elapsed + time.time() - run.t_start,
                 'config': run.cfg, 'data_sha256': run.meta['sha256'], 'w0': run.w0,
                 'control': run.ctl, 'numerics': {'dtype': run.dtype, 'threads': run.threads}},
                run.ckpt_path)
    run.saved_at = it


def resume(run):
    """The model, optimizer, control state and numerics from ckpt.pt.
    A Stop if it cannot be read, or if its settings or its text differ."""
    try:
        ckpt = torch.load(run.ckpt_path, map_location='cpu', weights_only=True)
        if not isinstance(ckpt, dict) or 'config' not in ckpt:
            raise ValueError
    except Exception as e:  # cut short, overwritten, not torch's: whatever reading it raised
        if isinstance(e, MemoryError) or 'allocate' in str(e):
            raise  # held(): too big for this machine, not damaged
        raise Stop(f'{run.ckpt_path} is damaged or not a checkpoint of train.py '
                   f'({type(e).__name__}): remove it, '
                   'or pass --overwrite=True to start the run over') from None
    free = NOT_IN_NAME + ('data_sha256',)
    changed = [k for k in run.cfg if k not in free and ckpt['config'].get(k) != run.cfg[k]]
    if 'numerics' not in ckpt:
        changed.append('dtype and threads, which an older train.py did not record')
    if ckpt['data_sha256'] != run.meta['sha256']:
        changed.append('the training text')
    if changed:
        raise Stop(f"{run.ckpt_path} was written with other settings ({', '.join(changed)}); "
                   "use the same settings to resume, or --overwrite=True to start over")
    run.model.load_state_dict(ckpt['model'])
    run.optimizer.load_state_dict(ckpt['optimizer'])
    run.start = run.saved_at = ckpt['iter']
    run.elapsed, run.ctl, run.w0 = ckpt['elapsed'], ckpt['control'], ckpt['w0'].to(run.dev)
    if ckpt['numerics'] != {'dtype': run.dtype, 'threads': run.threads}:
        print('resuming in {dtype} on {threads} threads as ckpt.pt was trained'
              .format(**ckpt['numerics']))
        set_numerics(run, **ckpt['numerics'])


@contextlib.contextmanager
def signals_caught(run):
    """A list that Ctrl-C or SIGTERM (a Slurm time limit) appends to, for the loop to stop at.
    The stop is said at once; a second signal acts as usual."""
    caught = []
    when = 'at its next record or checkpoint' if run.ddp else 'after this iteration'

    def catch(signum, frame):
        caught.append(signum)
        signal.signal(signum, handlers[signum])
        name = 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name
        if run.master:  # os.write, as a print here could land inside one of the loop's prints
            os.write(2, f'{name}: the run stops {when}, checkpointing to {run.ckpt_path} '
                        f'(a second {name} stops it at once, without)\n'.encode())
    handlers = {s: signal.signal(s, catch) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def save_weights(run, it, model_too):
    """The record's snapshot of every W_Q, W_K (float32), and the model checkpoint (model_too)."""
    t0 = time.time()
    if run.cfg['geom_interval'] and run.cfg['save_snapshots']:
        pairs = run.model.qk_weights()
        q, k = (np.stack([pair[side].detach().float().cpu().numpy() for pair in pairs])
                for side in (0, 1))
        npz = io.BytesIO()
        np.savez(npz, q=q, k=k, n_head=run.cfg['n_head'])
        atomic_save(npz.getvalue(), f'{run.dir}/snapshots/qk_{it:07d}.npz')
    if model_too:
        model = {'model': run.model.state_dict(), 'model_config': run.model.config.__dict__,
                 'iter': it}
        atomic_save(model, f'{run.dir}/models/model_{it:07d}.pt')
    run.t_geom += time.time() - t0


# Significant digits of a record's geometry in metrics.jsonl: the values are computed in float64,
# and float32's 7 digits are more than any analysis reads.
# The whole spectra (sv_*, 3 x C values a layer) keep 3 (a relative 5e-4), so a compact log stays
# within 1.5 times one without them (results/cpu-wide-spread/README.md measures it).
DIGITS, SPECTRUM_DIGITS = 7, 3


def rounded(v, digits):
    """A float, list or list of lists with each number at `digits` significant digits."""
    if isinstance(v, list):
        return [rounded(x, digits) for x in v]
    return float(f'{v:.{digits}g}')


def logged(layer):
    """One layer's geometry as metrics.jsonl keeps it (DIGITS)."""
    return {key: rounded(v, SPECTRUM_DIGITS if key.startswith('sv_') else DIGITS)
            for key, v in layer.items()}


def write_record(run, row, started, model_too):
    """The record's weights (save_weights), its line of metrics.jsonl with its geometry rounded,
    and its printed line. started: when measuring it began, where training time stops."""
    it = row['iter']
    save_weights(run, it, model_too)  # geometry's time
    row['time'] = run.elapsed + time.time() - run.t_start
    kept = dict(row, layers=[logged(layer) for layer in row['layers']]) if 'layers' in row else row
    print(json.dumps(kept), file=run.metrics, flush=True)
    if run.wandb:
        run.wandb.log(wandb_row(kept), step=it)
    run.last = row
    ms = 1000 * (started - run.mark[0]) / (it - run.mark[1]) if it > run.mark[1] else None
    print_record(row, ms, run)
    run.mark = (time.time(), it)  # time spent measuring is not training time


def layer_means(row, keys):
    """Each key's mean over the layers of a record's geometry ({} if it has none)."""
    if not row.get('layers'):
        return {}
    return {key: float(np.mean([layer[key] for layer in row['layers']])) for key in keys}


def print_record(row, ms, run):
    """A record on one line: losses, speed, the training time left, the mean geometry."""
    line = f"iter {row['iter']}: "
    if 'val_loss' in row:
        line += f"train {row['train_loss']:.4f}, val {row['val_loss']:.4f}, "
    line += f"lr {row['lr']:.2e}"
    if ms:
        left = ms * (run.cfg['max_iters'] - row['iter']) / 1000
        line += f', {ms:.1f} ms/iter, ETA {duration(left)}'
    mean = layer_means(row, ('pr_q', 'pr_k', 'entropy'))
    if mean:
        line += f" | pr_q {mean['pr_q']:.1f} pr_k {mean['pr_k']:.1f} entropy {mean['entropy']:.3f}"
    print(line, flush=True)


def print_sizes(run):
    """The run's device and sizes, the first line it prints (rank 0)."""
    if not run.master:
        return
    cfg, n_params = run.cfg, sum(p.numel() for p in run.model.parameters())
    tokens = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size']
    print(f"{run.dev}: {n_params / 1e6:.2f}M parameters, {tokens:,} tokens an iteration "
          f"(batch_size x grad_accum x block_size), {cfg['max_iters']:,} iterations", flush=True)


def print_time_left(run, it, seconds=None):
    """The training time left after `it` iterations (rank 0), at `seconds` an iteration
    (the first micro-batch's) or else at the speed since run.mark."""
    if not run.master:
        return
    since = 'the first micro-batch'
    if seconds is None:
        since = f'iteration {run.mark[1]} on'
        seconds = (time.time() - run.mark[0]) / (it - run.mark[1])
    left = duration(seconds * (run.cfg['max_iters'] - it))
    print(f'about {left} to go on {run.dev}, evaluations aside (from {since})', flush=True)


def allocate_state(optimizer):
    """The state a first step gives the optimizer (an AdamW's moments and step count, an SGD's
    momentum), at zero, from which that step starts alike. Allocated now, its memory fails before
    the run folder is touched. A step at lr 0 on zero gradients leaves the weights as they are."""
    if optimizer.state:  # ckpt.pt's
        return
    lrs = [group['lr'] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group['lr'] = 0.0
        for p in group['params']:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group['lr'] = lr
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                value.zero_()


def write_done(run):
    """done.json, a sweep's sign of a complete run: the last losses and mean geometry, the time."""
    run.metrics.close()
    done = {k: run.last.get(k) for k in ('iter', 'train_loss', 'val_loss')}
    done.update(layer_means(run.last, ('pr_q', 'pr_k', 'pr_qk', 'entropy', 'entropy_norm')))
    wall = max(time.time() - run.t_start, 1e-9)  # this process's, as t_geom and t_ctl are
    done.update(wall_time=run.elapsed, geometry_share=run.t_geom / wall,
                control_share=run.t_ctl / wall)
    atomic_save(json.dumps(done, indent=1).encode(), os.path.join(run.dir, 'done.json'))
    if run.wandb:
        run.wandb.finish()
    print(f"done in {duration(run.elapsed)}: val loss {done['val_loss']:.4f}; "
          f"geometry logging took {100 * done['geometry_share']:.1f}% of wall time; "
          f"run folder {run.dir}", flush=True)


def duration(s):
    """s seconds as 12s, 4.5m or 2.1h."""
    return f'{s / 3600:.1f}h' if s > 5400 else f'{s / 60:.1f}m' if s > 90 else f'{s:.0f}s'


def start(name):
    """(ddp, rank, world, device): --device checked, or cuda, mps, cpu; a GPU a torchrun process."""
    cuda = [f'cuda:{i}' for i in range(torch.cuda.device_count())]
    here = ['cpu'] + ['cuda'] * bool(cuda) + cuda + ['mps'] * torch.backends.mps.is_available()
    if name and name not in here:
        raise Stop(f"--device={name} is not available here (available: {', '.join(here)})")
    dev = name or ('cuda' if cuda else 'mps' if 'mps' in here else 'cpu')
    ddp = 'RANK' in os.environ
    if ddp and dev.startswith('cuda'):
        if int(os.environ.get('LOCAL_WORLD_SIZE', 1)) > len(cuda):
            raise Stop(f"torchrun started {os.environ['LOCAL_WORLD_SIZE']} processes "
                       f"on a machine with {len(cuda)} GPUs: use --nproc_per_node={len(cuda)}")
        dev = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    if dev.startswith('cuda:'):  # the current device, which synchronize without a device means
        torch.cuda.set_device(dev)
    if ddp:
        torch.distributed.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
    return ddp, int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1)), dev
