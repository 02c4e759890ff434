"""Tests of regime.py on planted run folders shaped like sweep.sh's ladder (widths 32-384 with 6 heads of 64 at
384, 4x length at width 128, lr x1/3 and x3 at width 64, freeze with both keeps at width 256): the axes are found,
a statistic planted to grow by a known amount per doubling of width is recovered by the regime table and its trend,
an effect planted in one layer shows in that position only, and the whole analysis of a ladder-sized set is fast."""
import json
import math
import os
import time
import zlib

import numpy as np
import pytest

import analyze
import folders
import regime
from report import ACROSS, CHANGES

WIDTHS = (32, 64, 128, 256, 384)
SEED_OFFSET = {1: -1.0, 2: 0.0, 3: 1.0}   # seed offsets of a planted value: the mean over seeds is the value itself
GAP0, GAP_SLOPE, SPREAD = -0.05, 0.03, 0.005   # gap_end = GAP0 + GAP_SLOPE * log2(C / 32), seeds +-SPREAD
HEAD_SLOPE = 0.04                         # gap_end_head in the last layer only: HEAD_SLOPE * log2(C / 32)
LENGTH_SLOPE = 0.02                       # gap_end per doubling of max_iters at width 128
D_ENTROPY = {'fro': 0.2, 'spec': -0.05}   # the planted entropy effect of freeze per control_keep
OVERFIT_AT = {384: 0.2}                   # val - train at these widths (0.01 elsewhere)


def planted_gap(C, max_iters=2000):
    return GAP0 + GAP_SLOPE * math.log2(C / 32) + LENGTH_SLOPE * math.log2(max_iters / 2000)


def heads(v, n_head, rng, spread):
    return [float(x) for x in v + rng.normal(0, spread, n_head)]


def layer_rec(layer, f, C, n_head, gap, head_gap, ent_shift, scale_shift, rng):
    """One layer of a record with every key train.py logs. Layer 0 has PR_Q up and PR_K down, the others both
    down; at the end (f = 1) PR_Q - PR_K = gap * C and, per head, head_gap * d."""
    d = C // n_head
    q0, k0, mid = (0.3 * C, 0.5 * C, 0.4 * C) if layer == 0 else (0.45 * C, 0.45 * C, 0.3 * C)
    noise = rng.normal(0, 0.002 * C) * (f < 1)
    pr_q = q0 + (mid + gap * C / 2 - q0) * f + noise
    pr_k = k0 + (mid - gap * C / 2 - k0) * f + noise
    q_head, k_head = d * (0.5 + head_gap / 2 * f), d * (0.5 - head_gap / 2 * f)
    ent = 1.0 + 0.5 * pr_k / C + ent_shift + rng.normal(0, 0.01)
    scale = 0.5 + f + scale_shift
    rec = {'pr_q': pr_q, 'pr_k': pr_k, 'pr_q_head': q_head, 'pr_k_head': k_head, 'pr_qk': 0.3 * pr_k,
           'pr_dq': C * (0.2 + 0.05 * f) if f else 0.0, 'pr_dk': C * (0.1 + 0.05 * f) if f else 0.0,
           'qk_spec_norm': scale, 'qk_fro_norm': 2 * scale, 'entropy': ent, 'entropy_norm': ent / 3,
           'erank_q': pr_q, 'erank_k': pr_k, 'erank_qk': pr_k / 3, 'srank_q': 3.0, 'srank_k': 3.0,
           'tok_pr_q': pr_q / 2, 'tok_pr_k': pr_k / 2, 'tok_pr_q_head': q_head / 2, 'tok_pr_k_head': k_head / 2,
           'tok_pr_qk': pr_k / 4, 'dq_rel': f, 'dk_rel': f, 'pr_dq_head': d * 0.3, 'pr_dk_head': d * 0.2}
    per_head = {'pr_q_heads': (q_head, 0.01 * d), 'pr_k_heads': (k_head, 0.05 * d), 'pr_qk_heads': (pr_k / 3, 0.1),
                'entropy_heads': (ent, 0.05), 'entropy_norm_heads': (ent / 3, 0.02), 'qk_spec_norm_heads': (scale, 0.1),
                'qk_fro_norm_heads': (2 * scale, 0.1), 'tok_pr_q_heads': (q_head / 2, 0.1),
                'tok_pr_k_heads': (k_head / 2, 0.1), 'tok_pr_qk_heads': (pr_k / 4, 0.1),
                'pr_dq_heads': (d * 0.3, 0.1), 'pr_dk_heads': (d * 0.2, 0.1)}
    rec.update({k: heads(v, n_head, rng, s) for k, (v, s) in per_head.items()})
    return {k: float(v) if not isinstance(v, list) else v for k, v in rec.items()}


