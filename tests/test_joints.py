"""Planted tests of the analysis' joints, where a table is assembled from parts that are each right:
a controlled run meets the baseline of its own seed and setting, a robustness-map cell is the
claim judged alone in its view (whatever order the lenses come in), and a figure draws the values
its axis labels name (plots.TRANSFORMS)."""
import csv
import dataclasses
import json
import math
import os
import re

import numpy as np

import analyze
import plots
from plumbing import engine, stats
import test_analyze as synth
from analyze import ALL
from plumbing.engine import View

LAYER_MEAN = {'pr_q', 'pr_k', 'tok_pr_q', 'tok_pr_k', 'pr_dq', 'pr_dk'}   # logged as 2 x head mean


def set_heads(layer, key, values):
    """A layer's per-head list of key and its layer values, as test_analyze.layer logs them."""
    values = [float(v) for v in values]
    layer[f'{key}_heads'] = values
    if key in LAYER_MEAN:
        layer[f'{key}_head'] = float(np.mean(values))
        layer[key] = 2 * layer[f'{key}_head']
    else:
        layer[key] = float(np.mean(values))


def replant(path, fn):
    """A run folder's metrics.jsonl rewritten: fn(iteration, layer index, layer) edits each layer of
    each record; the records as written."""
    file = os.path.join(path, 'metrics.jsonl')
    recs = [json.loads(line) for line in open(file)]
    for rec in recs:
        for i, lay in enumerate(rec['layers']):
            fn(rec['iter'], i, lay)
    open(file, 'w').write(''.join(json.dumps(r) + '\n' for r in recs))
    return recs


def same(x, y):
    """Two judge() results (or parts of them) equal, NaN equal to NaN."""
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(same, x, y))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


# -------------------------------------------------------------- a control pairs by seed and setting
# the final entropy of each seed's baseline, and each controlled run's change from its own baseline
BASE = {'normal': (1.0, 1.6, 2.2), 'orthogonal': (1.3, 0.7, 1.9)}
CHANGE = {('normal', 'freeze'): (0.10, 0.13, 0.19), ('normal', 'shrink'): (-0.21, -0.25, -0.30),
          ('orthogonal', 'freeze'): (0.31, 0.24, 0.28),
          ('orthogonal', 'shrink'): (-0.05, -0.11, -0.02)}


def entropy_at(value):
    """Every head's entropy at value in every record."""
    return lambda it, i, lay: set_heads(lay, 'entropy', [value] * len(lay['entropy_heads']))


def test_each_controlled_run_is_paired_with_the_baseline_of_its_own_seed_and_setting(tmp_path):
    """Baselines whose final entropy differs by seed and setting, each controlled run (freeze and
    shrink0.2, spec arm) at a planted change from its own seed's: control_dose's entropy change,
    the (d), (e) claim rows and their map cells are exactly the planted per-pair changes and their
    t interval."""
    for init, bases in BASE.items():
        for seed, base in enumerate(bases, 1):
            kw = dict(seed=seed, effect=0, noise=0, link=0, qk_init=init)
            replant(synth.write_run(str(tmp_path), f'{init}_s{seed}', **kw), entropy_at(base))
            for kind, dose in (('freeze', {}), ('shrink', {'shrink_to': 0.2})):
                path = synth.write_run(str(tmp_path), f'{init}_{kind}_s{seed}', control=kind,
                                       control_keep='spec', **dose, **kw)
                replant(path, entropy_at(base + CHANGE[init, kind][seed - 1]))
    s = synth.run([tmp_path], tmp_path / 'out')
    assert len(s.arms) == 4 and not s.skipped
    claims = {(r['key'], r['scope']): r for r in s.tables['claims'] if r['key'] in ('d', 'e')}
    dose = {(r['setting'], r['arm']): r for r in s.tables['control_dose']}
    cells = {(c['key'], c['setting'], c['arm']): c for c in s.tables['cells'] if c['keep']}
    assert len(claims) == 4 and len(dose) == 4
    for (setting, arm), pairs in s.arms.items():
        init, kind = json.loads(setting)['qk_init'], dict(arm)['control']
        planted = CHANGE[init, kind]
        est, lo, hi, n = stats.t_interval(planted)
        where, key = (s.label[setting], s.arm_name(arm)), 'e' if kind == 'freeze' else 'd'
        shown = engine.shown(ALL['d_entropy'], {'n': n, 'est': est, 'lo': lo, 'hi': hi})
        assert (dose[where]['n'], dose[where]['entropy']) == (3, shown), where
        row = claims[(key, ', '.join(where))]
        assert row['n'] == 3, where
        assert np.allclose([row['est'], row['lo'], row['hi']], [est, lo, hi], rtol=0, atol=1e-9), (
            where, (row['est'], row['lo'], row['hi']), (est, lo, hi))
        assert np.allclose(cells[(key, *where)]['values'], planted, rtol=0, atol=1e-9), where
        assert [(c.seed, b.seed) for c, b in pairs] == [(1, 1), (2, 2), (3, 3)], where
        assert all(b.setting == setting and b.control == 'none' for _, b in pairs), where


