"""Tests of the claims that can fail: (c) on planted runs whose PR_K and entropy trend with and without a link,
(c2) in one correlation family and on records past the near-uniform start, and the dose-response control (the
achieved change, the slope and its interval, the fit with the logit scale, the dose that decides (d)). Run folders
are written with conftest.py's make_run and their records edited in place."""
import json
import math
import os

import numpy as np
import pytest

import analyze
import folders
import plots
import report
import stats

ITERS = (0, 1, 2, 4, 8, 16, 32, 50, 64, 100)     # conftest's LOG_ITERS; warm-up ends at 10


def edit_records(run_dir, edit):
    """Rewrite a written run's metrics.jsonl: edit(index, record) changes each record in place."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [json.loads(line) for line in open(path)]
    for i, row in enumerate(rows):
        edit(i, row)
    with open(path, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in rows)


def run_analysis(root, **kw):
    kw.setdefault('figures', False)
    return analyze.analyze([str(root)], log=lambda msg: None, **kw)


def claim(res, key):
    return next(c for c in res['claims'] if c['key'] == key)


# ----------------------------------------------------------------------------- (c): trends without a link

def plant_trends(run_dir, linked, seed, n_layer=4, n_head=4):
    """Per head, PR_K, PR_QK and entropy that all fall over training and slow down together (1 - exp(-it / 20) at
    log-spaced records), each head with its own offset and noise. linked: PR_QK and entropy follow the head's PR_K;
    else each series has its own. The layer values are the head means."""
    rng = np.random.default_rng(seed)
    f = 1 - np.exp(-np.array(ITERS) / 20)[:, None, None]          # (records, 1, 1)
    own = lambda: rng.normal(0, 0.1, (1, n_layer, n_head)) + rng.normal(0, 0.2, (len(ITERS), n_layer, n_head))
    k = 4 - 2 * f + own()
    qk = 2 + 0.5 * (k - 4) if linked else 2 - f + 0.5 * own()
    ent = 1.5 + 0.2 * (k - 4) if linked else 1.5 - 0.4 * f + 0.2 * own()

    def edit(i, row):
        for layer, rec in enumerate(row['layers']):
            rec.update(pr_k_heads=k[i, layer].tolist(), pr_qk_heads=qk[i, layer].tolist(),
                       entropy_heads=ent[i, layer].tolist(), pr_k_head=float(k[i, layer].mean()),
                       pr_k=float(2 * k[i, layer].mean()), pr_qk=float(qk[i, layer].mean()),
                       entropy=float(ent[i, layer].mean()))
    edit_records(run_dir, edit)


def trend_study(root, write_run, linked):
    for init in ('normal', 'tied'):
        for seed in range(1, 7):
            run = write_run(root, f'L4_{init}_s{seed}', n_layer=4, n_head=16, n_embd=16, qk_init=init, seed=seed)
            plant_trends(run, linked, seed + 100 * (init == 'tied'), n_head=16)
    return run_analysis(root)


def test_c_does_not_hold_when_pr_k_and_entropy_trend_without_a_link(tmp_path, write_run):
    res = trend_study(str(tmp_path / 'runs'), write_run, linked=False)
    c = claim(res, 'c')
    assert c['verdict'] == 'does not hold', c['value']
    # the trends alone make the within-run correlations high, of levels and of changes between records: a test on
    # them would have said holds
    pooled = res['views'][('head', analyze.FROM_WARMUP, None)]['link_rows'][-1]
    assert pooled['pr_k~entropy'] > 0.8 and pooled['pr_k~entropy_lo'] > 0.5
    assert pooled['dpr_k~dentropy'] > 0.5
    tests = [t for t in res['link_tests'] if (t['lens'], t['window']) == ('head', analyze.FROM_WARMUP)]
    assert {t['scope'] for t in tests} == {analyze.ACROSS, analyze.CHANGES}
    assert all(t['ci_hi'] < report.LINK_MARGIN for t in tests if t['link'] in report.C_LINKS)
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert report.LINK_RULE in text and '## Tests of (c): across heads' in text


def test_c_holds_when_entropy_follows_each_head_s_pr_k(tmp_path, write_run):
    res = trend_study(str(tmp_path / 'runs'), write_run, linked=True)
    c = claim(res, 'c')
    assert c['verdict'] == 'holds', c['value']
    assert '12/12 runs > 0' in c['value'] and 'records from iteration 10 (60 in all' in c['statistic']
    tests = [t for t in res['link_tests'] if (t['lens'], t['window']) == ('head', analyze.FROM_WARMUP)]
    assert all(t['verdict'] == 'holds' and t['share_positive'] > 0.9 for t in tests)


def test_c_across_heads_is_the_spearman_of_one_checkpoint(tmp_path, write_run):
    run = write_run(str(tmp_path), 'L2_normal_s1', n_layer=2, n_head=4, n_embd=16)
    plant_trends(run, False, 7, n_layer=2)
    loaded = folders.load_run(run)
    found = analyze.head_links(loaded, 'head')
    its, levels = found[analyze.ACROSS]
    H, K = (loaded.heads[key][5].ravel() for key in ('entropy_heads', 'pr_k_heads'))
    assert its[5] == 16 and levels['pr_k~entropy'][5] == pytest.approx(stats.spearman(K, H), abs=1e-12)
    its, changes = found[analyze.CHANGES]
    dH, dK = (np.diff(loaded.heads[key][5:7], axis=0).ravel() for key in ('entropy_heads', 'pr_k_heads'))
    assert its[5] == 16 and changes['pr_k~entropy'][5] == pytest.approx(stats.spearman(dK, dH), abs=1e-12)


# ----------------------------------------------------------------------------- (c2): one family, its window

def test_a_partial_of_ranks_is_biased_by_a_pure_scale_link_and_the_pearson_partial_is_not():
    rng = np.random.default_rng(0)
    pearson, ranks = [], []
    for _ in range(400):   # 16 heads: PR_K and entropy both follow the log scale z, and nothing else links them
        z = rng.normal(size=16)
        x, y = -z + 0.5 * rng.normal(size=16), -0.5 * z + 0.3 * rng.normal(size=16)
        pearson.append(stats.partial(x, y, z))
        ranks.append(stats.partial(*(stats.rankdata(v) for v in (x, y, z))))
    assert abs(np.mean(pearson)) < 0.025 and np.mean(ranks) > 0.05


def plant_scale_shape(run_dir, seed, early_link):
    """Per head, log ||W_QK^h||_2 = z and PR_K, entropy: before warm-up (iterations below 10) attention is near
    uniform (entropy_norm 0.999) and, with early_link, its tiny per-head differences follow PR_K beyond the scale;
    from warm-up on entropy follows the scale alone."""
    rng = np.random.default_rng(seed)

    def edit(i, row):
        for rec in row['layers']:
            z, u = rng.normal(size=4), rng.normal(size=4)
            pr_k = 4 - z + 0.5 * u
            early = row['iter'] < 10
            ent = 3 + 1e-3 * (u if early_link else rng.normal(size=4)) if early else 2 - 0.5 * z + 0.1 * \
                rng.normal(size=4)
            rec.update(qk_spec_norm_heads=np.exp(z).tolist(), pr_k_heads=pr_k.tolist(),
                       pr_qk_heads=(pr_k / 2).tolist(), entropy_heads=ent.tolist(),
                       entropy_norm=0.999 if early else 0.7)
    edit_records(run_dir, edit)


def test_c2_headline_is_not_carried_by_near_uniform_records(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    for seed in range(1, 7):
        run = write_run(root, f'L4_normal_s{seed}', n_layer=4, n_head=4, n_embd=16, seed=seed)
        plant_scale_shape(run, seed, early_link=True)
    res = run_analysis(root)
    c2 = claim(res, 'c2')
    assert c2['verdict'] == 'does not hold', c2['value']
    assert 'records from iteration 10 (30 in all, 0 with near-uniform attention' in c2['statistic']
    everything = res['views'][('head', analyze.ALL, None)]
    assert everything['near_uniform'] == (6 * 5, 6 * 10)     # 5 of each run's 10 records are before warm-up
    assert everything['shape']['pr_k~entropy|scale'] > 0.3   # ... and would carry the all-records mean
    assert report.map_cell(res, 'c2', 'per-head weight PR').startswith(('holds', 'mixed'))   # the other window
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert report.C2_RULE in text and 'Pearson for both' in text


def test_c2_raw_and_partial_are_both_pearson(tmp_path, write_run):
    run = write_run(str(tmp_path), 'L4_normal_s1', n_layer=4, n_head=4, n_embd=16)
    plant_scale_shape(run, 3, early_link=False)
    loaded = folders.load_run(run)
    per_record = analyze.across_heads(loaded, 'head')
    H, S, K = (loaded.heads[key][7].ravel() for key in ('entropy_heads', 'qk_spec_norm_heads', 'pr_k_heads'))
    assert per_record[7]['pr_k~entropy'] == pytest.approx(np.corrcoef(K, H)[0, 1], abs=1e-12)
    assert per_record[7]['pr_k~entropy|scale'] == pytest.approx(stats.partial(K, H, np.log(S)), abs=1e-12)
    assert per_record[7]['scale~entropy'] == pytest.approx(np.corrcoef(np.log(S), H)[0, 1], abs=1e-12)


# ----------------------------------------------------------------------------- the dose response

DOSES = (0.5, 0.3, 0.1)


def dose_study(root, write_run, achieved, entropy_of, scale_of, seeds=(1, 2, 3, 4, 5), keeps=('fro',)):
    """A control experiment at depth 2: per seed a baseline and per keep and dose a shrink run, whose final per-head
    PR_K is the baseline's times (1 + achieved(dose, rng)), log qk_spec_norm moves by scale_of(dPR, rng) and
    entropy by entropy_of(dose, dPR, d log scale, rng) (the layer values of every record, so that they are final;
    rng is the seed's)."""
    base = {'pr_k_head': 3.0, 'qk_spec_norm': 0.05, 'entropy': 2.0}
    for seed in seeds:
        rng = np.random.default_rng(100 + seed)
        offset = rng.normal(0, 0.1)                            # the seed's own level, shared by its arms
        runs = [(write_run(root, f'L2_normal_s{seed}', seed=seed), 0.0, 0.0, 0.0)]
        for keep in keeps:
            for dose in DOSES:
                name = f'L2_normal_shrink{dose:g}-k' + ('-spec' if keep == 'spec' else '') + f'_s{seed}'
                run = write_run(root, name, seed=seed, control='shrink', shrink_to=dose, control_keep=keep)
                d_pr = base['pr_k_head'] * achieved(dose, rng)
                d_log = scale_of(d_pr, rng)
                runs.append((run, d_pr, d_log, entropy_of(dose, d_pr, d_log, rng)))
        for run, d_pr, d_log, d_ent in runs:
            values = {'pr_k_head': base['pr_k_head'] + offset + d_pr, 'entropy': base['entropy'] + offset + d_ent,
                      'qk_spec_norm': base['qk_spec_norm'] * math.exp(offset + d_log)}
            edit_records(run, lambda i, row: [layer.update(values) for layer in row['layers']])
    return root


def test_student_t_quantiles_match_tables():
    for df, t in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (30, 2.0423)):
        assert stats.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert stats.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)


