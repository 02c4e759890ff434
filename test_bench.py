"""Tests of bench.py on the CPU at tiny sizes: the timing helper, the command line and its errors, and each
measurement run small enough to take seconds. The numbers themselves are the machine's; the tests check
that they are measured, finite and put together as the docstring says."""
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

import bench
import train
from configurator import Stop

HERE = os.path.dirname(os.path.abspath(__file__))


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, 'bench.py', *args], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- the timing helper

def test_timings_interleaves_the_calls_after_one_warm_up_each():
    calls = []
    ts = bench.timings({'a': lambda: calls.append('a'), 'b': lambda: calls.append('b')}, repeats=3)
    assert calls == ['a', 'b'] + ['a', 'b'] * 3
    assert set(ts) == {'a', 'b'} and all(len(t) == 3 and min(t) >= 0 for t in ts.values())
    calls.clear()
    bench.timings({'a': lambda: calls.append('a')}, repeats=2, warmup=False)
    assert calls == ['a', 'a']


def test_timings_measures_wall_time():
    import time
    ts = bench.timings({'sleep': lambda: time.sleep(0.02), 'nothing': lambda: None}, repeats=2, warmup=False)
    assert min(ts['sleep']) >= 0.02 > max(ts['nothing'])


# ----------------------------------------------------------------------------- the command line

def error_of(args):
    """The one-line message bench.py prints for args (its own errors and train.py's config errors)."""
    with pytest.raises((bench.BenchError, Stop)) as info:
        bench.main(args)
    return info.value.msg if isinstance(info.value, Stop) else str(info.value)


@pytest.mark.parametrize('args,match', [
    ([], 'one of the arguments --jobs --fixed_cost'),
    (['--geometry', '--control'], 'not allowed with'),
    (['--geometry', '--widths=a,2'], "--widths='a,2': expected positive whole numbers"),
    (['--control', '--widths=0'], 'expected positive whole numbers'),
    (['--loop', '--data_file=no/such/file.txt'], 'does not exist'),
    (['--loop', '--iters=0'], 'must be at least 1'),
    (['--jobs=0'], "--jobs='0': expected positive whole numbers"),
    (['--jobs=1', '--preset=gpu'], "--preset=gpu is not one of sweep.sh's presets (paper, cpu, ladder, smoke)"),
    (['--jobs=1', '--device=cuda'], 'torch sees no CUDA device'),
    (['--jobs=1', '--n_embed=32'], 'did you mean n_embd'),
    (['--geometry', '--n_embd=32'], 'only --jobs, --fixed_cost and --loop'),
    (['--fixed-cost', '--repeats=-1'], 'must be at least 1'),
])
def test_bad_arguments_are_clear_errors(args, match):
    assert match in error_of(args)


