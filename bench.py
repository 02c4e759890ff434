"""
Every speed figure the README quotes, and the GPU check; other --key=value arguments go to every
train.py run:

    python bench.py --jobs=1,2,4 [--preset=cpu]
        K train.py runs at once on one device: tokens/s, ms/iter
    python bench.py --whole [--iters=150] [--repeats=3]
        whole train.py processes against a plain nanoGPT-shaped one
    python bench.py --geometry [--widths=128,256,384]
        ms per layer of each metric of a geometry record
    python bench.py --control [--widths=128,256,384]
        ms per control.apply on 4 layers (freeze, 4 heads)
    python bench.py --overhead [--preset=paper]
        kernels and ms of a training step, a control step, a record
    python bench.py --syncs
        where a training and a control step wait for the host (CUDA)
    python bench.py --gpu_check [--steps=a,b] [--small]
        the GPU path end to end, a log per step in --log
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import control
import geometry
from plumbing import prepare
import train
from plumbing.configurator import Stop

REPO = os.path.dirname(os.path.abspath(__file__))
WHOLE_SIZE = ['--n_layer=4', '--n_embd=128', '--n_head=4', '--block_size=128', '--batch_size=32']


def preset_args(preset):
    """The --key=value sizes of one of sweep.sh's presets, their one home."""
    out = subprocess.run(['bash', f'{REPO}/sweep.sh'],
                         env=dict(os.environ, PRESET=preset, PRINT_ARGS='1'),
                         capture_output=True, text=True)
    if out.returncode:
        raise Stop(out.stderr.strip())
    return out.stdout.split()


def launch(cmds):
    """Run the commands at once: (wall seconds until the last ends, their CPU seconds).
    A command that fails ends this process, naming it."""
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    for cmd, p in zip(cmds, procs):
        err = p.communicate()[1].strip().splitlines() or ['?']
        if p.returncode:
            sys.exit(f"bench.py: {' '.join(map(str, cmd[1:4]))} ... failed: {err[-1]}")
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - t0, cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime


def train_cmd(args, out, name):
    return [sys.executable, os.path.join(REPO, 'train.py'), *args,
            f'--out_dir={out}', f'--run_name={name}', '--overwrite=True']


def bench_jobs(a, args):
    preset = a.preset or ('paper' if a.device != 'cpu' else 'cpu')
    iters = a.iters or 200
    args = [*preset_args(preset), *args, f'--max_iters={iters}', f'--device={a.device}']
    cfg = train.get_config(args)
    prepare.prepare_data(cfg)   # the cache is built once here, not raced by K processes
    tokens = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size'] * iters
    print(f'{iters} iterations per run on {a.device}: {" ".join(args)}')
    print(f'{"jobs":>4} {"tokens/s":>10} {"ms/iter per run":>16}')
    for k in a.jobs:
        threads = [f'--threads={max(1, (os.cpu_count() or 1) // k)}'] if a.device == 'cpu' else []
        with tempfile.TemporaryDirectory() as out:
            launch([train_cmd([*args, *threads, f'--seed={i + 1}'], out, f'job{i}')
                    for i in range(k)])
            walls = [json.load(open(os.path.join(out, f'job{i}', 'done.json')))['wall_time']
                     for i in range(k)]
        print(f'{k:>4} {k * tokens / max(walls):>10.0f} '
              f'{1000 * statistics.median(walls) / iters:>16.1f}', flush=True)


def plain(a, args):
    """--whole's plain process: train.py's model, optimizer, training step and loss estimates,
    and nothing else."""
    cfg = train.get_config(args)
    data, val, meta = prepare.prepare_data(cfg)
    run = bare_run(cfg, 'cpu', {'train': data, 'val': val}, meta['vocab_size'])[0]
    train.estimate_loss(run.model, run.data, cfg, run.dev, run.ctx)
    for it in range(a.iters):
        train.train_step(run, it)
    train.estimate_loss(run.model, run.data, cfg, run.dev, run.ctx)


