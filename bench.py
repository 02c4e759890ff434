"""
Every speed figure the project quotes, with the command that measures it. One timing helper,
`timings`, times every measurement: the calls are interleaved, so a slow spell of a shared machine
hits all of them alike, and the figures are medians.

    python bench.py --jobs=1,2,4,8 [--preset=paper|cpu] [--device=cuda] [--iters=200]
                                 K train.py runs at once on one device at a sweep.sh preset's size, for each K:
                                 aggregate tokens/s, ms/iter per run, geometry (and control) share of wall
                                 time. This is how to pick sweep.sh's JOBS per GPU. [device: cuda when
                                 available, else cpu; preset: paper on cuda, else cpu]
    python bench.py --fixed_cost whole train.py processes (150 iterations, default logging) against whole plain
                                 nanoGPT-style processes of the same model: start-up and records included
    python bench.py --loop       train.py per iteration against a plain nanoGPT-style loop (--iters, --repeats)
    python bench.py --geometry   geometry per evaluation, layer_geometry and token_geometry, at several widths
    python bench.py --control    control.apply at several widths, control_keep fro and spec (--threads)
    python bench.py --encode     encoding a text into the data cache (--mb), and a cache hit

The text is --data_file=PATH, or by default WikiText-103's 1.3 MB test split (train.py's
--dataset=wikitext103-test: wiki.test.raw alone, downloaded once into train.py's data_dir). Other
--key=value arguments go to every train.py run, as with sweep.sh (--n_layer=8, --control=freeze,
--dataset=wikitext103, ...). The sizes of --jobs are read from sweep.sh's presets, their one home.

Measured on the 2-core CPU of the development machine, torch 2.13, on the WikiText-103 test split; ratios
rather than single times (the machine is shared, and single runs vary by 10% or more):

- train.py against a plain loop (`python bench.py --loop --iters=1000 --repeats=2`; n_layer 4, n_embd 128,
  4 heads, block 128, batch 32, default intervals): train.py's training steps alone (its printed ms/iter,
  which leaves out records) 161.7 ms/iter against 164.1 ms/iter for a plain nanoGPT-style loop of the same
  model: x0.985, no slower. Whole runs, records and checkpoints included: 172.9 ms/iter with geometry
  logging, 184.7 ms/iter without (--geom_interval=0), a difference inside the machine's noise; the time
  train.py itself counts as measuring and writing geometry (geometry_share in done.json) was 0.8% of wall
  time at geom_interval=250.
- Geometry per evaluation (`python bench.py --geometry`; eval batch of 16 windows of 256, n_head = C/64, ms):
  C = 128: 2.8 (weights) + 26.8 (tokens); 256: 13.2 + 58.1; 384: 21.8 + 92.6; 512: 42.2 + 161.4;
  768: 106.5 + 338.5; 1024: 223.5 + 560.3. For an 8-layer C = 384 model, all layers take 0.72 s inside
  train.py (plus 0.74 s for the measuring forward pass), against 11.1 s for one training iteration at that
  size (batch 64 x 256): 6.5% of one iteration, so once per 250 iterations it is about 0.03% of training.
  The token metrics (float64 covariances of 4096 x 384 activations) are most of it.
- Control, the transform alone (`python bench.py --control --threads=1`; one apply on 4 layers, freeze with
  every block changing, median of 7, ms, head scope with n_head=4 / layer scope): n_embd 128: 6.2 / 12.8;
  256: 23.7 / 57.8; 384: 52.3 / 138.6; 512: 118.9 / 360.8; 768: 274.2 / 849.0. It grows about as C^3 (the
  SVD); at n_embd 128 that is 1-4% of a training iteration with control_interval=1. Inside train.py at the
  cpu sweep size (n_embd 64, 4 layers, control=freeze, which acts at every step, 600 iterations): control
  took 10.8% of wall time with 1 thread (as the sweep runs it) and 14.6% with 2, about 2.5 ms per step
  against a 15-25 ms step. At n_embd 128 it is about 7 ms against a
  160 ms step (4%); the training step grows about as C^2.
- Fixed per-run cost (`python bench.py --fixed_cost`; whole processes of 150 iterations at n_layer 4, n_embd 128,
  4 heads, block 128, batch 32; 3 interleaved pairs, load average 1.7-3.8): train.py with default logging
  42.4 s, a plain process of the same model with no evaluation, logging or checkpoints 34.0 s: x1.23 wall,
  x1.24 CPU time. Outside the loop (imports, data, set-up, exit) 2.9 s against 2.7 s; the rest is train.py's
  records (losses at 0 and 150, geometry at the early log-spaced records, snapshots, model checkpoints).
- Data encoding (`python bench.py --encode`): 31 M characters/s (a 160 MB synthetic WikiText-shaped file,
  prepare.prepare_data), so the full WikiText-103 (540 M characters) encodes in well under a minute; a cache
  hit costs one SHA-256 of the source.
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import control
import geometry
import prepare
import train
from configurator import Stop

REPO = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(REPO, 'train.py')
DATASET = '--dataset=wikitext103-test'   # the text when no --data_file is given
LOOP_SIZE = ['--n_layer=4', '--n_embd=128', '--n_head=4', '--block_size=128', '--batch_size=32']


class BenchError(Exception):
    """A problem with bench.py's arguments or inputs: main prints it as one line and exits with status 2."""


