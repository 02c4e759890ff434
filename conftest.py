"""Shared test fixtures: a synthetic corpus, a tiny run's config, and train.py run in a subprocess
(optionally killed or signalled at an exact point). Test modules take these as fixtures and never
import each other."""
import os
import json
import math
import random
import subprocess
import sys
import zlib

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LOG_ITERS = (0, 1, 2, 4, 8, 16, 32, 50, 64, 100)
WORDS = 'the of and to in a is was for on as with by he it at from his an were are which this'.split()


def make_text(n_chars, seed=0):
    """Word salad from a small vocabulary: structured enough for a tiny model to learn quickly."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < n_chars:
        sentence = ' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + '. '
        out.append(sentence)
        n += len(sentence)
    return ''.join(out)[:n_chars]


def make_tiny_config(tmp_path, text_file, *extra):
    """A resolved config of a 2-layer, 32-wide model for 16 iterations, writing under tmp_path."""
    import train
    args = [f'--data_file={text_file}', f'--out_dir={tmp_path / "out"}', f'--cache_dir={tmp_path / "cache"}',
            '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=8', '--max_iters=16',
            '--eval_interval=8', '--geom_interval=8', '--eval_iters=2', '--eval_windows=4', '--ckpt_interval=8',
            '--model_ckpts=4', '--warmup_iters=2', '--min_char_count=1', '--threads=1', *extra]
    return train.get_config(args)


def read_records(run_dir):
    import runfolder
    return runfolder.read_metrics(os.path.join(run_dir, 'metrics.jsonl'))


def drop_wall_clock(rows):
    return [{k: v for k, v in r.items() if k != 'time'} for r in rows]


# argv: point iteration train-args...; dies (or signals itself) at that point of that iteration
WRAPPER = r'''
import os, signal, sys
import runfolder, train
point, at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
print_record, atomic_save = train.print_record, runfolder.atomic_save

def after_record(row, *rest):
    print_record(row, *rest)
    if row['iter'] != at:
        return
    if point == 'record':
        die()
    if point == 'half_line':  # a kill in the middle of writing the next metrics line
        with open(os.path.join(train.get_config(args)['out_dir'], train.get_config(args)['run_name'],
                               'metrics.jsonl'), 'a') as f:
            f.write('{"iter": 99, "train_lo')
        die()
    if point in ('SIGTERM', 'SIGINT'):
        os.kill(os.getpid(), getattr(signal, point))

def during_save(obj, path):
    if point == 'ckpt_write' and path.endswith('ckpt.pt') and obj['iter'] == at:
        with open(path + '.tmp', 'wb') as f:
            f.write(b'half a checkpoint')
            f.flush()
        die()
    atomic_save(obj, path)

train.print_record, runfolder.atomic_save = after_record, during_save
train.train(train.get_config(args))
'''


def run_train_process(args, point=None, at=0):
    """train.py ARGS in a subprocess; with point, killed or signalled there (see WRAPPER)."""
    cmd = [sys.executable, '-c', WRAPPER, point, str(at), *args] if point else [sys.executable, 'train.py', *args]
    return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600)


def tiny_args(tmp_path, text_file, name, *extra):
    """The command-line arguments of a 24-iteration tiny run named name (only what differs from the defaults)."""
    import train
    cfg = make_tiny_config(tmp_path, text_file, f'--run_name={name}', '--max_iters=24', *extra)
    defaults = train.get_config([])
    return [f'--{k}={v}' for k, v in cfg.items() if v != defaults[k]]


# ----------------------------------------------------------------------------- synthetic run folders (analyze.py's input)

def layer_record(pr_q, pr_k, pr_qk, entropy, n_head, offsets=None):
    """One layer of a metrics.jsonl record with every key train.py logs (per-head lists included). offsets: the
    per-head deviations (n_head each) of PR_K, PR_QK and entropy from the layer value; None: every head alike."""
    k_off, qk_off, e_off = np.zeros((3, n_head)) if offsets is None else offsets
    heads = lambda v, off=np.zeros(n_head): [float(x) for x in v + off]
    rec = {'pr_q': pr_q, 'pr_k': pr_k, 'pr_q_head': pr_q / 2, 'pr_k_head': pr_k / 2,
           'pr_q_heads': heads(pr_q / 2), 'pr_k_heads': heads(pr_k / 2, k_off), 'pr_qk': pr_qk,
           'pr_qk_heads': heads(pr_qk, qk_off), 'qk_spec_norm': 0.03, 'qk_fro_norm': 0.05,
           'qk_spec_norm_heads': heads(0.03), 'qk_fro_norm_heads': heads(0.05), 'erank_q': pr_q * 1.5,
           'erank_k': pr_k * 1.5, 'srank_q': 3.0, 'srank_k': 3.0, 'erank_qk': pr_qk * 1.5, 'tok_pr_q': pr_q - 1,
           'tok_pr_k': pr_k - 1, 'tok_pr_q_head': pr_q / 3, 'tok_pr_k_head': pr_k / 3,
           'tok_pr_q_heads': heads(pr_q / 3), 'tok_pr_k_heads': heads(pr_k / 3, k_off), 'tok_pr_qk': pr_qk / 2,
           'tok_pr_qk_heads': heads(pr_qk / 2, qk_off),
           'entropy': entropy, 'entropy_norm': entropy / 3, 'entropy_heads': heads(entropy, e_off),
           'entropy_norm_heads': heads(entropy / 3, e_off / 3)}
    return {k: float(v) if isinstance(v, (float, np.floating)) else v for k, v in rec.items()}


def head_offsets(rng, n_records, n_head, effect):
    """Per-head deviations from the layer value, (n_records, n_head) random walks centred across heads (the layer
    means stay as they are): PR_K's, and PR_QK's and entropy's following it with the sign of effect (0: each an
    independent walk)."""
    def walk():
        w = np.cumsum(rng.normal(0, 0.05, (n_records, n_head)), 0)
        return w - w.mean(1, keepdims=True)
    k = walk()
    qk, e = (effect * 0.5 * k, effect * 0.1 * k + 0.002 * walk()) if effect else (walk(), 0.1 * walk())
    return k, qk, e


def make_run(root, name, *, n_layer=2, qk_init='normal', seed=1, control='none', control_target='k', effect=1,
              iters=LOG_ITERS, n_embd=8, n_head=2, snapshots=True, done=True, **cfg):
    """A finished run folder. effect=+1 plants the study's claims (PR_Q up, PR_K down, PR_QK and entropy
    following PR_K, over training and across heads, shrink lowering and freeze raising entropy), -1 the opposite,
    0 none (noise). Shrink lowers PR_K towards shrink_to of its value."""
    path = os.path.join(root, name)
    os.makedirs(path)
    config = dict(out_dir=root, run_name=name, n_layer=n_layer, n_head=n_head, n_embd=n_embd, qk_init=qk_init,
                  seed=seed, control=control, control_target=control_target, control_scope='head', control_keep='fro',
                  shrink_to=0.5, max_iters=iters[-1], lr=1e-3, warmup_iters=10, weight_decay=0.1, decay_qk=True,
                  block_size=32, batch_size=8, eval_windows=4, data_file='corpus.txt', torch='test', device='cpu',
                  git_commit=None, vocab_size=50, n_params=1000)
    config.update(cfg)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f)
    seed_rng = np.random.default_rng(seed)             # shared by none/shrink/freeze of a seed: the pairing
    pair_offset = seed_rng.normal(0, 0.05)
    rng = np.random.default_rng(zlib.crc32(name.encode()))   # str hash() is salted per process
    head_rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)   # its own stream: rng's draws stay put
    f = np.log1p(np.array(iters, dtype=float)) / math.log1p(iters[-1])    # progress 0 -> 1
    walk = lambda: np.cumsum(rng.normal(0, 0.3, len(iters))) * (f > 0)
    sign = {'none': 0, 'shrink': -1, 'freeze': +1}[control]
    ctl_shift = effect * sign * 0.3 * f if effect else rng.normal(0, 0.05) * f
    layers = []
    for layer in range(n_layer):
        if effect:
            pr_q = 4 + effect * 2 * f + rng.normal(0, 0.02, len(f)) + 0.1 * layer
            pr_k = 4 - effect * 2 * f + rng.normal(0, 0.02, len(f))
            pr_qk = 2 + effect * 0.5 * (pr_k - 4) + rng.normal(0, 0.02, len(f))
            ent = 1.5 + effect * 0.2 * (pr_k - 4) + rng.normal(0, 0.01, len(f))
        else:
            pr_q, pr_k = 4 + walk(), 4 + walk()
            pr_qk, ent = 2 + rng.normal(0, 0.1, len(f)), 1.5 + rng.normal(0, 0.02, len(f))  # iid: no trend
        if control == 'shrink':
            pr_k = pr_k * (1 - (1 - config['shrink_to']) * f)
        layers.append((pr_q, pr_k, pr_qk, ent + pair_offset + ctl_shift,
                       head_offsets(head_rng, len(f), n_head, effect)))
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as fh:
        for i, it in enumerate(iters):
            row = {'iter': it, 'tokens': it * 256, 'lr': 1e-3, 'train_loss': 4 - f[i], 'val_loss': 4.1 - f[i],
                   'layers': [layer_record(*(a[i] for a in L[:4]), n_head, [o[i] for o in L[4]]) for L in layers],
                   'time': 0.01 * it}
            fh.write(json.dumps(row) + '\n')
    if snapshots:
        os.makedirs(os.path.join(path, 'snapshots'))
        for it in (iters[0], iters[-1]):
            q = rng.normal(0, 0.02, (n_layer, n_embd, n_embd)).astype(np.float32)
            np.savez(os.path.join(path, 'snapshots', f'qk_{it:07d}.npz'), q=q, k=q * 0.9, n_head=n_head)
    if done:
        with open(os.path.join(path, 'done.json'), 'w') as fh:
            json.dump({'iter': iters[-1], 'train_loss': 3.0, 'val_loss': 3.1, 'wall_time': 12.5,
                       'geometry_share': 0.2}, fh)
    return path


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope='session')
def write_run():
    return make_run


@pytest.fixture(scope='session')
def synthetic_text():
    return make_text


@pytest.fixture(scope='session')
def tiny_config():
    return make_tiny_config


@pytest.fixture(scope='session')
def records():
    return read_records


@pytest.fixture(scope='session')
def without_wall_clock():
    return drop_wall_clock


@pytest.fixture(scope='session')
def run_train():
    return run_train_process


@pytest.fixture(scope='session')
def args_for():
    return tiny_args


@pytest.fixture
def text_file(tmp_path):
    """A 40,000-character synthetic corpus at tmp_path/src/corpus.txt."""
    (tmp_path / 'src').mkdir()
    path = tmp_path / 'src' / 'corpus.txt'
    path.write_text(make_text(40_000), encoding='utf-8')
    return str(path)


@pytest.fixture(scope='session')
def log_iters():
    """The iterations of make_run's records."""
    return LOG_ITERS


def make_odd_path(tmp_path, kind):
    """A path that is not a regular file, of the given kind: (path, the words that should name what it is)."""
    path = tmp_path / 'thing'
    if kind == 'folder':
        path.mkdir()
    elif kind == 'device':
        path = '/dev/null'
    elif kind == 'fifo':
        os.mkfifo(path)
    elif kind == 'broken link':
        path.symlink_to(tmp_path / 'gone.txt')
    words = {'folder': 'is a folder', 'device': 'is not a regular file', 'fifo': 'is not a regular file',
             'missing': 'does not exist', 'broken link': f'is a link to {tmp_path / "gone.txt"}, which does not exist'}
    return path, words[kind]


@pytest.fixture(scope='session')
def odd_path():
    return make_odd_path