# the change of each freeze arm, one setting with two families (control_interval 1 and 5)
TWINS = {(1, 'spec'): (-0.10, -0.12, -0.15), (1, 'fro'): (0.30, 0.33, 0.34),
         (5, 'spec'): (-0.20, -0.21, -0.25), (5, 'fro'): (0.50, 0.52, 0.56)}


def test_a_spec_arm_s_claim_row_shows_the_fro_arm_of_its_own_family_beside_it(tmp_path):
    """Two freeze families in one setting, each with a spec and a fro arm at planted changes: each
    (e) row shows its own family's fro arm beside it, never the other family's."""
    for seed, base in enumerate(BASE['normal'], 1):
        kw = dict(seed=seed, effect=0, noise=0, link=0)
        replant(synth.write_run(str(tmp_path), f'base_s{seed}', **kw), entropy_at(base))
        for (every, keep), change in TWINS.items():
            path = synth.write_run(str(tmp_path), f'freeze{every}{keep}_s{seed}', control='freeze',
                                   control_keep=keep, control_interval=every, **kw)
            replant(path, entropy_at(base + change[seed - 1]))
    s = synth.run([tmp_path], tmp_path / 'out')
    rows = [r for r in s.tables['claims'] if r['key'] == 'e']
    assert len(rows) == 2
    for every, row in zip((1, 5), rows):
        est, lo, hi, n = stats.t_interval(TWINS[every, 'fro'])
        fro = engine.shown(ALL['e'], {'n': n, 'est': est, 'lo': lo, 'hi': hi})
        assert row['scope'].endswith(f'control_interval={every}'), row['scope']
        assert row['beside'].startswith(f'keep=fro (freeze-k control_interval={every}): {fro};'), (
            row['beside'])


# ------------------------------------------------------------- a map cell is its claim judged alone
def lenses_apart(it, i, lay):
    """The token-level PR_K and PR_QK of each head reversed in order against the weight ones, the
    learned part's PR_K with the heads of a layer swapped: each lens correlates on its own."""
    k = lay['pr_k_heads']
    set_heads(lay, 'tok_pr_k', [8 - x for x in k])
    set_heads(lay, 'tok_pr_qk', [9 - x for x in lay['pr_qk_heads']])
    set_heads(lay, 'pr_dk', k[::-1])


def fresh(run):
    """The run as loaded, nothing remembered: a statistic computed on it is computed alone."""
    copy = dataclasses.replace(run, memo={})
    copy.use(run.settings)
    return copy


def alone(study, key, lens, window, decay):
    """A map statistic judged alone in one view, on fresh copies of its runs."""
    pool = engine.uncontrolled(study.runs)
    if decay != 'pooled':
        pool = [r for r in pool if r.cfg['decay_qk'] is decay]   # weight_decay is 0.1 in each
    return engine.judge(ALL[key], [fresh(r) for r in pool], View(lens, window, study.from_iter))


BOOKKEEPING = ('key', 'lens', 'window', 'decay', 'keep')


def unlike_alone(study, cells):
    """The cells that differ from their statistic judged alone in their view: (view, est, alone)."""
    out = []
    for c in cells:
        res = alone(study, *(c[k] for k in BOOKKEEPING[:4]))
        if not same({k: v for k, v in c.items() if k not in BOOKKEEPING}, res):
            out.append((*(c[k] for k in BOOKKEEPING[:4]), c.get('est'), res.get('est')))
    return out


