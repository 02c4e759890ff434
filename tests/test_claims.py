"""Planted tests of the one standard of evidence: the intervals cover at their level (a share too,
with the layers of a seed correlated), every verdict is reachable at the study's n, equivalence
comes first, (a) and (b) are judged after the init is forgotten, trends read a curved rise as
monotone, Holm adjusts the claims table, and the control claims are decided on the spec arm per
setting at the dose that moves PR_K."""
import itertools
import math
import types

import numpy as np
import pytest

import analyze
import exploratory
from plumbing import engine, folders, stats
import geometry
import report
import train
import test_analyze as synth
from analyze import ALL
from plumbing.engine import Claim, View, judge


@pytest.mark.parametrize('n', [3, 4, 5])
def test_the_interval_covers_a_planted_mean_at_its_level(n):
    rng = np.random.default_rng(n)
    hits = sum(lo <= 0.3 <= hi for lo,
               hi in (stats.t_interval(rng.normal(0.3, 1.0, n))[1:3] for _ in range(2000)))
    assert hits / 2000 >= 0.93


@pytest.mark.parametrize('seeds, sd', [(3, 2.0), (5, 1.0), (12, 1.0)])
def test_a_share_covers_at_its_level_when_the_layers_of_a_seed_are_correlated(seeds, sd):
    rng = np.random.default_rng(seeds)
    # a seed effect of sd on the logit scale; at sd 2 a share of 0.70
    logit = lambda p: math.log(p / (1 - p))
    share = np.mean(1 / (1 + np.exp(-(logit(0.8) + sd * rng.normal(size=200_000)))))
    hits = 0
    for _ in range(2000):
        p = 1 / (1 + np.exp(-(logit(0.8) + sd * rng.normal(size=seeds))))
        hold = (rng.random((seeds, 4)) < p[:, None]).sum(1)
        lo, hi = stats.share(hold, [4] * seeds)[1:3]
        hits += lo <= share <= hi
    assert hits / 2000 >= 0.93


@pytest.mark.parametrize('seeds, each', [(3, 4), (4, 4), (5, 2), (12, 1)])
def test_one_more_hit_in_any_seed_never_lowers_a_share_s_bounds(seeds, each):
    splits = list(itertools.product(range(each + 1), repeat=seeds))
    bounds = {h: stats.share(h, [each] * seeds)[1:3] for h in splits}
    for h in splits:
        for up in (h[:j] + (h[j] + 1,) + h[j + 1:] for j in range(seeds) if h[j] < each):
            assert bounds[up][0] >= bounds[h][0] and bounds[up][1] >= bounds[h][1], (h, up)
    # all hits hold at every shape here, 12/12 at 3 x 4 too
    assert bounds[(each,) * seeds][0] > 0.5


def test_the_quantiles_match_the_tables():
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-5)
    assert stats.t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-5)
    # F(2, 10): 0.0625 above 3.708
    assert stats.f_sf(3.708265, 2, 10) == pytest.approx(0.0625, abs=1e-4)
    assert stats.t_sf(4.302653, 2) == pytest.approx(0.025, abs=1e-6)
    assert stats.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])


@pytest.mark.parametrize('values, verdict',
                         [([0.50, 0.55, 0.45], 'holds'), ([-0.50, -0.55, -0.45], 'reversed'),
                                             ([0.004, -0.003, 0.001], 'no effect'),
                          ([0.3, -0.2, 0.1], 'undecided'),
                                             ([1.0e-7, 1.1e-7, 1.2e-7], 'no effect'),
                          ([0.01] * 3, 'no effect')])
def test_each_verdict_is_reachable_with_three_seeds_and_equivalence_comes_first(values, verdict):
    claim = Claim(key='x', text='x', stat='the value', fn=lambda v, view: v, margin=0.1)
    res = judge(claim, values)
    assert (res['verdict'], res['n']) == (verdict, 3)
    assert res['why'] == ('n = 3: the interval spans 0 and is wider than +/-0.1'
                          if verdict == 'undecided' else '')
    assert (res['p'] < 0.05) == (verdict != 'undecided')