# ----------------------------------------------------------------------------- the one timing helper

def timings(fns, repeats, warmup=True):
    """Wall seconds of each call: fns is a dict name -> function of no arguments, each called `repeats`
    times, interleaved (a, b, a, b, ...), after one untimed call each when warmup. {name: [seconds, ...]}"""
    if warmup:
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def median_ms(ts):
    return 1000 * statistics.median(ts)


# ----------------------------------------------------------------------------- train.py against a plain loop

def load_data(args):
    """The encoded training text of a train.py argument list (through train.py's cache), and its vocabulary."""
    data, _, meta = prepare.prepare_data(train.get_config(args))
    return data, meta['vocab_size']


def plain_loop(data, vocab_size, args, iters, seed=1):
    """The nanoGPT loop at its plainest, on train.py's model at the size in args: random windows from a
    memmap, forward, backward, clip, step. Seconds per iteration."""
    cfg = train.get_config(args)
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    torch.manual_seed(seed)
    np.random.seed(seed)
    T, B = cfg['block_size'], cfg['batch_size']
    model = train.GPT(train.GPTConfig(vocab_size, T, cfg['n_layer'], cfg['n_head'], cfg['n_embd']))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                            weight_decay=cfg['weight_decay'])
    t0 = time.perf_counter()
    for _ in range(iters):
        ix = np.random.randint(len(data) - T - 1, size=B)
        x = torch.from_numpy(np.stack([data[i:i + T] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + T] for i in ix]).astype(np.int64))
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / iters


def train_py(args, out, name='bench'):
    """A whole train.py run; its done.json (wall_time excludes start-up) and console output."""
    log = launch([[sys.executable, TRAIN, *args, f'--out_dir={out}', f'--run_name={name}',
                   '--overwrite=True']])[0][0]
    with open(os.path.join(out, name, 'done.json')) as f:
        return json.load(f), log


def steps_alone(log, iters):
    """Seconds per iteration of the training steps alone: each console line's ms/iter covers the steps
    since the previous record, and leaves the record itself out."""
    records = [(int(m[1]), m[2]) for m in re.finditer(r'^iter (\d+):.*? ([\d.]+|-) ms/iter', log, re.M)]
    return sum((it - prev) * float(ms) for (prev, _), (it, ms) in zip(records, records[1:])) / 1000 / iters