def plant_run(root, name, n_embd, seed, n_head=4, max_iters=2000, lr=1e-3, control='none', keep='fro', n_layer=4,
              n_records=25, gap=None, head_gap=None, overfit=0.01):
    """A finished run folder with the planted values above (gap, head_gap: at this run's seed already)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    cfg = dict(out_dir=root, run_name=name, n_layer=n_layer, n_head=n_head, n_embd=n_embd, qk_init='normal', seed=seed,
               control=control, control_target='k', control_keep=keep, control_scope='head', shrink_to=0.5,
               max_iters=max_iters, lr=lr, min_lr=lr / 10, warmup_iters=100, weight_decay=0.1, decay_qk=True,
               block_size=64, batch_size=16, eval_windows=16, data_file='corpus.txt', vocab_size=100)
    with open(os.path.join(path, 'config.json'), 'w') as fh:
        json.dump(cfg, fh)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    iters = np.linspace(0, max_iters, n_records).astype(int)
    on = control != 'none'
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as fh:
        for it in iters:
            f = min(1.0, it / (0.7 * max_iters))   # the last FINAL_LOGS records at the planted end
            layers = [layer_rec(i, f, n_embd, n_head, gap, head_gap if i == n_layer - 1 else 0.0,
                                D_ENTROPY[keep] * f * on, -0.3 * f * on, rng) for i in range(n_layer)]
            fh.write(json.dumps({'iter': int(it), 'tokens': int(it) * 1024, 'lr': lr, 'train_loss': 3 - f,
                                 'val_loss': 3 - f + overfit, 'layers': layers, 'time': 0.1 * it}) + '\n')
    with open(os.path.join(path, 'done.json'), 'w') as fh:
        json.dump({'iter': max_iters, 'train_loss': 2.0, 'val_loss': 2.0 + overfit, 'wall_time': 60.0}, fh)
    return path


def plant_ladder(root, seeds=(1, 2, 3), widths=WIDTHS, n_records=25):
    """sweep.sh's ladder (30 runs with 3 seeds), planted: gap_end grows by GAP_SLOPE per doubling of width (and
    LENGTH_SLOPE per doubling of length), gap_end_head by HEAD_SLOPE in the last layer only."""
    for seed in seeds:
        spread = SPREAD * SEED_OFFSET[seed]
        for C in widths:
            n_head = 4 if C <= 256 else C // 64
            common = dict(n_head=n_head, n_records=n_records, gap=planted_gap(C) + spread,
                          head_gap=HEAD_SLOPE * math.log2(C / 32) + spread, overfit=OVERFIT_AT.get(C, 0.01))
            plant_run(root, f'w{C}_s{seed}', C, seed, **common)
            for keep in ('fro', 'spec') if C == 256 else ():
                plant_run(root, f'w{C}_freeze-k-{keep}_s{seed}', C, seed, control='freeze', keep=keep, **common)
        plant_run(root, f'w128_it8000_s{seed}', 128, seed, max_iters=8000, n_records=n_records,
                  gap=planted_gap(128, 8000) + spread, head_gap=HEAD_SLOPE * 2 + spread)
        for lr in (3e-4, 3e-3):
            plant_run(root, f'w64_lr{lr:g}_s{seed}', 64, seed, lr=lr, n_records=n_records,
                      gap=planted_gap(64) + spread, head_gap=HEAD_SLOPE + spread)
    return root


@pytest.fixture(scope='module')
def ladder(tmp_path_factory):
    """The planted ladder, loaded, and its regime analysis."""
    root = plant_ladder(str(tmp_path_factory.mktemp('ladder')))
    runs = folders.load_runs(folders.find_run_dirs([root]), lambda msg: None)[0]
    return root, runs, regime.regime(runs)


def value(reg, name, position='all', **coords):
    """The regime table's row of a statistic at the point with these coordinates."""
    return next(r for r in reg['rows'] if r['statistic'] == name and r['position'] == position
                and all(r[k] == v for k, v in coords.items()))


def trend(reg, name, axis, position='all'):
    return next(t for t in reg['trends'] if (t['statistic'], t['axis'], t['position']) == (name, axis, position))