def signs(per_seed, layers=4, parts=1):
    """Units of a trajectory claim: each seed's trajectories hold (+1), are the mirror (-1) or
    neither (0)."""
    return [np.array([[[x] * parts]] * layers, dtype=float).reshape(layers, 1, parts)
            if np.isscalar(x) else
            np.array(x, dtype=float)[:, None, None] for x in per_seed]


@pytest.mark.parametrize('seeds, layers, verdict', [([1] * 3, 4, 'holds'), ([1] * 8, 4, 'holds'),
                                                    ([-1] * 3, 4, 'reversed'),
                                                    ([0] * 3, 4, 'fails'),
                                                    ([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], 4,
                                                     'undecided')])
def test_each_verdict_of_a_share_claim_is_reachable_at_12_and_32_trajectories(
        seeds, layers, verdict):
    claim = Claim(key='x', text='x', stat='signs', fn=lambda u, view: u, unit='trajectory', ref=0.5)
    res = judge(claim, signs(seeds, layers))
    assert (res['verdict'] == verdict and res['n'] == len(seeds) * layers
            and res['seeds'] == len(seeds))
    assert res['hits'] == sum(np.sum(np.array(s) == 1) * (layers if np.isscalar(s) else 1)
                              for s in seeds)


def memory_run(q, k, seed, iters, moved=None):
    """A run of 2 layers with the given whole-matrix PR_Q, PR_K (records x layers) and dq_rel =
    dk_rel = moved."""
    cfg = synth.config(seed=seed, max_iters=int(iters[-1]), warmup_iters=int(iters[1]), n_embd=64,
                       n_head=4)
    moved = np.linspace(0, 3, len(iters)) if moved is None else moved
    m = {'pr_q': q, 'pr_k': k, 'dq_rel': np.c_[moved, moved], 'dk_rel': np.c_[moved, moved]}
    return folders.Run(f'run{seed}', cfg, {}, np.asarray(iters), m, {}, [])


def collapse_then(q_end, k_end, seed, rng, apart=1.0):
    """Both PRs collapse from 32 towards 8 -/+ apart over the first third of training, then move to
    q_end, k_end."""
    x = np.linspace(0, 1, 30)
    q, k = (np.where(x < 1 / 3, floor + (32 - floor) * np.exp(-12 * x),
                     floor + (end - floor) * (x - 1 / 3) * 1.5)
            for floor, end in ((8 + apart, q_end), (8 - apart, k_end)))
    noise = lambda: rng.normal(0, 0.05, (30, 2))
    return memory_run(q[:, None] + noise(), k[:, None] + noise(), seed, np.arange(0, 3000, 100))


def test_an_asymmetry_that_begins_after_the_collapse_holds_and_one_that_never_begins_does_not():
    rng = np.random.default_rng(0)
    apart = [collapse_then(11, 5, s, rng) for s in (1, 2, 3, 4)]
    together = [collapse_then(6, 6, s, rng, apart=0) for s in (1, 2, 3, 4)]
    post, early = View('whole', 'post'), View('whole', 'warmup')
    assert judge(ALL['a'], apart, post)['verdict'] == 'holds'
    assert judge(ALL['b'], apart, post)['verdict'] == 'holds'
    # from inside the collapse PR_Q only falls
    assert judge(ALL['a'], apart, early)['verdict'] == 'fails'
    for key in 'ab':
        assert judge(ALL[key], together, post)['verdict'] == 'fails'
    res = judge(ALL['a'], together, post)
    # PR_K falls, PR_Q too
    assert res['per_part'] == [0, 8] and [n for _, n in res['per_ref']] == [8, 8, 8]


def planted(run, it):
    """The run with a record at iteration it (interpolated) where PR_Q < PR_K in every layer."""
    its = np.union1d(run.iters, [it])
    m = {key: np.stack([np.interp(its, run.iters, v[:, i]) for i in range(2)], 1) for key,
         v in run.m.items()}
    m['pr_q'][its == it] = m['pr_k'][its == it] - 1
    return memory_run(m['pr_q'], m['pr_k'], run.seed, its, m['dq_rel'][:, 0])