def test_fit_intervals_cover_the_planted_coefficients_at_their_level():
    # 5 seeds x 3 doses, the rows of a seed sharing its level: the jackknife-t interval should hold the planted slope
    # in about 95% of the draws (a percentile bootstrap of seeds held it in about 84%)
    rng = np.random.default_rng(0)
    covered = np.zeros(2)
    for _ in range(300):
        x = 3 * (-(1 - np.tile(DOSES, 5)) * 0.8 + rng.normal(0, 0.05, 15))
        z = rng.normal(0, 0.1, 15)
        y = np.repeat(rng.normal(0, 0.01, 5), 3) + 0.2 * x - 0.5 * z + rng.normal(0, 0.01, 15)
        seeds = np.repeat(np.arange(5), 3)
        one, two = stats.fit_groups(y, x, seeds), stats.fit_groups(y, np.column_stack([x, z]), seeds)
        covered += [one['lo'][1] < 0.2 < one['hi'][1], two['lo'][1] < 0.2 < two['hi'][1]]
    assert ((covered / 300 > 0.9) & (covered / 300 < 0.99)).all(), covered / 300
    assert np.isnan(stats.fit_groups(y[:6], x[:6], seeds[:6])['lo']).all()        # 2 seeds: no interval
    assert np.isnan(stats.fit_groups(y, np.column_stack([x, x]), seeds)['coef']).all()   # collinear


