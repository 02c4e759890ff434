"""Planted tests of the one standard of evidence: the interval covers at its level with 3 to 5 seeds, every verdict is
reachable with 3 seeds in both directions, trends are fitted to seeds and refuse a zigzag, (a) needs every reference
record, and the control claims are judged per (setting, arm) at the dose that moves PR_K."""
import numpy as np
import pytest

import analyze
import stats
import test_analyze as synth
from analyze import CLAIM, Claim, judge


@pytest.mark.parametrize('n', [3, 4, 5])
def test_the_interval_covers_a_planted_mean_at_its_level(n):
    rng = np.random.default_rng(n)
    hits = sum(lo <= 0.3 <= hi for lo, hi in (stats.t_interval(rng.normal(0.3, 1.0, n))[1:3] for _ in range(2000)))
    assert hits / 2000 >= 0.93
    shares = sum(lo <= 0.3 <= hi for lo, hi in (stats.wilson(rng.binomial(40, 0.3), 40)[1:] for _ in range(2000)))
    assert shares / 2000 >= 0.93


def test_the_quantiles_match_the_tables():
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-5)
    assert stats.t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-5)
    assert stats.f_sf(3.708265, 2, 10) == pytest.approx(0.0625, abs=1e-4)   # F(2, 10): 0.0625 above 3.708
    assert stats.wilson(0, 54)[2] == pytest.approx(0.0664, abs=1e-4)
    assert [stats.wilson(k, n)[1] <= k / n <= stats.wilson(k, n)[2] for k, n in ((0, 8), (8, 8), (0, 3))] == [True] * 3


@pytest.mark.parametrize('values, verdict', [([0.50, 0.55, 0.45], 'holds'), ([-0.50, -0.55, -0.45], 'reversed'),
                                             ([0.004, -0.003, 0.001], 'no effect'), ([0.3, -0.2, 0.1], 'undecided')])
def test_each_verdict_is_reachable_with_three_seeds(values, verdict):
    claim = Claim('x', 'x', 'the value', 'seed', lambda v, view: v, sign=+1, margin=0.1)
    res = judge(claim, values)
    assert (res['verdict'], res['n']) == (verdict, 3)
    assert res['why'] == ('n = 3: the interval spans 0 and is wider than +/-0.1' if verdict == 'undecided' else '')


def test_planted_control_effects_reach_each_verdict_per_setting(tmp_path):
    shifts = {'holds': [0.30, 0.32, 0.28], 'reversed': [-0.30, -0.32, -0.28], 'no effect': [0.004, -0.003, 0.002],
              'undecided': [0.20, -0.15, 0.05]}
    for init, shift in shifts.items():
        for s, d in enumerate(shift, 1):
            kw = dict(seed=s, effect=0, noise=0, qk_init=init.replace(' ', '_'))
            synth.write_run(str(tmp_path), f'{init}_s{s}'.replace(' ', '_'), **kw)
            synth.write_run(str(tmp_path), f'{init}_freeze_s{s}'.replace(' ', '_'), control='freeze', shift=d, **kw)
    s = synth.run([tmp_path], tmp_path / 'out')
    rows = [r for r in s.tables['claims'] if r['key'] == 'e']
    assert sorted((r['scope'], r['verdict'].split(' (')[0]) for r in rows) == sorted(
        (f"qk_init={k.replace(' ', '_')}, freeze-k", k) for k in shifts)