def test_a_negative_gap_off_the_grid_changes_no_verdict_and_one_on_it_does():
    runs, post = [collapse_then(11, 5, s, np.random.default_rng(s))
                  for s in (1, 2, 3, 4)], View('whole', 'post')
    # the grid: every 50 iterations
    assert 1425 not in engine.on_grid(planted(runs[0], 1425)).iters
    for it, verdict, all_above in ((1425, 'holds', True), (1400, 'undecided', False)):
        found = [planted(runs[0], it)] + runs[1:]
        assert judge(ALL['b'], found, post)['verdict'] == verdict
        assert (judge(ALL['gap_share'], found, post)['est'] == 1) == all_above


def test_the_final_values_are_the_mean_of_the_last_three_records_on_the_grid():
    its, q = np.arange(0, 2100, 100), np.full((21, 2), 5.0)
    q[-1] = 8   # PR_Q rises only at the last record: by 1 over the last three
    run = memory_run(q, q - 1, 1, its)
    run.m['entropy'] = np.arange(21.0)[:, None] * [1, 1]
    assert ALL['entropy_end'].fn(run, View()) == 19 and run.final('pr_q') == 6
    assert analyze.moves(run, View('whole', 'post'))[..., 0].tolist() == [[1, 1, 1]] * 2


def test_a_counts_a_trajectory_if_it_and_its_mirror_hold_from_every_reference():
    # references: 400, 800, 1000
    its = np.array([0, 100, 200, 400, 800, 1000, 1200, 1400, 1600, 1800, 2000])
    # the init forgotten at 400
    moved = np.array([0, 0.3, 0.6, 1.2, 2, 2, 2, 2, 2, 2, 2])
    q = np.c_[[30, 20, 10, 6, 9, 5, 8, 7, 7, 7, 7], [30, 20, 10, 6, 5, 4, 4, 3, 3, 3, 3]]
    k = np.c_[[30, 20, 10, 6, 5, 4, 4, 3, 3, 3, 3], [30, 20, 10, 2, 2, 2, 3, 4, 4, 4, 4]]
    a = analyze.moves(memory_run(q, k, 1, its, moved), View('whole', 'post'))
    # PR_Q above its value at 800 in layer 0
    assert a.tolist() == [[[1, 1], [-1, 1], [1, 1]], [[-1, -1]] * 3]
    # neither; the mirror from every reference
    assert engine.outcomes(a).tolist() == [0, -1]


def test_a_zigzag_is_not_a_line_a_line_is_recovered_and_a_curved_rise_reads_monotone():
    # at: 3 units a point
    x, at, rng = np.arange(5.0), np.arange(5.0)[:, None], np.random.default_rng(1)
    zigzag = stats.trend(x, np.where(at % 2, 1.0, -1.0) + rng.normal(0, 0.1, (5, 3)))
    assert zigzag['lof_p'] < 0.05 and engine.reading(zigzag, [0] * 5).startswith('not a line')
    assert engine.reading(zigzag, [0] * 5).endswith('no monotone trend')
    # rises, then saturates
    curve = stats.trend(x, 1 - np.exp(-2 * at) + rng.normal(0, 0.02, (5, 3)))
    assert curve['lof_p'] < 0.05 and engine.reading(curve, [0] * 5).endswith('rises monotonically')
    hits = 0
    for _ in range(1000):
        fit = stats.trend(x, 0.5 - 0.2 * at + rng.normal(0, 0.3, (5, 3)))
        hits += fit['lo'] <= -0.2 <= fit['hi']
    assert hits / 1000 >= 0.93


