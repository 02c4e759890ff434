"""The GPU code paths of train.py, exercised on CPU: bfloat16 autocast (--dtype=bfloat16) and torch.compile
(--compile=True), each for a few iterations of a tiny model with geometry logging and key-spectrum control
on. And gpu_check.sh, the one command that tests and measures the GPU path on a GPU machine, run end to end
on CPU with its small sizes (SMALL=1).

Compiling is slow on CPU: the compiled run takes about 15 s with a warm inductor cache and about a minute
with a cold one (the first run on a machine)."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import geometry

HERE = os.path.dirname(os.path.abspath(__file__))
# one layer (compiling cost grows with the graph), records at iterations 0, 1, 2, 4, control acting at each step
SHORT = ('--n_layer=1', '--max_iters=4', '--eval_interval=2', '--geom_interval=2', '--ckpt_interval=4',
         '--control=shrink', '--shrink_iters=4', '--device=cpu')
LOSSES = ('train_loss', 'val_loss', 'eval_loss')


@pytest.fixture(scope='module')
def device_runs(tmp_path_factory, synthetic_text, args_for, run_train):
    """The same tiny run three ways, {name: (run folder, train.py's output)}: float32, bfloat16 autocast,
    and float32 with the training forward compiled (TORCH_LOGS prints the graphs dynamo captured)."""
    tmp = tmp_path_factory.mktemp('devices')
    text = tmp / 'corpus.txt'
    text.write_text(synthetic_text(40_000), encoding='utf-8')
    runs = {}
    for name, extra in (('f32', ['--dtype=float32']), ('bf16', ['--dtype=bfloat16']),
                        ('compiled', ['--dtype=float32', '--compile=True'])):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv('TORCH_LOGS', 'graph_code')
            res = run_train(args_for(tmp, str(text), name, *SHORT, *extra))
        assert res.returncode == 0, res.stdout + res.stderr
        runs[name] = (str(tmp / 'out' / name), res.stdout + res.stderr)
    return runs


def config(run_dir):
    with open(os.path.join(run_dir, 'config.json')) as f:
        return json.load(f)


def metric_bounds(cfg):
    """(low, high) of every per-layer metric train.py logs, from its definition: a PR lies between 1 and the
    rank of its matrix, an entropy between 0 and log T (its normalised form between 0 and 1). The learned part
    W - W(0) has PR 0 where it is zero (at iteration 0)."""
    C, T = cfg['n_embd'], cfg['block_size']
    d = C // cfg['n_head']
    n_tokens = cfg['eval_windows'] * T
    b = dict.fromkeys(('pr_q', 'pr_k', 'erank_q', 'erank_k', 'srank_q', 'srank_k'), (1, C))
    b.update(dict.fromkeys(('pr_q_head', 'pr_k_head', 'pr_qk', 'erank_qk', 'tok_pr_q_head', 'tok_pr_k_head',
                            'tok_pr_qk', 'ctl_pr', 'ctl_target_pr'), (1, d)))  # (d, C) blocks, rank-d W_QK^h
    b.update(dict.fromkeys(('tok_pr_q', 'tok_pr_k'), (1, min(C, n_tokens - 1))))
    b.update(entropy=(0, math.log(T)), entropy_norm=(0, 1), pr_dq=(0, C), pr_dk=(0, C), pr_dq_head=(0, d),
             pr_dk_head=(0, d), dq_rel=(0, math.inf), dk_rel=(0, math.inf))
    b.update(dict.fromkeys(('qk_spec_norm', 'qk_fro_norm'), (1e-12, math.inf)))
    return b


def heads_of(layer, key):
    """The layer-level key that is the mean of the per-head list `key`: pr_q_heads -> pr_q_head,
    pr_qk_heads -> pr_qk, entropy_heads -> entropy."""
    return key[:-1] if key[:-1] in layer else key[:-len('_heads')]


def check_record(row, cfg):
    """Every value finite; losses between 0 and twice the uniform loss; each layer metric inside its bounds,
    each per-head list of n_head values whose mean is the layer's value."""
    assert all(math.isfinite(row[k]) for k in ('iter', 'tokens', 'lr', 'time'))
    for key in LOSSES:
        if key in row:
            assert 0 < row[key] < 2 * math.log(cfg['vocab_size']), (key, row[key])
    bounds, tol = metric_bounds(cfg), 1e-6
    for layer in row.get('layers', []):
        assert {'pr_q', 'pr_k', 'pr_qk', 'entropy', 'tok_pr_q', 'ctl_pr'} <= set(layer)  # geometry and control
        for key, value in layer.items():
            values = value if isinstance(value, list) else [value]
            base = heads_of(layer, key) if isinstance(value, list) else key
            assert len(values) == (cfg['n_head'] if isinstance(value, list) else 1), key
            assert all(math.isfinite(v) for v in values), (key, value)
            low, high = bounds[base]
            assert all(low - tol <= v <= high * (1 + tol) for v in values), (row['iter'], key, value, (low, high))
            if isinstance(value, list):
                assert np.mean(values) == pytest.approx(layer[base], rel=1e-9, abs=1e-12), key
        assert all(s <= f * (1 + tol) for s, f in zip(layer['qk_spec_norm_heads'], layer['qk_fro_norm_heads']))
        if 'pr_dq' in layer:  # the learned part (contract 3): exactly zero at iteration 0, and only there
            assert (layer['pr_dq'] == layer['dq_rel'] == 0) == (row['iter'] == 0)


@pytest.mark.parametrize('name', ['bf16', 'compiled'])
def test_logged_metrics_are_finite_and_in_range(device_runs, records, name):
    run_dir, _ = device_runs[name]
    cfg = config(run_dir)
    assert (cfg['dtype'], cfg['compile']) == {'bf16': ('bfloat16', False), 'compiled': ('float32', True)}[name]
    rows = records(run_dir)
    iters = [r['iter'] for r in rows]
    assert iters[0] == 0 and iters[-1] == 4 and iters == sorted(set(iters)) and all(len(r['layers']) == 1 for r in rows)
    for row in rows:
        check_record(row, cfg)
    # the control acted: the controlled PR followed its falling target
    first, last = rows[0]['layers'][0], rows[-1]['layers'][0]
    assert last['ctl_target_pr'] < first['ctl_target_pr'] and last['ctl_pr'] <= last['ctl_target_pr'] * (1 + 1e-6)


def test_bf16_geometry_equals_the_geometry_of_its_float32_snapshots(device_runs, records):
    run_dir, _ = device_runs['bf16']
    n_head = config(run_dir)['n_head']
    rows = records(run_dir)
    snap = lambda it: np.load(os.path.join(run_dir, 'snapshots', f'qk_{it:07d}.npz'))
    q0, k0 = snap(0)['q'], snap(0)['k']
    for row in rows:
        s = snap(row['iter'])
        assert s['q'].dtype == s['k'].dtype == np.float32  # the weights stay float32 under autocast
        for layer, (q, k) in enumerate(zip(s['q'], s['k'])):
            want = geometry.layer_geometry(q, k, n_head)
            if 'pr_dq' in row['layers'][layer]:
                want.update(geometry.learned_geometry(q, k, q0[layer], k0[layer], n_head))
            for key, value in want.items():  # one key at a time: pytest.approx takes no dict of lists
                assert row['layers'][layer][key] == pytest.approx(value, rel=1e-6, abs=1e-12), (row['iter'], key)
    # autocast was on: the losses moved off the float32 run's, by bfloat16's rounding and no more
    f32 = records(device_runs['f32'][0])
    pairs = [(r[k], g[k]) for r, g in zip(rows, f32) for k in LOSSES if k in r]
    assert any(a != b for a, b in pairs) and all(a == pytest.approx(b, rel=1e-3) for a, b in pairs)


def test_compiled_run_matches_the_uncompiled_one(device_runs, records):
    run_dir, output = device_runs['compiled']
    assert 'TRACED GRAPH' in output  # dynamo captured the model: the compiled path ran, not a silent fallback
    assert 'TRACED GRAPH' not in device_runs['f32'][1]
    compiled, eager = records(run_dir), records(device_runs['f32'][0])
    assert [r['iter'] for r in compiled] == [r['iter'] for r in eager]
    for c, e in zip(compiled, eager):
        for key in LOSSES:
            assert (key in c) == (key in e)
            if key in c:
                assert c[key] == pytest.approx(e[key], rel=1e-5), (c['iter'], key)
        for lc, le in zip(c['layers'], e['layers']):
            keys = ('pr_q', 'pr_k', 'entropy')
            assert [lc[k] for k in keys] == pytest.approx([le[k] for k in keys], rel=1e-4), c['iter']


# ----------------------------------------------------------------------------- gpu_check.sh

SWEEP_VARS = ('DEPTHS', 'INITS', 'SEEDS', 'CONTROL_DEPTH', 'CONTROL_SEEDS', 'CONTROL_KEEPS', 'MIRROR', 'RUN_LIST',
              'BACKEND', 'DRY_RUN', 'SBATCH_ARGS', 'ANALYZE', 'JOBS', 'PRESET', 'OUT', 'DATA_FILE', 'LOG', 'RUNS',
              'STEPS', 'TESTS', 'SMALL', 'STEP_TIMEOUT')
inside_gpu_check = pytest.mark.skipif(os.environ.get('QKGEOM_GPU_CHECK') == '1',
                                      reason='the suite is running inside gpu_check.sh: not the script again')


@pytest.fixture
def gpu_check(tmp_path, synthetic_text):
    """gpu_check.sh with SMALL=1 on CPU, on a synthetic text, its folders in tmp_path (log/, runs/)."""
    text = tmp_path / 'corpus.txt'
    text.write_text(synthetic_text(50_000), encoding='utf-8')
    base = {k: v for k, v in os.environ.items() if k not in SWEEP_VARS}
    base.update(SMALL='1', DATA_FILE=str(text), LOG=str(tmp_path / 'log'), RUNS=str(tmp_path / 'runs'),
                QKGEOM_CACHE=str(tmp_path / 'cache'), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES='')

    def run(**env):  # in its own process group, so that a timeout stops every run and worker it started
        proc = subprocess.Popen(['bash', os.path.join(HERE, 'gpu_check.sh')], env={**base, **env}, cwd=str(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return run


def done_runs(folder):
    return {n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, 'done.json'))}


def make_test_file(tmp_path, passes):
    """A test file of one test that passes or fails, for gpu_check.sh's test step (TESTS)."""
    path = tmp_path / ('test_passes.py' if passes else 'test_fails.py')
    path.write_text(f'import geometry\n\n\ndef test_pr():\n    assert geometry.participation_ratio([1.0, 1.0]) '
                    f'{"==" if passes else "!="} 2\n')
    return str(path)


@inside_gpu_check
def test_gpu_check_runs_every_step_end_to_end_with_small_sizes(gpu_check, tmp_path):
    res = gpu_check(TESTS=make_test_file(tmp_path, passes=True), ANALYZE='0')
    assert res.returncode == 0, res.stdout + res.stderr
    log, runs = tmp_path / 'log', tmp_path / 'runs'
    summary = (log / 'summary.txt').read_text()
    assert set(summary.splitlines()) <= set(res.stdout.splitlines())  # the console shows it too
    assert re.search(r'^1 tests: ok in [\d.]+ min: 1 passed', summary, re.M), summary
    assert re.search(r'^2 paper run L6_normal_s1 \(PRESET=smoke, 6 iterations\): ok in .* training; val loss [\d.]+$',
                     summary, re.M), summary
    assert re.search(r'^3 bench --jobs=1,2 --preset=smoke .*: ok in .*most tokens/s with [12] processes .* on cpu '
                     r'\([\d.]+x the tokens/s of one\)$', summary, re.M), summary
    assert re.search(r'^4 smoke sweep, JOBS=2 \(0 GPUs\): ok in .*2 runs, 0 skipped .*2 trained now, 0 failed$',
                     summary, re.M), summary
    assert re.search(r'^estimate: the whole smoke study \(\d+ runs\) at [12] runs at once per device on CPU: [\d.]+ min',
                     summary, re.M), summary
    assert done_runs(runs / 'paper') == {'L6_normal_s1'}
    assert json.loads((runs / 'paper' / 'L6_normal_s1' / 'done.json').read_text())['iter'] == 6
    assert re.findall(r'^\s+(\d+)\s+\d+\s', (log / 'bench.log').read_text(), re.M) == ['1', '2']  # the table's rows
    assert done_runs(runs / 'smoke') == {'L4_normal_s1', 'L4_tied_s1'}
    # what a device machine sends back: a few small files, at most 8
    files = sorted(os.listdir(log))
    assert files == ['bench.log', 'machine.txt', 'paper.log', 'summary.txt', 'sweep.log', 'tests.log']
    assert all(os.path.getsize(log / f) < 1 << 20 for f in files)


def test_gpu_check_reports_a_failed_step_and_goes_on(gpu_check, tmp_path):
    res = gpu_check(STEPS='tests tests', TESTS=make_test_file(tmp_path, passes=False))  # the next step: the same again
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (tmp_path / 'log' / 'summary.txt').read_text()
    failed = re.findall(r'^1 tests: FAILED \(exit 1\) after .*tests.log ends:$', summary, re.M)
    assert len(failed) == 2 and '1 failed' in summary, summary  # each quotes the end of its log


def test_gpu_check_refuses_bad_settings_in_one_line_and_writes_nothing(gpu_check, tmp_path):
    log = tmp_path / 'log'
    for env, message in ((dict(STEPS='tests gpu'), "unknown step 'gpu' in STEPS"),
                         (dict(SMALL='yes'), 'SMALL=yes must be 0 or 1'),
                         (dict(SMALL='0'), 'torch sees no CUDA GPU here'),  # the tests hide any GPU
                         (dict(DATA_FILE=str(tmp_path / 'no.txt')), f'DATA_FILE={tmp_path / "no.txt"} does not exist')):
        res = gpu_check(**env)
        assert res.returncode == 2 and message in res.stderr and res.stderr.count('\n') == 1, res.stderr
        assert not log.exists()
    log.mkdir()
    (log / 'summary.txt').write_text('an earlier measurement\n')
    res = gpu_check()
    assert res.returncode == 2 and f'{log} is not empty' in res.stderr and res.stderr.count('\n') == 1
    assert os.listdir(log) == ['summary.txt'] and (log / 'summary.txt').read_text() == 'an earlier measurement\n'