def bench_whole(a, args):
    iters = a.iters or 150
    args = [*WHOLE_SIZE, *args, f'--max_iters={iters}', '--device=cpu']
    prepare.prepare_data(train.get_config(args))
    # (wall, CPU) seconds of each round
    times = {'train.py': [], 'train.py, geometry off': [], 'plain': []}
    with tempfile.TemporaryDirectory() as out:
        cmds = {'train.py': train_cmd(args, out, 'on'),
                'train.py, geometry off': train_cmd([*args, '--geom_interval=0', '--model_ckpts=0'],
                                                    out, 'off'),
                'plain': [sys.executable, os.path.join(REPO, 'bench.py'), '--plain',
                          f'--iters={iters}', *args]}
        for r in range(a.repeats):   # interleaved: a slow spell of a shared machine hits each alike
            for kind, cmd in cmds.items():
                times[kind].append(launch([cmd]))
            print(f'round {r + 1}: ' + ', '.join(f'{k} {v[-1][0]:.1f} s' for k, v in times.items()),
                  flush=True)
        share = json.load(open(os.path.join(out, 'on', 'done.json')))['geometry_share']
    wall, cpu = ({kind: statistics.median(t[i] for t in v) for kind, v in times.items()}
                 for i in (0, 1))
    for kind in times:   # CPU time is what a busy machine inflates least
        print(f"{kind:24s} median {wall[kind]:6.1f} s wall, {cpu[kind]:6.1f} s CPU: "
              f"speed x{wall['plain'] / wall[kind]:.3f} (CPU x{cpu['plain'] / cpu[kind]:.3f})"
              " of the plain process")
    print(f'geometry logging: {100 * share:.1f}% of the wall time of the train.py run'
          ' (its done.json)')


