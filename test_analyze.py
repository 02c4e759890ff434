"""Tests of analyze.py: the statistics against known values, and the whole analysis on synthetic run
folders (written directly, in train.py's format) with planted, opposite and no effects."""
import errno
import json
import math
import os

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

import analyze
import folders
import plots
import report
import stats

@pytest.fixture
def synthetic_study(write_run):
    """synthetic_study(root, effect, ...): uncontrolled runs over depths x inits x seeds, and the control
    experiment (none, shrink, freeze x control_seeds) at depth control_depth, init normal."""
    return lambda root, **kw: make_study(write_run, root, **kw)


def make_study(write_run, root, effect=1, depths=(2,), inits=('normal', 'tied'), seeds=(1, 2, 3),
               control_seeds=(1, 2, 3, 4, 5), control_depth=3, **kw):
    for depth in depths:
        for init in inits:
            for seed in seeds:
                write_run(root, f'L{depth}_{init}_s{seed}', n_layer=depth, qk_init=init, seed=seed, effect=effect, **kw)
    for seed in control_seeds:
        for kind in folders.CONTROL_KINDS:
            name = f'L{control_depth}_normal' + ('' if kind == 'none' else f'_{kind}-k') + f'_s{seed}'
            write_run(os.path.join(root, 'control'), name, n_layer=control_depth, seed=seed, control=kind,
                      effect=effect, **kw)
    return root


def verdicts(result, every=False):
    """{claim key: verdict}; without every, only (a)-(e) over all records with control_keep=fro, and 'f' for
    the token-level rows (the verdict of the last)."""
    found = {c['key']: c['verdict'] for c in result['claims']}
    if every:
        return found
    short = {k: v for k, v in found.items() if k in ('a', 'b', 'c', 'd', 'e')}
    return {**short, 'f': next(v for k, v in reversed(found.items()) if k.startswith('f'))}


def claim(result, key):
    return next(c for c in result['claims'] if c['key'] == key)


def map_cell(result, key, column):
    """The robustness map's cell of a claim (by key) and a column."""
    return next(row for row in result['map'] if row['key'] == key)[column]