def test_the_planted_slope_is_recovered_within_its_interval(tmp_path, write_run, monkeypatch):
    # entropy falls 0.2 nats per unit of per-head PR_K taken off, and 0.5 per unit of log scale added; the scale
    # moves independently of the PR change
    root = dose_study(str(tmp_path / 'runs'), write_run,
                      achieved=lambda dose, rng: -(1 - dose) * 0.8 + rng.normal(0, 0.05),
                      scale_of=lambda d_pr, rng: rng.normal(0, 0.03),
                      entropy_of=lambda dose, d_pr, d_log, rng: 0.2 * d_pr - 0.5 * d_log + rng.normal(0, 0.01),
                      keeps=('fro', 'spec'))
    drawn = []

    def save(fig, out, stem, pdf):   # every figure is made, only fig10 is drawn (drawing them all takes minutes)
        drawn.append(stem)
        return real_save(fig, out, stem, pdf) if stem == 'fig10_dose_response' else []
    real_save = plots.save_figure
    monkeypatch.setattr(plots, 'save_figure', save)
    res = run_analysis(root, figures=True)
    assert 'fig10_dose_response' in drawn and not res['figure_notes']
    fits = {f['keep']: f for f in res['dose_fits']}
    assert set(fits) == {'fro', 'spec'} and all(f['follows'] == 'follows' for f in fits.values())
    fit = fits['fro']
    assert fit['n_points'] == 15 and fit['n_seeds'] == 5 and fit['doses'] == '0.1 0.3 0.5'
    assert fit['slope_lo'] < 0.2 < fit['slope_hi'] and fit['slope_hi'] - fit['slope_lo'] < 0.1
    assert fit['pr_coef_lo'] < 0.2 < fit['pr_coef_hi'] and fit['scale_coef_lo'] < -0.5 < fit['scale_coef_hi']
    dose = {(r['keep'], r['dose']): r for r in res['dose']}
    assert dose[('fro', 0.1)]['d_pr_head'] == pytest.approx(3.0 * -0.72, abs=0.1)
    assert dose[('fro', 0.1)]['d_pr_ctl_head_rel'] == pytest.approx(-0.72, abs=0.04)
    assert dose[('fro', 0.5)]['well_below'] and dose[('fro', 0.5)]['pr_head_none'] == pytest.approx(3.0, abs=0.2)
    assert os.path.isfile(os.path.join(res['out'], 'fig10_dose_response.png'))
    assert os.path.isfile(os.path.join(res['out'], 'control_dose.md'))
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert report.FIT_RULE in text and 'fig10_dose_response.png' in text