def test_planted_control_effects_reach_each_verdict_per_setting_on_the_spec_arm(tmp_path):
    shifts = {'holds': [0.30, 0.32, 0.28], 'reversed': [-0.30, -0.32, -0.28],
              'no effect': [0.004, -0.003, 0.002],
              'undecided': [0.20, -0.15, 0.05]}
    for init, shift in shifts.items():
        for s, d in enumerate(shift, 1):
            kw = dict(seed=s, effect=0, noise=0, qk_init=init.replace(' ', '_'))
            synth.write_run(str(tmp_path), f'{init}_s{s}'.replace(' ', '_'), **kw)
            # the fro arm, beside, planted the other way
            for keep, sign in (('spec', 1), ('fro', -1)):
                synth.write_run(str(tmp_path), f'{init}_{keep}_s{s}'.replace(' ', '_'),
                                control='freeze',
                                control_keep=keep, shift=d * sign, **kw)
    s = synth.run([tmp_path], tmp_path / 'out')
    rows = [r for r in s.tables['claims'] if r['key'] == 'e']
    assert sorted((r['scope'], r['verdict'].split(' (')[0]) for r in rows) == sorted(
        (f"qk_init={k.replace(' ', '_')}, freeze-k-spec", k) for k in shifts)
    assert all(r['beside'].startswith('keep=fro (freeze-k): ') for r in rows)
    verdicts = {'holds', 'reversed', 'no effect', 'fails', 'undecided'}
    assert {r['holm'] for r in s.tables['claims'] if 'holm' in r} <= verdicts


def test_d_and_e_are_judged_per_depth_at_the_dose_that_moves_pr_k(tmp_path):
    for depth in (2, 3):
        synth.study(tmp_path, name=f'L{depth}', n_layer=depth)
        synth.study(tmp_path, name=f'L{depth}_freeze', n_layer=depth, control='freeze',
                    control_keep='spec')
        # 0.9 leaves PR_K near the baseline's; 0.3 and 0.15 move it well below
        for dose in (0.9, 0.3, 0.15):
            synth.study(tmp_path, name=f'L{depth}_shrink{dose}', n_layer=depth, control='shrink',
                        shrink_to=dose,
                        control_keep='spec')
    s = synth.run([tmp_path], tmp_path / 'out')
    rows = {(r['key'], r['scope']): r for r in s.tables['claims'] if r['key'] in 'de'}
    arms = (('d', 'shrink0.15-k-spec'), ('e', 'freeze-k-spec'))
    assert sorted(rows) == [(k, f'n_layer={n}, {arm}') for k, arm in arms for n in (2, 3)]
    assert all(r['verdict'] == 'holds' and r['n'] == 3 for r in rows.values())
    weak = judge(ALL['d_pr_head_rel'],
                 [p for k, p in s.arms.items() if dict(k[1])['shrink_to'] == 0.9
                                        and dict(k[1])['control'] == 'shrink'][0])
    assert weak['hi'] > analyze.WELL_BELOW


def test_d_is_not_measured_when_no_dose_moves_pr_k_well_below_or_there_is_no_spec_arm(tmp_path):
    synth.study(tmp_path, name='base')
    synth.study(tmp_path, name='weak', control='shrink', shrink_to=0.95, control_keep='spec')
    synth.study(tmp_path, name='fro', control='freeze')
    rows = {r['key']: r for r in synth.run([tmp_path], tmp_path / 'out').tables['claims']}
    assert rows['d']['verdict'] == 'not measured'
    assert rows['d']['value'].startswith('no dose moves per-head PR_K')
    assert rows['e']['verdict'] == 'not measured'
    assert rows['e']['value'] == 'no control_keep=spec arm'


