"""sweep.sh: the grids, its variables and RUN_LIST checked before anything runs, a real sweep,
resume, stop, Slurm."""
import fcntl
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO
from plumbing import sweep as sweep_py


SWEEP = os.path.join(REPO, 'sweep.sh')
# bad values of the variables sweep.sh reads (the test finds them in it); any other, a grid's
# numbers, gets x, 4,6, -1
BAD = {'PRESET': ['', 'Paper'], 'OUT': [''], 'BACKEND': ['', 'slrum'], 'DRY_RUN': ['', 'true'],
       'ANALYZE': ['yes'], 'PRINT_ARGS': ['2'], 'JOBS': ['', '0', 'a'], 'ARRAY_JOBS': ['-1'],
       'DATA_FILE': ['', 'none.txt'], 'RUN_LIST': ['', 'none.txt'], 'PYTHON': ['', 'no-python'],
       'INITS': ['normale'], 'CONTROL_KEEPS': ['frob'], 'SEEDS': ['2.5'],
       'CUDA_VISIBLE_DEVICES': [], 'SLURM_CPUS_PER_TASK': [], 'SBATCH_ARGS': []}  # CUDA's, Slurm's


def sweep(tmp_path, *args, **env):
    env = {**os.environ, 'PYTHON': sys.executable, 'OUT': str(tmp_path / 'out'),
           'QKGEOM_CACHE': str(tmp_path / 'cache'), **env}
    return subprocess.run(['bash', SWEEP, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)


def commands(out):
    return [line for line in out.stdout.splitlines() if 'train.py' in line]


@pytest.mark.parametrize('preset, n', [('paper', 77), ('cpu', 77), ('smoke', 77), ('ladder', 30),
                                       ('length', 18), ('optim', 57), ('wide', 67)])
def test_dry_run_lists_each_preset_s_grid_and_writes_nothing(tmp_path, preset, n):
    out = sweep(tmp_path, PRESET=preset, DRY_RUN='1')
    assert out.returncode == 0, out.stderr
    runs = commands(out)
    names = [re.search(r'--run_name=(\S+)', c)[1] for c in runs]
    assert len(runs) == n == len(set(names)) and os.listdir(tmp_path) == []
    if preset == 'optim':  # the lr scans, then five arms and the control at the tuned lrs
        lrs = sorted({(('sgd' if 'optimizer=sgd' in c else 'adamw'),
                       re.search(r'--lr=(\S+)', c)[1]) for c in runs})
        assert lrs == sorted([('adamw', x) for x in ('1e-3', '3e-3', '1e-2', '3e-2')] +
                             [('sgd', x) for x in ('0.1', '0.3', '1', '3')])
        arms = [c for c in runs if '--seed=5' in c]
        assert len(arms) == 9 and sum('--control=' in c for c in arms) == 4
        assert all('--weight_decay=0' in c for c in runs if 'optimizer=sgd' in c)
    if preset == 'wide':  # the control and its none arm (seeds 1-5) before the matrix
        assert (all('--n_layer=4 --qk_init=normal' in c for c in runs[:35])
                and '--control=' not in runs[35])


def names_of(runs):
    return [re.search(r'--run_name=(\S+)', c)[1] for c in runs]


def test_extra_arguments_are_in_the_names(tmp_path):
    plain = names_of(commands(sweep(tmp_path, PRESET='ladder', DRY_RUN='1')))
    dropout = names_of(commands(sweep(tmp_path, '--dropout=0.1', PRESET='ladder', DRY_RUN='1')))
    assert len(plain) == len(set(dropout)) == 30 and not set(plain) & set(dropout)
    one = dict(PRESET='cpu', DRY_RUN='1', SEEDS='1', DEPTHS='4', INITS='normal', CONTROL_SEEDS='')
    plain, decay = (commands(sweep(tmp_path, *args, **one))[0]
                    for args in ([], ['--decay_qk=False']))
    assert re.search(r'--run_name=(\S+)', plain)[1] != re.search(r'--run_name=(\S+)', decay)[1]


def test_a_bad_variable_or_argument_stops_the_sweep_in_one_line_before_anything_runs(tmp_path):
    # the smoke preset's --n_embd=16 would win over it
    (tmp_path / 'mine.py').write_text('n_embd = 32\n')
    read = sorted(sweep_py.variables(open(SWEEP).read()))
    cases = [({var: bad}, []) for var in read for bad in BAD.get(var, ['x', '4,6', '-1'])] + [
        ({'OUT': 'runs#1', 'BACKEND': 'slurm'}, []), ({}, ['mine.py']), ({}, ['--overwrite=True'])]
    for env, args in cases:
        out = sweep(tmp_path, *args, **{'PRESET': 'smoke', 'DRY_RUN': '1', **env})
        stopped = (out.returncode, out.stdout, out.stderr.count('\n'))
        assert stopped == (2, '', 1), (env, args, out.stderr)
        named = [w for w in [*env, *env.values(), *args] if w and w.lstrip('-') in out.stderr]
        assert named, out.stderr  # names it
        assert os.listdir(tmp_path) == ['mine.py']


# what a shell, a cluster or a GPU machine sets: none is a near miss of a variable sweep.sh reads
ORDINARY = ('HOME PATH USER SHELL PWD OLDPWD LANG TERM TMPDIR DISPLAY EDITOR HOSTNAME '
            'LD_LIBRARY_PATH PYTHONPATH PYTHONHOME PYTHON_VERSION VIRTUAL_ENV CONDA_PREFIX '
            'CUDA_HOME CUDA_DEVICE_ORDER HIP_VISIBLE_DEVICES OMP_NUM_THREADS MKL_NUM_THREADS '
            'MPLBACKEND RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT NCCL_DEBUG TORCH_HOME '
            'HF_HOME QKGEOM_CACHE SLURM_JOB_ID SLURM_JOBID SLURM_JOB_NAME SLURM_ARRAY_JOB_ID '
            'SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_COUNT SLURM_CPUS_ON_NODE SLURM_CPUS_PER_GPU '
            'SLURM_MEM_PER_CPU SLURM_NTASKS SLURM_NNODES SLURM_NODELIST SLURM_PROCID '
            'SLURM_LOCALID SLURM_SUBMIT_DIR SLURM_TASKS_PER_NODE SBATCH_ACCOUNT SBATCH_PARTITION '
            'SGE_TASK_ID JOB_ID NSLOTS PBS_JOBID LSB_JOBID').split()


def test_ordinary_environment_variables_are_never_taken_for_a_near_miss():
    known = sweep_py.variables(open(SWEEP).read())
    assert {'DRY_RUN', 'SEEDS', 'DEPTHS', 'CUDA_VISIBLE_DEVICES', 'SLURM_CPUS_PER_TASK'} <= known
    taken = {name: sweep_py.meant(name, known) for name in [*ORDINARY, *os.environ]}
    assert {name: k for name, k in taken.items() if k} == {}


@pytest.mark.parametrize('name, meant', [
    ('DRYRUN', 'DRY_RUN'), ('SEED', 'SEEDS'), ('DEPTH', 'DEPTHS'), ('dry_run', 'DRY_RUN'),
    ('PRSET', 'PRESET'), ('ANALYSE', 'ANALYZE'), ('RUNLIST', 'RUN_LIST'),
    ('CONTROL_SEED', 'CONTROL_SEEDS'), ('CUDA_VISIBLE_DEVICE', 'CUDA_VISIBLE_DEVICES')])
def test_a_near_miss_of_a_variable_stops_the_sweep_naming_the_one_meant(tmp_path, text_file,
                                                                        name, meant):
    (tmp_path / 'runs.txt').write_text('a --n_layer=2 --min_char_count=1\n')  # it would train
    out = sweep(tmp_path, PRESET='smoke', DATA_FILE=str(text_file),
                RUN_LIST=str(tmp_path / 'runs.txt'), **{name: '1'})
    assert (out.returncode, out.stdout, out.stderr.count('\n')) == (2, '', 1), out.stderr
    assert f'{name}=1' in out.stderr and f'did you mean {meant}?' in out.stderr
    assert sorted(os.listdir(tmp_path)) == ['runs.txt', 'text.txt']


@pytest.mark.parametrize('preset, arg, instead', [
    ('smoke', '--seed=3', 'set SEEDS=3'), ('smoke', '--n_layer=2', 'set DEPTHS=2'),
    ('smoke', '--control_keep=spec', 'set CONTROL_KEEPS=spec'),
    ('ladder', '--max_iters=100', 'set LONG_ITERS=100'),
    ('optim', '--lr=1e-3', "set the grid's variable for it")])
def test_an_argument_that_the_grid_sets_stops_the_sweep_naming_the_variable_to_set(
        tmp_path, preset, arg, instead):
    out = sweep(tmp_path, arg, PRESET=preset, DRY_RUN='1')
    assert (out.returncode, out.stdout, out.stderr.count('\n')) == (2, '', 1), out.stderr
    key = arg[2:].split('=')[0]
    assert f'{arg}: the grid sets --{key}' in out.stderr and instead in out.stderr


@pytest.mark.parametrize('out', ['a_file', 'a_file/runs', '/proc/qkgeom-runs'])
def test_an_out_that_cannot_be_written_stops_the_sweep_in_one_line_before_anything_runs(
        tmp_path, text_file, out):
    (tmp_path / 'a_file').write_text('')
    ran = sweep(tmp_path, PRESET='smoke', DATA_FILE=str(text_file), OUT=out, DEPTHS='2',
                SEEDS='1', INITS='normal', CONTROL_SEEDS='')
    assert (ran.returncode, ran.stdout, ran.stderr.count('\n')) == (2, '', 1), ran.stderr
    assert f'OUT={out}: cannot write' in ran.stderr
    assert sorted(os.listdir(tmp_path)) == ['a_file', 'text.txt']  # no data cache either


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into a read-only folder')
def test_an_out_in_a_read_only_folder_stops_the_sweep_in_one_line(tmp_path, text_file):
    (tmp_path / 'ro').mkdir(mode=0o555)
    ran = sweep(tmp_path, PRESET='smoke', DATA_FILE=str(text_file), OUT='ro/runs', DEPTHS='2',
                SEEDS='1', INITS='normal', CONTROL_SEEDS='')
    assert (ran.returncode, ran.stderr.count('\n')) == (2, 1) and 'OUT=ro/runs' in ran.stderr


def test_a_run_that_another_process_trains_is_no_failure_and_leaves_it_the_analysis(
        tmp_path, text_file):
    (tmp_path / 'runs.txt').write_text('a --n_layer=2 --min_char_count=1\n'
                                       'b --n_layer=2 --seed=2 --min_char_count=1\n')
    (tmp_path / 'out' / 'b').mkdir(parents=True)
    with open(tmp_path / 'out' / 'b' / '.lock', 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a train.py of another sweep holds it
        out = sweep(tmp_path, PRESET='smoke', DATA_FILE=str(text_file), JOBS='2',
                    RUN_LIST=str(tmp_path / 'runs.txt'))
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'done a in' in out.stdout and 'elsewhere b: another process trains it' in out.stdout
    assert 'FAILED' not in out.stdout and 'failed' not in out.stdout
    assert out.stdout.splitlines()[-1].startswith('1 runs are still training elsewhere')
    assert not os.path.exists(tmp_path / 'out' / 'logs' / 'b.failed')


@pytest.mark.parametrize('lines, words', [
    ('--seed=2\n', "'--seed=2' is not a run name"),
    ('a --seed=1\n../b --seed=2\n', "'../b' is not a run name"),
    ('a/b --seed=1\n', "'a/b' is not a run name"),
    ('a --seed=1\nb --seed=2\na --seed=3\n', 'line 3: a is listed twice'),
    # Windows line ends, and a last line without one, are read
    ('a\r\nb --sed=2', "unknown config key 'sed'"),
])
def test_run_list_lines_are_checked_before_anything_runs(tmp_path, lines, words):
    (tmp_path / 'runs.txt').write_text(lines)
    out = sweep(tmp_path, PRESET='smoke', RUN_LIST=str(tmp_path / 'runs.txt'))
    assert out.returncode == 2 and words in out.stderr and not (tmp_path / 'out').exists()


def test_a_run_that_fails_is_named_and_the_sweep_exits_1(tmp_path, text_file):
    """Training a grid in parallel, skipping what is done and refusing a finished run's other
    settings: tests/test_paths.py, on the README's sweep."""
    grid = dict(PRESET='smoke', DATA_FILE=str(text_file), JOBS='2', ANALYZE='0')
    (tmp_path / 'runs.txt').write_text('bad --n_embd=16 --block_size=100000\n')
    failed = sweep(tmp_path, RUN_LIST=str(tmp_path / 'runs.txt'), **grid)
    assert (failed.returncode == 1 and 'FAILED bad' in failed.stdout
            and 'runs failed' in failed.stdout)


def test_a_stop_signal_stops_the_sweep_s_own_runs_after_their_checkpoint_and_spares_its_caller(
        tmp_path, text_file):
    fake = tmp_path / 'python'
    fake.write_text(f'#!/usr/bin/env bash\n[[ $1 == *train.py ]] || exec {sys.executable} "$@"\n'
                    'trap "sleep 1; echo TERM >> $OUT/signals; exit 1" TERM; '
                    'echo >> $OUT/started; sleep 99 & wait\n')  # runs wait
    fake.chmod(0o755)
    caller = (f'bash {SWEEP} --min_char_count=1 & '
              'until [ "$(cat $OUT/started 2> /dev/null | wc -l)" = 2 ]; do '
              'sleep 0.1; done; kill -TERM $!; wait $!; echo "sweep exit $?, caller alive"')
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / 'out'), PRESET='smoke',
               DATA_FILE=str(text_file), JOBS='2', QKGEOM_CACHE=str(tmp_path / 'cache'),
               DEPTHS='2', INITS='normal', SEEDS='1 2', CONTROL_SEEDS='')
    out = subprocess.run(['bash', '-c', caller], capture_output=True, text=True, env=env,
                         timeout=300,
                         # whatever sweep.sh signals stays in this test's process group
                         start_new_session=True)
    assert (out.stdout.endswith('sweep exit 130, caller alive\n')
            and 'the same command resumes' in out.stderr)
    # both, before sweep.sh ended
    assert (tmp_path / 'out' / 'signals').read_text() == 'TERM\n' * 2