def test_an_entropy_effect_carried_by_the_logit_scale_does_not_follow_pr_k(tmp_path, write_run):
    # the scale grows as PR_K is taken off (as with control_keep=fro) and entropy follows the scale alone: the slope
    # on the PR change alone is there, the PR coefficient once the scale is in the fit is not
    root = dose_study(str(tmp_path / 'runs'), write_run,
                      achieved=lambda dose, rng: -(1 - dose) * 0.8 + rng.normal(0, 0.05),
                      scale_of=lambda d_pr, rng: -0.3 * d_pr + rng.normal(0, 0.03),
                      entropy_of=lambda dose, d_pr, d_log, rng: -0.5 * d_log + rng.normal(0, 0.01))
    fit = run_analysis(root)['dose_fits'][0]
    assert fit['slope_lo'] < 0.15 < fit['slope_hi'] and fit['slope_lo'] > 0   # -0.5 x -0.3 per unit of PR
    assert fit['pr_coef_lo'] < 0 < fit['pr_coef_hi'] and fit['scale_coef_lo'] < -0.5 < fit['scale_coef_hi']
    assert fit['follows'] == 'undecided'


def test_d_comes_from_the_strongest_dose_that_moves_pr_k_well_below_the_baseline(tmp_path, write_run):
    # 0.5 takes 10% off (not well below) with softer attention; 0.3 takes 30% off with none; 0.1 takes 60% off and
    # sharpens attention: (d) is 0.1's
    achieved = {0.5: -0.1, 0.3: -0.3, 0.1: -0.6}
    effect = {0.5: +0.05, 0.3: 0.0, 0.1: -0.05}
    root = dose_study(str(tmp_path / 'runs'), write_run,
                      achieved=lambda dose, rng: achieved[dose] + rng.normal(0, 0.01),
                      scale_of=lambda d_pr, rng: 0.0,
                      entropy_of=lambda dose, d_pr, d_log, rng: effect[dose] + rng.normal(0, 0.005))
    res = run_analysis(root)
    d = claim(res, 'd')
    assert d['verdict'] == 'holds' and d['value'].startswith('shrink0.1-k:'), d['value']
    rows = {r['dose']: r for r in res['dose']}
    assert [rows[x]['well_below'] for x in DOSES] == [False, True, True]
    assert [rows[x]['verdict'] for x in DOSES] == ['does not hold', 'mixed', 'holds']
    assert claim(res, 'd-spec')['verdict'] == 'not measured'      # no spec runs