@pytest.mark.parametrize('args', [['--jobs=1', '--preset=gpu'], ['--jobs=1', '--n_embed=32']])
def test_an_error_is_one_line_and_exit_2(args):
    r = run_bench(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == '' and len(lines) == 1 and lines[0] == f'bench.py: error: {error_of(args)}'


@pytest.mark.parametrize('kind', ['folder', 'device', 'fifo', 'broken link'])
def test_a_data_file_that_is_not_a_file_says_what_it_is(tmp_path, kind, odd_path):
    path, words = odd_path(tmp_path, kind)
    for mode in ('--loop', '--encode'):
        assert error_of([mode, f'--data_file={path}']).startswith(f'--data_file={path} {words}')


def clone_without_shared(tmp_path):
    """The project's files as a clone has them, with no ../shared beside it."""
    clone = tmp_path / 'clone'
    clone.mkdir()
    for name in os.listdir(HERE):
        if name.endswith(('.py', '.sh')):
            shutil.copy(os.path.join(HERE, name), clone / name)
    return clone


@pytest.mark.parametrize('args,match', [(['--jobs=1', '--preset=gpu'], '--preset=gpu is not one of'),
                                        (['--jobs=1', '--n_embed=32'], 'did you mean n_embd'),
                                        (['--jobs=0'], "--jobs='0': expected positive whole numbers")])
def test_errors_in_a_clone_without_shared_are_about_the_arguments(tmp_path, args, match):
    clone = clone_without_shared(tmp_path)
    r = subprocess.run([sys.executable, str(clone / 'bench.py'), *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and match in r.stderr and r.stderr.count('\n') == 1, r.stderr


def test_without_data_file_the_runs_train_on_the_wikitext_test_split(text_file):
    assert bench.parse_args(['--loop']).train_args == ['--dataset=wikitext103-test']
    assert bench.parse_args(['--jobs=1', '--n_layer=2']).train_args == ['--dataset=wikitext103-test', '--n_layer=2']
    assert bench.parse_args(['--loop', f'--data_file={text_file}']).train_args == [f'--data_file={text_file}']


def test_encode_without_data_file_reads_the_test_split_from_data_dir(tmp_path, monkeypatch, synthetic_text):
    monkeypatch.chdir(tmp_path)  # train.py's data_dir is relative to where it runs
    data_dir = tmp_path / train.get_config([])['data_dir']
    data_dir.mkdir(parents=True)
    (data_dir / 'wiki.test.raw').write_text(synthetic_text(20_000), encoding='utf-8')
    assert bench.default_text() == str(data_dir.relative_to(tmp_path) / 'wiki.test.raw')


# ----------------------------------------------------------------------------- each measurement, small

def test_geometry_and_control_tables_at_small_widths(capsys):
    rows = bench.bench_geometry([64, 128], repeats=1, B=2, T=16)
    assert set(rows) == {64, 128} and all(t > 0 and math.isfinite(t) for r in rows.values() for t in r)
    rows = bench.bench_control([32], repeats=1)
    assert {keep for _, keep in rows[32]} == {'fro', 'spec'} and len(rows[32]) == 6
    out = capsys.readouterr().out
    assert 'layer_geometry' in out and 'spec / fro, all cells together' in out


def test_encode_counts_every_character(tmp_path, synthetic_text):
    text = tmp_path / 'text.txt'
    text.write_text(synthetic_text(50_000), encoding='utf-8')
    rate, hit = bench.bench_encode(str(text), mb=0.2)
    assert rate > 0 and hit > 0


def test_steps_alone_weights_each_console_line_by_its_iterations():
    log = ('iter 0: lr 1e-4, - ms/iter, ETA -\n'
           'iter 10: train 3.0, val 3.1, lr 1e-3, 20.0 ms/iter, 200 tok/s, ETA 1s\n'
           'iter 40: lr 1e-3, 10.0 ms/iter, 400 tok/s, ETA 1s | pr_q 1.0\n')
    assert bench.steps_alone(log, 40) == pytest.approx((10 * 20.0 + 30 * 10.0) / 1000 / 40)


def test_plain_loop_trains_train_pys_model(tmp_path, text_file):
    args = [f'--data_file={text_file}', f'--cache_dir={tmp_path}/cache', '--n_layer=1', '--n_embd=16',
            '--n_head=2', '--block_size=16', '--batch_size=4', '--min_char_count=1']
    data, vocab = bench.load_data(args)
    assert 0 < bench.plain_loop(data, vocab, args, iters=3) < 10


# ----------------------------------------------------------------------------- --jobs: runs per device

@pytest.mark.parametrize('preset', ['paper', 'cpu', 'ladder', 'smoke'])
def test_preset_args_are_the_ones_sweep_sh_runs(tmp_path, preset):
    """bench.py reads the presets from sweep.sh; sweep.sh's dry run prints the command of each run."""
    env = dict(os.environ, PRESET=preset, DRY_RUN='1', ANALYZE='0', DATA_FILE='', OUT=str(tmp_path / 'out'),
               SEEDS='1', DEPTHS='4', INITS='normal', CONTROL_SEEDS='', LADDER_SEEDS='1')
    r = subprocess.run(['bash', 'sweep.sh'], cwd=HERE, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = next(line.split() for line in r.stdout.splitlines() if 'train.py' in line)
    args = bench.preset_args(preset)
    start = cmd.index(args[0])
    assert len(args) > 3 and cmd[start:start + len(args)] == args


def test_jobs_row_aggregates_over_the_slowest_process():
    dones = [{'wall_time': 2.0, 'geometry_share': 0.01, 'control_share': 0.0},
             {'wall_time': 4.0, 'geometry_share': 0.03, 'control_share': 0.0},
             {'wall_time': 3.0, 'geometry_share': 0.02, 'control_share': 0.0}]
    row = bench.jobs_row(3, dones, iters=100, tokens_per_iter=512, batch_s=9.0)
    assert row['tok_s'] == pytest.approx(3 * 100 * 512 / 4.0)
    assert row['ms_iter'] == pytest.approx(1000 * 3.0 / 100)
    assert row['geometry_share'] == pytest.approx(0.02) and row['batch_s'] == 9.0


def tiny(text_file, tmp_path):
    return [f'--data_file={text_file}', f'--cache_dir={tmp_path}/cache', '--min_char_count=1', '--n_layer=1']


def test_jobs_runs_k_processes_at_once_at_the_preset_size(tmp_path, text_file, capsys):
    rows = bench.bench_jobs([1, 2], [*bench.preset_args('smoke'), *tiny(text_file, tmp_path)], iters=4, device='cpu')
    assert [r['jobs'] for r in rows] == [1, 2]
    for r in rows:
        assert r['tok_s'] > 0 and r['ms_iter'] > 0 and 0 < r['geometry_share'] < 1 and r['control_share'] == 0
    out = capsys.readouterr().out
    assert 'n_embd 16, n_head 2, block 16, batch 4' in out and 'most tokens/s with' in out


def test_jobs_reports_the_control_share_when_control_is_on(tmp_path, text_file):
    rows = bench.bench_jobs([1], [*bench.preset_args('smoke'), *tiny(text_file, tmp_path), '--control=freeze',
                                  '--control_keep=spec'], iters=4, device='cpu')
    assert 0 < rows[0]['control_share'] < 1


def test_a_failing_train_run_is_one_line_naming_it(tmp_path, text_file):
    r = run_bench('--jobs=1', '--preset=smoke', '--iters=6', *tiny(text_file, tmp_path), '--lr=1e12', '--grad_clip=0')
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert 'train.py --n_embd=16' in lines[0] and 'exited with status 2: error: the loss became' in lines[0]


# ----------------------------------------------------------------------------- --fixed_cost: whole processes

def test_fixed_cost_compares_whole_processes(tmp_path, text_file, capsys):
    size = ['--n_embd=16', '--n_head=2', '--block_size=16', '--batch_size=4']
    ratio = bench.bench_fixed_cost([*tiny(text_file, tmp_path), *size], iters=3, repeats=1)
    assert 0 < ratio < 100
    out = capsys.readouterr().out
    assert 'n_layer 1, n_embd 16' in out and 'train.py / plain, median of the 1 pairs' in out
    pair = next(line for line in out.splitlines() if 'ratio x' in line)
    wall = [float(w) for w in re.findall(r'(?:train.py|plain) ([\d.]+) s \(', pair)]
    ratio = float(re.search(r'ratio x([\d.]+)', pair)[1])   # of the unrounded times: rounding moves it a little
    assert len(wall) == 2 and ratio == pytest.approx(wall[0] / wall[1], rel=0.05) and pair.count('CPU s') == 2