def test_the_regime_keeps_a_six_head_point_off_the_width_line_and_refuses_a_zigzag(tmp_path):
    for emb, heads, effect in ((16, 2, 1), (32, 2, -1), (64, 2, 1), (128, 2, -1), (96, 3, 1)):
        synth.study(tmp_path, name=f'e{emb}', n_embd=emb, n_head=heads, effect=effect)
    for lr, min_lr in ((3e-4, 3e-5), (3e-3, 3e-4)):   # min_lr = lr / 10 moves with lr
        synth.study(tmp_path, name=f'lr{lr}', lr=lr, min_lr=min_lr)
    s = synth.run([tmp_path], tmp_path / 'out')
    trends = {(t['axis'], t['statistic']): t for t in s.tables['regime_trend']}
    width = trends[('n_embd', 'gap_end')]
    assert (width['members'] == 'base | n_embd=32 | n_embd=64 | n_embd=128'
            and width['line'] == 'n_head=2, lr=0.001')
    assert width['reading'].startswith('not a line') and width['n'] == 12
    learning_rate = trends[('lr', 'gap_end')]
    assert learning_rate['members'] == 'lr=0.0003, min_lr=3e-05 | base | lr=0.003, min_lr=0.0003'
    assert 'min_lr' not in {t['axis'] for t in s.tables['regime_trend']}


def token_run(cfg, iters, seed=1):
    """tok_pr_q - tok_pr_k rises then falls at the model checkpoints (the reverse elsewhere);
    tok_pr_qk ~ entropy."""
    if cfg.get('pretrained'):
        at = np.ones(len(iters), bool)
    else:
        at = np.isin(iters, sorted(geometry.model_ckpt_iters(cfg)))
    x = np.log1p(iters)
    v = -np.abs(x - np.median(x[at])) * np.where(at, 1, -1)
    heads = np.arange(4.0).reshape(1, 2, 2) + x[:, None, None]
    m = {'tok_pr_q': np.c_[v, v] + 10, 'tok_pr_k': np.c_[v, v] * 0, 'tok_pr_qk_heads': heads,
         'entropy_heads': heads}
    return folders.Run(f'run{seed}', {**cfg, 'seed': seed}, {}, iters, m, {}, [])


def test_token_claims_read_our_runs_at_their_model_checkpoints_and_a_series_at_every_record():
    cfg = synth.config(model_ckpts=8, max_iters=2000, warmup_iters=100, geom_interval=200,
                       eval_interval=200)
    ours = [token_run(cfg, np.array(sorted(train.log_iters(cfg))), s) for s in (1, 2, 3)]
    series = token_run({**cfg, 'pretrained': True}, np.array([0, 8, 64, 512, 4096]))
    study = types.SimpleNamespace(runs=ours, series=[series])
    assert engine.models(study) == {'our checkpoints': ours, 'pretrained models': [series]}
    for key, sign in (('f1-early', 1), ('f1-late', -1), ('f2', 1)):
        assert judge(ALL[key], ours)['verdict'] == 'holds' and ALL[key].fn(series, View()) == sign


def test_a_ratio_claim_is_judged_and_its_rule_printed_in_the_units_of_its_value():
    claim = Claim(key='r', text='r', stat='PR_Q / PR_K', fn=lambda v, view: math.log(v), log=True,
                  ref=1.0,
                  margin=0.05)
    res = judge(claim, [1.19, 1.26, 1.33])   # no default bound clips it to [lo, 1]
    assert res['verdict'] == 'holds' and 1.05 < res['lo'] < 1.19 and res['hi'] > 1.33
    assert judge(claim, [1.01, 0.99, 1.0])['verdict'] == 'no effect'
    assert '[0.95, 1.05], holds if it lies above 1,' in report.rule(claim, analyze.REFERENCES)


def test_a_claim_a_fork_adds_is_judged_outside_holm_unless_it_joins_the_family(
        tmp_path, monkeypatch):
    synth.study(tmp_path / 'runs', seeds=4)
    paper = synth.run([tmp_path / 'runs'], tmp_path / 'paper').tables['claims']
    # a key no fork would take: the recipe's example key may be a fork's own claim
    planted = Claim(key='planted-outside', text='(planted) a fork claim',
                    stat='Spearman of PR_Q with entropy', fn=analyze.correlation('q', 'entropy'),
                    **analyze.ACROSS)
    monkeypatch.setattr(analyze, 'CLAIMS', analyze.CLAIMS + [planted])
    monkeypatch.setitem(analyze.ALL, planted.key, planted)
    s = synth.run([tmp_path / 'runs'], tmp_path / 'fork')
    rows = {r['key']: r for r in s.tables['claims']}
    assert math.isfinite(rows[planted.key]['p']) and 'holm' not in rows[planted.key]
    assert [r.get('p_holm') for r in s.tables['claims'] if r['key'] != planted.key] == [
        r.get('p_holm') for r in paper]   # the paper's adjusted p-values do not move
    def outside(folder):
        text = (tmp_path / folder / 'REPORT.md').read_text()
        return next((line for line in text.splitlines()
                     if line.startswith('Outside the pre-registered family')), '')
    assert planted.key in outside('fork') and planted.key not in outside('paper')
    monkeypatch.setattr(analyze, 'FAMILY', analyze.FAMILY + (planted.key,))
    joined = synth.run([tmp_path / 'runs'], tmp_path / 'joined').tables['claims']
    assert 'holm' in next(r for r in joined if r['key'] == planted.key)