def test_a_python_without_torch_is_named_with_how_to_point_at_the_right_one(tmp_path):
    (tmp_path / 'no_torch').mkdir()
    (tmp_path / 'no_torch' / 'torch.py').write_text(
        'raise ModuleNotFoundError("no torch here", name="torch")\n')
    out = sweep(tmp_path, PRESET='smoke', PYTHONPATH=str(tmp_path / 'no_torch'))
    assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr
    # however the path is spelled
    named = out.stderr.removeprefix('sweep.sh: ').split(' has no torch')[0]
    assert (os.path.samefile(named, sys.executable)
            and 'PYTHON=/path/to/venv/bin/python' in out.stderr)


def test_a_second_slurm_submission_leaves_the_pending_first_array_s_files_alone(tmp_path):
    """Each submission has its own commands file and array script (a dry run prints them and writes
    nothing); OUT and DATA_FILE may hold spaces."""
    bin_dir, log = tmp_path / 'bin', tmp_path / 'sbatch.log'
    bin_dir.mkdir()
    fake = bin_dir / 'sbatch'  # records its arguments, one call per line, and answers job id 42
    fake.write_text('#!/usr/bin/env bash\n'
                    'printf "%q " "$@" >> "$SBATCH_LOG"; echo >> "$SBATCH_LOG"; echo 42\n')
    fake.chmod(0o755)
    text, out_dir = tmp_path / 'my text.txt', tmp_path / 'the runs'
    text.write_text('A plain text to train on, short and repetitive. ' * 400)
    env = dict(PRESET='smoke', BACKEND='slurm', DATA_FILE=str(text), OUT=str(out_dir), DEPTHS='2',
               INITS='normal', CONTROL_SEEDS='', PATH=f'{bin_dir}:{os.environ["PATH"]}',
               SBATCH_LOG=str(log))
    dry = sweep(tmp_path, '--min_char_count=1', SEEDS='1 2', DRY_RUN='1', **env)
    assert '#SBATCH --array=0-1%16' in dry.stdout and len(commands(dry)) == 2
    assert not out_dir.exists() and not log.exists() and not (tmp_path / 'cache').exists()
    first = sweep(tmp_path, '--min_char_count=1', SEEDS='1 2', **env)
    assert first.returncode == 0, first.stderr
    script = shlex.split(log.read_text().splitlines()[0])[-1]
    tasks = os.path.join(os.path.dirname(script), 'commands.txt')
    before = open(tasks).read()
    # the first array still pending
    second = sweep(tmp_path, '--min_char_count=1', SEEDS='3', ARRAY_JOBS='4', **env)
    assert second.returncode == 0, second.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert (len(calls) == 4 and calls[0][-1] == script != calls[2][-1]
            and '--dependency=afterok:42' in calls[1])
    assert open(tasks).read() == before and len(before.splitlines()) == 2
    assert '#SBATCH --array=0-0%4' in open(calls[2][-1]).read()
    wrap = [a for a in calls[1] if a.startswith('--wrap=')][0][len('--wrap='):]
    assert shlex.split(wrap) == [sys.executable, os.path.join(REPO, 'analyze.py'), str(out_dir)]
    name = re.search(r'--run_name=(\S+)', before.splitlines()[1])[1]
    task = dict(os.environ, SLURM_ARRAY_TASK_ID='1', QKGEOM_CACHE=str(tmp_path / 'cache'))
    for _ in range(2):  # the second time its run is done, and the task does nothing
        ran = subprocess.run(['bash', script], cwd=tmp_path, env=task, capture_output=True,
                             text=True)
        assert ran.returncode == 0, ran.stderr
    assert '_s2-' in name and os.path.exists(out_dir / name / 'done.json')
    assert [n for n in os.listdir(out_dir) if os.path.exists(out_dir / n / 'done.json')] == [name]


def test_ci_runs_the_readme_s_test_lines_and_no_user_file_names_a_path_outside_the_repository():
    readme = open(os.path.join(REPO, 'README.md')).read()
    lines = [line.strip() for line in readme.splitlines() if line.startswith('    python -m p')]
    tests = lines[lines.index('python -m pip install -r requirements-dev.txt'):][:2]
    ci = [line for line in open(os.path.join(REPO, '.ci', 'run')).read().splitlines()
          if line and line[0] != '#']
    assert tests == ['python -m pip install -r requirements-dev.txt',
                     'python -m pytest -q'] == ci[-2:]
    users = [f for f in os.listdir(REPO)
             if f.endswith('.py') and not f.startswith(('test_', 'conftest'))]
    for name in ['README.md', 'sweep.sh', *users]:
        text = open(os.path.join(REPO, name)).read()
        assert not [p for p in ('../shared', '/work/', 'DESIGN.md') if p in text], name
