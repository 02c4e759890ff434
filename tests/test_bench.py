"""bench.py: each mode runs and prints its table, the GPU check included at its CPU size."""
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import bench as bench_py
from conftest import REPO


def bench(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, 'bench.py'), *map(str, args)],
                          capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_micro_benchmarks_print_a_row_per_width(capsys):
    for mode in ('--geometry', '--control'):
        bench_py.main([mode, '--widths=16,32'])
        assert capsys.readouterr().out.splitlines()[-1].startswith('   32')


def test_jobs_and_whole_processes_run_on_a_text(tmp_path, text_file):
    out = bench('--jobs=1,2', '--preset=smoke', '--iters=4', f'--data_file={text_file}',
                f'--cache_dir={tmp_path}')
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[-2:]] == ['1', '2']
    out = bench('--whole', '--iters=3', '--repeats=1', '--eval_iters=1', '--n_embd=32',
                '--block_size=32',
                '--batch_size=4', f'--data_file={text_file}', f'--cache_dir={tmp_path}')
    assert out.returncode == 0, out.stderr
    assert 'train.py, geometry off' in out.stdout and 'of the plain process' in out.stdout


def test_the_gpu_check_runs_every_step_at_cpu_size_and_goes_on_after_a_failure(tmp_path, text_file):
    out = bench('--gpu_check', '--small', f'--data_file={text_file}', f'--log={tmp_path / "log"}')
    assert out.returncode == 0, out.stderr
    summary = (tmp_path / 'log' / 'summary.txt').read_text()
    assert [line.split(':')[0] for line in summary.splitlines()[1:]] == [
        'tests', 'paper_run', 'paper_control', 'paper_compile', 'overhead', 'syncs', 'ddp', 'jobs',
        'sweep']
    assert 'FAILED' not in summary, summary
    assert 'paper_control: ok in' in summary and '% of its wall time' in summary, summary
    assert ('syncs: ok' if torch.cuda.device_count()
            else 'syncs: skipped (set_sync_debug_mode is CUDA') in summary
    assert (f'ddp: skipped (DDP needs 2 GPUs, {torch.cuda.device_count()} here)' in summary
            or 'ddp: ok' in summary)
    overhead = (tmp_path / 'log' / 'overhead.log').read_text().splitlines()
    assert [line.split()[:2] for line in overhead[-3:]] == [['training', 'step'],
                                                            ['control', 'step'],
                                                            ['geometry', 'record']]
    out = bench('--gpu_check', '--small', '--steps=paper_run,paper_control',
                f'--data_file={tmp_path / "missing.txt"}',
                f'--log={tmp_path / "log2"}')
    # the second ran after the first failed
    assert (tmp_path / 'log2' / 'summary.txt').read_text().count('FAILED') == 2


def test_the_gpu_check_s_relative_paths_lead_from_the_caller_s_folder(tmp_path, text_file):
    log = f'gpu-check-{os.getpid()}'  # a name no one else uses, should it land in the repository
    try:
        out = subprocess.run([sys.executable, os.path.join(REPO, 'bench.py'), '--gpu_check',
                              '--small', '--steps=paper_run', f'--data_file={text_file.name}',
                              f'--log={log}'], capture_output=True, text=True, cwd=tmp_path,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        assert 'paper_run: ok' in (tmp_path / log / 'summary.txt').read_text()
        assert (tmp_path / log / 'runs' / 'paper_run' / 'done.json').exists()
        assert not os.path.exists(os.path.join(REPO, log))
    finally:
        shutil.rmtree(os.path.join(REPO, log), ignore_errors=True)


def test_a_bad_number_or_an_absent_device_stops_bench_in_one_line_naming_it():
    for args in (['--jobs=0'], ['--jobs=a'], ['--geometry', '--widths=abc'],
                 ['--control', '--widths=0'],
                 ['--whole', '--repeats=0'], ['--overhead', '--device=cuda:99'],
                 ['--syncs', '--device=cpu']):
        with pytest.raises(bench_py.Stop, match=args[-1]):
            bench_py.main(args)
    out = bench('--jobs=1,0')
    assert (out.returncode, out.stdout, out.stderr.count('\n')) == (2, '', 1)
    assert '--jobs=1,0' in out.stderr


def test_count_syncs_names_each_step_s_host_syncs_and_restores_the_debug_mode(monkeypatch, capsys):
    modes = []
    monkeypatch.setattr(torch.cuda, 'set_sync_debug_mode', modes.append)
    bench_py.count_syncs({'quiet': lambda: None,
                          'syncing': lambda: warnings.warn('a synchronizing operation')})
    found = re.findall(r'(\w+): (\d) host syncs ?(\S*)', capsys.readouterr().out)
    assert [(name, n) for name, n, _ in found] == [('quiet', '0'),
                                                   ('syncing',
                                                    '1')] and 'test_bench.py:' in found[1][2]
    assert modes == ['warn', 'default'] * 2