def test_the_axes_are_the_settings_that_vary_and_followers_are_named(ladder):
    _, runs, reg = ladder
    assert len(runs) == 30
    assert reg['axes'] == ['n_embd', 'max_iters', 'lr']
    assert reg['derived'] == {'n_head': 'n_embd', 'min_lr': 'lr'}    # 6 heads at 384 only; min_lr = lr / 10
    assert len(reg['points']) == 8 and all(len(p.runs) == 3 for p in reg['points'])
    assert {label for p in reg['points'] for label in p.controls} == {'freeze-k', 'freeze-k-spec'}
    width_lines = {t['line'] for t in reg['trends'] if t['axis'] == 'n_embd'}
    assert width_lines == {'max_iters=2000, lr=0.001'}      # the lr and length points are not on the width line


def test_planted_growth_per_doubling_of_width_is_recovered(ladder):
    reg = ladder[2]
    for C in WIDTHS:
        row = value(reg, 'gap_end', n_embd=C, max_iters=2000, lr=1e-3)
        assert row['mean'] == pytest.approx(planted_gap(C), abs=1e-9)
        assert row['lo'] <= planted_gap(C) <= row['hi'] and row['n'] == 3
    t = trend(reg, 'gap_end', 'n_embd')
    assert t['slope'] == pytest.approx(GAP_SLOPE, abs=1e-9) and t['lo'] <= GAP_SLOPE <= t['hi']
    assert t['hi'] - t['lo'] < GAP_SLOPE / 2 and t['trend'] == 'up'
    assert (t['x_from'], t['x_to'], t['n_points'], t['per']) == (32, 384, 5, 'doubling')
    assert t['crosses'] == 'yes'                   # -0.05 at width 32, +0.058 at 384, intervals on both sides
    length = trend(reg, 'gap_end', 'max_iters')
    assert length['slope'] == pytest.approx(LENGTH_SLOPE, abs=1e-9) and length['n_points'] == 2
    assert trend(reg, 'gap_end', 'lr')['trend'] == 'no clear trend'


def test_an_effect_in_one_layer_shows_in_its_position_only(ladder):
    reg = ladder[2]
    last, first = trend(reg, 'gap_end_head', 'n_embd', 'last'), trend(reg, 'gap_end_head', 'n_embd', 'first')
    assert last['slope'] == pytest.approx(HEAD_SLOPE, abs=1e-9) and last['lo'] <= HEAD_SLOPE <= last['hi']
    assert first['slope'] == pytest.approx(0, abs=1e-9) and first['trend'] == 'no clear trend'
    assert trend(reg, 'gap_end_head', 'n_embd', 'all')['slope'] == pytest.approx(HEAD_SLOPE / 4, abs=1e-9)
    assert value(reg, 'q_up_k_down', 'first', n_embd=64, lr=1e-3)['mean'] == 1.0
    assert value(reg, 'q_up_k_down', 'middle', n_embd=64, lr=1e-3)['mean'] == 0.0
    assert value(reg, 'q_up_k_down', 'all', n_embd=64, lr=1e-3)['mean'] == 0.25
    assert value(reg, 'gap_end_learned', n_embd=384)['mean'] == pytest.approx(0.1)


def test_control_effects_per_keep_and_overfitting(ladder):
    reg = ladder[2]
    for label, keep in (('freeze-k', 'fro'), ('freeze-k-spec', 'spec')):
        row = value(reg, f'd_entropy [{label}]', n_embd=256)
        assert row['mean'] == pytest.approx(D_ENTROPY[keep], abs=0.02) and row['n'] == 3
        assert value(reg, f'd_qk_spec_norm [{label}]', n_embd=256)['mean'] == pytest.approx(-0.3, abs=1e-9)
    assert not any(r['statistic'].startswith('d_') for r in reg['rows'] if r['n_embd'] != 256)
    flagged = {r['point'] for r in reg['rows'] if r['note']}
    assert flagged == {'n_embd=384'}
    assert value(reg, 'train_val_gap', n_embd=384)['mean'] == pytest.approx(0.2)


def test_claim_statistics_match_the_claims_report(ladder):
    # the regime table's (c) and (c2) over all layers are the statistics REPORT.md's claims use, run by run
    _, runs, _ = ladder
    for run in runs[:4]:
        for start in (0, run.cfg['warmup_iters']):
            mine = regime.run_stats(run, start)
            links = analyze.head_links_of_run(run, 'head', start, {})
            shape = analyze.shape_of_run(run, 'head', start, {})[ACROSS]
            for name in ('pr_k~pr_qk', 'pr_k~entropy'):
                assert mine[f'c_{name}']['all'] == pytest.approx(links[(ACROSS, name)][0], abs=1e-12)
            assert mine['c_dpr_k~dentropy']['all'] == pytest.approx(links[(CHANGES, 'pr_k~entropy')][0], abs=1e-12)
            for name in ('pr_k~entropy|scale', 'scale~entropy'):
                assert mine[f'c2_{name}']['all'] == pytest.approx(shape[name], abs=1e-12)