def test_a_map_cell_is_the_claim_judged_alone_in_its_lens_in_any_order_of_the_lenses(
        tmp_path, monkeypatch):
    """Lenses planted apart (head, tok and learned correlate differently): every cell of
    robustness_cells, and every row of robustness_map.csv, equals its statistic judged alone in
    its view on fresh runs; built with each statistic's lenses reversed, the cells are the same."""
    paths = synth.study(tmp_path / 'runs', name='decay')
    paths += synth.study(tmp_path / 'runs', name='nodecay', decay_qk=False)
    for path in paths:
        replant(path, lenses_apart)
    s = engine.load([str(tmp_path / 'runs')], analyze.registries(), log=synth.quiet)
    own = {lens: alone(s, 'c', lens, 'all', 'pooled')['est'] for lens in analyze.HEADS}
    assert len({round(v, 6) for v in own.values()}) == 3, own   # the lenses planted apart
    cells = engine.robustness_cells(s)
    pooled = {tuple(c[k] for k in BOOKKEEPING[:4]): c for c in cells if c['decay'] == 'pooled'}
    assert {k for k, _, _, _ in pooled} == {k for k, st in ALL.items() if 'map' in st.tables}
    assert any(c['decay'] is False for c in cells) and not any(c['keep'] for c in cells)
    assert unlike_alone(s, cells) == []

    flip = lambda st: dataclasses.replace(st, lenses=st.lenses[::-1]) if 'map' in st.tables else st
    monkeypatch.setattr(analyze, 'CLAIMS', [flip(c) for c in analyze.CLAIMS])
    monkeypatch.setattr(analyze, 'STATS', [flip(st) for st in analyze.STATS])
    s2 = engine.load([str(tmp_path / 'runs')], analyze.registries(), log=synth.quiet)
    again = engine.robustness_cells(s2)
    flipped = {tuple(c[k] for k in BOOKKEEPING[:4]): c for c in again if c['decay'] == 'pooled'}
    assert flipped.keys() == pooled.keys()
    assert [k for k in pooled if not same(pooled[k], flipped[k])] == []
    assert unlike_alone(s2, again) == []
    monkeypatch.undo()

    synth.run([tmp_path / 'runs'], tmp_path / 'out')
    rows = list(csv.DictReader(open(tmp_path / 'out' / 'robustness_map.csv')))
    assert len(rows) == sum(hasattr(ALL[c['key']], 'sign') for c in cells)
    for row in rows:
        decay = {'True': True, 'False': False}.get(row['decay'], row['decay'])
        res = alone(s, row['key'], row['lens'], row['window'], decay)
        found = (int(row['n']), *(float(row[k]) for k in ('est', 'lo', 'hi')), row['verdict'])
        want = (res['n'], res['est'], res['lo'], res['hi'], res['verdict'])
        assert same(found, want), (row['key'], row['lens'], row['window'], decay, found, want)


# -------------------------------------------------------------- a figure draws what its label names
NAMED = {'log10': np.log10, 'log2': np.log2, 'log1p': np.log1p, 'log': np.log, 'ln': np.log,
         'exp': np.exp, 'sqrt': np.sqrt}


def named(label):
    """The function an axis label names at its start ('log10(1 + iteration)': log10 of 1 + x,
    'log10 ||W||': log10 of x), the identity where it names none."""
    found = re.match(r'(log10|log2|log1p|log|ln|exp|sqrt)(?:\((\d+(?:\.\d+)?) \+ |\b)', label)
    if not found:
        return lambda x: np.asarray(x, dtype=float)
    fn, shift = NAMED[found[1]], float(found[2] or 0)
    return lambda x: fn(shift + np.asarray(x, dtype=float))


def rows_sorted(a):
    a = np.asarray(a, dtype=float)
    return a[np.lexsort(np.round(a, 9).T[::-1])]


def test_each_transform_s_label_names_its_function():
    x = np.array([0.5, 1.0, 3.0, 250.0])
    for t in plots.TRANSFORMS.values():
        assert np.array_equal(named(t.label)(x), t(x)), t.label
    assert named('PR_K (whole matrix)')(x).tolist() == x.tolist()


