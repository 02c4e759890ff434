"""
Every speed figure the README quotes, and the GPU check, each from one command:

    python bench.py --jobs=1,2,4 [--preset=cpu] [--device=cuda]  K train.py runs at once on one device, for each
                      K: tokens/s in all and ms/iter per run at a sweep.sh preset's size (pick JOBS with it)
    python bench.py --whole [--iters=150] [--repeats=3]  whole train.py processes, with their default logging and
                      with geometry logging off, against a plain nanoGPT-shaped process of the same model with the
                      same loss estimates (n_layer 4, n_embd 128, block 128, batch 32), interleaved
    python bench.py --geometry [--widths=128,256,384]  ms per layer of every metric a geometry record measures
    python bench.py --control [--widths=128,256,384]   ms per control.apply on 4 layers (freeze: every block moves)
    python bench.py --overhead [--device=cuda]  a training step, a control step and a geometry record of train.py at
                      the paper shape (n_layer 4, n_embd 384, 6 heads, block 256, batch 64), their ratios, and the
                      kernels (aten operations) each launches
    python bench.py --syncs  a training step and a control step of --overhead under torch.cuda.set_sync_debug_mode:
                      where each synchronises with the host (exit 1 if anywhere; CUDA only)
    python bench.py --gpu_check [--small] [--steps=a,b]  the GPU path end to end, going on after a failed step: the
                      tests, paper-preset runs (plain, controlled, compiled), --overhead, --syncs, DDP on 2 GPUs,
                      --jobs=1,2,4,8 at that size, a smoke sweep; --small shrinks every step (smoke sizes, a few
                      tests) to check it on a CPU. Logs, and each step's status and time, in --log (summary.txt)

The text is --data_file=PATH, else WikiText-103's test split (train.py's --dataset=wikitext103-test, downloaded
once into its data_dir). Other --key=value arguments go to every train.py run.
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
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import control
import geometry
import prepare
import train

REPO = os.path.dirname(os.path.abspath(__file__))
WHOLE_SIZE = ['--n_layer=4', '--n_embd=128', '--n_head=4', '--block_size=128', '--batch_size=32']


def preset_args(preset):
    """The --key=value sizes of one of sweep.sh's presets, their one home."""
    out = subprocess.run(['bash', os.path.join(REPO, 'sweep.sh')], env=dict(os.environ, PRESET=preset, PRINT_ARGS='1'),
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f'bench.py: {out.stderr.strip()}')
    return out.stdout.split()


def launch(cmds):
    """Run the commands at once: (wall seconds until the last ends, their CPU seconds). Exits naming a failure."""
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate() for p in procs]
    for cmd, p, (_, err) in zip(cmds, procs, outs):
        if p.returncode:
            sys.exit(f"bench.py: {' '.join(map(str, cmd[1:4]))} ... failed: {(err.strip().splitlines() or ['?'])[-1]}")
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - t0, cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime


def train_cmd(args, out, name):
    return [sys.executable, os.path.join(REPO, 'train.py'), *args, f'--out_dir={out}', f'--run_name={name}',
            '--overwrite=True']


def bench_jobs(jobs, args, iters, device):
    args = [*args, f'--max_iters={iters}', f'--device={device}']
    cfg = train.get_config(args)
    prepare.prepare_data(cfg)   # the cache is built once here, not raced by K processes
    tokens = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size'] * iters
    ncpu = os.cpu_count() or 1
    print(f'{iters} iterations per run on {device}: {" ".join(args)}')
    print(f'{"jobs":>4} {"tokens/s":>10} {"ms/iter per run":>16}')
    for k in jobs:
        with tempfile.TemporaryDirectory() as out:
            threads = [f'--threads={max(1, ncpu // k)}'] if device == 'cpu' else []
            launch([train_cmd([*args, *threads, f'--seed={i + 1}'], out, f'job{i}') for i in range(k)])
            walls = [json.load(open(os.path.join(out, f'job{i}', 'done.json')))['wall_time'] for i in range(k)]
        print(f'{k:>4} {k * tokens / max(walls):>10.0f} {1000 * statistics.median(walls) / iters:>16.1f}', flush=True)