def test_analyze_writes_the_regime_table_trends_fig9_and_report_section(ladder, tmp_path):
    # timed in CPU seconds of this process, which a busy machine inflates far less than wall time
    root = ladder[0]
    t0, c0 = time.time(), time.process_time()
    analyze.analyze([root], out=str(tmp_path / 'out'), log=lambda msg: None)
    cpu = time.process_time() - c0
    print(f'analysis of the planted ladder (30 runs, 4 layers, 25 records, figures): {cpu:.1f} s CPU, '
          f'{time.time() - t0:.1f} s wall')
    assert cpu < 60
    names = set(os.listdir(tmp_path / 'out'))
    assert {'regime.csv', 'regime.md', 'regime_trend.csv', 'regime_trend.md', 'fig9_regime.png'} <= names
    rows = folders.read_table(str(tmp_path / 'out' / 'regime.csv'))
    assert any(r['statistic'] == 'gap_end' and r['n_embd'] == 384 for r in rows)
    text = open(tmp_path / 'out' / 'REPORT.md').read()
    section = text.split('## Regime', 1)[1].split('\n## ', 1)[0]
    assert 'differ in n_embd, max_iters, lr (n_head follows n_embd; min_lr follows lr)' in section
    assert 'Along n_embd, 32 to 384 (5 points; max_iters=2000, lr=0.001), slope per doubling' in section
    assert '| gap_end | +0.03 [' in section
    assert '- gap_end along n_embd (max_iters=2000, lr=0.001): clearly at all, first, middle, last' in section
    assert 'Overfitting (mean final val_loss - train_loss above 0.05 nats): n_embd=384.' in section
    assert '![fig9_regime.png](fig9_regime.png)' in section and 'no trend is projected beyond it' in section


def test_one_regime_point_writes_no_regime_table(tmp_path):
    for seed in (1, 2):
        plant_run(str(tmp_path / 'runs'), f'w32_s{seed}', 32, seed, gap=0.0, head_gap=0.0, n_records=8)
    runs = folders.load_runs(folders.find_run_dirs([str(tmp_path / 'runs')]), lambda msg: None)[0]
    assert regime.regime(runs) is None
    res = analyze.analyze([str(tmp_path / 'runs')], out=str(tmp_path / 'out'), log=lambda msg: None, figures=False)
    assert not any(n.startswith(('regime', 'fig9')) for n in os.listdir(tmp_path / 'out'))
    assert 'one regime point' in open(tmp_path / 'out' / 'REPORT.md').read()
    assert res['regime'] is None


def test_a_point_with_one_seed_gives_means_but_no_interval(tmp_path):
    root = plant_ladder(str(tmp_path), seeds=(1,), widths=(32, 64, 128), n_records=8)
    runs = folders.load_runs(folders.find_run_dirs([root]), lambda msg: None)[0]
    reg = regime.regime(runs)
    t = trend(reg, 'gap_end', 'n_embd')
    assert t['slope'] == pytest.approx(GAP_SLOPE, abs=1e-9) and t['trend'] == 'no interval (one seed at a point)'
    assert math.isnan(t['lo']) and math.isnan(value(reg, 'gap_end', n_embd=32, lr=1e-3)['lo'])
    assert '| gap_end | +0.03 | +0.03 |' in '\n'.join(regime.report_lines(reg))


def test_a_partial_ladder_keeps_the_long_runs_off_the_width_line(tmp_path):
    # width 128 done only at 8000 iterations: max_iters has one value per width, yet it is an axis, not a follower
    root = plant_ladder(str(tmp_path), seeds=(1, 2), widths=(32, 64), n_records=8)
    runs = folders.load_runs(folders.find_run_dirs([root]), lambda msg: None)[0]
    reg = regime.regime(runs)
    assert reg['axes'] == ['n_embd', 'max_iters', 'lr'] and reg['derived'] == {'min_lr': 'lr'}
    width = trend(reg, 'gap_end', 'n_embd')
    assert (width['x_from'], width['x_to']) == (32, 64) and width['slope'] == pytest.approx(GAP_SLOPE, abs=1e-9)
    assert not any(t['axis'] == 'max_iters' for t in reg['trends'])