def test_a_section_a_fork_adds_to_exploratory_alone_is_written_and_listed_in_the_report(
        tmp_path, monkeypatch):
    synth.study(tmp_path / 'runs', seeds=2)
    def final_losses(study):
        return {'fork_losses': [{'run': r.name, 'val_loss': r.final_loss('val_loss')}
                                for r in study.runs]}
    monkeypatch.setattr(exploratory, 'EXPLORATORY', exploratory.EXPLORATORY + (final_losses,))
    s = synth.run([tmp_path / 'runs'], tmp_path / 'fork')
    assert len(s.tables['fork_losses']) == len(s.runs)
    assert (tmp_path / 'fork' / 'fork_losses.csv').exists()
    assert '- [fork_losses.md](fork_losses.md)' in (tmp_path / 'fork' / 'REPORT.md').read_text()

@pytest.mark.parametrize('direct, reading', [(0.0, 'yes'), (0.5, 'refuted')])
def test_the_spread_mediation_reads_a_planted_path_through_the_spread_and_one_beside_it(
        direct, reading):
    """Units (seed pair, layer): dH = b_l d log sigma + direct dK, b = (-0.8, -0.4) planted."""
    rng = np.random.default_rng(0)
    seeds = np.repeat(np.arange(1, 6), 4)
    arm = np.tile(np.repeat(['shrink0.1-k-spec', 'freeze-k-spec'], 2), 5)
    layer = np.tile(['0 of 2', '1 of 2'], 10)
    d_spread = np.where(arm == 'freeze-k-spec', -0.2, 0.1) + rng.normal(0, 0.01, 20)
    dK = np.where(arm == 'freeze-k-spec', 1.5, -0.7) + rng.normal(0, 0.05, 20)
    slope = np.where(layer == '0 of 2', -0.8, -0.4)
    units = {'entropy': slope * d_spread + direct * dK, 'log pr_k': dK, 'seed': seeds, 'arm': arm,
             'pair': np.repeat(np.arange(10), 2), 'layer': layer, 'log logit_std': d_spread,
             'log qk_fro_norm': d_spread + rng.normal(0, 0.05, 20)}
    fits, slopes, shares = exploratory.mediation_rows(units)
    assert [fit['mediator'] for fit in fits] == ['log logit_std', 'log qk_fro_norm']
    assert exploratory.only_through_spread(fits[0], shares).split(':')[0] == reading
    if direct == 0:
        assert [row['b1'] for row in slopes[:2]] == pytest.approx([-0.8, -0.4])
        assert fits[0]['R2_1'] == pytest.approx(1)
        assert all(row['share'] == pytest.approx(1) for row in shares
                   if row['mediator'] == 'log logit_std')
    else:
        assert fits[0]['c_lo'] > 0 and fits[0]['c_dlogPR_K'] == pytest.approx(0.5)