def plain(args, iters):
    """A plain nanoGPT-shaped process (`bench.py --plain`): the same model, data, AdamW and clipping as train.py,
    and the same loss estimates (estimate_loss at iteration 0 and at the end); no geometry, files or checks."""
    cfg = train.get_config(args)
    torch.set_num_threads(cfg['threads'] or torch.get_num_threads())
    torch.manual_seed(cfg['seed'])
    data, val, meta = prepare.prepare_data(cfg)
    model = train.GPT(train.GPTConfig(meta['vocab_size'], cfg['block_size'], cfg['n_layer'], cfg['n_head'],
                                      cfg['n_embd']))
    opt = train.make_optimizer(model, cfg, 'cpu')
    gen, splits = torch.Generator().manual_seed(cfg['seed']), {'train': data, 'val': val}
    for it in range(iters + 1):
        if it in (0, iters):
            train.estimate_loss(model, splits, cfg, 'cpu', train.contextlib.nullcontext())
        if it == iters:
            break
        for group in opt.param_groups:
            group['lr'] = train.get_lr(it, cfg)
        x, y = train.get_batch(data, train.random_offsets(data, (cfg['batch_size'],), cfg['block_size'], gen),
                               cfg['block_size'])
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
        opt.zero_grad(set_to_none=True)


def bench_whole(args, iters, repeats):
    args = [*WHOLE_SIZE, *args, f'--max_iters={iters}', '--device=cpu']
    prepare.prepare_data(train.get_config(args))
    kinds = {'train.py': [], 'train.py, geometry off': [], 'plain': []}
    cpus = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as out:
        cmds = {'train.py': train_cmd(args, out, 'on'),
                'train.py, geometry off': train_cmd([*args, '--geom_interval=0', '--model_ckpts=0'], out, 'off'),
                'plain': [sys.executable, os.path.join(REPO, 'bench.py'), '--plain', f'--iters={iters}', *args]}
        for r in range(repeats):   # interleaved: a slow spell of a shared machine hits each alike
            for kind, cmd in cmds.items():
                wall, cpu = launch([cmd])
                kinds[kind].append(wall)
                cpus[kind].append(cpu)
            print(f'round {r + 1}: ' + ', '.join(f'{k} {v[-1]:.1f} s' for k, v in kinds.items()), flush=True)
        share = json.load(open(os.path.join(out, 'on', 'done.json')))['geometry_share']
    med = lambda d, k: statistics.median(d[k])
    for kind in kinds:   # CPU time is what a busy machine inflates least
        print(f"{kind:24s} median {med(kinds, kind):6.1f} s wall, {med(cpus, kind):6.1f} s CPU: speed x"
              f"{med(kinds, 'plain') / med(kinds, kind):.3f} (CPU x{med(cpus, 'plain') / med(cpus, kind):.3f}) of the "
              f"plain process")
    print(f'geometry logging: {100 * share:.1f}% of the wall time of the train.py run (its done.json)')


