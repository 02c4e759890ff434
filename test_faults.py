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

import prepare
import runfolder
import train
from configurator import Stop

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
def test_sigkill_then_rerun_gives_the_uninterrupted_metrics(setup, reference, point, at, records, without_wall_clock,
                                                            run_train, args_for):
    """SIGKILL at a record, mid-line or mid-checkpoint, then the same command: the metrics of a run never killed."""
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
    assert {'pr_dq', 'pr_dk_heads', 'dq_rel'} <= set(reference[0][-1]['layers'][0])  # learned part compared too


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_signal_checkpoints_exits_cleanly_and_resumes_exactly(setup, reference, sig, records, without_wall_clock,
                                                              run_train, args_for):
    """SIGTERM/SIGINT: the step finishes, a checkpoint is written, exit 128+signal without traceback; the
    rerun resumes exactly."""
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
    """A SIGTERM from outside mid-run checkpoints and names the iteration; no record lies beyond it."""
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
    assert all(r['iter'] <= it for r in runfolder.read_metrics(str(metrics)))


def test_nan_loss_stops_keeps_the_last_good_checkpoint(setup, monkeypatch, records, args_for):
    """A loss that blows up stops the run with the documented message; ckpt.pt keeps the last finite state."""
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
    """A checkpoint of other settings, or a truncated one, is refused naming the cause, deleting nothing;
    --overwrite=True starts over."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'bad')
    run_dir = train.train(train.get_config(args))
    os.remove(os.path.join(run_dir, 'done.json'))  # as if killed after the last checkpoint
    with pytest.raises(SystemExit, match=r'other settings \(lr\).*--overwrite=True'):
        train.train(train.get_config(args + ['--lr=0.5']))
    with open(os.path.join(run_dir, 'ckpt.pt'), 'r+b') as f:
        f.truncate(100)
    with pytest.raises(Stop, match='not a checkpoint torch can read.*--overwrite=True') as info:
        train.train(train.get_config(args))
    assert 'weights_only' not in info.value.msg  # torch's advice to load code from a damaged file is not passed on
    assert os.path.exists(os.path.join(run_dir, 'metrics.jsonl'))  # nothing deleted by the refusal
    assert train.train(train.get_config(args + ['--overwrite=True'])) == run_dir


def test_a_checkpoint_of_another_version_is_refused_in_one_line(setup, args_for):
    """A ckpt.pt without what this train.py writes (here W(0); or a setting it did not have) is refused
    naming what it lacks, not resumed with a silent default."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'old', '--max_iters=8')
    run_dir = train.train(train.get_config(args))
    os.remove(os.path.join(run_dir, 'done.json'))
    path = os.path.join(run_dir, 'ckpt.pt')
    ckpt = torch.load(path, weights_only=True)
    del ckpt['config']['control_keep']
    torch.save(ckpt, path)
    with pytest.raises(Stop, match=r'ckpt.pt lacks the setting control_keep: another version of train.py wrote it'):
        train.train(train.get_config(args))
    del ckpt['w0']
    torch.save(ckpt, path)
    with pytest.raises(Stop, match=r'ckpt.pt lacks w0: another version of train.py wrote it.*--overwrite=True'):
        train.train(train.get_config(args))


def test_checkpoint_of_another_text_is_refused(setup, synthetic_text, args_for):
    """Resuming on another training text is refused."""
    tmp_path, text_file = setup
    run_dir = train.train(train.get_config(args_for(tmp_path, text_file, 'text')))
    os.remove(os.path.join(run_dir, 'done.json'))
    other = tmp_path / 'src' / 'other.txt'
    other.write_text(synthetic_text(40_000, seed=1))
    with pytest.raises(SystemExit, match='other settings \\(the training text or its encoding\\)'):
        train.train(train.get_config(args_for(tmp_path, str(other), 'text')))


