"""Tests of bench.py on the CPU at tiny sizes: the timing helper, the command line and its errors, and each
measurement run small enough to take seconds. The numbers themselves are the machine's; the tests check
that they are measured, finite and put together as the docstring says."""
import math
import os
import subprocess
import sys

import pytest

import bench

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

@pytest.mark.parametrize('args,match', [
    ([], 'one of the arguments --loop'),
    (['--geometry', '--control'], 'not allowed with'),
    (['--geometry', '--widths=a,2'], "--widths='a,2': expected positive whole numbers"),
    (['--control', '--widths=0'], 'expected positive whole numbers'),
    (['--loop', '--data_file=no/such/file.txt'], 'does not exist'),
    (['--loop', '--iters=0'], 'must be at least 1'),
])
def test_bad_arguments_are_one_line_and_exit_2(args, match):
    r = run_bench(*args)
    assert r.returncode == 2 and r.stdout == ''
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('bench.py: error: ') and match in lines[0], r.stderr


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
