"""train.py under faults: SIGKILL at several points and resume, SIGTERM/SIGINT, the NaN guard, bad
checkpoints and caches, and a 2-process DDP run. Kills are injected by a small wrapper that patches
train.py's own functions in a subprocess, so the points are exact and train.py carries no test hooks."""
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import train

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def setup(tmp_path, synthetic_text):
    (tmp_path / 'src').mkdir()
    path = tmp_path / 'src' / 'corpus.txt'
    path.write_text(synthetic_text(40_000), encoding='utf-8')
    return tmp_path, str(path)


@pytest.fixture
def reference(setup, records, without_wall_clock, args_for):
    tmp_path, text_file = setup
    run_dir = train.train(train.get_config(args_for(tmp_path, text_file, 'ref')))
    return without_wall_clock(records(run_dir)), sorted(os.listdir(os.path.join(run_dir, 'snapshots')))


@pytest.mark.parametrize('point, at', [('record', 4),       # before the first checkpoint (at 8)
                                       ('record', 16),      # between checkpoints: record 16 written, ckpt not
                                       ('half_line', 8),    # a truncated last line in metrics.jsonl
                                       ('ckpt_write', 16)])  # halfway through writing a checkpoint
def test_sigkill_then_rerun_gives_the_uninterrupted_metrics(setup, reference, point, at, records, without_wall_clock, run_train, args_for):
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'killed')
    killed = run_train(args, point, at)
    assert killed.returncode == -signal.SIGKILL
    run_dir = tmp_path / 'out' / 'killed'
    assert not (run_dir / 'done.json').exists()
    if point == 'ckpt_write':  # the previous checkpoint survived the broken write
        assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter'] == 8
    resumed = run_train(args)
    assert resumed.returncode == 0, resumed.stderr
    assert ('resuming' in resumed.stdout) == (at > 8)
    assert without_wall_clock(records(run_dir)) == reference[0]
    assert sorted(os.listdir(run_dir / 'snapshots')) == reference[1]


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_signal_checkpoints_exits_cleanly_and_resumes_exactly(setup, reference, sig, records, without_wall_clock, run_train, args_for):
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'signalled')
    stopped = run_train(args, sig, 16)
    assert stopped.returncode == 128 + getattr(signal, sig), stopped.stderr
    assert 'Traceback' not in stopped.stderr and 'Run the same command again to resume' in stopped.stdout
    run_dir = tmp_path / 'out' / 'signalled'
    assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter'] == 17 and not (run_dir / 'done.json').exists()
    assert run_train(args).returncode == 0
    assert without_wall_clock(records(run_dir)) == reference[0]


def test_external_sigterm_mid_run(setup, args_for):
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'term', '--max_iters=100000', '--eval_interval=50')
    proc = subprocess.Popen([sys.executable, 'train.py', *args], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / 'out' / 'term' / 'metrics.jsonl'
    for line in proc.stdout:  # wait until training is under way
        if line.startswith('iter 8:'):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    it = torch.load(tmp_path / 'out' / 'term' / 'ckpt.pt', weights_only=True)['iter']
    assert it >= 8 and f'at iteration {it}' in out
    assert all(r['iter'] <= it for r in train.read_metrics(str(metrics)))


def test_nan_loss_stops_keeps_the_last_good_checkpoint(setup, monkeypatch, records, args_for):
    tmp_path, text_file = setup
    # an absurd learning rate from iteration 6 on: the weights blow up, and the loss with them
    get_lr = train.get_lr
    monkeypatch.setattr(train, 'get_lr', lambda it, cfg: 1e30 if it >= 6 else get_lr(it, cfg))
    cfg = train.get_config(args_for(tmp_path, text_file, 'nan', '--grad_clip=0', '--ckpt_interval=1'))
    with pytest.raises(SystemExit, match=r'the loss became (nan|inf) at iteration [78].*ckpt.pt keeps the last good'):
        train.train(cfg)
    run_dir = tmp_path / 'out' / 'nan'
    assert not (run_dir / 'done.json').exists()
    ckpt = torch.load(run_dir / 'ckpt.pt', weights_only=True)
    assert ckpt['iter'] in (6, 7) and all(torch.isfinite(v).all() for v in ckpt['model'].values())
    assert all(np.isfinite(r.get('val_loss', 0)) and np.isfinite(r.get('eval_loss', 0)) for r in records(run_dir))


def test_corrupt_or_mismatched_checkpoint_is_named(setup, args_for):
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'bad')
    run_dir = train.train(train.get_config(args))
    os.remove(os.path.join(run_dir, 'done.json'))  # as if killed after the last checkpoint
    with pytest.raises(SystemExit, match=r'other settings \(lr\).*--overwrite=True'):
        train.train(train.get_config(args + ['--lr=0.5']))
    with open(os.path.join(run_dir, 'ckpt.pt'), 'r+b') as f:
        f.truncate(100)
    with pytest.raises(SystemExit, match='it is corrupt.*--overwrite=True'):
        train.train(train.get_config(args))
    assert os.path.exists(os.path.join(run_dir, 'metrics.jsonl'))  # nothing deleted by the refusal
    assert train.train(train.get_config(args + ['--overwrite=True'])) == run_dir


