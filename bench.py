"""
Throughput of train.py at the CPU benchmark size, with geometry logging on and off, against a plain
nanoGPT-style loop (the same model, no logging, no checkpoints, no guards). Medians of several runs.
"train.py steps alone" is the geometry-off run without its loss estimates and checkpoint writes (the
ms/iter train.py prints covers only the steps since the previous record): the loop itself.

    python bench.py --data_file=../shared/data/wikitext-103/wiki.test.raw [--repeats=3] [--iters=1000]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import train

SIZE = ['--n_layer=4', '--n_embd=128', '--n_head=4', '--block_size=128', '--batch_size=32']


def train_py(data_file, iters, geom_interval, out):
    """Wall time per iteration of a whole train.py run (start-up excluded: its done.json's wall time), and
    the share of it spent measuring geometry. Loss estimates every 250 iterations (train.py's default) in
    both modes; geometry logging adds its early log-spaced records (with their loss estimates) on top."""
    args = [sys.executable, 'train.py', f'--data_file={data_file}', *SIZE, f'--max_iters={iters}',
            f'--geom_interval={geom_interval}', f'--out_dir={out}', '--run_name=bench', '--overwrite=True']
    log = subprocess.run(args, check=True, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    with open(os.path.join(out, 'bench', 'done.json')) as f:
        done = json.load(f)
    # the training steps alone: the ms/iter of each console line covers the steps since the last record
    steps = [(int(m[1]), float(m[2])) for m in re.finditer(r'^iter (\d+):.*? ([\d.]+) ms/iter', log, re.M)]
    bare = sum((it - prev) * ms for (prev, _), (it, ms) in zip(steps, steps[1:])) / 1000 / iters
    return done['wall_time'] / iters, done['geometry_share'], bare


def plain_loop(data_file, iters):
    """The nanoGPT loop at its plainest: random windows from a memmap, forward, backward, step."""
    cfg = train.get_config([f'--data_file={data_file}', *SIZE])
    data, _, meta = train.prepare_data(cfg)
    torch.manual_seed(1)
    model = train.GPT(train.GPTConfig(meta['vocab_size'], 128, 4, 4, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    t0 = time.time()
    for _ in range(iters):
        ix = np.random.randint(len(data) - 129, size=32)
        x = torch.from_numpy(np.stack([data[i:i + 128] for i in ix]).astype(np.int64))
        y = torch.from_numpy(np.stack([data[i + 1:i + 129] for i in ix]).astype(np.int64))
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.time() - t0) / iters


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--data_file', required=True)
    p.add_argument('--iters', type=int, default=1000)
    p.add_argument('--geom_interval', type=int, default=250, help="train.py's default")
    p.add_argument('--repeats', type=int, default=3)
    a = p.parse_args()
    times = {'train.py, geometry on': [], 'train.py, geometry off': [], 'train.py steps alone': [],
             'plain loop': []}
    shares = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(a.repeats):  # interleaved, so a slow spell of the machine hits all of them
            per_iter, share, _ = train_py(a.data_file, a.iters, a.geom_interval, out)
            times['train.py, geometry on'].append(per_iter)
            shares.append(share)
            per_iter, _, bare = train_py(a.data_file, a.iters, 0, out)
            times['train.py, geometry off'].append(per_iter)
            times['train.py steps alone'].append(bare)
            times['plain loop'].append(plain_loop(a.data_file, a.iters))
    tokens = 32 * 128
    base = statistics.median(times['plain loop'])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f'{name:24s} {1000 * m:7.1f} ms/iter  {tokens / m:8.0f} tok/s  x{m / base:.3f} of the plain loop  '
              f'(runs: {", ".join(f"{1000 * t:.0f}" for t in ts)} ms)')
    on, off = statistics.median(times['train.py, geometry on']), statistics.median(times['train.py, geometry off'])
    print(f'geometry logging costs {100 * (on - off) / on:.1f}% of wall time at geom_interval={a.geom_interval} '
          f'(on minus off); measuring and writing geometry alone: {100 * statistics.median(shares):.1f}% '
          f'(train.py\'s geometry_share)')