def test_cache_whose_meta_names_another_source_is_refused(setup, args_for):
    """A cache whose meta.json names another source is refused."""
    tmp_path, text_file = setup
    cfg = train.get_config(args_for(tmp_path, text_file, 'x'))
    folder = os.path.dirname(prepare.prepare_data(cfg)[0].filename)
    meta = json.load(open(os.path.join(folder, 'meta.json')))
    json.dump(dict(meta, sha256='0' * 64), open(os.path.join(folder, 'meta.json'), 'w'))
    with pytest.raises(SystemExit, match=f'{folder} is corrupt or was built from a different file'):
        prepare.prepare_data(cfg)


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_two_process_ddp_matches_one_process(setup, records, args_for):
    """Two DDP processes on gloo give the one-process metrics to float tolerance and the same files."""
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
    """A user mistake on the command line: one line on stderr naming it, exit status 2, no traceback."""
    proc = run_train(['--n_embd=16', '--n_head=3'])
    assert proc.returncode == 2 and 'not divisible by n_head=3' in proc.stderr and 'Traceback' not in proc.stderr
    proc = run_train(['--n_layr=4'])
    assert proc.returncode == 2 and 'did you mean n_layer' in proc.stderr


# ----------------------------------------------------------------------------- user mistakes and failures

def run_code(code, *args, timeout=300):
    """python -c CODE ARGS in the repository: a wrapper that patches train.py from outside."""
    return subprocess.run([sys.executable, '-c', code, *args], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc):
    return proc.returncode == 2 and 'Traceback' not in proc.stderr and proc.stderr.count('\n') == 1


@pytest.mark.parametrize('device, words', [('gpu', "'gpu' is not a device"), ('cuda:99', 'cuda:99'),
                                           ('mps:0', 'mps')])
def test_device_is_checked_first_and_names_what_is_available(tmp_path, run_train, device, words):
    """An unusable device is refused before any data is read, naming the devices available
    (cpu, cuda with its count, mps) and the fix."""
    proc = run_train([f'--device={device}', f'--data_file={tmp_path / "absent.txt"}', f'--out_dir={tmp_path}'])
    assert one_line_error(proc), proc.stderr
    assert words in proc.stderr and 'available here: cpu' in proc.stderr and '--device=' in proc.stderr