def test_d_and_e_are_judged_per_depth_at_the_dose_that_moves_pr_k(tmp_path):
    for depth in (2, 3):
        synth.study(tmp_path, name=f'L{depth}', n_layer=depth)
        synth.study(tmp_path, name=f'L{depth}_freeze', n_layer=depth, control='freeze')
        for dose in (0.9, 0.3, 0.15):   # 0.9 leaves PR_K near the baseline's; 0.3 and 0.15 move it well below
            synth.study(tmp_path, name=f'L{depth}_shrink{dose}', n_layer=depth, control='shrink', shrink_to=dose)
    s = synth.run([tmp_path], tmp_path / 'out')
    rows = {(r['key'], r['scope']): r for r in s.tables['claims'] if r['key'] in 'de'}
    assert sorted(rows) == [(k, f'n_layer={n}, {arm}') for k, arm in (('d', 'shrink0.15-k'), ('e', 'freeze-k'))
                            for n in (2, 3)]
    assert all(r['verdict'] == 'holds' and r['n'] == 3 for r in rows.values())
    weak = analyze.judge(CLAIM['d_pr_head_rel'], [p for k, p in s.arms.items() if dict(k[1])['shrink_to'] == 0.9
                                                  and dict(k[1])['control'] == 'shrink'][0])
    assert weak['hi'] > analyze.WELL_BELOW


def test_d_is_not_measured_when_no_dose_moves_pr_k_well_below(tmp_path):
    synth.study(tmp_path, name='base')
    synth.study(tmp_path, name='weak', control='shrink', shrink_to=0.95)
    row = next(r for r in synth.run([tmp_path], tmp_path / 'out').tables['claims'] if r['key'] == 'd')
    assert row['verdict'] == 'not measured' and row['value'].startswith('no dose moves per-head PR_K well below')


def test_a_counts_a_trajectory_only_if_it_holds_from_every_reference():
    its = np.array([0, 10, 20, 50, 100, 200, 500, 1000])
    q = np.array([5, 4, 4.1, 4.5, 6.0, 5.5, 5.2, 5.1])   # above its value at 10 and 20, below its value at 100
    k = np.array([5, 4, 3.9, 3.5, 3.0, 2.9, 2.8, 2.7])
    t = analyze.Trajectory('s', {'max_iters': 1000}, 0, its[1:], q[1:], k[1:], analyze.View(window='warmup'), 3)
    assert analyze.rises_and_falls(t) == (True, True, False)
    t = t._replace(its=its, q=q, k=k, view=analyze.View())
    assert analyze.rises_and_falls(t) == (True,)


def test_a_zigzag_is_no_linear_trend_and_a_line_is_recovered_at_its_level():
    x, point = np.repeat(np.arange(5.0), 3), np.repeat(np.arange(5), 3)
    rng = np.random.default_rng(1)
    zigzag = stats.trend(x, np.where(point % 2, 1.0, -1.0) + rng.normal(0, 0.1, 15), point)
    assert zigzag['lof_p'] < 0.05 and analyze.reading(zigzag, [[0]] * 5).startswith('no linear trend')
    hits = 0
    for _ in range(1000):
        fit = stats.trend(x, 0.5 - 0.2 * x + rng.normal(0, 0.3, 15), point)
        hits += fit['lo'] <= -0.2 <= fit['hi']
    assert hits / 1000 >= 0.93


def test_the_regime_keeps_a_six_head_point_off_the_four_head_width_line_and_refuses_a_zigzag(tmp_path):
    for emb, heads, effect in ((16, 2, 1), (32, 2, -1), (64, 2, 1), (128, 2, -1), (96, 3, 1)):
        synth.study(tmp_path, name=f'e{emb}', n_embd=emb, n_head=heads, effect=effect)
    for lr, min_lr in ((3e-4, 3e-5), (3e-3, 3e-4)):   # min_lr = lr / 10 moves with lr
        synth.study(tmp_path, name=f'lr{lr}', lr=lr, min_lr=min_lr)
    s = synth.run([tmp_path], tmp_path / 'out')
    trends = {(t['axis'], t['statistic']): t for t in s.tables['regime_trend'] if t['position'] == 'all'}
    width = trends[('n_embd', 'gap_end')]
    assert width['members'] == 'base | n_embd=32 | n_embd=64 | n_embd=128' and width['line'] == 'n_head=2, lr=0.001'
    assert width['reading'].startswith('no linear trend') and width['n'] == 12
    assert trends[('lr', 'gap_end')]['members'] == 'lr=0.0003, min_lr=3e-05 | base | lr=0.003, min_lr=0.0003'
    assert 'min_lr' not in {t['axis'] for t in s.tables['regime_trend']}