def test_entropy_is_best_predicted_within_layers_by_the_quantity_it_was_planted_on():
    """Entropy = a layer's intercept - log sigma; PR_K differs between layers only, so pooled
    across layers it would track entropy, and beside the layer intercepts it adds nothing."""
    rng, runs = np.random.default_rng(1), []
    level = np.array([0.0, 1.0, 2.0, 3.0])[:, None] * np.ones((1, 4, 4))
    for seed in range(1, 5):
        spread = rng.uniform(0.5, 3, (1, 4, 4))
        m = {'logit_std_heads': spread, 'entropy_heads': 3 + level - np.log(spread),
             'pr_k_heads': np.exp(level + rng.normal(0, 0.01, level.shape))}
        for key in ('qk_fro_norm', 'qk_spec_norm', 'pr_qk'):
            m[f'{key}_heads'] = rng.uniform(1, 9, (1, 4, 4))
        runs.append(types.SimpleNamespace(m=m, seed=seed, n_layer=4))
    rows = {row['predictor']: row['R2_held_out'] for row in exploratory.predictor_rows(runs)}
    assert max(rows, key=rows.get) == 'log logit_std' and rows['log logit_std'] == pytest.approx(1)
    assert rows['log pr_k'] == pytest.approx(rows['layer alone'], abs=0.05)
    assert rows['layer alone'] < 0.9
    heads = exploratory.across_heads(runs)
    assert heads[0]['mean'] == pytest.approx(-1)


def test_layer_effects_reads_where_a_planted_layer_control_moves_entropy():
    """Layer 0 controlled: its entropy falls by 0.1 nats in every seed, layer 1's moves by noise
    inside the margin, layer 2's by noise that straddles it."""
    rng = np.random.default_rng(0)
    planted = {0: lambda: -0.1 + rng.normal(0, 0.005), 1: lambda: rng.normal(0, 0.002),
               2: lambda: rng.normal(0, 0.05)}

    def run(entropy):
        return types.SimpleNamespace(n_layer=3, final=lambda key, layers: entropy[layers[0]])
    pairs = []
    for _ in range(5):
        base = [1.5, 1.6, 1.7]
        pairs.append((run([b + planted[i]() for i, b in enumerate(base)]), run(base)))
    arm = (('control', 'shrink'), ('control_layers', '0'))
    study = types.SimpleNamespace(arms={('s', arm): pairs}, label={'s': 'base'},
                                  arm_name=lambda arm: 'shrink-k')
    rows = exploratory.layer_effects(study)['entropy_layers']
    assert [r['reading'] for r in rows] == ['moves down', 'stays', 'undecided']
    assert [r['controlled'] for r in rows] == [True, False, False]
    assert rows[0]['dH'] == pytest.approx(-0.1, abs=0.01) and rows[0]['pairs'] == 5


def test_route_rows_give_a_planted_spread_route_its_share_and_the_shape_none():
    """Entropy planted as a layer's intercept - log sigma across heads (margin and kurtosis drawn
    apart from it); a control that widens layer 0's spread by e^0.1 in every seed lowers its
    entropy by 0.1 through the spread alone."""
    rng = np.random.default_rng(1)

    def run(seed, widen=0.0, control='none'):
        sigma = np.exp(rng.normal(0, 0.5, (2, 4))) * np.ones((3, 1, 1))   # records, layers, heads
        sigma[:, 0] *= math.exp(widen)
        entropy = np.array([1.0, 2.0])[:, None] - np.log(sigma)
        m = {'logit_std_heads': sigma, 'entropy_heads': entropy,
             'logit_margin_heads': rng.normal(2, 0.3, (3, 2, 4)),
             'logit_kurtosis_heads': rng.normal(-1, 0.3, (3, 2, 4))}
        return types.SimpleNamespace(m=m, n_layer=2, seed=seed, control=control, pretrained=False,
                                     setting='s')
    baselines = [run(seed) for seed in range(1, 6)]
    controlled = [run(seed, 0.1, 'shrink') for seed in range(1, 6)]
    for c, b in zip(controlled, baselines):   # the same heads, widened: a paired change
        for key in ('logit_margin_heads', 'logit_kurtosis_heads'):
            c.m[key] = b.m[key] + rng.normal(0, 0.01, b.m[key].shape)
        c.m['logit_std_heads'] = b.m['logit_std_heads'] * np.array([math.exp(0.1), 1])[:, None]
        c.m['entropy_heads'] = np.array([1.0, 2.0])[:, None] - np.log(c.m['logit_std_heads'])
    arm = (('control', 'shrink'), ('control_layers', '0'))
    study = types.SimpleNamespace(runs=baselines + controlled, label={'s': 'base'},
                                  arms={('s', arm): list(zip(controlled, baselines))},
                                  arm_name=lambda arm: 'shrink-k')
    tables = exploratory.route_rows(study)
    assert [fit['R2_held_out'] > 0.99 for fit in tables['entropy_routes_fit']] == [True, True]
    spread, shape = tables['entropy_routes']
    assert spread['dH'] == pytest.approx(-0.1, rel=1e-6)
    assert spread['reading'] == 'carries' and spread['share'] == pytest.approx(1, abs=0.05)
    assert shape['reading'] == 'carries none'