def test_a_second_process_on_the_same_run_is_refused_naming_the_holder(setup, args_for):
    """A lock file in the run folder (fcntl.flock, released by the OS when its holder dies)."""
    import fcntl
    tmp_path, text_file = setup
    cfg = train.get_config(args_for(tmp_path, text_file, 'locked'))
    run_dir = tmp_path / 'out' / 'locked'
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, '-c', 'import fcntl, sys, time; f = open(sys.argv[1], "a+"); '
                               'fcntl.flock(f, fcntl.LOCK_EX); f.truncate(0); '
                               'f.write("%d" % __import__("os").getpid()); '
                               'f.flush(); print("held", flush=True); time.sleep(60)',
                               str(run_dir / runfolder.LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == 'held\n'
        with pytest.raises(Stop, match=f'another train.py .*PID {holder.pid}.*{run_dir}'):
            train.train(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert os.listdir(run_dir) == [runfolder.LOCK_FILE]  # the refused process wrote nothing
    assert train.train(cfg) == str(run_dir)  # the lock died with its holder
    with open(run_dir / runfolder.LOCK_FILE) as f:  # and the finished run holds none
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_nan_loss_is_caught_before_geometry(setup, args_for, run_train):
    """With geometry on, a blown-up model stops with the documented message and exit 2, not a
    ValueError from geometry.py; the checkpoint kept is finite."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'nan', '--lr=1e30', '--grad_clip=0.0', '--warmup_iters=0', '--ckpt_interval=1')
    proc = run_train(args)
    assert one_line_error(proc), proc.stderr[-2000:]
    assert 'the loss became nan at iteration' in proc.stderr or 'the loss became inf at iteration' in proc.stderr
    run_dir = tmp_path / 'out' / 'nan'
    if (run_dir / 'ckpt.pt').exists():
        ckpt = torch.load(run_dir / 'ckpt.pt', weights_only=True)
        assert all(torch.isfinite(v).all() for v in ckpt['model'].values())
    assert all(np.isfinite(r.get('val_loss', 0)) for r in runfolder.read_metrics(str(run_dir / 'metrics.jsonl')))
    names = os.listdir(run_dir / 'snapshots')
    last = max(r['iter'] for r in runfolder.read_metrics(str(run_dir / 'metrics.jsonl')))
    assert all(int(n[3:10]) <= last for n in names)  # no snapshot of the blown-up weights


INTERRUPT_ENCODING = r"""
import os, signal, sys
import prepare, train
# a shell that starts this in the background (CI can) leaves SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler; a terminal's Ctrl-C reaches a process whose SIGINT is not ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
encode_to = prepare.encode_to
def interrupted(chunks, table, path):
    n = encode_to(chunks, table, path)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return n
prepare.encode_to = interrupted
train.main(sys.argv[2:])
"""


@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM'])
def test_a_signal_during_encoding_leaves_no_building_folder_and_no_traceback(setup, args_for, sig):
    """Ctrl-C or SIGTERM while the cache is being built: no traceback, the half-built
    .building-* folder removed, exit 128 + signal."""
    tmp_path, text_file = setup
    proc = run_code(INTERRUPT_ENCODING, sig, *args_for(tmp_path, text_file, 'x'))
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert 'Traceback' not in proc.stderr and proc.stderr.count('\n') == 1
    assert [n for n in os.listdir(tmp_path / 'cache') if n.startswith('.building')] == []


FULL_DISK = r"""
import resource, signal, sys
import train
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
train.main(sys.argv[2:])
"""


def test_full_disk_gives_one_line_and_keeps_the_previous_checkpoint(setup, args_for, run_train, records,
                                                                    without_wall_clock, reference):
    """A write that fails (here: a file size limit, as a full disk) names the path and the
    cause in one line, exit 2; the previous ckpt.pt is intact and no temporary file is left. The same
    command, once there is room, resumes to the uninterrupted metrics."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'full')
    assert run_train(args, 'record', 16).returncode == -signal.SIGKILL  # ckpt.pt at 8
    run_dir = tmp_path / 'out' / 'full'
    size = os.path.getsize(run_dir / 'ckpt.pt')
    proc = run_code(FULL_DISK, str(size // 2), *args)
    assert one_line_error(proc), proc.stderr[-2000:]
    assert 'cannot write' in proc.stderr and str(run_dir) in proc.stderr and 'File too large' in proc.stderr
    assert torch.load(run_dir / 'ckpt.pt', weights_only=True)['iter'] == 8
    assert not [n for n in os.listdir(run_dir) if n.endswith('.tmp')]
    assert run_train(args).returncode == 0
    assert without_wall_clock(records(run_dir)) == reference[0]


def test_unwritable_out_dir_gives_one_line(setup, args_for, run_train):
    """An out_dir that cannot be written (here a path under a file; a read-only folder goes the
    same way) gives one line naming the path and the cause."""
    tmp_path, text_file = setup
    (tmp_path / 'afile').write_text('')
    proc = run_train(args_for(tmp_path, text_file, 'x', f'--out_dir={tmp_path / "afile" / "out"}'))
    assert one_line_error(proc), proc.stderr[-2000:]
    assert f'cannot write {tmp_path / "afile" / "out"}' in proc.stderr and 'Not a directory' in proc.stderr
    proc = run_train(args_for(tmp_path, text_file, 'x', f'--cache_dir={tmp_path / "afile" / "cache"}'))
    assert one_line_error(proc), proc.stderr[-2000:]
    assert f'cannot write {tmp_path / "afile" / "cache"}' in proc.stderr and '--cache_dir' in proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into read-only folders')
def test_read_only_out_dir_gives_one_line(setup, args_for, run_train):
    """A read-only out_dir gives one line naming the cause (skipped as root, who may write anyway)."""
    tmp_path, text_file = setup
    (tmp_path / 'ro').mkdir(mode=0o555)
    proc = run_train(args_for(tmp_path, text_file, 'x', f'--out_dir={tmp_path / "ro"}'))
    assert one_line_error(proc) and 'Permission denied' in proc.stderr


def test_files_train_py_did_not_write_are_ignored_on_resume(setup, reference, args_for, run_train, records,
                                                             without_wall_clock):
    """A stray file in snapshots/ or models/ neither breaks a resume nor is deleted."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, 'stray')
    assert run_train(args, 'record', 16).returncode == -signal.SIGKILL
    run_dir = tmp_path / 'out' / 'stray'
    for name in ('snapshots/notes.txt', 'models/notes.txt', 'snapshots/qk_final.npz'):
        (run_dir / name).write_text('mine')
    proc = run_train(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert without_wall_clock(records(run_dir)) == reference[0]
    assert all((run_dir / name).read_text() == 'mine' for name in ('snapshots/notes.txt', 'models/notes.txt'))


def test_metrics_are_fsynced_before_each_checkpoint_is_renamed(setup, args_for, monkeypatch):
    """After a power loss, the records a checkpoint has passed must be on disk."""
    tmp_path, text_file = setup
    synced, order = set(), []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        synced.add(os.path.basename(os.readlink(f'/proc/self/fd/{fd}')))
        fsync(fd)

    def spy_replace(src, dst):
        if str(dst).endswith('ckpt.pt'):
            order.append('metrics.jsonl' in synced)
            synced.clear()
        replace(src, dst)
    monkeypatch.setattr(os, 'fsync', spy_fsync)
    monkeypatch.setattr(os, 'replace', spy_replace)
    train.train(train.get_config(args_for(tmp_path, text_file, 'synced')))
    assert order == [True, True, True]  # at 8, 16 and the end


def test_the_run_folder_is_printed_at_start_and_end(setup, args_for, run_train):
    """A user sees where the run goes."""
    tmp_path, text_file = setup
    proc = run_train(args_for(tmp_path, text_file, 'shown', '--max_iters=2'))
    lines = proc.stdout.strip().split('\n')
    run_dir = str(tmp_path / 'out' / 'shown')
    assert proc.returncode == 0 and run_dir in lines[0] and run_dir in lines[-1]


@pytest.mark.parametrize('arg', ['--lr=-1', '--dropout=1.5', '--qk_init=ortho', '--run_name=../v', '--seed=-1'])
def test_user_mistakes_give_one_line_and_exit_2(run_train, arg):
    """Every user mistake: one line, exit 2, no traceback."""
    proc = run_train([arg])
    assert one_line_error(proc), proc.stderr[-2000:]


@pytest.mark.parametrize('keep', ['spec', 'fro'])
def test_controlled_run_killed_and_resumed_matches_uninterrupted(setup, args_for, run_train, records,
                                                                 without_wall_clock, keep):
    """A shrink run with control_keep (spec keeps the top singular value) resumes exactly: W(0)
    and the control state come back from ckpt.pt, so the learned-part metrics continue unchanged."""
    tmp_path, text_file = setup
    extra = ('--control=shrink', f'--control_keep={keep}', '--shrink_iters=16', '--shrink_to=0.3')
    ref = train.train(train.get_config(args_for(tmp_path, text_file, 'ref', *extra)))
    args = args_for(tmp_path, text_file, 'killed', *extra)
    assert run_train(args, 'record', 16).returncode == -signal.SIGKILL
    ckpt = torch.load(tmp_path / 'out' / 'killed' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter'] == 8 and len(ckpt['w0']) == 2 and ckpt['config']['control_keep'] == keep
    assert run_train(args).returncode == 0
    want = without_wall_clock(records(ref))
    assert without_wall_clock(records(tmp_path / 'out' / 'killed')) == want
    assert want[-1]['layers'][0]['ctl_pr'] < 0.5 * want[0]['layers'][0]['ctl_pr']  # the control did act
    assert want[-1]['layers'][0]['dk_rel'] > 0


# ----------------------------------------------------------------------------- nothing lost without a word

def test_a_kill_during_the_first_config_json_write_does_not_block_a_restart(setup, args_for):
    """config.json.tmp alone (a kill while config.json was first written) is train.py's own: the same command
    starts the run."""
    tmp_path, text_file = setup
    run_dir = tmp_path / 'out' / 'first'
    run_dir.mkdir(parents=True)
    (run_dir / 'config.json.tmp').write_text('{"run_na')
    (run_dir / runfolder.LOCK_FILE).write_text('')
    assert train.train(train.get_config(args_for(tmp_path, text_file, 'first', '--max_iters=2'))) == str(run_dir)
    assert not (run_dir / 'config.json.tmp').exists() and (run_dir / 'done.json').exists()


@pytest.mark.parametrize('damage', ['cut', 'gone'])
def test_a_resume_that_would_lose_records_is_refused(setup, args_for, damage):
    """A record before the checkpoint missing from metrics.jsonl (or the whole file gone) cannot be measured
    again from ckpt.pt: the resume is refused in one line, and nothing is deleted."""
    tmp_path, text_file = setup
    args = args_for(tmp_path, text_file, damage)
    run_dir = train.train(train.get_config(args))
    os.remove(os.path.join(run_dir, 'done.json'))  # as if killed after the checkpoint at 24
    path = os.path.join(run_dir, 'metrics.jsonl')
    lines = open(path).readlines()
    if damage == 'cut':  # the record of 16, the last before the checkpoint, cut short; 24's not yet written
        assert json.loads(lines[-2])['iter'] == 16
        open(path, 'w').writelines(lines[:-2] + [lines[-2][:40]])
        words = r'metrics.jsonl lacks the records of iteration 16, before the checkpoint at iteration 24'
    else:
        os.remove(path)
        words = r'metrics.jsonl is gone, before the checkpoint at iteration 24'
    with pytest.raises(Stop, match=words + '.*--overwrite=True'):
        train.train(train.get_config(args))
    assert os.path.exists(os.path.join(run_dir, 'ckpt.pt'))


def test_a_checkpoint_is_never_written_of_weights_that_are_not_finite(setup, args_for, monkeypatch):
    """Weights that are no longer finite numbers stop the run before a checkpoint of them is written, and the
    message says what ckpt.pt holds: here no checkpoint was written yet."""
    tmp_path, text_file = setup
    control_step = train.control_step

    def poison(run, step):
        control_step(run, step)
        if step == 5:
            with torch.no_grad():
                run.model.ln_f.weight[0] = float('inf')
    monkeypatch.setattr(train, 'control_step', poison)
    monkeypatch.setattr(train, 'read_flags', lambda run, it: False)  # the loss check would stop it first
    args = args_for(tmp_path, text_file, 'inf', '--ckpt_interval=6', '--eval_interval=16', '--geom_interval=0',
                    '--model_ckpts=0')
    with pytest.raises(Stop, match='the weights are no longer finite numbers at iteration 6.*no ckpt.pt was written'):
        train.train(train.get_config(args))
    assert not (tmp_path / 'out' / 'inf' / 'ckpt.pt').exists()


def test_a_refused_start_leaves_no_empty_run_folder(setup, args_for):
    """A start refused after the run folder was made (here: a data_file that is a directory) removes the folder
    it made, which holds nothing but its lock."""
    tmp_path, text_file = setup
    with pytest.raises(Stop, match='is a directory'):
        train.train(train.get_config(args_for(tmp_path, str(tmp_path), 'refused')))
    assert not (tmp_path / 'out' / 'refused').exists()


@pytest.mark.parametrize('code, words', [('ENOSPC', 'the disk is full: free some space or choose another --out_dir'),
                                         ('ENOTDIR', 'a part of that path is a file, not a folder'),
                                         ('EEXIST', 'a file of that name is in the way'),
                                         ('ENAMETOOLONG', 'the name is too long: choose another --out_dir'),
                                         ('EROFS', 'the file system is read-only: choose another --out_dir'),
                                         ('EACCES', 'no permission to write there')])
def test_each_failed_write_is_worded_by_what_it_is(code, words):
    """A failed write says what it is; only a full disk (or a file size limit) asks for disk space."""
    import errno
    msg = runfolder.disk_error('/x/ckpt.pt', OSError(getattr(errno, code), os.strerror(getattr(errno, code)))).msg
    assert msg.startswith(f'cannot write /x/ckpt.pt: {os.strerror(getattr(errno, code))}; {words}')
    assert ('free some space' in msg) == (code == 'ENOSPC')


def test_a_run_name_too_long_for_the_file_system_is_one_line(setup, args_for, run_train):
    tmp_path, text_file = setup
    proc = run_train(args_for(tmp_path, text_file, 'x' * 300))
    assert one_line_error(proc), proc.stderr[-2000:]
    assert 'File name too long; the name is too long' in proc.stderr