def bench_loop(args, iters, repeats, geom_interval):
    """Per iteration, on the CPU: train.py with geometry logging on and off, its steps alone, the plain loop."""
    args = [*LOOP_SIZE, *args, f'--max_iters={iters}', '--device=cpu']
    data, vocab = load_data(args)
    cfg = train.get_config(args)
    results = {'train.py, geometry on': [], 'train.py, geometry off': [], 'train.py steps alone': [],
               'plain loop': []}
    shares = []
    with tempfile.TemporaryDirectory() as out:
        def on():
            done, _ = train_py([*args, f'--geom_interval={geom_interval}'], out)
            results['train.py, geometry on'].append(done['wall_time'] / iters)
            shares.append(done['geometry_share'])

        def off():
            done, log = train_py([*args, '--geom_interval=0'], out)
            results['train.py, geometry off'].append(done['wall_time'] / iters)
            results['train.py steps alone'].append(steps_alone(log, iters))

        def plain():
            results['plain loop'].append(plain_loop(data, vocab, args, iters))
        timings({'on': on, 'off': off, 'plain': plain}, repeats, warmup=False)
    tokens = cfg['batch_size'] * cfg['block_size']
    base = statistics.median(results['plain loop'])
    for name, ts in results.items():
        m = statistics.median(ts)
        print(f'{name:24s} {1000 * m:7.1f} ms/iter  {tokens / m:8.0f} tok/s  x{m / base:.3f} of the plain loop  '
              f'(runs: {", ".join(f"{1000 * t:.0f}" for t in ts)} ms)')
    on_s, off_s = (statistics.median(results[k]) for k in ('train.py, geometry on', 'train.py, geometry off'))
    print(f'geometry logging costs {100 * (on_s - off_s) / on_s:.1f}% of wall time at geom_interval={geom_interval} '
          f"(on minus off); measuring and writing geometry alone: {100 * statistics.median(shares):.1f}% "
          f"(train.py's geometry_share)")
    return results


# ----------------------------------------------------------------------------- runs per device: --jobs

def preset_args(preset):
    """The --key=value overrides of sweep.sh's PRESET, read from sweep.sh: its presets are the one place
    the run sizes are written (a preset there is `name) ... PRESET_ARGS=(...)`)."""
    with open(os.path.join(REPO, 'sweep.sh')) as f:
        presets = {m[1]: m[2].split() for m in re.finditer(r'^(\w+)\).*?PRESET_ARGS=\((.*?)\)', f.read(), re.M | re.S)}
    if preset not in presets:
        raise BenchError(f"--preset={preset} is not one of sweep.sh's presets ({', '.join(presets)})")
    return presets[preset]


def size_of(cfg):
    """The model and batch size of a train.py config, in words."""
    return (f"n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}, n_head {cfg['n_head']}, block {cfg['block_size']}, "
            f"batch {cfg['batch_size']}" + (f" x {cfg['grad_accum']}" if cfg['grad_accum'] > 1 else ''))


def launch(cmds):
    """Start every command at once and wait for all: (their standard outputs, the CPU seconds they used).
    BenchError naming the first that failed, with its last line. They run in this process's folder, so that
    a relative --data_file or data_dir means to them what it means here."""
    procs, cpu0 = [], resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate() for p in procs]
    finally:   # stopped (Ctrl-C) or failed: no run is left behind
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    for cmd, p, (_, err) in zip(cmds, procs, outs):
        if p.returncode:
            last = (err.strip().splitlines() or ['(no output)'])[-1]
            raise BenchError(f"{' '.join(cmd[1:3])}... exited with status {p.returncode}: {last}")
    return [out for out, _ in outs], cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime


def jobs_row(k, dones, iters, tokens_per_iter, batch_s):
    """One line of the --jobs table from the done.json of k processes that ran at once: the aggregate
    tokens/s over the slowest process's training time (start-up excluded), the median ms/iter per
    process (records and checkpoints included), the median geometry and control shares."""
    slowest = max(d['wall_time'] for d in dones)
    return {'jobs': k, 'tok_s': k * iters * tokens_per_iter / slowest,
            'ms_iter': 1000 * statistics.median(d['wall_time'] for d in dones) / iters,
            'geometry_share': statistics.median(d['geometry_share'] for d in dones),
            'control_share': statistics.median(d.get('control_share', 0.0) for d in dones), 'batch_s': batch_s}