def edit_records(run_dir, edit):
    """Rewrite a written run's metrics.jsonl: edit(record) changes each record in place."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [json.loads(line) for line in open(path)]
    for row in rows:
        edit(row)
    with open(path, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in rows)


def set_value(run_dir, it, layer, key, value):
    def edit(row):
        if row['iter'] == it:
            if layer is None:
                row[key] = value
            else:
                row['layers'][layer][key] = value
    edit_records(run_dir, edit)


def run_analysis(root, **kw):
    kw.setdefault('figures', False)
    return analyze.analyze([str(root)], log=lambda msg: None, **kw)


# ----------------------------------------------------------------------------- statistics

def test_sign_test_exact_binomial():
    assert stats.sign_test_p(5, 5) == 1 / 32
    assert stats.sign_test_p(4, 5) == 6 / 32
    assert stats.sign_test_p(0, 5) == 1.0
    assert stats.sign_test_p(9, 10) == pytest.approx(11 / 1024)
    assert math.isnan(stats.sign_test_p(0, 0))


def test_rankdata_averages_ties():
    assert stats.rankdata([10, 20, 20, 30]).tolist() == [1, 2.5, 2.5, 4]
    assert stats.rankdata([3, 1, 2]).tolist() == [3, 1, 2]
    assert stats.rankdata([5, 5, 5]).tolist() == [2, 2, 2]


def test_spearman_known_values():
    x = np.arange(10.0)
    assert stats.spearman(x, np.exp(x)) == pytest.approx(1.0)       # monotone, not linear
    assert stats.spearman(x, -x ** 3) == pytest.approx(-1.0)        # reversed
    # by hand: ranks x = [1, 2.5, 2.5, 4, 5], y = [2, 1, 3.5, 3.5, 5] -> 7.25 / 9.5 = 29/38
    assert stats.spearman([1, 2, 2, 3, 4], [2, 1, 3, 3, 5]) == pytest.approx(29 / 38)
    assert math.isnan(stats.spearman([1, 2, 3], [4, 4, 4]))          # constant: undefined
    assert math.isnan(stats.spearman([1, 2], [1, 2]))                # too few points
    assert stats.spearman([1, 2, np.nan, 3, 4], [1, 2, 9, 3, 4]) == pytest.approx(1.0)  # NaN pairs dropped


def test_partial_drops_missing_values_and_holds_the_control_fixed():
    rng = np.random.default_rng(0)
    z, u = rng.normal(size=40), rng.normal(size=40)
    x, y = z + 0.1 * u, z + 0.1 * rng.normal(size=40)          # linked only through z
    assert stats.spearman(x, y) > 0.9 and abs(stats.partial(x, y, z)) < 0.35
    assert stats.partial(u, u + 0.01 * z, z) > 0.99             # linked beyond z
    x_gap, y_gap = x.copy(), y.copy()
    x_gap[3], y_gap[7] = np.nan, np.inf                         # a triple with a NaN or Inf is left out
    keep = np.ones(40, bool)
    keep[[3, 7]] = False
    assert stats.partial(x_gap, y_gap, z) == pytest.approx(stats.partial(x[keep], y[keep], z[keep]), abs=1e-12)
    assert math.isnan(stats.partial([1, 2, 3], [3, 1, 2], [0, 1, 0]))   # fewer than 4 triples


def test_bootstrap_constant_and_seeded():
    lo, hi = stats.bootstrap_ci([0.3] * 5)
    assert lo == pytest.approx(0.3, rel=1e-12) and hi == pytest.approx(0.3, rel=1e-12)
    x = np.random.default_rng(1).normal(size=12)
    # seeded: the percentile interval of the means of resamples drawn from BOOT_SEED, computed here by hand
    draws = np.random.default_rng(stats.BOOT_SEED).integers(0, 12, size=(stats.N_BOOT, 12))
    assert stats.bootstrap_ci(x) == pytest.approx(np.percentile(x[draws].mean(1), [2.5, 97.5]), rel=1e-12)
    assert stats.bootstrap_ci(x, seed=1) != stats.bootstrap_ci(x, seed=2)
    lo, hi = stats.bootstrap_ci(np.arange(10.0))
    assert lo < 4.5 < hi and 2 < lo and hi < 7
    assert all(math.isnan(v) for v in stats.bootstrap_ci([1.0]))     # one value: no interval


def test_paired_effect_and_verdicts():
    e = stats.paired_effect([-0.2, -0.1, -0.3, -0.15, -0.25], sign=-1)
    assert e['n_predicted'] == 5 and e['sign_p'] == 1 / 32 and e['confidence'] == 1.0
    assert e['ci_hi'] < 0 and e['mean'] == pytest.approx(-0.2)
    assert report.interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], -1, e['sign_p']) == report.HOLDS
    assert report.interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], +1, e['sign_p']) == report.FAILS
    # interval below 0 but only 4 of 5 negative (p = 6/32): mixed, not holds
    e = stats.paired_effect([-0.2, -0.1, -0.3, 0.01, -0.25], sign=-1)
    assert e['n_predicted'] == 4 and e['ci_hi'] < 0
    assert report.interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], -1, e['sign_p']) == report.MIXED
    assert report.interval_verdict(float('nan'), 0, 0, 1) == report.NOT_MEASURED
    assert report.share_verdict(9, 10) == report.HOLDS
    assert report.share_verdict(8, 10) == report.MIXED
    assert report.share_verdict(5, 10) == report.FAILS
    assert report.share_verdict(0, 0) == report.NOT_MEASURED
    assert report.combine_verdicts([report.HOLDS, report.MIXED]) == report.MIXED


# ----------------------------------------------------------------------------- the analysis

def test_planted_effect_holds(tmp_path, synthetic_study):
    res = run_analysis(synthetic_study(str(tmp_path)))
    assert verdicts(res) == {'a': 'holds', 'b': 'holds', 'c': 'holds', 'd': 'holds', 'e': 'holds',
                             'f': 'not measured'}
    assert verdicts(res, every=True)['a-warmup'] == verdicts(res, every=True)['b-warmup'] == 'holds'
    # the control none runs (depth 3) are uncontrolled runs too: 2 layers x 2 inits + 3 layers x 1 init
    assert res['summary']['trajectories'] == 2 * 2 + 3
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert report.SHARE_RULE in text and report.EFFECT_RULE in text and report.LINK_RULE in text
    assert 'weight decay 0.1' in text and 'C/2' in text
    shrink = next(e for e in res['effects'] if e['control'] == 'shrink' and e['metric'] == 'entropy')
    assert shrink['n'] == 5 and shrink['n_predicted'] == 5 and shrink['sign_p'] == 1 / 32


def test_opposite_effect_does_not_hold(tmp_path, synthetic_study):
    res = run_analysis(synthetic_study(str(tmp_path), effect=-1))
    assert verdicts(res) == {'a': 'does not hold', 'b': 'does not hold', 'c': 'does not hold',
                             'd': 'does not hold', 'e': 'does not hold', 'f': 'not measured'}


def test_no_effect_is_neither(tmp_path, synthetic_study):
    res = run_analysis(synthetic_study(str(tmp_path), effect=0))
    v = verdicts(res)
    # the control effects are inconclusive on noise; (c) finds at most a negligible link; the share claims do not
    # hold (random walks rarely keep PR_Q - PR_K > 0 everywhere), and certainly never hold
    assert v['d'] == v['e'] == 'mixed' and v['c'] != 'holds'
    assert v['a'] != 'holds' and v['b'] != 'holds'


def test_trajectory_table_values(tmp_path, write_run):
    for seed in (1, 2):
        write_run(str(tmp_path), f'L2_normal_s{seed}', seed=seed)
    res = run_analysis(tmp_path)
    rows = analyze.trajectory_rows(res['cells'], 'whole', analyze.ALL, None, print)
    assert [(r['n_layer'], r['layer']) for r in rows] == [(2, 0), (2, 1)]
    runs = res['cells'][(2, 'normal')]
    want = np.mean([r.metric('pr_q')[-1, 1] - r.metric('pr_k')[-1, 1] for r in runs])
    assert rows[1]['gap_end'] == pytest.approx(want)
    assert rows[1]['n_seeds'] == 2 and rows[1]['gap_positive_share'] == 1.0


def test_missing_runs_come_from_the_sweep_s_runs_txt(tmp_path, write_run):
    for seed in (1, 2, 3):
        write_run(str(tmp_path), f'L4_normal_s{seed}', n_layer=4, seed=seed)
    write_run(str(tmp_path), 'L4_normal_shrink-k_s1', n_layer=4, seed=1, control='shrink')
    write_run(str(tmp_path), 'L4_normal_shrink-k_s2', n_layer=4, seed=2, control='shrink', done=False)
    res = run_analysis(tmp_path)
    assert res['missing'] is None                  # no plan: nothing to check against, and it says so
    assert 'No runs.txt found' in open(os.path.join(res['out'], 'REPORT.md')).read()
    planned = ['L4_normal_s1', 'L4_normal_s2', 'L4_normal_s3', 'L4_normal_s4', 'L4_normal_shrink-k_s1',
               'L4_normal_shrink-k_s2']
    (tmp_path / 'runs.txt').write_text(''.join(f'{n} --n_layer=4 --seed={n[-1]}\n' for n in planned))
    res = run_analysis(tmp_path)
    plan = str(tmp_path / 'runs.txt')
    assert res['missing'] == [f'{plan}: 2 of 6 planned runs have no done.json: L4_normal_s4, L4_normal_shrink-k_s2']
    assert 'L4_normal_s4, L4_normal_shrink-k_s2' in open(os.path.join(res['out'], 'REPORT.md')).read()
    assert not any('L8' in m for m in res['missing'])   # no grid of its own


def test_corrupt_and_unfinished_runs_are_skipped_with_a_warning(tmp_path, write_run, log_iters):
    root = str(tmp_path)
    for seed in (1, 2):
        write_run(root, f'L2_normal_s{seed}', seed=seed)
    bad_cfg = write_run(root, 'bad_config', seed=3)
    with open(os.path.join(bad_cfg, 'config.json'), 'w') as f:
        f.write('{"n_layer": 2, "qk_')
    unfinished = write_run(root, 'unfinished', seed=4, done=False)
    truncated = write_run(root, 'truncated', seed=5)
    with open(os.path.join(truncated, 'metrics.jsonl'), 'a') as f:
        f.write('{"iter": 200, "tokens": 51')            # a kill mid-write
    broken = write_run(root, 'broken_middle', seed=6)
    lines = open(os.path.join(broken, 'metrics.jsonl')).read().split('\n')
    lines[3] = lines[3][:40]
    open(os.path.join(broken, 'metrics.jsonl'), 'w').write('\n'.join(lines))
    write_run(os.path.join(root, 'copy'), 'L2_normal_s1', seed=1)   # the same run twice
    messages = []
    res = analyze.analyze([root], figures=False, log=messages.append)
    skipped = dict(res['skipped'])
    assert 'config.json' in skipped[bad_cfg]
    assert 'no done.json' in skipped[unfinished]
    assert broken not in skipped                      # its corrupt line is left out, with a warning naming it
    assert 'duplicate' in skipped[os.path.join(root, 'copy', 'L2_normal_s1')]
    assert truncated not in skipped                   # a truncated last line is tolerated ...
    run = next(r for r in res['runs'] if r.path == truncated)
    assert run.iters[-1] == log_iters[-1]             # ... and dropped
    for path in (bad_cfg, unfinished, broken):
        assert any(path in m for m in messages), path  # every warning names its folder
    assert any('line 4' in m and broken in m for m in messages)
    assert any(truncated in m for m in messages)       # a finished run's cut last line is a record lost: said
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert bad_cfg in text and unfinished in text and f'{broken}/metrics.jsonl line 4' in text
    runs_csv = open(os.path.join(res['out'], 'runs.csv')).read()
    assert 'skipped: unfinished' in runs_csv
    assert len(res['runs']) == 4
    assert len(next(r for r in res['runs'] if r.path == broken).iters) == len(log_iters) - 1


def test_other_settings_are_kept_apart(tmp_path, write_run):
    root = str(tmp_path)
    for seed in (1, 2, 3):
        write_run(root, f'L2_normal_s{seed}', seed=seed)
    write_run(os.path.join(root, 'long'), 'L2_normal_s1', seed=1, lr=3e-4)   # same cell, another setup
    res = run_analysis(tmp_path)
    assert not res['skipped']
    assert len(res['cells'][(2, 'normal')]) == 3
    assert any('lr=0.0003' in n for n in res['setting_notes'])


def test_settings_compare_the_data_by_content_and_ignore_the_control_settings(tmp_path, write_run):
    root = str(tmp_path)
    data = dict(data_sha256='ab' * 32, data_cache='wiki.test.raw-0123456789abcdef-min10-enc1')
    spellings = ('../shared/wiki.test.raw', '/tmp/x/../shared/wiki.test.raw', 'copy/wiki_test.txt')
    for seed, spelled in enumerate(spellings, 1):   # one study started from three working directories
        write_run(root, f'L2_normal_s{seed}', seed=seed, data_file=spelled,
                  **dict(data, data_cache=data['data_cache'].replace('wiki.test.raw', os.path.basename(spelled))))
    controls = [dict(control='shrink', shrink_to=0.1), dict(control='shrink', shrink_to=0.2, shrink_iters=50),
                dict(control='freeze', control_keep='spec'), dict(control='freeze', control_target='q'),
                dict(control='shrink', shrink_to=0.14, control_scope='layer', control_layers='0')]
    for i, ctl in enumerate(controls):
        write_run(os.path.join(root, 'control'), f'c{i}', seed=1, **data, **ctl)
    write_run(os.path.join(root, 'other'), 'L2_normal_s1', data_sha256='cd' * 32,
              data_cache='wiki.test.raw-fedcba9876543210-min10-enc1')          # other text: another setting
    write_run(os.path.join(root, 'enc'), 'L2_normal_s1', **dict(data, data_cache=data['data_cache'][:-1] + '2'))
    res = run_analysis(tmp_path)
    assert not res['skipped']
    by_setting = {os.path.relpath(r.path, root): r.setting for r in res['runs']}
    assert {by_setting[f'L2_normal_s{seed}'] for seed in (1, 2, 3)} == {'A'}
    assert {by_setting[f'control/c{i}'] for i in range(len(controls))} == {'A'}
    assert len({'A', by_setting['other/L2_normal_s1'], by_setting['enc/L2_normal_s1']}) == 3
    assert len(res['cells'][(2, 'normal')]) == 3


def test_every_figure_is_written(tmp_path, write_run, synthetic_study):
    root = synthetic_study(str(tmp_path / 'runs'), seeds=(1, 2), control_seeds=(1, 2))
    write_run(os.path.join(root, 'mirror'), 'L3_normal_shrink-q_s1', n_layer=3, seed=1, control='shrink',
              control_target='q')
    res = run_analysis(root, out=str(tmp_path / 'out'), figures=True, pdf=True)
    names = set(os.listdir(tmp_path / 'out'))
    for stem in ('fig1_pr_over_training', 'fig2_pr_gap', 'fig3_entropy_and_pr', 'fig4_spectra', 'fig5_control_k',
                 'fig5_control_q'):
        assert {stem + '.png', stem + '.pdf'} <= names, stem
        assert os.path.getsize(tmp_path / 'out' / (stem + '.png')) > 1000
        with Image.open(tmp_path / 'out' / (stem + '.png')) as im:  # palette PNG, small enough to commit
            assert im.mode == 'P' and im.size[0] > 300 and len(im.getcolors(256)) > 5
    for stem in ('runs', 'trajectories', 'trajectories_head', 'trajectories_tok', 'trajectory_summary',
                 'attention_link', 'attention_link_runs', 'control', 'control_effects'):
        assert {stem + '.csv', stem + '.md'} <= names, stem
    assert 'REPORT.md' in names and not res['figure_notes']
    assert any(e['target'] == 'q' for e in res['effects'])


def test_fig5_draws_each_control_setup_in_its_own_row(tmp_path, write_run):
    # two control experiments of different depth (and width): fig5 crashed stacking their layers together
    for seed in (1, 2):
        for kind in folders.CONTROL_KINDS:
            ctl = '' if kind == 'none' else f'_{kind}-k'
            write_run(str(tmp_path / 'a'), f'L2_normal{ctl}_s{seed}', n_layer=2, seed=seed, control=kind)
            write_run(str(tmp_path / 'b'), f'L3_normal{ctl}_s{seed}', n_layer=3, seed=seed, control=kind, n_embd=16)
    one = run_analysis(tmp_path / 'a', out=str(tmp_path / 'one'), figures=True)
    both = run_analysis(tmp_path, out=str(tmp_path / 'both'), figures=True)
    assert not one['figure_notes'] and not both['figure_notes']
    with Image.open(tmp_path / 'one' / 'fig5_control_k.png') as a:
        with Image.open(tmp_path / 'both' / 'fig5_control_k.png') as b:
            assert b.size[1] > 1.8 * a.size[1]     # a row per setup
    assert {(r['setting'], r['n_layer']) for r in both['ctl_rows']} == {('A', 2), ('B', 3)}


def test_timeline_is_the_mean_over_runs_of_layer_means(tmp_path, write_run, log_iters):
    root = str(tmp_path)
    write_run(root, 'L2_normal_s1', n_layer=2, seed=1)
    write_run(root, 'L3_normal_s1', n_layer=3, seed=1, iters=log_iters[:-1], max_iters=100)  # one record fewer
    write_run(root, 'L2_normal_shrink-k_s1', n_layer=2, seed=1, control='shrink')
    res = run_analysis(root)
    rows = folders.read_table(os.path.join(res['out'], 'timeline.csv'))
    pooled = [r for r in rows if r['n_layer'] == 'all']
    assert [r['iter'] for r in pooled] == list(log_iters[:-1]) and {r['n_runs'] for r in pooled} == {2}
    def layer_mean(name, it):
        for line in open(os.path.join(root, name, 'metrics.jsonl')):
            rec = json.loads(line)
            if rec['iter'] == it:
                return np.mean([layer['pr_k'] for layer in rec['layers']])
    expected = (layer_mean('L2_normal_s1', 50) + layer_mean('L3_normal_s1', 50)) / 2
    assert next(r for r in pooled if r['iter'] == 50)['pr_k'] == pytest.approx(expected, rel=1e-9)
    shrink = [r for r in rows if r['control'] == 'shrink']
    assert len(shrink) == len(log_iters)
    assert shrink[-1]['pr_k'] == pytest.approx(layer_mean('L2_normal_shrink-k_s1', 100))


def test_clip_marks_where_the_console_cut():
    assert report.clip('short', 10) == 'short'
    assert report.clip('x' * 20, 10) == 'x' * 7 + '...'


def test_absent_data_skips_a_figure_with_a_note(tmp_path, write_run):
    write_run(str(tmp_path), 'L2_normal_s1', snapshots=False)
    res = run_analysis(tmp_path, figures=True)
    notes = ' '.join(res['figure_notes'])
    assert 'fig5_control_k' in notes and 'fig4_spectra' in notes
    assert os.path.exists(os.path.join(res['out'], 'fig1_pr_over_training.png'))
    assert 'figure skipped: fig5_control_k' in open(os.path.join(res['out'], 'REPORT.md')).read()


# ----------------------------------------------------------------------------- lenses, scale and shape, control_keep

def plant_heads(run_dir, kind, seed):
    """Per-head values in every record of a written run, with log ||W_QK^h||_2 = z ~ N(0, 1) per (layer, head)
    and u ~ N(0, 1) the shape: 'scale': PR_K falls with z and entropy follows z alone (PR_K correlates with
    entropy only through the scale); 'shape': z independent of both, entropy follows PR_K; 'both'."""
    rng = np.random.default_rng(seed)

    def edit(row):
        for layer in row['layers']:
            n = len(layer['entropy_heads'])
            z, u = rng.normal(size=n), rng.normal(size=n)
            pr_k = 4 + u if kind == 'shape' else 4 - z + 0.5 * u
            ent = {'scale': 2 - 0.5 * z, 'shape': 2 + 0.3 * u, 'both': 2 - 0.5 * z + 0.3 * u}[kind]
            layer.update(qk_spec_norm_heads=np.exp(z).tolist(), pr_k_heads=pr_k.tolist(),
                         pr_qk_heads=(pr_k / 2 + rng.normal(0, 0.1, n)).tolist(),
                         entropy_heads=(ent + rng.normal(0, 0.02, n)).tolist())
    edit_records(run_dir, edit)


@pytest.mark.parametrize('kind, verdict', [('scale', 'does not hold'), ('shape', 'holds'), ('both', 'holds')])
def test_c2_separates_the_spectrum_s_shape_from_the_logit_scale(tmp_path, write_run, kind, verdict):
    for init in ('normal', 'tied'):
        for seed in (1, 2, 3):
            run = write_run(str(tmp_path / 'runs'), f'L4_{init}_s{seed}', n_layer=4, n_head=8, n_embd=16, qk_init=init,
                            seed=seed)
            plant_heads(run, kind, seed + 10 * (init == 'tied'))
    res = run_analysis(tmp_path / 'runs')
    assert claim(res, 'c2')['verdict'] == verdict
    pooled = next(r for r in res['scale_shape'] if r['lens'] == 'head' and r['window'] == 'all records'
                  and r['scope'] == 'across heads, per checkpoint')
    if kind != 'shape':   # the raw correlation is there either way: only the partial one tells them apart
        assert pooled['pr_k~entropy'] > 0.5
    assert (pooled['pr_k~entropy|scale'] > 0.5) == (kind != 'scale')
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert report.C2_RULE in text and 'two trending series correlate' in text
    over_time = next(r for r in res['scale_shape'] if r['scope'] == analyze.OVER_TIME)
    assert {'pr_k~entropy|scale', 'pr_qk~entropy|scale', 'scale~entropy'} <= set(over_time)


def test_each_lens_reads_its_own_keys(tmp_path, write_run, log_iters):
    root = str(tmp_path / 'runs')
    runs = [write_run(root, f'L2_normal_s{seed}', seed=seed) for seed in (1, 2, 3)]
    progress = {it: math.log1p(it) / math.log1p(log_iters[-1]) for it in log_iters}
    for run in runs:   # the whole-matrix PR_Q falls, as in the cpu study; per head and token level are planted up
        edit_records(run, lambda row: [layer.update(pr_q=4 - 2 * progress[row['iter']]) for layer in row['layers']])
    res = run_analysis(root)
    assert map_cell(res, 'a', 'whole-matrix weight PR').startswith('does not hold (0/2')
    assert map_cell(res, 'a', 'per-head weight PR').startswith('holds (2/2')
    assert map_cell(res, 'a', 'token-level PR').startswith('holds (2/2')
    assert map_cell(res, 'a', 'learned part W - W(0)').startswith('not measured') and \
        'pr_dq' in map_cell(res, 'a', 'learned part W - W(0)')
    assert map_cell(res, 'c2', 'whole-matrix weight PR').startswith('-')      # no per-head value in that lens
    for run in runs:   # the learned part: 0 at iteration 0 by definition, then Q up and K down
        edit_records(run, lambda row: [layer.update(
            pr_dq=3 + 2 * progress[row['iter']] if row['iter'] else 0.0,
            pr_dk=3 - 2 * progress[row['iter']] if row['iter'] else 0.0) for layer in row['layers']])
    res = run_analysis(root)
    assert map_cell(res, 'a', 'learned part W - W(0)').startswith('holds (2/2')
    learned = [r for r in folders.read_table(os.path.join(res['out'], 'trajectories_learned.csv'))
               if r['window'] == 'all records']
    assert {r['iter_start'] for r in learned} == {1}          # iteration 0 (W = W(0)) is no measurement


def test_from_warmup_leaves_the_records_before_it_out(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    for seed in (1, 2, 3):   # PR_Q - PR_K < 0 at the records inside the warm-up (1 <= iteration < 10), > 0 after
        run = write_run(root, f'L2_normal_s{seed}', seed=seed, warmup_iters=10)
        edit_records(run, lambda row: [layer.update(pr_q=layer['pr_k'] - 1) for layer in row['layers']
                                       if 0 < row['iter'] < 10])
    res = run_analysis(root)
    assert claim(res, 'b')['verdict'] == 'does not hold' and claim(res, 'b-warmup')['verdict'] == 'holds'
    assert map_cell(res, 'b', 'from warm-up on').startswith('holds')
    warm = [r for r in folders.read_table(os.path.join(res['out'], 'trajectories.csv')) if r['window'] != 'all records']
    assert {r['iter_start'] for r in warm} == {16}             # the first record at or after warmup_iters
    assert analyze.main([root, '--from_iter=50', '--no_figures']) == 0
    warm = [r for r in folders.read_table(os.path.join(root, 'analysis', 'trajectories.csv'))
            if r['window'] != 'all records']
    assert {r['iter_start'] for r in warm} == {50}
    assert 'from iteration 50' in open(os.path.join(root, 'analysis', 'REPORT.md')).read()


def test_control_keep_gets_verdicts_of_its_own_and_softer_attention_names_the_loss(tmp_path, synthetic_study,
                                                                                   write_run):
    root = synthetic_study(str(tmp_path / 'runs'), seeds=(1, 2))
    res = run_analysis(root)
    assert claim(res, 'd-spec')['verdict'] == claim(res, 'e-spec')['verdict'] == 'not measured'
    for seed in (1, 2, 3, 4, 5):
        for kind in ('shrink', 'freeze'):
            write_run(os.path.join(root, 'control'), f'L3_normal_{kind}-k-spec_s{seed}', n_layer=3, seed=seed,
                      control=kind, control_keep='spec')
    res = run_analysis(root)
    v = verdicts(res, every=True)
    assert v['d'] == v['d-spec'] == v['e'] == v['e-spec'] == 'holds'
    assert 'not less trained' in claim(res, 'e')['qualifier']       # the paired val_loss difference is 0
    metrics = {(e['keep'], e['metric']) for e in res['effects'] if e['control'] == 'freeze'}
    assert {('fro', 'qk_spec_norm'), ('fro', 'val_loss'), ('spec', 'qk_spec_norm'), ('spec', 'entropy')} <= metrics
    for seed in (1, 2, 3, 4, 5):   # freezing now costs validation loss
        freeze = os.path.join(root, 'control', f'L3_normal_freeze-k_s{seed}')
        edit_records(freeze, lambda row: row.update(val_loss=row['val_loss'] + 0.02 + 0.001 * seed))
    res = run_analysis(root)
    assert 'also less trained' in claim(res, 'e')['qualifier'] and '+0.02' in claim(res, 'e')['qualifier']
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert 'does not hold the logit scale over training' in text and 'also less trained' in text
    assert map_cell(res, 'd', report.SPEC_COLUMN).startswith('holds')
    assert map_cell(res, 'a', report.SPEC_COLUMN).startswith('-')


def test_robustness_map_splits_by_weight_decay_when_both_are_given(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    for seed in (1, 2, 3):
        write_run(root, f'L2_normal_s{seed}', seed=seed)
    res = run_analysis(root)
    assert map_cell(res, 'a', 'no decay on W_Q, W_K').startswith('-')
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert text.index('## Claims') < text.index('## Robustness map') < text.index('## Trajectory summary')
    for seed in (1, 2):   # fewer than with decay: A stays the setting with decay
        write_run(os.path.join(root, 'nodecay'), f'L2_normal_s{seed}', seed=seed, decay_qk=False, effect=-1)
    res = run_analysis(root)
    assert map_cell(res, 'a', 'decay on W_Q, W_K').startswith('holds (2/2')
    assert map_cell(res, 'a', 'no decay on W_Q, W_K').startswith('does not hold (0/2')
    assert map_cell(res, 'a', 'whole-matrix weight PR').startswith('holds (2/2')   # the main setting: decay on
    keys = [row['key'] for row in res['map']]
    assert keys == ['a', 'b', 'c', 'c2', 'd', 'e']


# ----------------------------------------------------------------------------- bad input, short runs, figures

def test_bad_values_are_left_out_with_a_warning_naming_run_iteration_and_key(tmp_path, synthetic_study):
    root = synthetic_study(str(tmp_path / 'runs'))
    bad = [(os.path.join(root, 'L2_normal_s1'), 50, 0, 'pr_k', float('nan')),
           (os.path.join(root, 'L2_normal_s2'), 64, 1, 'entropy', float('inf')),
           (os.path.join(root, 'L2_tied_s1'), 100, 0, 'pr_q', 'abc'),
           (os.path.join(root, 'L2_tied_s2'), 32, 1, 'pr_k_heads', [1.0, None]),
           (os.path.join(root, 'control', 'L3_normal_shrink-k_s1'), 100, None, 'val_loss', float('nan'))]
    for run, it, layer, key, value in bad:
        set_value(run, it, layer, key, value)
    messages = []
    res = analyze.analyze([root], out=str(tmp_path / 'out'), figures=False, log=messages.append)
    assert verdicts(res) == {'a': 'holds', 'b': 'holds', 'c': 'holds', 'd': 'holds', 'e': 'holds',
                             'f': 'not measured'}
    for run, it, _, key, _ in bad:
        assert any(run in m and f'iteration {it}' in m and key in m for m in messages), (run, key)
        loaded = next(r for r in res['runs'] if r.path == run)
        assert it not in loaded.iters                  # that record is left out, the run kept
    text = open(tmp_path / 'out' / 'REPORT.md').read()
    claims_table = text.split('## Claims')[1].split('###')[0]
    assert 'nan' not in claims_table and 'iteration 50' in text


def test_a_damaged_snapshot_is_left_out_and_the_analysis_completes(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    for init in ('normal', 'tied'):
        for seed in (1, 2):
            write_run(root, f'L2_{init}_s{seed}', qk_init=init, seed=seed)
    damaged = os.path.join(root, 'L2_normal_s1', 'snapshots', 'qk_0000100.npz')
    with open(damaged, 'r+b') as f:
        f.truncate(os.path.getsize(damaged) // 2)
    messages = []
    res = analyze.analyze([root], out=str(tmp_path / 'out'), log=messages.append)
    assert any('L2_normal_s1' in m and 'iteration 100' in m and 'snapshot' in m for m in messages)
    assert os.path.exists(tmp_path / 'out' / 'fig4_spectra.png')     # the tied run still has its row
    assert any('iteration 100' in w for w in res['warnings'])


def test_a_damaged_snapshot_of_the_one_representative_run_leaves_fig4_to_the_next(tmp_path, write_run):
    root = str(tmp_path / 'runs')
    for seed in (1, 2):
        write_run(root, f'L2_normal_s{seed}', seed=seed)         # one init: L2_normal_s1 stands for it
    damaged = os.path.join(root, 'L2_normal_s1', 'snapshots', 'qk_0000100.npz')
    with open(damaged, 'r+b') as f:
        f.truncate(os.path.getsize(damaged) // 2)
    warnings = []
    fig = plots.plot_spectra(run_analysis(root)['cells'], warnings.append)
    assert any('L2_normal_s1' in w and 'iteration 100' in w for w in warnings)
    assert 'L2_normal_s2' in fig.axes[0].get_title()


def test_a_report_never_sits_beside_the_tables_of_another_analysis(tmp_path, synthetic_study, write_run,
                                                                     monkeypatch):
    out = tmp_path / 'out'
    run_analysis(synthetic_study(str(tmp_path / 'study'), seeds=(1, 2), control_seeds=(1, 2)), out=str(out))
    assert (out / 'control.csv').exists() and (out / 'control_effects.md').exists()
    write_run(str(tmp_path / 'plain'), 'L2_normal_s1')
    run_analysis(tmp_path / 'plain', out=str(out))
    assert not (out / 'control.csv').exists() and not (out / 'control_effects.md').exists()   # stale: removed
    before = {name: (out / name).read_bytes() for name in ('runs.csv', 'REPORT.md')}
    write_run(str(tmp_path / 'other'), 'L2_tied_s1', qk_init='tied')
    monkeypatch.setattr(plots, 'plot_pr_gap', lambda cells: 1 / 0)    # a crash halfway through
    with pytest.raises(ZeroDivisionError):
        run_analysis(tmp_path / 'other', out=str(out), figures=True)
    assert {name: (out / name).read_bytes() for name in before} == before   # nothing half-written
    assert [p.name for p in out.iterdir() if p.name.startswith('.staging')] == []


FOREIGN = ('fig1_draft.png', 'fig3_my_plot.pdf', 'attention_link_v2.csv', 'robustness_notes.md')


def test_only_files_analyze_wrote_are_replaced_or_removed(tmp_path, synthetic_study, write_run, capsys):
    out = tmp_path / 'out'
    out.mkdir()
    for name in FOREIGN:
        (out / name).write_text(f'the user\'s {name}')
    study = synthetic_study(str(tmp_path / 'study'), seeds=(1, 2), control_seeds=(1, 2))
    assert analyze.main([study, f'--out={out}', '--pdf']) == 0
    assert (out / 'control.csv').exists() and (out / 'fig5_control_k.pdf').exists()
    write_run(str(tmp_path / 'plain'), 'L2_normal_s1')
    assert analyze.main([str(tmp_path / 'plain'), f'--out={out}']) == 0
    assert not (out / 'control.csv').exists() and not (out / 'fig5_control_k.png').exists()   # ours, stale: gone
    assert all((out / name).read_text() == f'the user\'s {name}' for name in FOREIGN)      # theirs: kept
    # a folder holding a REPORT.md, control.csv and timeline.md that analyze.py did not write: refused, untouched
    theirs = tmp_path / 'theirs'
    theirs.mkdir()
    for name in ('REPORT.md', 'control.csv', 'timeline.md'):
        (theirs / name).write_text('mine')
    capsys.readouterr()
    assert analyze.main([study, f'--out={theirs}', '--no_figures']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'REPORT.md' in err and 'not written by analyze.py' in err
    assert sorted(os.listdir(theirs)) == ['REPORT.md', 'control.csv', 'timeline.md']
    assert all((theirs / name).read_text() == 'mine' for name in os.listdir(theirs))


def test_out_that_is_a_run_folder_or_the_root_is_refused(tmp_path, write_run, capsys):
    root = str(tmp_path / 'runs')
    write_run(root, 'L2_normal_s1')
    run = write_run(root, 'analysis', seed=2)                  # a run named analysis: the default --out
    before = sorted(os.listdir(run))
    assert analyze.main([root, '--no_figures']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and f'{run} is a run folder' in err and '--out' in err
    assert sorted(os.listdir(run)) == before
    assert analyze.main([root, f'--out={os.path.join(root, "L2_normal_s1")}', '--no_figures']) == 2
    assert 'is a run folder' in capsys.readouterr().err
    assert analyze.main([root, '--out=/', '--no_figures']) == 2
    assert 'root of the file system' in capsys.readouterr().err
    assert analyze.main([root, f'--out={tmp_path / "res"}', '--no_figures']) == 0   # elsewhere: both runs used
    assert '2 run folders found: 2 used' in capsys.readouterr().out


def test_out_that_is_a_file_read_only_or_full_is_one_line(tmp_path, write_run, capsys, monkeypatch):
    root = str(tmp_path / 'runs')
    write_run(root, 'L2_normal_s1')
    (tmp_path / 'a_file').write_text('x')
    assert analyze.main([root, f'--out={tmp_path / "a_file"}', '--no_figures']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'is a file, not a folder' in err
    assert analyze.main([os.path.join(root, 'L2_normal_s1', 'config.json')]) == 2   # a file as a run folder
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'a file, not a folder' in err and 'no such folder' not in err
    out = tmp_path / 'out'
    assert analyze.main([root, f'--out={out}', '--no_figures']) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for code, words in ((errno.EROFS, 'read-only'), (errno.EACCES, 'make it writable')):
        def refuse(*args, **kw):
            raise OSError(code, os.strerror(code))
        with monkeypatch.context() as m:
            m.setattr(folders.tempfile, 'mkdtemp', refuse)
            capsys.readouterr()
            assert analyze.main([root, f'--out={out}', '--no_figures']) == 2
            err = capsys.readouterr().err
            assert err.count('\n') == 1 and words in err and 'disk space' not in err
    def full(rows, out, stem, columns=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(analyze, 'write_table', full)
    assert analyze.main([root, f'--out={out}', '--no_figures']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'free some disk space' in err and str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before     # nothing already written is lost


def test_odd_folders_and_repeated_records_are_named(tmp_path, write_run):
    root = tmp_path / 'runs'
    write_run(str(root), 'L2_normal_s1')
    orphan = write_run(str(root), 'L2_normal_s2', seed=2)
    os.remove(os.path.join(orphan, 'config.json'))              # metrics.jsonl without config.json
    elsewhere = write_run(str(tmp_path / 'elsewhere'), 'L2_normal_s3', seed=3)
    os.symlink(elsewhere, root / 'linked')                       # a symlinked run folder
    repeated = write_run(str(root), 'L2_normal_s4', seed=4)
    with open(os.path.join(repeated, 'metrics.jsonl')) as f:
        lines = f.readlines()
    with open(os.path.join(repeated, 'metrics.jsonl'), 'a') as f:
        f.write(lines[5])                                        # iteration 16 twice
    messages = []
    res = analyze.analyze([str(root)], figures=False, log=messages.append)
    assert any(orphan in m and 'no config.json' in m for m in messages)
    assert any(str(root / 'linked') in m and 'symbolic link' in m and elsewhere in m for m in messages)
    assert any(repeated in m and 'iteration 16' in m and '2 records' in m for m in messages)
    assert len(res['runs']) == 2


def test_hidden_and_nested_runs_are_found(tmp_path, write_run, capsys):
    root = tmp_path / 'runs'
    outer = write_run(str(root), 'L2_normal_s1')
    hidden = write_run(str(root), '.seed2', seed=2)                       # train.py accepts the name
    nested = write_run(os.path.join(outer, 'more'), 'L2_normal_s3', seed=3)   # --out_dir inside a run's folder
    os.makedirs(root / '.git' / 'x')
    (root / '.git' / 'x' / 'config.json').write_text('{"n_layer": 2}')   # not a run: hidden, not searched
    assert analyze.main([str(root), '--no_figures']) == 0
    assert '3 run folders found: 3 used, 0 skipped' in capsys.readouterr().out
    assert sorted(folders.find_run_dirs([str(root)])) == sorted([outer, hidden, nested])


def test_short_runs_get_plumbing_checks_not_verdicts(tmp_path, synthetic_study):
    # warm-up to iteration 64 leaves one record after it (100): too short for any verdict
    res = run_analysis(synthetic_study(str(tmp_path / 'short'), seeds=(1, 2), control_seeds=(1, 2, 3),
                                       warmup_iters=64))
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert 'too short for verdicts' in text and '(plumbing check)' in text.split('## Claims')[1].split('###')[0]
    res = run_analysis(synthetic_study(str(tmp_path / 'long'), seeds=(1, 2), control_seeds=(1, 2, 3)))
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert 'too short for verdicts' not in text and 'plumbing check' not in text


def test_runs_that_end_before_warm_up_are_analysed(tmp_path, write_run, capsys):
    # two runs of 12 iterations with warm-up to 100 (train.py's default): nothing from warm-up on
    root = str(tmp_path / 'runs')
    for seed in (1, 2):
        write_run(root, f'L2_normal_s{seed}', seed=seed, iters=(0, 1, 2, 4, 8, 12), warmup_iters=100)
    assert analyze.main([root]) == 0
    text = capsys.readouterr().out
    assert 'fig8_scale_shape skipped: no record from the end of warm-up' in text
    assert 'fewer than 2 records from iteration 100 on' in text
    report_text = open(os.path.join(root, 'analysis', 'REPORT.md')).read()
    assert 'figure skipped: fig8_scale_shape' in report_text and 'fig1_pr_over_training.png' in report_text


def test_one_run_gets_the_small_sample_note_and_the_notes_count_as_the_tables(tmp_path, write_run, capsys):
    root = str(tmp_path / 'one')
    write_run(root, 'L4_normal_s1', n_layer=4, effect=-1)      # one run: (a) and (b) do not hold
    assert analyze.main([root, '--no_figures']) == 0
    assert 'note: small sample: every (depth, init) configuration has fewer than 3 seeds' in capsys.readouterr().out
    text = open(os.path.join(root, 'analysis', 'REPORT.md')).read()
    assert '**Small sample, not results:' in text
    claims = text.split('## Claims')[1].split('###')[0]
    assert claims.count('does not hold (small sample)') >= 4 and 'plumbing check' not in claims
    assert '4 (depth, init, layer) trajectories (seed means)' in text
    assert '/4 (depth, init, layer) trajectories (seed means, all records) end with both' in text
    res = run_analysis(make_study(write_run, str(tmp_path / 'three'), seeds=(1, 2, 3), control_seeds=()))
    text = open(os.path.join(res['out'], 'REPORT.md')).read()
    assert 'small sample' not in text.lower()


def test_effects_below_the_precision_shown_are_in_scientific_notation():
    effect = {'target': 'k', 'keep': 'fro', 'control': 'freeze', 'dose': None, 'n_layer': 4, 'qk_init': 'normal',
              'arm': 'freeze-k', 'metric': 'entropy', 'n': 5, 'mean': 2.1e-8,
              'ci_lo': 1.2e-8, 'ci_hi': 3.3e-8, 'n_predicted': 5, 'sign_p': 1 / 32, 'confidence': 1.0}
    e = report.effect_claim('e', [effect], 'fro', 3)
    assert '+2.10e-08 [+1.20e-08, +3.30e-08]' in e['value'] and '0.0000' not in e['value']
    assert report.signed(0.25) == '+0.2500' and report.signed(-3e-5) == '-3.00e-05' and report.signed(0.0) == '0'


def offsets(fig):
    """The additive offsets (the 2.04477 of an axis that reads '1e-6+2.04477') of every axis of a figure, drawn."""
    FigureCanvasAgg(fig).draw()
    formatters = [axis.get_major_formatter() for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]
    return [f.offset for f in formatters if getattr(f, 'offset', 0)]


def test_figures_have_no_offset_notation_and_fig1_a_readable_legend(tmp_path, synthetic_study):
    root = synthetic_study(str(tmp_path), seeds=(1, 2), control_seeds=(1, 2))
    for name in os.listdir(os.path.join(root, 'control')):   # entropies that differ in the 7th digit
        edit_records(os.path.join(root, 'control', name), lambda row: [
            layer.update(entropy=2.04477 + 1e-6 * layer['entropy']) for layer in row['layers']])
    res = run_analysis(root)
    assert offsets(plots.plot_control(res['runs'], [r for r in res['ctl_rows'] if r['target'] == 'k'], 'k')) == []
    fig = plots.plot_pr_over_training(res['cells'])
    assert len(fig.legends) == 1                                  # one legend for the figure, not one panel
    assert min(t.get_fontsize() for t in fig.legends[0].get_texts()) >= 8
    one = plots.plot_pr_over_training({(2, 'normal'): res['cells'][(2, 'normal')]})   # a single panel
    canvas = FigureCanvasAgg(one)
    canvas.draw()
    title, legend = (a.get_window_extent(canvas.get_renderer()) for a in (one._suptitle, one.legends[0]))
    assert not title.overlaps(legend) and title.x0 >= 0 and title.x1 <= one.bbox.x1   # the title reads whole


# ----------------------------------------------------------------------------- command line

def test_cli_errors_on_an_empty_folder(tmp_path, capsys, write_run):
    (tmp_path / 'empty').mkdir()
    assert analyze.main([str(tmp_path / 'empty')]) == 2
    err = capsys.readouterr().err
    assert 'no run folder' in err and str(tmp_path / 'empty') in err
    assert analyze.main([str(tmp_path / 'nowhere')]) == 2
    assert 'no such folder' in capsys.readouterr().err
    write_run(str(tmp_path / 'running'), 'L2_normal_s1', done=False)     # found, but nothing usable
    assert analyze.main([str(tmp_path / 'running'), '--no_figures']) == 1
    captured = capsys.readouterr()
    assert 'none of the 1 run folders is usable' in captured.err and 'no done.json' in captured.out


def test_cli_summary_and_subcommand(tmp_path, capsys, write_run):
    write_run(str(tmp_path / 'a'), 'L2_normal_s1')
    write_run(str(tmp_path / 'b'), 'L2_normal_s2', seed=2)
    write_run(str(tmp_path / 'b'), 'L2_normal_s3', seed=3, done=False)
    out = tmp_path / 'res'
    assert analyze.main([str(tmp_path / 'a'), str(tmp_path / 'b'), f'--out={out}', '--no_figures']) == 0
    text = capsys.readouterr().out
    assert '3 run folders found: 2 used, 1 skipped' in text and 'no done.json' in text
    assert 'missing from the planned runs: not checked' in text and f'to {out}' in text
    assert (out / 'REPORT.md').exists()
    assert analyze.main(['runs', str(tmp_path / 'a'), '--no_figures']) == 0     # the explicit subcommand
    assert (tmp_path / 'a' / 'analysis' / 'REPORT.md').exists()
