"""Shared by the training-side tests: a synthetic text, the arguments of a tiny run, train.py in a
subprocess."""
import json
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
WORDS = ('the of and to in a is was for on as with by he it at from his an were are '
         'which this').split()


def make_text(n_chars, seed=0):
    """Word salad from a small vocabulary: structured enough for a tiny model to learn quickly."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < n_chars:
        sentence = ' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        out.append(sentence.capitalize() + '. ')
        n += len(out[-1])
    return ''.join(out)[:n_chars]


@pytest.fixture(autouse=True, scope='session')
def test_process(tmp_path_factory):
    """Every data cache the tests build, in subprocesses too, in a temporary folder, not
    ~/.cache/qkgeom; torch on one CPU thread (on the tests' small tensors a second thread
    mostly waits: on two busy cores the Q/K trainings of test_geometry.py take 30 times longer
    with two)."""
    os.environ['QKGEOM_CACHE'] = str(tmp_path_factory.mktemp('cache'))
    import torch
    torch.set_num_threads(1)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / 'text.txt'
    path.write_text(make_text(60_000))
    return path


def tiny_args(tmp_path, text_file, *extra):
    """A 2-layer, 32-wide model for 16 iterations on the CPU (in float32 on any machine), writing
    under tmp_path."""
    return ['--device=cpu', f'--data_file={text_file}', f'--out_dir={tmp_path / "out"}',
            f'--cache_dir={tmp_path / "cache"}',
            '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=8',
            '--max_iters=16', '--eval_interval=8', '--geom_interval=8', '--eval_iters=2',
            '--eval_windows=4', '--ckpt_interval=8', '--model_ckpts=4', '--warmup_iters=2',
            '--min_char_count=1', '--threads=1', *extra]


def run_train(args, cwd=REPO, script=os.path.join(REPO, 'train.py'), env=None):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


def records(run_dir):
    """The records of a run, wall-clock time aside."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    return [{k: v for k, v in r.items() if k != 'time'} for r in rows]