def bench_jobs(jobs, args, iters, device):
    """K train.py processes at once on one device, for each K in jobs; returns the table's rows."""
    args = [*args, f'--max_iters={iters}', f'--device={device}']
    cfg = train.get_config(args)
    prepare.prepare_data(cfg)   # the cache is built once here, not raced by K processes
    tokens_per_iter = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size']
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    print(f"train.py at {size_of(cfg)}, {iters} iterations per process on {device}, --threads=CPUs/K as sweep.sh "
          f"sets it (unless given); arguments: {' '.join(args)}")
    print(f"{'jobs':>4} {'aggregate tok/s':>16} {'ms/iter/process':>16} {'geometry':>9} {'control':>8} "
          f"{'batch wall s':>13} {'load before':>12}")
    rows = []
    for k in jobs:
        threads = [] if any(a.startswith('--threads=') for a in args) else [f'--threads={max(1, ncpu // k)}']
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as out:
            cmds = [[sys.executable, TRAIN, *args, *threads, f'--seed={i + 1}', f'--out_dir={out}',
                     f'--run_name=job{i}', '--overwrite=True'] for i in range(k)]
            batch = timings({'batch': lambda: launch(cmds)}, 1, warmup=False)['batch'][0]
            dones = []
            for i in range(k):
                with open(os.path.join(out, f'job{i}', 'done.json')) as f:
                    dones.append(json.load(f))
        row = jobs_row(k, dones, iters, tokens_per_iter, batch)
        rows.append(row)
        print(f"{k:>4} {row['tok_s']:>16.0f} {row['ms_iter']:>16.1f} {100 * row['geometry_share']:>8.1f}% "
              f"{100 * row['control_share']:>7.1f}% {batch:>13.1f} {load:>12.2f}", flush=True)
    best = max(rows, key=lambda r: r['tok_s'])
    print(f"most tokens/s with {best['jobs']} processes at once on {device}")
    return rows


# ----------------------------------------------------------------------------- fixed per-run costs

def plain_process(cache, args, iters):
    """The body of a whole plain process (`bench.py --plain_process=CACHE`): the encoded text from the
    cache folder as a memmap, as nanoGPT reads its train.bin, then plain_loop. Prints its loop time."""
    data = np.memmap(os.path.join(cache, 'train.bin'), dtype=np.uint16, mode='r')
    with open(os.path.join(cache, 'meta.json')) as f:
        vocab_size = json.load(f)['vocab_size']
    print(json.dumps({'loop_s': iters * plain_loop(data, vocab_size, args, iters)}))


def bench_fixed_cost(args, iters, repeats):
    """Whole processes, start-up included: train.py with its default logging against a plain process of
    the same model and iterations (no logging, no checkpoints), interleaved, `repeats` pairs, each pair
    printed as it ends. Also the CPU seconds of each process, which a busy machine inflates less than wall
    time. On the CPU: the plain loop has no device code."""
    args = [*LOOP_SIZE, *args, f'--max_iters={iters}', '--device=cpu']
    data, _, _ = prepare.prepare_data(train.get_config(args))   # a warm cache for both
    cache = os.path.dirname(os.path.abspath(data.filename))
    loop_s, cpu_s = {'train.py': [], 'plain': []}, {'train.py': [], 'plain': []}
    with tempfile.TemporaryDirectory() as out:
        def whole_train():
            cpu_s['train.py'].append(launch([[sys.executable, TRAIN, *args, f'--out_dir={out}',
                                              '--run_name=fixed', '--overwrite=True']])[1])
            with open(os.path.join(out, 'fixed', 'done.json')) as f:
                loop_s['train.py'].append(json.load(f)['wall_time'])

        def whole_plain():
            outs, cpu = launch([[sys.executable, os.path.join(REPO, 'bench.py'), f'--plain_process={cache}',
                                 f'--iters={iters}', *args]])
            cpu_s['plain'].append(cpu)
            loop_s['plain'].append(json.loads(outs[0].strip().splitlines()[-1])['loop_s'])
        print(f"whole processes, {iters} iterations at {size_of(train.get_config(args))}: train.py with default "
              f"logging against a plain loop of the same model, {repeats} interleaved pairs")
        wall = {'train.py': [], 'plain': []}
        for _ in range(repeats):
            load = os.getloadavg()[0]
            for name, ts in timings({'train.py': whole_train, 'plain': whole_plain}, 1, warmup=False).items():
                wall[name] += ts
            print('  ' + ';  '.join(f'{name} {wall[name][-1]:.1f} s ({loop_s[name][-1]:.1f} s in its loop, '
                                    f'{cpu_s[name][-1]:.1f} CPU s)' for name in wall) +
                  f';  ratio x{wall["train.py"][-1] / wall["plain"][-1]:.3f}; load {load:.2f} before', flush=True)
    ratio = statistics.median(t / p for t, p in zip(wall['train.py'], wall['plain']))
    cpu_ratio = statistics.median(t / p for t, p in zip(cpu_s['train.py'], cpu_s['plain']))
    print(f"train.py / plain, median of the {repeats} pairs: x{ratio:.3f} in wall time, x{cpu_ratio:.3f} in CPU "
          f"time; outside its loop (imports, data, set-up, exit): train.py "
          f"{statistics.median(w - l for w, l in zip(wall['train.py'], loop_s['train.py'])):.1f} s, plain "
          f"{statistics.median(w - l for w, l in zip(wall['plain'], loop_s['plain'])):.1f} s")
    return ratio