def test_layer_mediation_finds_a_planted_path_beside_the_spread():
    """Per (seed pair, layer): dH = b_l d log sigma + c d log PR_K with b = (-1, -0.5) and c = -0.3
    planted; the fit with m = log sigma gives c back, its interval excluding 0."""
    rng = np.random.default_rng(2)

    def run(seed, values):
        m = {f'{key}_heads': np.ones((3, 2, 4)) * value[:, None] for key, value in values.items()}
        return types.SimpleNamespace(m=m, n_layer=2, seed=seed)
    pairs = []
    for seed in range(1, 6):
        d_sigma, d_pr = rng.normal(0, 0.2, 2), rng.normal(0, 0.2, 2)
        dH = np.array([-1.0, -0.5]) * d_sigma - 0.3 * d_pr + rng.normal(0, 0.002, 2)
        base = {'entropy': np.ones(2), 'logit_std': np.ones(2), 'pr_k': np.ones(2) * 4,
                'logit_margin': np.ones(2), 'logit_kurtosis': np.zeros(2)}
        moved = dict(base, entropy=1 + dH, logit_std=np.exp(d_sigma), pr_k=4 * np.exp(d_pr))
        pairs.append((run(seed, moved), run(seed, base)))
    arm = (('control', 'shrink'), ('control_layers', '0'))
    study = types.SimpleNamespace(arms={('s', arm): pairs}, label={'s': 'base'},
                                  arm_name=lambda arm: 'shrink-k')
    spread = exploratory.layer_mediation(study)['entropy_layer_mediation'][0]
    assert spread['mediator'] == 'log logit_std' and spread['units'] == 10
    assert spread['c_dlogPR_K'] == pytest.approx(-0.3, abs=0.02) and spread['reading'] == 'beyond m'


def test_two_texts_are_compared_claim_by_claim_with_a_welch_interval(tmp_path):
    values, others = np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 4.0, 6.0])
    var, var_other = values.var(ddof=1) / 4, others.var(ddof=1) / 3
    df = (var + var_other) ** 2 / (var ** 2 / 3 + var_other ** 2 / 2)
    half = stats.t_quantile(0.975, df) * math.sqrt(var + var_other)
    assert exploratory.welch(values, others) == pytest.approx((-1.5, -1.5 - half, -1.5 + half))
    assert [exploratory.kept(*pair) for pair in (('holds', 'holds'), ('holds', 'reversed'),
                                             ('holds', 'undecided'))] == [
        'kept', 'changed', 'undecided']
    synth.study(tmp_path / 'runs', 3, 'a', data_sha256='a' * 64)
    synth.study(tmp_path / 'runs', 3, 'b', data_sha256='b' * 64)
    (row,) = synth.run([tmp_path / 'runs'], tmp_path / 'out').tables['across_texts']
    assert row['claim'] == 'b' and row['verdicts'] in ('kept', 'changed', 'undecided')
    synth.study(tmp_path / 'runs', 3, 'c', data_sha256='a' * 64, lr=3e-3)   # not the text alone
    assert 'across_texts' not in synth.run([tmp_path / 'runs'], tmp_path / 'out2').tables
