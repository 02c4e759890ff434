"""Tests of sweep.sh, run as a researcher runs it (`bash sweep.sh` with environment variables) on a small
synthetic text: the smoke preset end to end, a rerun that skips everything, a sweep stopped by SIGTERM
and restarted, a failing run, the grid and the Slurm back end (a dry run, and a stand-in sbatch that
runs the array tasks here)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest


HERE = os.path.dirname(os.path.abspath(__file__))
GRID_VARS = ('DEPTHS', 'INITS', 'SEEDS', 'CONTROL_DEPTH', 'CONTROL_SEEDS', 'CONTROL_KEEPS', 'MIRROR', 'RUN_LIST',
             'BACKEND', 'DRY_RUN', 'SBATCH_ARGS', 'ANALYZE', 'JOBS', 'PRESET', 'OUT', 'DATA_FILE')
PROGRESS = re.compile(r'^\[(\d+)/(\d+)\] (\S+), (.*)$', re.M)


@pytest.fixture
def sweep_env(tmp_path, synthetic_text):
    """Environment for a small smoke sweep of its own: synthetic text, OUT and data cache in tmp_path."""
    text = tmp_path / 'corpus.txt'
    text.write_text(synthetic_text(50_000), encoding='utf-8')
    return make_env(tmp_path, text)


def make_env(tmp_path, text, **grid):
    env = {k: v for k, v in os.environ.items() if k not in GRID_VARS}
    env.update(PRESET='smoke', DATA_FILE=str(text), OUT=str(tmp_path / 'out'), QKGEOM_CACHE=str(tmp_path / 'cache'),
               JOBS='2', PYTHON=sys.executable, CUDA_VISIBLE_DEVICES='')  # tests never need a GPU
    env.update(grid)
    return env


def sweep(env, *args, timeout=600, **overrides):
    """bash sweep.sh ARGS in its own process group: a timeout stops its workers and runs too (none is orphaned)."""
    proc = subprocess.Popen(['bash', os.path.join(HERE, 'sweep.sh'), *args], env={**env, **overrides}, cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_list(out):
    with open(os.path.join(out, 'runs.txt')) as f:
        return [line.split()[0] for line in f if line.strip()]


def done_mtimes(out):
    return {name: os.stat(os.path.join(out, name, 'done.json')).st_mtime_ns
            for name in os.listdir(out) if os.path.exists(os.path.join(out, name, 'done.json'))}


def metric_iters(run_dir):
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        return [json.loads(line)['iter'] for line in f if line.strip()]


# ----------------------------------------------------------------------------- end to end

SMALL_GRID = dict(DEPTHS='4 6', INITS='normal tied', SEEDS='1', CONTROL_SEEDS='1', SHRINK_TOS='0.2')
SMALL_RUNS = {'L4_normal_s1', 'L4_tied_s1', 'L6_normal_s1', 'L6_tied_s1',  # the study
              'L4_normal_shrink0.2-k_s1', 'L4_normal_freeze-k_s1',        # control; its none run is L4_normal_s1
              'L4_normal_shrink0.2-k-spec_s1', 'L4_normal_freeze-k-spec_s1'}


@pytest.fixture(scope='module')
def finished_sweep(tmp_path_factory, synthetic_text):
    """One smoke sweep over a small grid, run to the end (with the analysis): (env, result)."""
    tmp = tmp_path_factory.mktemp('sweep')
    text = tmp / 'corpus.txt'
    text.write_text(synthetic_text(50_000), encoding='utf-8')
    env = make_env(tmp, text, **SMALL_GRID)
    return env, sweep(env)


def test_smoke_sweep_trains_every_run_then_analyses(finished_sweep):
    env, res = finished_sweep
    assert res.returncode == 0, res.stdout + res.stderr
    out = env['OUT']
    assert set(run_list(out)) == SMALL_RUNS and len(run_list(out)) == len(SMALL_RUNS)  # the shared run once
    assert set(done_mtimes(out)) == SMALL_RUNS
    import train
    with open(os.path.join(out, 'runs.txt')) as f:  # the plan analyze.py reads: each name is its settings' name
        for line in f:
            name, *args = line.split()
            assert train.get_config(args)['run_name'] == name and f'--n_layer={name[1]}' in args
    for name in SMALL_RUNS:
        cfg = json.load(open(os.path.join(out, name, 'config.json')))
        assert cfg['run_name'] == name and cfg['max_iters'] == 6 and cfg['n_embd'] == 16  # the smoke preset
        assert cfg['control'] == ('shrink' if 'shrink' in name else 'freeze' if 'freeze' in name else 'none')
        assert cfg['control_keep'] == ('spec' if name.endswith('-spec_s1') else 'fro')
        assert metric_iters(os.path.join(out, name))[-1] == 6
        assert os.path.getsize(os.path.join(out, 'logs', f'{name}.log')) > 0
    # one progress line per run, numbered 1..N in the order they finish, with a time and an ETA
    lines = PROGRESS.findall(res.stdout)
    assert [int(k) for k, *_ in lines] == list(range(1, 9)) and {n for _, _, n, _ in lines} == SMALL_RUNS
    assert all(total == '8' and 'ETA' in rest for _, total, _, rest in lines)
    assert '8 trained now, 0 failed' in res.stdout


def test_smoke_sweep_writes_the_analysis(finished_sweep):
    env, res = finished_sweep
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.path.isfile(os.path.join(env['OUT'], 'analysis', 'REPORT.md')), res.stdout
    assert os.path.getsize(os.path.join(env['OUT'], 'logs', 'analyze.log')) > 0


def test_second_invocation_skips_every_run(finished_sweep):
    env, first = finished_sweep
    assert first.returncode == 0, first.stdout + first.stderr
    out = env['OUT']
    before = done_mtimes(out)
    logs = {n: os.path.getsize(os.path.join(out, 'logs', f'{n}.log')) for n in SMALL_RUNS}
    res = sweep(env, ANALYZE='0')
    assert res.returncode == 0, res.stdout + res.stderr
    assert done_mtimes(out) == before  # no run retrained
    assert logs == {n: os.path.getsize(os.path.join(out, 'logs', f'{n}.log')) for n in SMALL_RUNS}  # none started
    lines = PROGRESS.findall(res.stdout)
    assert {n for *_, n, _ in lines} == SMALL_RUNS and all(rest.startswith('skipped') for *_, rest in lines)
    assert '8 skipped (done before), 0 trained now' in res.stdout


# ----------------------------------------------------------------------------- stop and restart

def test_stopped_sweep_finishes_on_restart_without_repeating_work(sweep_env):
    env = {**sweep_env, 'DEPTHS': '4', 'INITS': 'normal tied', 'SEEDS': '1 2', 'CONTROL_SEEDS': '', 'ANALYZE': '0'}
    # long enough runs that the signal finds one training; its only checkpoint is the one the signal makes
    args = ['--max_iters=1500', '--eval_interval=500', '--geom_interval=500', '--ckpt_interval=100000']
    out = env['OUT']
    proc = subprocess.Popen(['bash', os.path.join(HERE, 'sweep.sh'), *args], env=env, cwd=HERE, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600  # a loaded machine: the first two runs may take minutes
    while time.time() < deadline and proc.poll() is None:
        names = [n for n in os.listdir(out) if n.startswith('L')] if os.path.isdir(out) else []
        done = [n for n in names if os.path.exists(os.path.join(out, n, 'done.json'))]
        training = [n for n in names if n not in done and os.path.exists(os.path.join(out, n, 'metrics.jsonl'))]
        if len(done) >= 2 and training:  # the first two ran side by side: a third or fourth is now training
            break
        time.sleep(0.1)
    assert proc.poll() is None, 'the sweep ended before it could be stopped midway:\n' + proc.stdout.read()
    os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C or a scheduler does: the whole process group
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout
    assert 'stopped by SIGTERM' in stdout and 'run the same command again' in stdout
    # no worker or train.py outlives the sweep (a moment's grace: an exited orphan lingers until it is reaped)
    deadline = time.time() + 10
    with pytest.raises(ProcessLookupError):
        while time.time() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
    before = done_mtimes(out)
    partial = [n for n in os.listdir(out) if n.startswith('L') and n not in before
               and os.path.exists(os.path.join(out, n, 'ckpt.pt'))]
    assert before and partial, stdout  # finished runs and at least one stopped midway with a checkpoint
    assert len(before) < 4

    res = sweep(env, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(done_mtimes(out)) == {'L4_normal_s1', 'L4_tied_s1', 'L4_normal_s2', 'L4_tied_s2'}
    assert {n: t for n, t in done_mtimes(out).items() if n in before} == before  # not trained again
    skipped = {n for *_, n, rest in PROGRESS.findall(res.stdout) if rest.startswith('skipped')}
    assert skipped == set(before)
    for name in partial:  # resumed from the checkpoint the signal made, not started over
        assert 'resuming' in open(os.path.join(out, 'logs', f'{name}.log')).read()
    for name in done_mtimes(out):
        iters = metric_iters(os.path.join(out, name))
        assert iters == sorted(set(iters)) and iters[-1] == 1500  # no iteration logged twice


def tree(folder):
    """Every path under folder with its size and modification time: what a refused sweep must not change."""
    return {os.path.join(d, n): (os.stat(os.path.join(d, n)).st_size, os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, dirs, files in os.walk(folder) for n in dirs + files}


@pytest.fixture
def lock_holder(tmp_path):
    """hold(out, pid): a live process that holds out's sweep lock as a sweep does (bash running a file named
    sweep.sh, with the lock on an inherited descriptor), the file naming pid, or its own pid when pid is None."""
    procs = []

    def hold(out, pid=None):
        fake = tmp_path / 'holder' / 'sweep.sh'
        fake.parent.mkdir(exist_ok=True)
        fake.write_text(f'exec 9>>"$1"\n{sys.executable} -c "import fcntl; fcntl.flock(9, fcntl.LOCK_EX)"\n'
                        'echo "${2:-$$}" > "$1"\necho locked\nsleep 120\n')
        procs.append(subprocess.Popen(['bash', str(fake), os.path.join(out, '.sweep.pid'), str(pid or '')],
                                      stdout=subprocess.PIPE, text=True))
        assert procs[-1].stdout.readline() == 'locked\n'
        return procs[-1].pid
    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_sweep_on_the_same_out_is_refused_and_changes_nothing(sweep_env, lock_holder):
    out = sweep_env['OUT']
    os.makedirs(os.path.join(out, 'logs'))
    with open(os.path.join(out, 'runs.txt'), 'w') as f:
        f.write('L4_normal_s1 --n_layer=4 --qk_init=normal --seed=1\n')  # the running sweep's plan
    holder = lock_holder(out)
    before = tree(out)
    for backend in ('local', 'slurm'):  # a Slurm array on the same folder would train the same runs
        res = sweep(sweep_env, DEPTHS='4 6', INITS='normal', SEEDS='1', CONTROL_SEEDS='', BACKEND=backend)
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr.count('\n') == 1 and f'another sweep (pid {holder}) is running in {out}' in res.stderr
        assert tree(out) == before  # runs.txt, logs and the lock as they were


def test_runs_left_by_a_killed_sweep_keep_its_lock(sweep_env, lock_holder):
    """A sweep killed outright leaves its workers and runs training: they hold the lock it took."""
    out = sweep_env['OUT']
    os.makedirs(out)
    lock_holder(out, pid=2 ** 22 + 1)  # the file names the killed sweep, no such process now
    res = sweep(sweep_env, DEPTHS='4', INITS='normal', SEEDS='1', CONTROL_SEEDS='')
    assert res.returncode == 2 and res.stderr.count('\n') == 1, res.stdout + res.stderr
    assert f'another sweep, or runs left by one that was killed, hold {out}/.sweep.pid' in res.stderr
    assert os.listdir(out) == ['.sweep.pid']


def test_a_lock_left_by_a_dead_sweep_or_another_program_is_taken_over(sweep_env):
    out = sweep_env['OUT']
    os.makedirs(out)
    for holder in (os.getpid(), 2 ** 22 + 1):  # alive but not a sweep (a reused pid), and no such process
        with open(os.path.join(out, '.sweep.pid'), 'w') as f:
            f.write(str(holder))
        res = sweep(sweep_env, DEPTHS='4', INITS='normal', SEEDS='1', CONTROL_SEEDS='', ANALYZE='0')
        assert res.returncode == 0, res.stdout + res.stderr
        assert not os.path.exists(os.path.join(out, '.sweep.pid'))  # released at the end


STAND_IN_PYTHON = """#!/usr/bin/env bash
# a stand-in interpreter: preparing the data and training take a second each and do nothing; the rest is Python
case "$*" in *train.py*|*prepare_data*) sleep 1; exit 0 ;; esac
exec {python} "$@"
"""


def test_two_sweeps_started_together_on_a_stale_lock_one_runs_and_the_other_is_refused(sweep_env, tmp_path):
    python = tmp_path / 'python'
    python.write_text(STAND_IN_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    runs = tmp_path / 'runs.txt'
    runs.write_text('only --n_layer=2\n')
    env = {**sweep_env, 'RUN_LIST': str(runs), 'ANALYZE': '0', 'PYTHON': str(python)}
    out = env['OUT']
    os.makedirs(out)
    for trial in range(6):  # the two race for the lock: one trial alone rarely shows a fault
        with open(os.path.join(out, '.sweep.pid'), 'w') as f:
            f.write(str(2 ** 22 + 1))  # left by a sweep that was killed outright: no such process now
        procs = [subprocess.Popen(['bash', os.path.join(HERE, 'sweep.sh')], env=env, cwd=HERE, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                 for _ in range(2)]
        res = [(*p.communicate(timeout=60), p.returncode) for p in procs]
        res = [(rc, out, err) for out, err, rc in res]
        refused = [r for r in res if r[0] == 2 and 'another sweep' in r[2]]
        ran = [r for r in res if 'sweep finished' in r[1]]
        assert len(refused) == 1 and len(ran) == 1, f'trial {trial}: {res}'
        assert re.search(r'\[1/1\] only, FAILED \(exit 0\)', ran[0][1]), ran[0]  # its own state folder was kept
        assert not [n for n in os.listdir(out) if n.startswith('.sweep')], os.listdir(out)  # lock and state gone


# ----------------------------------------------------------------------------- failures

def test_a_failing_run_is_reported_and_the_others_finish(sweep_env, tmp_path):
    runs = tmp_path / 'runs.txt'
    runs.write_text('# name, then its own settings\n'
                    'first --n_layer=2 --seed=1\n'
                    'broken --n_layer=2 --n_head=3\n'  # n_embd=16 is not divisible by 3: train.py refuses
                    '\n'
                    'last --n_layer=2 --seed=2\n')
    res = sweep(sweep_env, RUN_LIST=str(runs), ANALYZE='0')
    assert res.returncode == 1, res.stdout + res.stderr
    out = sweep_env['OUT']
    assert set(done_mtimes(out)) == {'first', 'last'}
    log = os.path.join(out, 'logs', 'broken.log')
    assert re.search(rf'\[\d/3\] broken, FAILED \(exit 2\) after .*see {re.escape(log)}', res.stdout)
    assert f'FAILED broken: see {log}' in res.stdout and '2 trained now, 1 failed' in res.stdout


def test_bad_settings_stop_the_sweep_before_any_run(sweep_env):
    res = sweep(sweep_env, '--n_layr=2', DEPTHS='4', INITS='normal', SEEDS='1', CONTROL_SEEDS='')
    assert res.returncode == 2 and 'nothing was run' in res.stderr
    res = sweep(sweep_env, PRESET='huge')
    assert res.returncode == 2 and 'unknown PRESET=huge' in res.stderr
    for var, value in (('DRY_RUN', 'yes'), ('MIRROR', 'true'), ('ANALYZE', 'no'), ('JOBS', 'two'), ('JOBS', '0')):
        res = sweep(sweep_env, DEPTHS='4', INITS='normal', SEEDS='1', CONTROL_SEEDS='', **{var: value})
        assert res.returncode == 2 and f'{var}={value} must be' in res.stderr, res.stdout + res.stderr
        assert res.stderr.count('\n') == 1
    assert not os.path.exists(os.path.join(sweep_env['OUT'], 'L4_normal_s1'))  # DRY_RUN=yes did not run it


def test_help_prints_the_header_and_exits_0(sweep_env):
    for flag in ('--help', '-h'):
        res = sweep(sweep_env, '--max_iters=2', flag, PRESET='huge')  # before any setting is checked
        assert res.returncode == 0 and res.stderr == '', res.stderr
        assert res.stdout.startswith('The whole study') and 'PRESET      paper | cpu | ladder | smoke' in res.stdout
        assert not re.search(r'^#', res.stdout, re.M) and 'PRESET=${PRESET' not in res.stdout
    assert not os.path.exists(sweep_env['OUT'])


def test_extra_arguments_may_not_set_the_per_run_keys_sweep_sh_sets(sweep_env, tmp_path):
    config = tmp_path / 'my_config.py'
    config.write_text("out_dir = 'out-elsewhere'\nn_layer = 2\n")  # as nanoGPT's config files do
    for args, key in ((['--run_name=mine'], '--run_name='), (['--max_iters=2', '--out_dir=elsewhere'], '--out_dir='),
                      ([str(config)], 'out_dir')):
        for backend in ('local', 'slurm'):
            res = sweep(sweep_env, *args, DEPTHS='4 6', INITS='normal', SEEDS='1', CONTROL_SEEDS='', BACKEND=backend)
            assert res.returncode == 2 and res.stderr.count('\n') == 1, res.stdout + res.stderr
            assert key in res.stderr and 'sweep.sh sets' in res.stderr and 'OUT=' in res.stderr, res.stderr
    assert not os.path.exists(sweep_env['OUT'])
    cmds, _ = dry_commands(sweep_env, '--threads=1', JOBS='1')  # a thread count of its own is allowed: it wins
    assert cmds and all(c.endswith('--threads=1') for c in cmds)


@pytest.mark.parametrize('kind', ['folder', 'device', 'fifo', 'missing', 'broken link'])
def test_a_data_file_or_run_list_that_is_not_a_file_says_what_it_is(sweep_env, tmp_path, kind, odd_path):
    path, words = odd_path(tmp_path, kind)
    for var in ('DATA_FILE', 'RUN_LIST'):
        res = sweep(sweep_env, **{var: str(path)})
        assert res.returncode == 2 and res.stderr.count('\n') == 1, res.stdout + res.stderr
        assert f'{var}={path} {words}' in res.stderr, res.stderr
    assert not os.path.exists(sweep_env['OUT'])


# ----------------------------------------------------------------------------- the grid (dry runs)

def dry_commands(env, *args, **overrides):
    res = sweep(env, *args, DRY_RUN='1', **overrides)
    assert res.returncode == 0, res.stdout + res.stderr
    return [line for line in res.stdout.splitlines() if 'train.py' in line], res.stdout


def test_the_full_grid_shares_the_control_baseline_with_the_study(sweep_env):
    cmds, _ = dry_commands(sweep_env, '--lr=2e-3')
    assert not os.path.exists(sweep_env['OUT'])  # a dry run writes nothing (runs.txt is a real sweep's plan)
    names = [re.search(r'--run_name=(\S+)', c).group(1) for c in cmds]
    study = {f'L{d}_{i}_s{s}' for d in (4, 6, 8) for i in ('normal', 'orthogonal', 'tied') for s in (1, 2, 3, 4)}
    doses = ('0.2', '0.14', '0.1')
    control = {f'L4_normal{c}_s{s}' for c in ('', '_freeze-k', '_freeze-k-spec', *(f'_shrink{d}-k{k}' for d in doses
                                                                                  for k in ('', '-spec')))
               for s in range(1, 6)}
    assert len(names) == len(set(names)) == 77 and set(names) == study | control  # L4_normal_s1..4 in both
    assert all(c.endswith('--lr=2e-3') for c in cmds)  # extra arguments last, so they win
    assert all('--control=shrink --shrink_to=0.1 --seed' in c for c in cmds if '_shrink0.1-k_' in c)
    assert all('--control_keep=spec --control=freeze' in c for c in cmds if '_freeze-k-spec_' in c)
    mirror, _ = dry_commands(sweep_env, MIRROR='1')  # both keeps mirrored
    assert len(mirror) == 117 and sum('--control_target=q' in c for c in mirror) == 40
    assert sum(bool(re.search(r'--run_name=L4_normal_(shrink[0-9.]+|freeze)-q-spec_s\d', c)) for c in mirror) == 20
    deeper, _ = dry_commands(sweep_env, CONTROL_DEPTH='6')
    assert len(deeper) == 77 and sum(bool(re.search(r'--run_name=L6_normal_s\d', c)) for c in deeper) == 5
    assert len(dry_commands(sweep_env, CONTROL_SEEDS='')[0]) == 36
    assert len(dry_commands(sweep_env, CONTROL_KEEPS='fro')[0]) == 57
    assert len(dry_commands(sweep_env, SHRINK_TOS='0.2')[0]) == 57


def test_train_py_names_the_whole_grid_in_one_call(sweep_env, tmp_path):
    python = tmp_path / 'python'  # the interpreter, logging how it is called
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / "calls"}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    cmds, _ = dry_commands(sweep_env, PYTHON=str(python))
    calls = (tmp_path / 'calls').read_text().splitlines()
    assert len(cmds) > 40 and calls == [f'{HERE}/train.py --print_run_names']
    # a name is what train.py makes of the run's whole command line: the extra arguments included
    cmds, _ = dry_commands(sweep_env, '--control_keep=spec', DEPTHS='', CONTROL_SEEDS='1')
    names = {re.search(r'--run_name=(\S+)', c).group(1) for c in cmds}
    assert names == {'L4_normal_s1', 'L4_normal_shrink0.2-k-spec_s1', 'L4_normal_shrink0.14-k-spec_s1',
                     'L4_normal_shrink0.1-k-spec_s1', 'L4_normal_freeze-k-spec_s1'}


def test_a_bad_grid_value_stops_the_sweep_before_anything_is_written(sweep_env):
    res = sweep(sweep_env, DEPTHS='4 x', INITS='normal', SEEDS='1')
    assert res.returncode == 2, res.stdout + res.stderr
    assert '--n_layer=x: expected int' in res.stderr and 'nothing was run' in res.stderr
    assert not os.path.exists(sweep_env['OUT'])


def test_workers_split_the_cpu_threads_and_the_gpus(sweep_env):
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    cmds, out = dry_commands(sweep_env, JOBS='1')
    assert all(f'--threads={ncpu}' in c for c in cmds) and 'on CPU' in out
    cmds, out = dry_commands(sweep_env, JOBS=str(2 * ncpu))
    assert all('--threads=1' in c for c in cmds)
    _, out = dry_commands(sweep_env, CUDA_VISIBLE_DEVICES='0,1', JOBS='4')
    assert 'JOBS=4 on GPUs 0 1 (round-robin)' in out


@pytest.mark.parametrize('preset', ['cpu', 'ladder', 'smoke'])
def test_the_small_presets_train_on_the_wikitext_test_split_unless_data_file_is_set(sweep_env, preset):
    env = {k: v for k, v in sweep_env.items() if k != 'DATA_FILE'}  # a clone: no text of its own
    cmds, out = dry_commands(env, PRESET=preset, DEPTHS='4', SEEDS='1', CONTROL_SEEDS='1', LADDER_SEEDS='1')
    assert cmds and all(' --dataset=wikitext103-test ' in c and '--data_file' not in c for c in cmds)
    assert 'data: the WikiText-103 test split (--dataset=wikitext103-test)' in out and 'shared' not in out
    cmds, out = dry_commands(sweep_env, PRESET=preset, DEPTHS='4', SEEDS='1', CONTROL_SEEDS='1', LADDER_SEEDS='1')
    assert all(f" --data_file={sweep_env['DATA_FILE']} " in c and '--dataset' not in c for c in cmds)
    assert f"data: {sweep_env['DATA_FILE']}" in out


def test_the_paper_preset_trains_on_the_whole_wikitext(sweep_env):
    env = {k: v for k, v in sweep_env.items() if k != 'DATA_FILE'}
    cmds, out = dry_commands(env, PRESET='paper', DEPTHS='4', SEEDS='1', CONTROL_SEEDS='')
    assert cmds and all('--dataset' not in c and '--data_file' not in c for c in cmds)
    assert 'data: the whole WikiText-103 (--dataset=wikitext103)' in out


def test_data_that_cannot_be_fetched_stops_the_sweep_naming_data_file(sweep_env, tmp_path):
    env = {k: v for k, v in sweep_env.items() if k != 'DATA_FILE'}  # no network: a download that fails at once
    res = sweep(env, f'--data_dir={tmp_path / "data"}', f'--data_url=file://{tmp_path / "no.zip"}', DEPTHS='4',
                INITS='normal', SEEDS='1', CONTROL_SEEDS='', ANALYZE='0')
    assert res.returncode == 2, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert 'nothing was run' in last and 'set DATA_FILE=' in last, res.stderr
    assert not os.path.exists(os.path.join(env['OUT'], 'L4_normal_s1'))


# ----------------------------------------------------------------------------- Slurm

def test_slurm_dry_run_writes_an_array_of_the_runs_left(sweep_env):
    out = sweep_env['OUT']
    res = sweep(sweep_env, BACKEND='slurm', DRY_RUN='1', JOBS='3')
    assert res.returncode == 0, res.stdout + res.stderr
    assert '#SBATCH --array=0-76%3' in res.stdout and 'not submitted' in res.stdout
    assert re.search(r'^sbatch --parsable --dependency=afterok:JOBID \S+/analyze.sbatch$', res.stdout, re.M)
    (folder,) = os.listdir(os.path.join(out, 'slurm'))
    folder = os.path.join(out, 'slurm', folder)
    assert subprocess.run(['bash', '-n', os.path.join(folder, 'array.sbatch')]).returncode == 0
    assert len(open(os.path.join(folder, 'runs.txt')).read().splitlines()) == 77
    for name in ('L4_normal_s1', 'L8_tied_s4'):  # finished runs are left out of the next array
        os.makedirs(os.path.join(out, name))
        open(os.path.join(out, name, 'done.json'), 'w').write('{}')
    res = sweep(sweep_env, BACKEND='slurm', DRY_RUN='1', MIRROR='1', JOBS='')  # at most 8 at once by default
    assert '#SBATCH --array=0-114%8' in res.stdout  # 117 runs with the mirror, 2 of them done


FAKE_SBATCH = r'''#!/usr/bin/env python3
"""Stand-in for sbatch: logs its arguments, runs each task of an array job here, one after another."""
import os, re, subprocess, sys
script = sys.argv[-1]
with open(os.environ['SBATCH_LOG'], 'a') as f:
    f.write(' '.join(sys.argv[1:]) + '\n')
m = re.search(r'^#SBATCH --array=(\d+)-(\d+)', open(script).read(), re.M)
if m and '--dependency' not in ' '.join(sys.argv):
    for task in range(int(m.group(1)), int(m.group(2)) + 1):
        env = dict(os.environ, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_JOB_ID='4242', SLURM_CPUS_PER_TASK='1')
        subprocess.run(['bash', script], env=env, check=True)
print('4242' if m else '4243')
'''


def test_slurm_array_tasks_train_the_runs_and_the_analysis_waits_for_them(sweep_env, tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'sbatch').write_text(FAKE_SBATCH)
    (bin_dir / 'sbatch').chmod(0o755)
    env = {**sweep_env, 'PATH': f"{bin_dir}{os.pathsep}{os.environ['PATH']}", 'SBATCH_LOG': str(tmp_path / 'calls'),
           'DEPTHS': '4', 'INITS': 'normal tied', 'SEEDS': '1', 'CONTROL_SEEDS': ''}
    res = sweep(env, BACKEND='slurm', SBATCH_ARGS='--partition=test')
    assert res.returncode == 0, res.stdout + res.stderr
    assert 'submitted job array 4242' in res.stdout
    assert set(done_mtimes(env['OUT'])) == {'L4_normal_s1', 'L4_tied_s1'}
    assert 'slurm task 4242_1' in open(os.path.join(env['OUT'], 'logs', 'L4_tied_s1.log')).read()
    calls = open(env['SBATCH_LOG']).read().splitlines()
    assert calls[0].startswith('--parsable --partition=test') and calls[0].endswith('array.sbatch')
    assert '--dependency=afterok:4242' in calls[1] and calls[1].endswith('analyze.sbatch')


# ----------------------------------------------------------------------------- gpu_check.sh's command line

def gpu_check(tmp_path, *args, **env):
    base = {k: v for k, v in os.environ.items() if k not in GRID_VARS + ('LOG', 'RUNS', 'STEPS', 'SMALL')}
    return subprocess.run(['bash', os.path.join(HERE, 'gpu_check.sh'), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**base, 'LOG': str(tmp_path / 'log'), 'SMALL': '1',
                                                       'PYTHON': sys.executable, **env})


def test_gpu_check_help_prints_the_header_and_an_argument_is_refused(tmp_path):
    for flag in ('--help', '-h'):
        res = gpu_check(tmp_path, flag)
        assert res.returncode == 0 and res.stdout.startswith('The GPU path') and 'DATA_FILE' in res.stdout
    res = gpu_check(tmp_path, '--max_iters=10')
    assert res.returncode == 2 and res.stderr.count('\n') == 1 and "unknown argument '--max_iters=10'" in res.stderr
    folder = tmp_path / 'texts'
    folder.mkdir()
    res = gpu_check(tmp_path, DATA_FILE=str(folder))
    assert res.returncode == 2 and f'DATA_FILE={folder} is a folder' in res.stderr and res.stderr.count('\n') == 1
    assert sorted(os.listdir(tmp_path)) == ['texts']  # nothing written


# ----------------------------------------------------------------------------- the README, the docs and CI

USER_FILES = ('README.md', 'docs/train.md', 'docs/sweeps.md', 'sweep.sh', 'bench.py', 'gpu_check.sh',
              'requirements.txt', 'requirements-dev.txt', '.ci/run', 'train.py', 'configurator.py', 'prepare.py',
              'runfolder.py', 'geometry.py', 'control.py', 'analyze.py', 'folders.py', 'stats.py', 'report.py',
              'plots.py', 'regime.py', 'tokens.py')


def code_blocks(path):
    """The indented code blocks of a markdown file, each a list of its lines without the indent."""
    blocks, block = [], []
    for line in open(os.path.join(HERE, path)).read().splitlines() + ['']:
        if line.startswith('    '):
            block.append(line[4:])
        elif block and line.strip() == '':
            blocks.append(block)
            block = []
    return blocks


def test_the_readme_installs_what_its_test_command_needs_and_ci_runs_exactly_that():
    (tests,) = [b for b in code_blocks('README.md') if 'python -m pytest -q' in b]
    installs = [line for line in tests[:tests.index('python -m pytest -q')] if 'pip install' in line]
    assert any('-r requirements-dev.txt' in line for line in installs), tests
    with open(os.path.join(HERE, 'requirements-dev.txt')) as f:
        assert any(re.match(r'pytest\b', line) for line in f)
    with open(os.path.join(HERE, '.ci', 'run')) as f:
        ci = [line for line in f.read().splitlines() if line.strip() and not line.startswith('#')]
    assert ci[-len(tests):] == tests  # CI's last commands are the README's, as written


@pytest.mark.parametrize('path', USER_FILES)
def test_nothing_a_user_reads_or_runs_names_a_file_outside_the_repository(path):
    with open(os.path.join(HERE, path)) as f:
        text = f.read()
    for outside in ('../shared', '/work/', 'shared/data', 'DESIGN.md'):
        assert outside not in text, f'{path} names {outside}'