# ----------------------------------------------------------------------------- geometry per evaluation

def bench_geometry(widths, repeats=5, B=16, T=256):
    """ms per call of layer_geometry and token_geometry, n_head = C / 64, on an eval batch (B, T)."""
    torch.manual_seed(0)
    print(f'torch {torch.__version__}, {torch.get_num_threads()} CPU threads; eval batch B={B}, T={T}, '
          f'n_head=C/64; median of {repeats} runs, ms')
    print(f"{'C':>5} {'n_head':>6} {'layer_geometry':>15} {'token_geometry':>15}")
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rows = {}
    for C in widths:
        n_head = max(1, C // 64)
        W_Q, W_K = 0.02 * torch.randn(C, C), 0.02 * torch.randn(C, C)
        q, k = torch.randn(B, T, C), torch.randn(B, T, C)
        att = torch.randn(B, n_head, T, T).masked_fill(~causal, float('-inf')).softmax(-1)
        ts = timings({'layer': lambda: geometry.layer_geometry(W_Q, W_K, n_head),
                      'token': lambda: geometry.token_geometry(q, k, att, n_head)}, repeats)
        rows[C] = (median_ms(ts['layer']), median_ms(ts['token']))
        print(f'{C:>5} {n_head:>6} {rows[C][0]:>15.1f} {rows[C][1]:>15.1f}')
    if 384 in rows:
        print(f'8-layer C=384 model, one evaluation: 8 x (layer + token) = {8 * sum(rows[384]):.0f} ms')
    return rows


# ----------------------------------------------------------------------------- control.apply

def control_step(C, scope, n_head, keep, n_layer=4):
    """One stand-in optimizer step (a small random change, so that freeze has something to undo) and
    control.apply on n_layer (C, C) weights, as a function of no arguments."""
    qk = [(torch.nn.Parameter(0.02 * torch.randn(C, C)), torch.nn.Parameter(0.02 * torch.randn(C, C)))
          for _ in range(n_layer)]
    cfg = dict(control='freeze', control_target='k', control_scope=scope, control_layers='', control_keep=keep,
               shrink_to=0.5, shrink_iters=100, control_interval=1, n_head=n_head)
    state = control.record(cfg, qk)
    noise = [0.001 * torch.randn(C, C) for _ in range(n_layer)]

    def step():
        with torch.no_grad():
            for (_, wk), e in zip(qk, noise):
                wk.add_(e)
        control.apply(state, cfg, qk, 1)
    return step


def bench_control(widths, repeats=7):
    """ms per control.apply on 4 layers, control=freeze (every block changes), fro and spec interleaved."""
    torch.manual_seed(0)
    scopes = (('head, n_head=4', 'head', lambda C: 4), ('head, d=32', 'head', lambda C: C // 32),
              ('layer', 'layer', lambda C: 4))
    print(f'torch {torch.__version__}, {torch.get_num_threads()} CPU threads; apply() on 4 layers, control=freeze '
          f'(every block changes), median of {repeats} runs, ms, control_keep fro / spec')
    print(f"{'C':>5}" + ''.join(f'{label:>22}' for label, _, _ in scopes))
    rows = {}
    for C in widths:
        fns = {(label, keep): control_step(C, scope, n_head(C), keep)
               for label, scope, n_head in scopes for keep in ('fro', 'spec')}
        ts = timings(fns, repeats)
        rows[C] = {key: median_ms(t) for key, t in ts.items()}
        print(f'{C:>5}' + ''.join(f"{rows[C][label, 'fro']:>14.1f} / {rows[C][label, 'spec']:<5.1f}"
                                  for label, _, _ in scopes))
    spec = sum(r[key] for r in rows.values() for key in r if key[1] == 'spec')
    fro = sum(r[key] for r in rows.values() for key in r if key[1] == 'fro')
    print(f'spec / fro, all cells together: {spec / fro:.3f}')
    return rows


# ----------------------------------------------------------------------------- data encoding

def bench_encode(text_file, mb, repeats=1):
    """Characters per second of encoding a text of about mb megabytes (text_file repeated) into an empty
    cache with prepare.prepare_data, and the time of a cache hit (one SHA-256 of the source)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cache = os.path.join(tmp, 'text.txt'), os.path.join(tmp, 'cache')
        text = open(text_file, encoding='utf-8').read()
        with open(src, 'w', encoding='utf-8') as f:
            for _ in range(max(1, round(mb * 2 ** 20 / max(1, len(text.encode('utf-8')))))):
                f.write(text)
        size_mb = os.path.getsize(src) / 2 ** 20
        args = [f'--data_file={src}', f'--cache_dir={cache}']
        chars = []

        def miss():   # emptying the cache first (a few ms) makes every call a miss
            shutil.rmtree(cache, ignore_errors=True)
            _, _, meta = prepare.prepare_data(train.get_config(args))
            chars.append(meta['n_train'] + meta['n_val'])
        ts = timings({'miss': miss, 'hit': lambda: prepare.prepare_data(train.get_config(args))}, repeats,
                     warmup=False)
    rate, hit = chars[0] / statistics.median(ts['miss']), statistics.median(ts['hit'])
    print(f"encoding {chars[0] / 1e6:.1f} M characters ({size_mb:.0f} MB): "
          f"{rate / 1e6:.1f} M characters/s; a cache hit {1000 * hit:.0f} ms")
    return rate, hit


# ----------------------------------------------------------------------------- command line

def int_list(text, name):
    try:
        values = [int(t) for t in text.split(',') if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchError(f'{name}={text!r}: expected positive whole numbers separated by commas, such as 1,2,4')
    return values


def check_text(path):
    """A readable regular file, or BenchError saying what path is instead."""
    if os.path.isfile(path) and os.access(path, os.R_OK):
        return
    if os.path.islink(path) and not os.path.exists(path):
        what = f'is a link to {os.readlink(path)}, which does not exist'
    elif not os.path.exists(path):
        what = 'does not exist'
    elif os.path.isdir(path):
        what = 'is a folder'
    elif not os.path.isfile(path):
        what = 'is not a regular file (a device, pipe or socket)'
    else:
        what = 'cannot be read (permission denied)'
    raise BenchError(f'--data_file={path} {what}; pass a UTF-8 text file, or leave --data_file out for the '
                     f'WikiText-103 test split')


def default_text():
    """The path of WikiText-103's test split, the text when no --data_file is given: in train.py's data_dir,
    which train.py fills from the download the first time."""
    path = os.path.join(train.get_config([])['data_dir'], 'wiki.test.raw')
    if not os.path.isfile(path):
        train.prepare_data(train.get_config([DATASET]))
    return path


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not the usage block
        raise BenchError(f'{message} (see python bench.py --help)')


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog='Other --key=value arguments go to every train.py run (and the plain loop), as in sweep.sh.')
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument('--jobs', help='K[,K,...]: K train.py processes at once on one device, for each K')
    mode.add_argument('--fixed_cost', '--fixed-cost', action='store_true',
                      help='whole train.py processes against whole plain ones')
    mode.add_argument('--loop', action='store_true', help='train.py per iteration against a plain loop')
    mode.add_argument('--geometry', action='store_true', help='geometry per evaluation at several widths')
    mode.add_argument('--control', action='store_true', help='control.apply at several widths, fro and spec')
    mode.add_argument('--encode', action='store_true', help='encoding a text into the data cache')
    mode.add_argument('--plain_process', help=argparse.SUPPRESS)   # the child process of --fixed_cost
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu', help='(--jobs) [cuda if '
                   'available, else cpu]')
    p.add_argument('--preset', default='', help="(--jobs) sweep.sh's preset whose sizes to run: paper | cpu | "
                   'ladder | smoke [paper on cuda, else cpu]')
    p.add_argument('--data_file', default='', help='the text to train on or encode [the WikiText-103 test split, '
                   f'{DATASET}]')
    p.add_argument('--iters', type=int, help='iterations per run [--jobs 200, --fixed_cost 150, '
                   '--loop 1000]')
    p.add_argument('--repeats', type=int, help='runs of each, interleaved [--fixed_cost and --loop 3, '
                   '--encode 1]')
    p.add_argument('--geom_interval', type=int, default=250, help="--loop's geometry-on runs (train.py's default)")
    p.add_argument('--widths', default='', help='C values, comma-separated (--geometry, --control)')
    p.add_argument('--threads', type=int, default=0, help='torch CPU threads (0: torch default)')
    p.add_argument('--mb', type=float, default=64, help='size of the text to encode (--encode)')
    a, extra = p.parse_known_args(argv)
    check_values(a, extra)
    trains = a.jobs or a.fixed_cost or a.loop or a.plain_process
    a.train_args = [f'--data_file={a.data_file}' if a.data_file else DATASET, *extra] if trains else []
    train.get_config(a.train_args)   # an unknown key or a bad value: train.py's one-line error, here
    return a


def check_values(a, extra):
    """bench.py's own arguments, checked before train.py reads the rest; fills in the defaults that depend
    on the mode (iters, repeats, the --jobs list and its preset's arguments)."""
    if a.iters is None:
        a.iters = 200 if a.jobs else 150 if a.fixed_cost else 1000
    if a.repeats is None:
        a.repeats = 1 if a.encode else 3
    if a.iters < 1 or a.repeats < 1:
        raise BenchError(f'--iters={a.iters} and --repeats={a.repeats} must be at least 1')
    if extra and not (a.jobs or a.fixed_cost or a.loop or a.plain_process):
        raise BenchError(f"{extra[0]}: extra --key=value arguments go to train.py runs, which only --jobs, "
                         f"--fixed_cost and --loop make")
    if a.data_file:
        check_text(a.data_file)
    if a.jobs:
        a.jobs = int_list(a.jobs, '--jobs')
        if a.device.startswith('cuda') and not torch.cuda.is_available():
            raise BenchError(f'--device={a.device}, but torch sees no CUDA device here; use --device=cpu')
        a.preset_args = preset_args(a.preset or ('paper' if a.device.startswith('cuda') else 'cpu'))


def main(argv):
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.jobs:
        bench_jobs(a.jobs, [*a.preset_args, *a.train_args], a.iters, a.device)
    elif a.fixed_cost:
        bench_fixed_cost(a.train_args, a.iters, a.repeats)
    elif a.plain_process:
        plain_process(a.plain_process, a.train_args, a.iters)
    elif a.loop:
        bench_loop(a.train_args, a.iters, a.repeats, a.geom_interval)
    elif a.geometry:
        bench_geometry(int_list(a.widths or '128,256,384,512,768,1024', '--widths'))
    elif a.control:
        bench_control(int_list(a.widths or '128,256,384,512,768', '--widths'))
    elif a.encode:
        bench_encode(a.data_file or default_text(), a.mb, a.repeats)


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (BenchError, Stop) as e:
        print(f'bench.py: error: {e.msg if isinstance(e, Stop) else e}', file=sys.stderr)
        sys.exit(2)