def test_d_is_not_measured_when_no_dose_moves_pr_k_well_below(tmp_path, write_run):
    root = dose_study(str(tmp_path / 'runs'), write_run, achieved=lambda dose, rng: -0.1 + rng.normal(0, 0.01),
                      scale_of=lambda d_pr, rng: 0.0,
                      entropy_of=lambda dose, d_pr, d_log, rng: -0.05 + rng.normal(0, 0.005))
    d = claim(run_analysis(root), 'd')
    assert d['verdict'] == 'not measured'
    assert 'no shrink dose moves per-head PR_K well below' in d['value'] and '0.1: -10%' in d['value']


def test_k_spec_norm_is_the_top_singular_value_of_each_head_from_the_snapshots(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    rng = np.random.default_rng(0)
    for name, control in (('L2_normal_s1', 'none'), ('L2_normal_freeze-k_s1', 'freeze')):
        run = write_run(root, name, control=control)
        for it in ITERS[-3:]:                                  # the final records: snapshots of known weights
            q, k = rng.normal(0, 0.02, (2, 2, 8, 8)).astype(np.float32)
            np.savez(os.path.join(run, 'snapshots', f'qk_{it:07d}.npz'), q=q, k=k, n_head=2)
    res = run_analysis(root)
    row = res['ctl_rows'][0]
    expected = {}
    for name in ('L2_normal_s1', 'L2_normal_freeze-k_s1'):
        tops = []
        for it in ITERS[-3:]:
            with np.load(os.path.join(root, name, 'snapshots', f'qk_{it:07d}.npz')) as z:
                k = z['k'].astype(np.float64)
            tops.append(np.mean([np.linalg.svd(w[h * 4:(h + 1) * 4], compute_uv=False)[0] for w in k for h in (0, 1)]))
        expected[name] = np.mean(tops)
    assert row['k_spec_norm'] == pytest.approx(expected['L2_normal_freeze-k_s1'], rel=1e-9)
    assert row['k_spec_norm_none'] == pytest.approx(expected['L2_normal_s1'], rel=1e-9)
    assert row['d_k_spec_norm'] == pytest.approx(expected['L2_normal_freeze-k_s1'] - expected['L2_normal_s1'],
                                                 rel=1e-9)