def test_fig3_draws_the_planted_values_under_the_transforms_its_labels_name(tmp_path):
    """Planted per-head PR_K, entropy and logit scale (spread over four decades): fig3's scatter
    points (x, y, colour) and its entropy line, read back from the Axes, are the planted values
    under the function each axis label (or colour bar label) names."""
    rng = np.random.default_rng(3)

    def plant(it, i, lay):
        n = len(lay['pr_k_heads'])
        set_heads(lay, 'pr_k', rng.uniform(1.5, 7.5, n))
        set_heads(lay, 'entropy', rng.uniform(0.5, 3.0, n))
        spec = 10 ** rng.uniform(-3, 1, n)
        set_heads(lay, 'qk_spec_norm', spec)
        set_heads(lay, 'qk_fro_norm', 2 * spec)
    recs = [replant(path, plant) for path in synth.study(tmp_path / 'runs', seeds=2)]
    s = engine.load([str(tmp_path / 'runs')], analyze.registries(), log=synth.quiet)
    assert [(len(r.iters), r.notes) for r in s.runs] == [(len(synth.ITERS), [])] * 2
    warmup = s.runs[0].cfg['warmup_iters']
    layers = [(rec['iter'], lay) for run in recs for rec in run for lay in rec['layers']]
    planted = {   # per panel: (x, y, colour) of every point
        'pr_k': [(lay['pr_k'], lay['entropy'], it) for it, lay in layers],
        'pr_qk': [(lay['pr_qk'], lay['entropy'], it) for it, lay in layers],
        'scale': [point for it, lay in layers if it >= warmup for point in
                  zip(*(lay[f'{k}_heads'] for k in ('qk_spec_norm', 'entropy', 'pr_k')))]}

    fig3 = next(f for f in plots.FIGURES if f.stem == 'fig3_entropy_and_pr')
    fig = fig3.fn(s, {})
    ax_h, by_pr_k, by_pr_qk, by_scale = fig.axes[:4]
    for ax, key in ((by_pr_k, 'pr_k'), (by_pr_qk, 'pr_qk'), (by_scale, 'scale')):
        colour = ax.collections[0].colorbar.ax.get_ylabel()   # each panel its own colour bar
        (dots,) = ax.collections
        drawn = np.column_stack([dots.get_offsets(), dots.get_array()])
        labels = (ax.get_xlabel(), ax.get_ylabel(), colour)
        x, y, c = np.array(planted[key], dtype=float).T
        want = np.column_stack([named(label)(v) for label, v in zip(labels, (x, y, c))])
        assert drawn.shape == want.shape, (key, labels)
        drawn, want = rows_sorted(drawn), rows_sorted(want)
        bad = ~np.isclose(drawn, want, rtol=1e-9, atol=0)
        first = np.argwhere(bad)[:1].tolist()
        assert int(bad.sum()) == 0, (f'{key}: {bad.sum()} of {bad.size} drawn values are not the '
                                     f'planted ones under the labels {labels}; first (point, '
                                     f'column) {first}: drawn {drawn[bad][:1]}, planted '
                                     f'{want[bad][:1]}')

    (line,) = ax_h.lines
    means = [np.mean([lay['entropy'] for run in recs for lay in run[j]['layers']])
             for j in range(len(synth.ITERS))]
    assert ax_h.get_xscale() == 'symlog'   # a scale, not a transform of the data
    assert np.allclose(line.get_xdata(), named(ax_h.get_xlabel())(synth.ITERS))
    assert np.allclose(line.get_ydata(), named(ax_h.get_ylabel())(means), rtol=1e-9, atol=0)


def test_fig11_draws_each_head_s_final_spread_and_entropy_and_each_seed_pair(tmp_path):
    """fig11 is every head's final (logit_std, entropy, PR_K) under the transforms its labels name;
    fig12 is entropy_pairs' (d log logit_std, dH), a panel a layer, an arm a colour; without
    logit_std in the logs there is neither figure and no note."""
    paths = synth.study(tmp_path / 'runs', seeds=2)
    s = engine.load([str(tmp_path / 'runs')], analyze.registries(), log=synth.quiet)
    fig11, fig12 = (next(f for f in plots.FIGURES if f.stem == stem)
                    for stem in ('fig11_entropy_spread', 'fig12_spread_pairs'))
    assert fig11.fn(s, {}) == [] and fig12.fn(s, {}) == []
    rng = np.random.default_rng(5)

    def plant(it, i, lay):
        n = len(lay['pr_k_heads'])
        set_heads(lay, 'logit_std', 10 ** rng.uniform(-1, 1, n))
        set_heads(lay, 'entropy', rng.uniform(0.5, 3.0, n))
        set_heads(lay, 'pr_k', rng.uniform(1.5, 7.5, n))
    recs = [replant(path, plant) for path in paths]
    s = engine.load([str(tmp_path / 'runs')], analyze.registries(), log=synth.quiet)
    final = [lay for run in recs for lay in run[-1]['layers']]
    want = np.array([point for lay in final for point in
                     zip(*(lay[f'{k}_heads'] for k in ('logit_std', 'entropy', 'pr_k')))])
    pairs = [{'arm': 'a', 'layer': '0 of 2', 'dH': 0.1, 'd log logit_std': -0.2},
             {'arm': 'b', 'layer': '0 of 2', 'dH': -0.3, 'd log logit_std': 0.05},
             {'arm': 'a', 'layer': '1 of 2', 'dH': 0.2, 'd log logit_std': -0.4}]
    heads = fig11.fn(s, {}).axes[0]
    layers = fig12.fn(s, {'entropy_pairs': pairs}).axes
    (dots,) = heads.collections
    drawn = np.column_stack([dots.get_offsets(), dots.get_array()])
    want = np.column_stack([named(heads.get_xlabel())(want[:, 0]), want[:, 1:]])
    assert 'logit_std' in heads.get_xlabel()
    assert np.allclose(rows_sorted(drawn), rows_sorted(want), rtol=1e-9, atol=0)
    assert [axis.get_title().split(',')[0] for axis in layers] == ['layer 0 of 2', 'layer 1 of 2']
    drawn = [[dots.get_offsets().tolist() for dots in axis.collections] for axis in layers]
    assert drawn == [[[[-0.2, 0.1]], [[0.05, -0.3]]], [[[-0.4, 0.2]]]]
    colours = [tuple(dots.get_facecolor()[0]) for axis in layers for dots in axis.collections]
    assert colours[0] == colours[2] != colours[1]   # an arm keeps its colour in every panel