def timed(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_geometry(widths, B=16, T=256):
    print(f'ms per layer, eval batch {B} x {T}, n_head = C / 64, {torch.get_num_threads()} threads\n'
          f'{"C":>5} {"weights":>8} {"learned":>8} {"tokens":>8}')
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for C in widths:
        h = max(1, C // 64)
        wq, wk, q, k = 0.02 * torch.randn(C, C), 0.02 * torch.randn(C, C), torch.randn(B, T, C), torch.randn(B, T, C)
        att = torch.randn(B, h, T, T).masked_fill(~mask, float('-inf')).softmax(-1)
        ms = [timed(lambda: geometry.layer_geometry(wq, wk, h)), timed(lambda: geometry.learned_geometry(
            wq, wk, wk, wq, h)), timed(lambda: geometry.token_geometry(q, k, att, h))]
        print(f'{C:>5}' + ''.join(f'{m:>9.1f}' for m in ms), flush=True)


def bench_control(widths):
    print(f'ms per control.apply on 4 layers, control=freeze, head scope with 4 heads\n{"C":>5} {"fro":>8} {"spec":>8}')
    for C in widths:
        row = []
        for keep in ('fro', 'spec'):
            cfg = dict(control='freeze', control_target='k', control_scope='head', control_layers='', n_head=4,
                       control_keep=keep, shrink_to=0.5, shrink_iters=1, control_interval=1)
            qk = [(torch.randn(C, C), torch.randn(C, C)) for _ in range(4)]
            state = control.record(cfg, qk)

            def step():   # a small move first, so that freeze has something to undo
                for _, wk in qk:
                    wk.add_(1e-3 * torch.randn(C, C))
                control.apply(state, cfg, qk, 1)
            row.append(timed(step))
        print(f'{C:>5}' + ''.join(f'{m:>9.1f}' for m in row), flush=True)


def count_kernels(run, steps):
    """Print the aten operations of one call of each step (about one GPU kernel each; views and Python numbers wrapped
    as tensors launch none), the optimizer fused as on CUDA, past its first step (which creates its state)."""
    free = {torch.ops.aten._unsafe_view.default, torch.ops.aten.scalar_tensor.default}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view and func not in free and func.namespace == 'aten'
            return func(*args, **(kwargs or {}))
    optimizer, run.optimizer = run.optimizer, train.make_optimizer(run.model, run.cfg, 'cuda')
    steps['training step']()
    counts = []
    for name, step in steps.items():
        with Count() as mode:
            step()
        counts.append(f'{name} {mode.n}')
    run.optimizer = optimizer
    print(f"kernels per step (aten operations, the optimizer fused): {', '.join(counts)}")


def overhead_run(args, device):
    """train.py's Run at the paper shape on random tokens, and its steps: training, control, geometry record."""
    cfg = train.get_config([*preset_args('paper'), '--control=shrink', '--shrink_iters=1', f'--device={device}', *args])
    torch.manual_seed(0)
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    data = torch.randint(200, (1 << 20,), dtype=torch.int16).numpy().astype('uint16')
    run = train.Run(cfg, False, 0, 1, device, meta={'vocab_size': 200}, data={'train': data},
                    data_gen=torch.Generator().manual_seed(0))
    train.runfolder.set_numerics(run, 'bfloat16' if device.startswith('cuda') and torch.cuda.is_bf16_supported()
                                 else 'float32', torch.get_num_threads())
    train.build_model(run, device.split(':')[0], resuming=False)   # the model, optimizer and control state of a run
    run.train_model = run.model
    x, y = (t.to(device) for t in train.get_batch(data, torch.arange(cfg['eval_windows']) * 997, cfg['block_size']))
    steps = {'training step': lambda: train.train_step(run, 0), 'control step': lambda: train.control_step(run, 1),
             'geometry record': lambda: train.measure_geometry(run.model, x, y, cfg['n_head'], run.w0)}
    return run, cfg, steps


def bench_overhead(args, device, repeats):
    """The steps of overhead_run (their speed does not depend on the text), synchronised with the device before each
    clock reading."""
    run, cfg, steps = overhead_run(args, device)
    sync = getattr(torch, device.split(':')[0]).synchronize
    count_kernels(run, steps)
    ms = {name: timed(lambda: (step(), sync()), repeats) for name, step in steps.items()}
    sizes = ', '.join(f'{k} {cfg[k]}' for k in ('n_layer', 'n_embd', 'n_head', 'block_size', 'batch_size'))
    print(f'{sizes} on {device}, {run.dtype}, {torch.get_num_threads()} threads; medians of {repeats} after one more')
    train_ms, every = ms['training step'], cfg['geom_interval']
    print(f"{'training step':16s} {train_ms:10.1f} ms\n{'control step':16s} {ms['control step']:10.1f} ms  "
          f"{100 * ms['control step'] / train_ms:.1f}% of a training step (control=shrink, after every step)\n"
          f"{'geometry record':16s} {ms['geometry record']:10.1f} ms  {100 * ms['geometry record'] / train_ms:.1f}% of a "
          f"training step, {100 * ms['geometry record'] / (every * train_ms):.2f}% at one record per {every} steps")


def count_syncs(steps):
    """{step: ['file:line', ...]} where each step, called once before, synchronises with the host, from the warnings
    of torch.cuda.set_sync_debug_mode('warn'); printed."""
    found = {}
    for name, step in steps.items():
        step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode('default')
        found[name] = [f'{w.filename}:{w.lineno}' for w in caught if 'synchroniz' in str(w.message)]
        print(f"{name}: {len(found[name])} host syncs {' '.join(sorted(set(found[name])))}", flush=True)
    return found


def bench_syncs(args, device):
    """A training step and control.apply (the control step without its timing's synchronisations)."""
    if not device.startswith('cuda'):
        raise train.configurator.Stop(f'--syncs needs CUDA (torch.cuda.set_sync_debug_mode), not --device={device}')
    run, cfg, steps = overhead_run(args, device)
    count_syncs({'training step': steps['training step'],
                 'control step': lambda: control.apply(run.ctl, cfg, run.model.qk_weights(), 1)})


def gpu_check(a, data_args):
    """Each step logged to LOG/STEP.log, its status and time to LOG/summary.txt; a failed step does not stop
    the next."""
    os.makedirs(a.log, exist_ok=True)
    py, small, runs, ngpu = sys.executable, a.small, os.path.join(a.log, 'runs'), torch.cuda.device_count()
    preset = 'smoke' if small else 'paper'
    tiny = (['--n_embd=32', '--n_head=2', '--block_size=32', '--batch_size=4', '--eval_windows=2', '--repeats=1']
            if small else [])
    run = [py, 'train.py', *preset_args(preset), *data_args, f'--out_dir={runs}', '--overwrite=True']
    steps = {
        'tests': [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *(['test_geometry.py', '-k', 'test_pr_'] if small
                                                                         else [])],
        'paper_run': [*run, '--run_name=paper_run'],
        'paper_control': [*run, '--control=shrink', '--shrink_to=0.2', '--run_name=paper_control'],
        'paper_compile': 'skipped (--small: compiling takes minutes on a CPU; test_train.py compiles on one)' if small
        else [*run, '--compile=True', '--run_name=paper_compile'],
        'overhead': [py, 'bench.py', '--overhead', *tiny],
        'syncs': [py, 'bench.py', '--syncs', *tiny] if ngpu else 'skipped (set_sync_debug_mode is CUDA only)',
        'ddp': f'skipped (DDP needs 2 GPUs, {ngpu} here)' if ngpu < 2 else
        [py, '-m', 'torch.distributed.run', '--nproc_per_node=2', *run[1:], '--grad_accum=2', '--run_name=ddp'],
        'jobs': [py, 'bench.py', f"--jobs={'2' if small else '1,2,4,8'}", f'--preset={preset}',
                 f'--iters={4 if small else 200}', *data_args],
        'sweep': ['bash', 'sweep.sh'],
    }
    sweep_env = dict(os.environ, PRESET='smoke', OUT=os.path.join(a.log, 'sweep'), JOBS=str(max(2, 2 * ngpu)),
                     DEPTHS='4', INITS='normal tied', SEEDS='1', CONTROL_SEEDS='' if small else '1', SHRINK_TOS='0.2',
                     CONTROL_KEEPS='fro', PYTHON=py,
                     **({'DATA_FILE': a.data_file} if a.data_file else {}))
    steps = {name: cmd for name, cmd in steps.items() if not a.steps or name in a.steps.split(',')}
    with open(os.path.join(a.log, 'summary.txt'), 'a') as summary:
        summary.write(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {ngpu} GPUs\n')
        for name, cmd in steps.items():
            t0, rc = time.perf_counter(), cmd if isinstance(cmd, str) else None
            if rc is None:
                with open(os.path.join(a.log, f'{name}.log'), 'w') as log:
                    rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        env=sweep_env if name == 'sweep' else None).returncode
            line = f"{name}: {rc if isinstance(rc, str) else 'ok' if rc == 0 else f'FAILED (exit {rc})'} in " \
                   f"{time.perf_counter() - t0:.0f} s" + run_speed(os.path.join(runs, name)) + found_syncs(a.log, name)
            print(line, flush=True)
            summary.write(line + '\n')


def found_syncs(log, name):
    """'; training step: 0 host syncs; control step: 1 host syncs FILE:LINE' from the syncs step's log, else ''."""
    path = os.path.join(log, f'{name}.log')
    if name != 'syncs' or not os.path.isfile(path):
        return ''
    return ''.join(f'; {line.strip()}' for line in open(path) if ' host syncs' in line)


def run_speed(run_dir):
    """', 12.3 ms/iter, control 4.5%, geometry 1.2% of its wall time' from a finished run's done.json, else ''."""
    if not os.path.isfile(os.path.join(run_dir, 'done.json')):
        return ''
    done, cfg = (json.load(open(os.path.join(run_dir, f))) for f in ('done.json', 'config.json'))
    return (f", {1000 * done['wall_time'] / cfg['max_iters']:.1f} ms/iter, control {100 * done['control_share']:.1f}%, "
            f"geometry {100 * done['geometry_share']:.1f}% of its wall time")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument('--jobs', help='K,K,...: runs at once on one device')
    for flag in ('whole', 'geometry', 'control', 'overhead', 'syncs', 'gpu_check', 'plain'):
        mode.add_argument(f'--{flag}', action='store_true', help=argparse.SUPPRESS if flag == 'plain' else None)
    p.add_argument('--preset', default='', help='(--jobs) the sweep.sh preset [paper on a GPU, else cpu]')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--data_file', default='', help='the text [WikiText-103 test split]')
    p.add_argument('--iters', type=int, default=0, help='iterations per run [--jobs 200, --whole 150]')
    p.add_argument('--repeats', type=int, default=3, help='(--whole) interleaved rounds; (--overhead) timed steps')
    p.add_argument('--widths', default='128,256,384', help='(--geometry, --control) the widths C')
    p.add_argument('--small', action='store_true', help='(--gpu_check) every step at smoke sizes')
    p.add_argument('--steps', default='', help='(--gpu_check) only these steps, comma-separated [all]')
    p.add_argument('--log', default=os.path.join('out', 'gpu_check', time.strftime('%Y%m%d-%H%M%S')))
    a, extra = p.parse_known_args(argv)
    for flag, text in (('jobs', a.jobs), ('widths', a.widths), ('repeats', str(a.repeats))):
        if text is not None and not all(v.isdigit() and int(v) > 0 for v in text.split(',')):
            raise train.configurator.Stop(f'--{flag}={text}: use whole numbers >= 1, comma-separated (like 1,2,4)')
    try:  # an absent device: one line here, not a traceback from a run
        torch.empty(0, device=a.device)
    except Exception:  # torch raises one of several kinds, some many lines long
        raise train.configurator.Stop(f'--device={a.device} is not available here (torch {torch.__version__})')
    data_args = [f'--data_file={a.data_file}'] if a.data_file else ['--dataset=wikitext103-test']
    if a.jobs:
        bench_jobs([int(k) for k in a.jobs.split(',')], [*preset_args(a.preset or ('paper' if a.device != 'cpu' else
                   'cpu')), *data_args, *extra], a.iters or 200, a.device)
    elif a.whole:
        bench_whole([*data_args, *extra], a.iters or 150, a.repeats)
    elif a.plain:
        plain([*data_args, *extra], a.iters)
    elif a.geometry or a.control:
        (bench_geometry if a.geometry else bench_control)([int(w) for w in a.widths.split(',')])
    elif a.overhead:
        bench_overhead(extra, a.device, a.repeats)
    elif a.syncs:
        bench_syncs(extra, a.device)
    else:
        gpu_check(a, data_args)


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except train.configurator.Stop as e:
        print(f'bench.py: {e.msg}', file=sys.stderr)
        sys.exit(2)