def timed(fn, repeats=5):
    """Median milliseconds of fn over repeats calls, after one more."""
    fn()
    return 1000 * statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def bench_geometry(a, args, B=16, T=256):
    print(f'ms per layer, eval batch {B} x {T}, n_head = C / 64, '
          f'{torch.get_num_threads()} threads\n'
          f'{"C":>5} {"weights":>8} {"learned":>8} {"tokens":>8}')
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for C in a.widths:
        h = max(1, C // 64)
        wq, wk, q, k = (0.02 * torch.randn(C, C), 0.02 * torch.randn(C, C),
                        torch.randn(B, T, C), torch.randn(B, T, C))
        att = torch.randn(B, h, T, T).masked_fill(~mask, float('-inf')).softmax(-1)
        ms = [timed(lambda: geometry.layer_geometry(wq, wk, h)),
              timed(lambda: geometry.learned_geometry(wq, wk, wk, wq, h)),
              timed(lambda: geometry.token_geometry(q, k, att, h))]
        print(f'{C:>5}' + ''.join(f'{m:>9.1f}' for m in ms), flush=True)


def bench_control(a, args):
    print('ms per control.apply on 4 layers, control=freeze, head scope with 4 heads\n'
          f'{"C":>5} {"fro":>8} {"spec":>8}')
    for C in a.widths:
        row = []
        for keep in ('fro', 'spec'):
            cfg = train.get_config(['--control=freeze', '--n_head=4', f'--control_keep={keep}'])
            qk = [(torch.randn(C, C), torch.randn(C, C)) for _ in range(4)]
            # apply does the same work whether or not a block is at its target
            state = control.record(cfg, qk)
            row.append(timed(lambda: control.apply(state, cfg, qk, 1)))
        print(f'{C:>5}' + ''.join(f'{m:>9.1f}' for m in row), flush=True)


class KernelCount(TorchDispatchMode):
    """Counts aten operations, about one GPU kernel each.
    Views, and Python numbers wrapped as tensors, launch none."""
    FREE = (torch.ops.aten._unsafe_view.default, torch.ops.aten.scalar_tensor.default)
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view and func not in self.FREE and func.namespace == 'aten'
        return func(*args, **(kwargs or {}))


def bare_run(cfg, device, data, vocab_size):
    """A train.Run built as train.py builds one (model, optimizer, control, numerics) with nothing
    on disk, and its steps by name."""
    run = train.Run(cfg, False, 0, 1, device, meta={'vocab_size': vocab_size}, data=data,
                    data_gen=torch.Generator().manual_seed(cfg['seed']))
    train.runfolder.seed_all(cfg['seed'], 0, 0)
    bf16 = run.dev.startswith('cuda') and torch.cuda.is_bf16_supported()   # as dtype=auto
    train.runfolder.set_numerics(run, 'bfloat16' if bf16 else 'float32',
                                 cfg['threads'] or torch.get_num_threads())
    train.build_model(run, run.dev.split(':')[0], resuming=False)
    run.train_model = run.model
    run.eval_batch = tuple(t.to(run.dev) for t in train.eval_batch(data['val'], cfg))
    return run, {'training step': lambda: train.train_step(run, 0),
                 'control step': lambda: control.apply(run.ctl, cfg, run.model.qk_weights(), 1),
                 'geometry record': lambda: train.measure_geometry(run.model, *run.eval_batch,
                                                                   cfg['n_head'], run.w0)}


def bench_overhead(a, args):
    """--overhead: each step's kernels (the optimizer fused as on CUDA, past its first step) and
    its time, synchronised before each clock reading. --syncs: the host syncs of a training step
    and of a control step (a record copies once, by design)."""
    if a.syncs and not a.device.startswith('cuda'):
        raise Stop(f'--syncs needs CUDA (torch.cuda.set_sync_debug_mode), not --device={a.device}')
    cfg = train.get_config([*preset_args(a.preset or 'paper'), '--control=shrink',
                            '--shrink_iters=1', *args])
    # the steps' speed does not depend on the text
    tokens = torch.randint(200, (1 << 20,)).numpy().astype('uint16')
    run, steps = bare_run(cfg, a.device, {'train': tokens, 'val': tokens}, 200)
    if a.syncs:
        return count_syncs({name: steps[name] for name in ('training step', 'control step')})
    optimizer, run.optimizer = run.optimizer, train.make_optimizer(run.model, cfg, 'cuda')
    steps['training step']()
    counts = []
    for name, step in steps.items():
        with KernelCount() as mode:
            step()
        counts.append(f'{name} {mode.n}')
    print(f"kernels per step (aten operations, the optimizer fused): {', '.join(counts)}")
    run.optimizer, sync = optimizer, getattr(torch, a.device.split(':')[0]).synchronize
    ms = {name: timed(lambda: (step(), sync()), a.repeats) for name, step in steps.items()}
    sizes = ', '.join(f'{k} {cfg[k]}'
                      for k in ('n_layer', 'n_embd', 'n_head', 'block_size', 'batch_size'))
    print(f'{sizes} on {a.device}, {run.dtype}, {run.threads} threads; '
          f'medians of {a.repeats} after one more')
    train_ms, control_ms, record_ms = ms.values()
    print(f"{'training step':16s} {train_ms:10.1f} ms\n"
          f"{'control step':16s} {control_ms:10.1f} ms  "
          f"{100 * control_ms / train_ms:.1f}% of a training step"
          " (control=shrink, after every step)\n"
          f"{'geometry record':16s} {record_ms:10.1f} ms  "
          f"{100 * record_ms / train_ms:.1f}% of a training step, "
          f"{100 * record_ms / (cfg['geom_interval'] * train_ms):.2f}% "
          f"at one record per {cfg['geom_interval']} steps")


def count_syncs(steps):
    """Print where each step, called once before, synchronises with the host:
    'NAME: N host syncs FILE:LINE ...'."""
    for name, step in steps.items():
        step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
            step()
            torch.cuda.set_sync_debug_mode('default')
        where = [f'{w.filename}:{w.lineno}' for w in caught if 'synchroniz' in str(w.message)]
        print(f"{name}: {len(where)} host syncs {' '.join(sorted(set(where)))}", flush=True)


def gpu_check(a, args):
    """The tests, paper runs (plain, controlled, compiled), --overhead, --syncs, DDP on 2 GPUs,
    --jobs and a smoke sweep (--small: at CPU sizes), each to LOG/STEP.log, then LOG/summary.txt.
    A failed step does not stop the next. Each runs in the caller's folder, where its paths lead."""
    py, small, runs, ngpu = (sys.executable, a.small, os.path.join(a.log, 'runs'),
                             torch.cuda.device_count())
    sizes = preset_args('smoke' if small else 'paper')
    run = [py, f'{REPO}/train.py', *sizes, *args, f'--out_dir={runs}', '--overwrite=True']
    # for --overhead, --syncs and --jobs
    tiny = ['--preset=smoke', '--iters=4', '--repeats=1'] if small else []
    tests = [f'{REPO}/tests/test_geometry.py', '-k', 'test_pr_'] if small else [f'{REPO}/tests']
    sweep = {'PRESET': 'smoke', 'OUT': os.path.join(a.log, 'sweep'), 'JOBS': max(2, 2 * ngpu),
             'DEPTHS': 4, 'SEEDS': 1, 'INITS': 'normal tied', 'CONTROL_SEEDS': '' if small else 1,
             'SHRINK_TOS': 0.2, 'CONTROL_KEEPS': 'fro', 'PYTHON': py,
             'DATA_FILE': a.data_file or None}   # None: sweep.sh's default
    steps = {
        'tests': [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *tests],
        'paper_run': [*run, '--run_name=paper_run'],
        'paper_control': [*run, '--control=shrink', '--shrink_to=0.2', '--run_name=paper_control'],
        'paper_compile': 'skipped (--small)' if small else
        [*run, '--compile=True', '--run_name=paper_compile'],
        'overhead': [py, f'{REPO}/bench.py', '--overhead', *tiny],
        'syncs': [py, f'{REPO}/bench.py', '--syncs', *tiny] if ngpu else
        'skipped (set_sync_debug_mode is CUDA only)',
        'ddp': f'skipped (DDP needs 2 GPUs, {ngpu} here)' if ngpu < 2 else
        [py, '-m', 'torch.distributed.run', '--nproc_per_node=2', *run[1:], '--grad_accum=2',
         '--run_name=ddp'],
        'jobs': [py, f'{REPO}/bench.py', '--jobs=2' if small else '--jobs=1,2,4,8', *tiny, *args],
        'sweep': ['env', *(f'{k}={v}' for k, v in sweep.items() if v is not None),
                  'bash', f'{REPO}/sweep.sh'],
    }
    os.makedirs(a.log, exist_ok=True)
    with open(os.path.join(a.log, 'summary.txt'), 'a') as summary:
        summary.write(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {ngpu} GPUs\n')
        for name in [s for s in steps if not a.steps or s in a.steps.split(',')]:
            t0, status, log = time.perf_counter(), steps[name], os.path.join(a.log, f'{name}.log')
            if not isinstance(status, str):
                with open(log, 'w') as out:
                    rc = subprocess.run(status, stdout=out, stderr=subprocess.STDOUT).returncode
                status = 'ok' if rc == 0 else f'FAILED (exit {rc})'
            line = f'{name}: {status} in {time.perf_counter() - t0:.0f} s'
            if os.path.isfile(os.path.join(runs, name, 'done.json')):   # a run's speed
                done = json.load(open(os.path.join(runs, name, 'done.json')))
                shares = (f"control {100 * done['control_share']:.1f}%, "
                          f"geometry {100 * done['geometry_share']:.1f}%")
                line += (f", {1000 * done['wall_time'] / done['iter']:.1f} ms/iter, "
                         f"{shares} of its wall time")
            if name == 'syncs' and os.path.isfile(log):
                line += ''.join(f'; {found.strip()}' for found in open(log)
                                if ' host syncs' in found)
            print(line, flush=True)
            summary.write(line + '\n')


def counts(flag, text):
    """The whole numbers >= 1 of --flag=1,2,4, or a Stop naming it."""
    if not all(v.isdigit() and int(v) > 0 for v in text.split(',')):
        raise Stop(f'--{flag}={text}: use whole numbers >= 1, comma-separated (like 1,2,4)')
    return [int(v) for v in text.split(',')]


def main(argv):
    modes = {'jobs': bench_jobs, 'whole': bench_whole, 'geometry': bench_geometry,
             'control': bench_control, 'overhead': bench_overhead, 'syncs': bench_overhead,
             'gpu_check': gpu_check, 'plain': plain}
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument('--jobs', help='K,K,...: runs at once on one device')
    for mode in ('whole', 'geometry', 'control', 'overhead', 'syncs', 'gpu_check', 'plain'):
        group.add_argument(f'--{mode}', action='store_true',
                           help=argparse.SUPPRESS if mode == 'plain' else None)
    p.add_argument('--preset', default='',
                   help="the sweep.sh preset's sizes [paper; --jobs on a CPU: cpu]")
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                   help='[cuda, else cpu]')
    p.add_argument('--data_file', default='', help='the text [WikiText-103 test split]')
    p.add_argument('--iters', type=int, default=0,
                   help='iterations per run [--jobs 200, --whole 150]')
    p.add_argument('--repeats', default='3',
                   help='(--whole) interleaved rounds; (--overhead) timed steps')
    p.add_argument('--widths', default='128,256,384', help='(--geometry, --control) the widths C')
    p.add_argument('--steps', default='',
                   help='(--gpu_check) only these steps, comma-separated [all]')
    p.add_argument('--small', action='store_true', help='(--gpu_check) every step at CPU sizes')
    p.add_argument('--log',
                   default=os.path.join('out', 'gpu_check', time.strftime('%Y%m%d-%H%M%S')))
    a, extra = p.parse_known_args(argv)
    a.jobs = a.jobs if a.jobs is None else counts('jobs', a.jobs)
    a.widths, a.repeats = counts('widths', a.widths), counts('repeats', a.repeats)[0]
    try:  # an absent device: one line here, not a traceback from a run
        torch.empty(0, device=a.device)
    except Exception:  # torch raises one of several kinds, some many lines long
        raise Stop(f'--device={a.device} is not available here (torch {torch.__version__})')
    data_args = [f'--data_file={a.data_file}'] if a.data_file else ['--dataset=wikitext103-test']
    mode = next(m for m in modes if getattr(a, m))
    modes[mode](a, [*data_args, *extra])


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except Stop as e:
        print(f'bench.py: {e.code}', file=sys.stderr)
        sys.exit(2)