def test_checkpoint_of_another_text_is_refused(setup, synthetic_text, args_for):
    tmp_path, text_file = setup
    run_dir = train.train(train.get_config(args_for(tmp_path, text_file, 'text')))
    os.remove(os.path.join(run_dir, 'done.json'))
    other = tmp_path / 'src' / 'other.txt'
    other.write_text(synthetic_text(40_000, seed=1))
    with pytest.raises(SystemExit, match='other settings \\(the training text\\)'):
        train.train(train.get_config(args_for(tmp_path, str(other), 'text')))


def test_cache_whose_meta_names_another_source_is_refused(setup, args_for):
    tmp_path, text_file = setup
    cfg = train.get_config(args_for(tmp_path, text_file, 'x'))
    folder = os.path.dirname(train.prepare_data(cfg)[0].filename)
    meta = json.load(open(os.path.join(folder, 'meta.json')))
    json.dump(dict(meta, sha256='0' * 64), open(os.path.join(folder, 'meta.json'), 'w'))
    with pytest.raises(SystemExit, match=f'{folder} is corrupt or was built from a different file'):
        train.prepare_data(cfg)


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_two_process_ddp_matches_one_process(setup, records, args_for):
    tmp_path, text_file = setup
    single = train.train(train.get_config(args_for(tmp_path, text_file, 'one', '--grad_accum=2')))
    args = args_for(tmp_path, text_file, 'ddp', '--grad_accum=2')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nnodes=1', '--nproc_per_node=2',
           f'--master_port={free_port()}', 'train.py', *args]
    proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ddp = str(tmp_path / 'out' / 'ddp')
    assert sorted(os.listdir(ddp)) == sorted(os.listdir(single))
    assert json.load(open(os.path.join(ddp, 'config.json')))['world_size'] == 2
    a, b = records(single), records(ddp)
    assert [r['iter'] for r in a] == [r['iter'] for r in b]
    # the same global batch, split over two processes: only the order of float additions differs
    np.testing.assert_allclose([r['eval_loss'] for r in b], [r['eval_loss'] for r in a], rtol=1e-4)
    np.testing.assert_allclose([r.get('val_loss', 0) for r in b], [r.get('val_loss', 0) for r in a], rtol=1e-4)
    np.testing.assert_allclose([r['layers'][1]['pr_k'] for r in b], [r['layers'][1]['pr_k'] for r in a], rtol=1e-4)


def test_refusals_from_the_command_line_print_their_reason(run_train):
    proc = run_train(['--n_embd=16', '--n_head=3'])
    assert proc.returncode == 2 and 'not divisible by n_head=3' in proc.stderr and 'Traceback' not in proc.stderr
    proc = run_train(['--n_layr=4'])
    assert proc.returncode == 2 and 'did you mean n_layer' in proc.stderr
