"""
Run folders in, the study's evidence out: REPORT.md, tables, figures.

    python analyze.py out/ [more/] [--out=DIR] [--no_figures] [--from_iter=N]   # -> out/analysis/

This file holds what a research change touches; each change below is one edit here:
    a claim with its statistic:  def final_cos(run, view): return run.final('qk_cos'), then
        Claim(key='g', text='(g) queries and keys align', stat='final qk_cos', fn=final_cos,
        margin=0.05) in CLAIMS (judged outside Holm unless its key joins FAMILY)
    a descriptive statistic:     Stat(key=..., stat=..., fn=...) in STATS, its `tables` naming
        where it is shown (map, regime, trend, optimizer, control)
    an exploratory section:      def my_section(study): return {'my_table': rows}, then its name in
        EXPLORATORY: each table is written as .csv and .md and listed in REPORT.md; text around it
        in REPORT.md is report.py's (a second edit, if wanted)
    a figure:                    Figure(...) in plots.FIGURES
The engine (plumbing/engine.py) judges each statistic over its units and builds the tables; it
reads the registries that registries() passes it and nothing else of this file.

A statistic is fn(unit, view); a unit is a seed (a run), a seed pair (a controlled run and the none
run of its other settings and seed) or a model (a run or a pretrained series, read at its model
checkpoints); (a), (b) give signs per trajectory (a layer of a run), summarised per seed
(stats.share). A view is a lens and a window. Why (a), (b) start where the init is forgotten and
(d), (e) read the spec arm: README.md. (a), (b) read only the records of the regular grid (every
geom_interval-th iteration and the last): the log-spaced extra records move with a run's length.
(f1), (f2) read the token-level values of a model's checkpoints: train.py's model_ckpts
iterations in our runs, every record of a pretrained series.
"""
import argparse
import json
import math
import os
import sys
import time
from collections import namedtuple

import numpy as np

import control
import report
from plumbing import engine, stats
from plumbing.engine import WELL_BELOW, Claim, Stat, checkpoints, group, on_grid
from plumbing.folders import FINAL_LOGS, OutError, Skip
from plumbing.stats import nanmean

# ------------------------------------------------------------------------------------------ views
Lens = namedtuple('Lens', 'q k qk size what')   # per-head lists: the key without _head, + _heads
LENSES = {'whole': Lens('pr_q', 'pr_k', 'pr_qk', 'C', 'whole-matrix weight PR'),
          'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'd', 'per-head weight PR'),
          'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'C', 'token-level PR'),
          'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'C', 'learned part W - W(0)')}
WINDOWS = {'all': 'all records', 'warmup': 'from warm-up on', 'post': 'after the init is forgotten'}
FORGOTTEN = 'init forgotten (the first record where ||W - W(0)||_F >= ||W(0)||_F for W_Q and W_K)'
REFERENCES = {'all': ('the first record',),
              'warmup': ('the end of warm-up', 'twice that', '10% of training'),
              'post': (FORGOTTEN, '25% of training', '50% of training')}


def usable(run, it):
    """The index of the first record at or after iteration it, before the final records."""
    i = len(run.iters) if it is None else int(np.searchsorted(run.iters, it))
    return i if i < len(run.iters) - FINAL_LOGS else None


def references(run, view, layers):
    """The window's REFERENCES' iterations (None: not reached)."""
    m = run.cfg['max_iters']
    w = run.cfg['warmup_iters'] if view.from_iter is None else view.from_iter
    if view.window == 'all':
        return [int(view.lens == 'learned')]   # the learned part is 0 at iteration 0
    if view.window == 'warmup':
        return [w, 2 * w, m / 10]
    moved = [run.m[k][:, layers] >= 1 for k in ('dq_rel', 'dk_rel') if k in run.m]
    gone = np.flatnonzero(np.all(moved, (0, 2))) if moved else []
    return [int(run.iters[gone[0]]) if len(gone) else None, m / 4, m / 2]


def start(run, view, layers):
    """The first iteration a window keeps ('post': its earliest usable reference)."""
    refs = references(run, view, layers)
    found = [run.iters[i] for i in (usable(run, it) for it in refs) if i is not None]
    first = min(found, default=math.inf) if view.window == 'post' else refs[0]
    return max(first, int(view.lens == 'learned'))


# ------------------------------------------------------------------------ statistics of one unit
def series(run, key, i):
    return run.m[key][:, i] if key in run.m else np.full(len(run.iters), np.nan)


def moves(run, view):
    """(a), per trajectory and reference: signs of PR_Q(end) - PR_Q(ref), PR_K(ref) - PR_K(end)."""
    run, out, lens = on_grid(run), [], LENSES[view.lens]
    for i in range(run.n_layer):
        q, k = series(run, lens.q, i), series(run, lens.k, i)
        q1, k1 = nanmean(q[-FINAL_LOGS:]), nanmean(k[-FINAL_LOGS:])
        at = [usable(run, it) for it in references(run, view, [i])]
        out.append([(np.nan, np.nan) if j is None else (np.sign(q1 - q[j]), np.sign(k[j] - k1))
                    for j in at])
    return np.array(out, dtype=float)


def gap_signs(run, view):
    """(b), per trajectory and record from the window's start (after iteration 0): the gap sign."""
    run, lens, out = on_grid(run), LENSES[view.lens], []
    for i in range(run.n_layer):
        kept = run.iters >= max(start(run, view, [i]), 1)
        gap = series(run, lens.q, i) - series(run, lens.k, i)
        out.append(np.where(kept, np.sign(gap), np.nan)[:, None])
    return np.array(out)


def gap_share(run, view):
    """The share of (b)'s records with PR_Q - PR_K > 0 (of its iterations: the grid is regular)."""
    signs = gap_signs(run, view)
    kept = np.isfinite(signs)
    return float((signs[kept] > 0).mean()) if kept.any() else math.nan


def values(run, role, lens, heads):
    """(records, values) of a role (k, qk: the lens' PR_K, PR_QK; entropy; scale: log
    ||W_QK^h||_2), per (layer, head) or per layer; None if not logged."""
    key = {'entropy': 'entropy', 'scale': 'qk_spec_norm'}.get(role) or getattr(LENSES[lens], role)
    key = key.removesuffix('_head') + '_heads' if heads else key
    if key not in run.m:
        return None
    a = run.m[key]
    if role == 'scale':
        with np.errstate(divide='ignore', invalid='ignore'):
            a = np.log(np.where(a > 0, a, np.nan))
    return a.reshape(len(a), -1)


def correlation(x, y, scope='heads', kind='spearman', changes=False):
    """A statistic of a run: the correlation of roles x, y (partial: given the scale), of levels or
    of changes between records; across each record's (layer, head) pairs, mean over records
    (heads), or over the run's records, mean over layers (time)."""
    roles = (x, y, 'scale') if kind == 'partial' else (x, y)
    corr = {'spearman': stats.spearman_rows, 'pearson': stats.pearson_rows,
            'partial': stats.partial_rows}[kind]

    def fn(run, view):
        vals = [values(run, role, view.lens, scope == 'heads') for role in roles]
        if any(v is None for v in vals):
            return math.nan
        keep = run.iters >= start(run, view, list(range(run.n_layer)))
        if scope == 'time':
            kept = [np.diff(v[keep], axis=0) if changes else v[keep] for v in vals]
            return nanmean(corr(*(v.T for v in kept)))
        key = (x, y, kind, changes, view.lens)
        if key not in run.memo:   # every window of the run reads the same per-record correlations
            run.memo[key] = corr(*(np.diff(v, axis=0) if changes else v for v in vals))
        return nanmean(run.memo[key][keep[:-1] if changes else keep])
    return fn


def final_pr(stat):
    """A statistic of a run: final (PR_Q - PR_K) / C (/ d per head), or log(PR_Q / PR_K)."""
    def fn(run, view):
        lens, layers = LENSES[view.lens], range(run.n_layer)
        q, k = (np.array([run.final(key, [i]) for i in layers]) for key in (lens.q, lens.k))
        if stat == 'gap':
            return nanmean(q - k) / getattr(run, lens.size)
        with np.errstate(divide='ignore', invalid='ignore'):
            return nanmean(np.log(q / k))
    return fn


def value(key):
    """A statistic of a run: a metric's final layer mean."""
    return lambda run, view: run.final(key)


def conserved_imbalance(run, view):
    """The final qk_imbalance had D_h kept its norm: imbalance_h(0) gram_h(0) / gram_h(t)."""
    if not {'qk_imbalance_heads', 'qk_gram_heads'} <= set(run.m) or not len(run.iters):
        return math.nan
    imb, gram = (run.m[k] for k in ('qk_imbalance_heads', 'qk_gram_heads'))
    with np.errstate(divide='ignore', invalid='ignore'):
        return nanmean(imb[0] * gram[0] / gram[-FINAL_LOGS:])


def change(key, how='difference'):
    """A statistic of a seed pair: key's final value (pr_ctl_head: the controlled projection's
    per-head PR), controlled against baseline: difference, relative change or log ratio."""
    def fn(pair, view):
        name = f'pr_{pair[0].cfg["control_target"]}_head' if key == 'pr_ctl_head' else key
        a, b = (r.final_loss(name) if name.endswith('_loss') else r.final(name) for r in pair)
        if how == 'difference':
            return a - b
        if not (a > 0 and b > 0):
            return math.nan
        return a / b - 1 if how == 'relative' else math.log(a / b)
    return fn


def contrast_rho(part):
    """A statistic of a model: Spearman of tok_pr_q - tok_pr_k with log(1 + step) over its early
    (log step at or below the median) or late (at or above) checkpoints, mean over layers."""
    def fn(run, view):
        at = checkpoints(run)
        x = np.log1p(run.iters[at].astype(float))
        if not len(x):
            return math.nan
        half = x <= np.median(x) if part == 'early' else x >= np.median(x)
        rhos = []
        for i in range(run.n_layer):
            contrast = series(run, 'tok_pr_q', i) - series(run, 'tok_pr_k', i)
            rhos.append(stats.spearman(x[half], contrast[at][half]))
        return nanmean(rhos)
    return fn


def token_link(run, view):
    """A statistic of a model: Spearman of tok_pr_qk with entropy at its last checkpoint's heads"""
    at = checkpoints(run)
    if not len(at) or not {'tok_pr_qk_heads', 'entropy_heads'} <= set(run.m):
        return math.nan
    x, y = (run.m[k][at[-1]].ravel() for k in ('tok_pr_qk_heads', 'entropy_heads'))
    return stats.spearman(x, y)


# ---------------------------------------------------------------------------------- the registries
CORRELATION = (-1.0, 1.0)


ALL4, HEADS = tuple(LENSES), ('head', 'tok', 'learned')
PAIRS = 'across the (layer, head) pairs of a record, mean over records'
TIME = 'within a run over its records, per layer, mean over layers'
CONTROLLED = 'controlled - baseline'
SHARE = {'unit': 'trajectory', 'lenses': ALL4, 'window': 'post', 'ref': 0.5}
ACROSS = {'lenses': HEADS, 'window': 'warmup', 'margin': 0.1, 'limits': CORRELATION}
CONTROL = {'unit': 'pair', 'margin': 0.02, 'beside': ('d_qk_spec_norm',), 'tables': ()}
TOKEN = {'unit': 'model', 'margin': 0.1, 'limits': CORRELATION, 'tables': ()}
CLAIMS = [
    Claim(key='a', text='(a) PR_Q grows and PR_K falls over training', fn=moves, **SHARE,
          beside=('a@warmup',),
          stat='PR_Q(end) > PR_Q(ref) and PR_K(end) < PR_K(ref) from every reference, on the grid '
               'records; mirror: PR_Q falls and PR_K rises from every one'),
    Claim(key='b', text='(b) PR_Q - PR_K > 0 along every trajectory', fn=gap_signs, **SHARE,
          beside=('gap_share', 'b@all', 'ratio_end', 'ratio_end_head'),
          stat='PR_Q - PR_K > 0 at every grid record from the first reference; mirror: < 0 at '
               'every one'),
    Claim(key='c', text='(c) lower PR_K goes with lower attention entropy, across heads',
          stat=f'Spearman of PR_K with entropy {PAIRS}', fn=correlation('k', 'entropy'), **ACROSS),
    Claim(key='c-qk', text='(c) lower PR_K goes with a narrower QK^T spectrum, across heads',
          stat=f'Spearman of PR_K with PR_QK {PAIRS}', fn=correlation('k', 'qk'), **ACROSS),
    Claim(key='c-d', text='(c) changes of PR_K go with changes of entropy, across heads',
          stat='the same of the changes between records',
          fn=correlation('k', 'entropy', changes=True), **ACROSS),
    Claim(key='c-dqk', text='(c) changes of PR_K go with changes of PR_QK, across heads',
          stat='the same of PR_K with PR_QK', fn=correlation('k', 'qk', changes=True), **ACROSS),
    Claim(key='c2', text="(c2) the key spectrum's shape tracks entropy beyond the logit scale",
          stat=f'Pearson partial correlation of PR_K with entropy given log ||W_QK^h||_2 {PAIRS}',
          fn=correlation('k', 'entropy', kind='partial'), **ACROSS),
    Claim(key='d', text='(d) shrinking the key spectrum sharpens attention',
          stat=f'final attention entropy, {CONTROLLED}, at the strongest shrink dose whose '
               f"per-head PR_K change lies below {WELL_BELOW:.0%} of the baseline's",
          fn=change('entropy'), sign=-1, control='shrink', **CONTROL),
    Claim(key='e', text='(e) freezing the key spectrum softens attention',
          stat=f'final attention entropy, {CONTROLLED}', fn=change('entropy'), control='freeze',
          **CONTROL),
    Claim(key='f1-early', text='(f1) token-level PR_Q - PR_K rises early',
          stat="Spearman of tok_pr_q - tok_pr_k with log(1 + step) over a model's early "
               'checkpoints (log step at or below its median), mean over layers',
          fn=contrast_rho('early'), **TOKEN),
    Claim(key='f1-late', text='(f1) ... and decays later',
          stat='the same over the late checkpoints (at or above the median)',
          fn=contrast_rho('late'), sign=-1, **TOKEN),
    Claim(key='f2', text='(f2) token-level interaction rank tracks attention entropy',
          stat="Spearman of tok_pr_qk with entropy across the (layer, head) pairs of a model's "
               'last checkpoint', fn=token_link, **TOKEN),
]
# The pre-registered family: Holm adjusts over these claims' rows only. A claim a fork adds to
# CLAIMS is judged and reported beside them, outside Holm, unless its key is added here.
FAMILY = ('a', 'b', 'c', 'c-qk', 'c-d', 'c-dqk', 'c2', 'd', 'e', 'f1-early', 'f1-late', 'f2')


def described(key, stat, x, y, scope='heads', kind='spearman', changes=False, tables=('map',)):
    """A descriptive correlation of roles x, y: across the (layer, head) pairs of each record in the
    head lenses, or within a run over its records (scope 'time') in every lens."""
    lenses = {'lenses': HEADS, 'window': 'warmup'} if scope == 'heads' else {'lenses': ALL4}
    return Stat(key=key, stat=f"{stat} {PAIRS if scope == 'heads' else TIME}", tables=tables,
                fn=correlation(x, y, scope, kind, changes), limits=CORRELATION, **lenses)


def final_stats():
    """The final PR gap and ratio in each weight lens (the ratio on the log scale)."""
    out = []
    for lens, suffix, tables in (('whole', '', ('regime', 'trend')),
                                 ('head', '_head', ('regime', 'trend', 'optimizer')),
                                 ('learned', '_learned', ('regime',))):
        size, what = LENSES[lens].size, LENSES[lens].what
        out.append(Stat(key=f'gap_end{suffix}', stat=f'final (PR_Q - PR_K) / {size} in the {what}',
                        fn=final_pr('gap'), lenses=(lens,), tables=('regime',)))
        out.append(Stat(key=f'ratio_end{suffix}', stat=f'final PR_Q / PR_K in the {what}',
                        fn=final_pr('ratio'), lenses=(lens,), log=True, tables=tables))
    return out


def control_stats():
    """Final values of a seed pair, controlled - baseline."""
    rows = (('entropy', 'final entropy', change('entropy')),
            ('pr_head', 'final per-head PR of the controlled projection', change('pr_ctl_head')),
            ('pr_head_rel', "the same relative to the baseline's",
             change('pr_ctl_head', 'relative')),
            ('qk_spec_norm', 'final qk_spec_norm', change('qk_spec_norm')),
            ('log_qk_spec_norm', 'final log qk_spec_norm', change('qk_spec_norm', 'log')),
            ('k_spec_norm', 'final k_spec_norm (top singular value of W_K^h)',
             change('k_spec_norm')),
            ('q_spec_norm', 'final q_spec_norm', change('q_spec_norm')),
            ('val_loss', 'final val_loss', change('val_loss')))
    return [Stat(key=f'd_{key}', stat=f'{stat}, {CONTROLLED}', fn=fn, unit='pair',
                 tables=('control',)) for key, stat, fn in rows]


STATS = [
    described('qk~entropy', 'Spearman of PR_QK with entropy', 'qk', 'entropy'),
    described('scale~entropy', 'Pearson of log ||W_QK^h||_2 with entropy', 'scale', 'entropy',
              kind='pearson', tables=('map', 'regime')),
    described('k~entropy over time', 'Spearman of PR_K with entropy (two trends correlate, '
              'linked or not)', 'k', 'entropy', 'time'),
    described('dk~dentropy over time', 'Spearman of their changes between records', 'k',
              'entropy', 'time', changes=True),
    described('k~entropy|scale over time', 'Pearson partial of PR_K with entropy given the log '
              'scale', 'k', 'entropy', 'time', 'partial'),
    Stat(key='gap_share', stat="the share of (b)'s grid records with PR_Q - PR_K > 0 (of the "
                               'iterations from the reference on), over layers',
         fn=gap_share, lenses=ALL4, window='post', tables=('regime',), limits=(0.0, 1.0)),
    *final_stats(),
    Stat(key='entropy_end', stat='final attention entropy (nats)', fn=value('entropy'),
         tables=('regime', 'trend')),
    Stat(key='imbalance_end', stat='final qk_imbalance', fn=value('qk_imbalance'),
         tables=('regime', 'optimizer', 'trend')),
    Stat(key='imbalance_conserved', stat='final qk_imbalance had D_h kept its initial norm',
         fn=conserved_imbalance, tables=('optimizer',)),
    Stat(key='drift_end', stat='final qk_drift, ||D_h(t) - D_h(0)||_F / gram(t)',
         fn=value('qk_drift'), tables=('regime', 'optimizer')),
    Stat(key='dq_rel_end', stat='final ||W_Q - W_Q(0)||_F / ||W_Q(0)||_F', fn=value('dq_rel'),
         tables=('optimizer',)),
    Stat(key='val_loss', stat='final validation loss',
         fn=lambda run, view: run.final_loss('val_loss'), tables=('regime', 'optimizer')),
    Stat(key='train_val_gap', stat='final val_loss - train_loss',
         fn=lambda run, view: run.final_loss('val_loss') - run.final_loss('train_loss'),
         tables=('regime', 'trend')),
    *control_stats(),
]
ALL = {s.key: s for s in CLAIMS + STATS}


# -------------------------------------------------------------- what sets entropy (exploratory)
# Outside the claims and Holm: each run at its final record, per (layer, head), and the control by
# seed pair, in the statistics results/cpu-wide-spread/README.md fixed before its runs. Only runs
# that log logit_std take part; without them these tables are empty and REPORT.md has no section.
MEDIATORS = {'log logit_std': 'logit_std', 'log ||W_QK||_F': 'qk_fro_norm',
             'log ||W_QK||_2': 'qk_spec_norm'}
PREDICTORS = {**MEDIATORS, 'log PR_K': 'pr_k', 'log PR_QK': 'pr_qk'}
ONLY_SPREAD_R2 = 0.8   # model 1's uncentred R^2 that "only through the spread" asks for


def final_heads(run, key):
    """key's per-head values at the run's final record, over (layer, head); None if not logged."""
    values = run.m.get(f'{key}_heads')
    return None if values is None else values[-1].reshape(-1)


def spread_runs(study):
    return [r for r in study.runs if final_heads(r, 'logit_std') is not None]


def across_heads(runs):
    """Per run over its heads: Spearman of entropy with log logit_std, and the partial Spearman of
    PR_K and of PR_QK with entropy given log logit_std; each a mean over runs, t interval. Runs
    of any depth and head count: each run is correlated over its own heads."""
    def ranked(run, key):
        return stats.ranks(final_heads(run, key))
    found = {'Spearman of entropy with log logit_std': [
        float(stats.pearson_rows(ranked(r, 'entropy'), ranked(r, 'logit_std'))) for r in runs]}
    for name, key in (('PR_K', 'pr_k'), ('PR_QK', 'pr_qk')):
        found[f'partial Spearman of {name} with entropy | log logit_std'] = [
            float(stats.partial_rows(ranked(r, key), ranked(r, 'entropy'), ranked(r, 'logit_std')))
            for r in runs]
    rows = []
    for statistic, values in found.items():
        mean, lo, hi, n = stats.t_interval(values)
        rows.append({'statistic': statistic, 'mean': mean, 'lo': lo, 'hi': hi, 'runs': n,
                     'reading': beyond_spread(lo, hi) if 'partial' in statistic else ''})
    return rows


def beyond_spread(lo, hi):
    """A partial link given log logit_std, by the band fixed before the runs (ACROSS's margin)."""
    band = ACROSS['margin']
    if -band <= lo and hi <= band:
        return 'no further than the spread'
    if (lo > 0 or hi < 0) and (lo > band or hi < -band):
        return 'beyond the spread (a correlation)'
    return 'undecided'


def head_change(controlled, baseline, key, log=True):
    """The change in the mean over heads of key (of its log), controlled - baseline."""
    def mean(run):
        values = final_heads(run, key)
        return float(np.mean(np.log(values) if log else values))
    return mean(controlled) - mean(baseline)


def spread_pairs(study):
    """The seed pairs of the key control whose runs log logit_std, as arrays: dH, d log PR_K, the
    change of each mediator, their seeds and arm names."""
    found = []
    for (setting, arm), pairs in study.arms.items():
        if dict(arm)['control_target'] != 'k':
            continue
        for controlled, baseline in pairs:
            if any(final_heads(run, 'logit_std') is None for run in (controlled, baseline)):
                continue
            found.append({'arm': study.arm_name(arm), 'seed': controlled.seed,
                          'dH': head_change(controlled, baseline, 'entropy', log=False),
                          'dK': head_change(controlled, baseline, 'pr_k'),
                          **{name: head_change(controlled, baseline, key)
                             for name, key in MEDIATORS.items()}})
    return {key: np.array([p[key] for p in found]) for key in found[0]} if found else {}


def uncentred_r2(y, X):
    """1 - sum e^2 / sum y^2 of the least-squares fit of y on the columns of X, no intercept."""
    residual = y - X @ stats.solve(X, y)
    return 1 - float(residual @ residual) / float(y @ y)


def mediation_rows(pairs):
    """Per mediator m: dH = b dm (model 1) and dH = b dm + c dK (model 2), no intercept (a pair of
    equal runs changes nothing), jackknife-t over seeds; then, per arm, the share of its mean dH
    that goes through m, b mean(dm) / mean(dH) with b of model 1."""
    fits, shares = [], []
    dH, dK, seeds = pairs['dH'], pairs['dK'], pairs['seed']
    for name in MEDIATORS:
        one, two = pairs[name][:, None], np.column_stack([pairs[name], dK])
        b1 = stats.jackknife(lambda keep: stats.solve(one[keep], dH[keep]), seeds)
        b2 = stats.jackknife(lambda keep: stats.solve(two[keep], dH[keep]), seeds)
        fits.append({'mediator': name, 'pairs': len(dH), 'b1': b1[0][0], 'b1_lo': b1[1][0],
                     'b1_hi': b1[2][0], 'R2_1': uncentred_r2(dH, one), 'b2': b2[0][0],
                     'b2_lo': b2[1][0], 'b2_hi': b2[2][0], 'c_dlogPR_K': b2[0][1],
                     'c_lo': b2[1][1], 'c_hi': b2[2][1], 'R2_2': uncentred_r2(dH, two)})
        for arm in dict.fromkeys(pairs['arm']):
            shares.append({'mediator': name, 'arm': arm,
                           **arm_share(dH, pairs[name], seeds, pairs['arm'] == arm)})
    return fits, shares


def arm_share(dH, dm, seeds, in_arm):
    """An arm's mean dH (t interval over its pairs), mean dm, and its share through the mediator."""
    def share(keep):
        b = stats.solve(dm[keep, None], dH[keep])[0]
        with np.errstate(divide='ignore', invalid='ignore'):   # no change: no share (not measured)
            return b * dm[keep & in_arm].mean() / dH[keep & in_arm].mean()
    mean, lo, hi, n = stats.t_interval(dH[in_arm])
    through, through_lo, through_hi = stats.jackknife(share, seeds)
    return {'pairs': n, 'dH': mean, 'dH_lo': lo, 'dH_hi': hi,
            'effect': bool(lo > CONTROL['margin'] or hi < -CONTROL['margin']),
            'd_mediator': float(dm[in_arm].mean()), 'share': float(through),
            'share_lo': float(through_lo), 'share_hi': float(through_hi)}


def only_through_spread(fits, shares):
    """The reading fixed before the runs, of model 2's c, the arms' shares and model 1's R^2 with
    m = log logit_std: 'yes', 'refuted' (and why) or 'undecided'."""
    fit = next(f for f in fits if f['mediator'] == 'log logit_std')
    arms = [r for r in shares if r['mediator'] == 'log logit_std' and r['effect']]
    refuted = []
    if fit['c_lo'] > 0 or fit['c_hi'] < 0:
        refuted.append("PR_K's change acts beyond the spread (c's interval excludes 0)")
    refuted += [f"the share of {r['arm']} lies below 1" for r in arms if r['share_hi'] < 1]
    if refuted:
        return 'refuted: ' + '; '.join(refuted)
    holds = (fit['c_lo'] <= 0 <= fit['c_hi'] and fit['R2_1'] >= ONLY_SPREAD_R2
             and all(r['share_lo'] <= 1 <= r['share_hi'] for r in arms))
    return 'yes' if holds else 'undecided'


def predictor_rows(runs):
    """Per candidate: R^2 of entropy on it (a line) across heads, fitted on all seeds but one and
    read on the held-out seed's heads; mean, lowest and highest over the held-out seeds."""
    seeds, rows = np.array([r.seed for r in runs]), []
    entropy = [final_heads(r, 'entropy') for r in runs]
    for name, key in PREDICTORS.items():
        x = [np.log(final_heads(r, key)) for r in runs]
        scores = []
        for held in np.unique(seeds):
            fit = np.polyfit(np.concatenate([v for v, s in zip(x, seeds) if s != held]),
                             np.concatenate([h for h, s in zip(entropy, seeds) if s != held]), 1)
            x_out = np.concatenate([v for v, s in zip(x, seeds) if s == held])
            h_out = np.concatenate([h for h, s in zip(entropy, seeds) if s == held])
            error = h_out - np.polyval(fit, x_out)
            scores.append(1 - (error @ error) / ((h_out - h_out.mean()) @ (h_out - h_out.mean())))
        rows.append({'predictor': name, 'R2_held_out': float(np.mean(scores)),
                     'lowest': float(np.min(scores)), 'highest': float(np.max(scores)),
                     'held_out_seeds': len(scores)})
    return rows


def what_sets_entropy(study):
    """The section's tables: across heads, the mediation fits, the arms' shares, the predictors."""
    runs = spread_runs(study)
    if not runs:
        return {}
    tables = {'entropy_heads': across_heads(runs)}
    if len({r.seed for r in runs}) >= 2:
        tables['entropy_predictors'] = predictor_rows(runs)
    pairs = spread_pairs(study)
    if pairs:
        fits, shares = mediation_rows(pairs)
        for fit in fits:
            fit['only through the spread'] = (only_through_spread(fits, shares)
                                              if fit['mediator'] == 'log logit_std' else '')
        tables.update(entropy_mediation=fits, entropy_share=shares,
                      entropy_pairs=pair_rows(pairs))
    return tables


def pair_rows(pairs):
    """The seed pairs the mediation reads, a row each."""
    names = {'dH': 'dH', 'dK': 'd log PR_K', **{name: f'd {name}' for name in MEDIATORS}}
    rows = []
    for i in range(len(pairs['dH'])):
        row = {'arm': str(pairs['arm'][i]), 'seed': int(pairs['seed'][i])}
        rows.append(row | {label: float(pairs[key][i]) for key, label in names.items()})
    return rows


def token_layers(study):
    """(f2) per layer of each pretrained series: Spearman of tok_pr_qk with entropy across the
    layer's heads at the last checkpoint (exploratory: heads of one layer, one model)."""
    rows = []
    for r in study.series:
        if not {'tok_pr_qk_heads', 'entropy_heads'} <= set(r.m):
            continue
        rank, entropy = (r.m[k][-1] for k in ('tok_pr_qk_heads', 'entropy_heads'))
        for layer in range(r.n_layer):
            rows.append({'model': r.name, 'step': int(r.iters[-1]), 'layer': layer,
                         'heads': rank.shape[-1], 'f2 within the layer': stats.spearman(
                             rank[layer], entropy[layer])})
    return {'token_layers': rows}


def layer_effects(study):
    """Where a key control in some layers moves entropy: per arm with control_layers set and per
    layer, dH (the mean of the last FINAL_LOGS records over the layer's heads, controlled -
    baseline) over the arm's seed pairs, read by the control claims' margin (results/
    cpu-wide-layers/README.md fixed it): moves, stays or undecided."""
    rows, margin = [], CONTROL['margin']
    for (setting, arm), pairs in study.arms.items():
        chosen = dict(arm).get('control_layers', '')
        if not chosen:
            continue
        controlled = control.parse_layers(chosen, pairs[0][0].n_layer)
        for layer in range(pairs[0][0].n_layer):
            changes = [run.final('entropy', [layer]) - base.final('entropy', [layer])
                       for run, base in pairs]
            mean, low, high, n = stats.t_interval(changes)
            outside = (low - margin, high + margin)   # above 0: above the margin
            reading = engine.side(*outside, 'moves up', 'moves down', 'undecided')
            if -margin <= low and high <= margin:
                reading = 'stays'
            rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                         'layer': layer, 'controlled': layer in controlled, 'pairs': n,
                         'dH': mean, 'lo': low, 'hi': high, 'reading': reading})
    return {'entropy_layers': rows}


ROUTES = {'spread': ('log logit_std',), 'shape': ('logit_margin', 'logit_kurtosis')}
CARRIES = 0.2   # a route carries an effect when its share's interval lies above this


def late_heads(run, key):
    """(layers, heads) of key's per-head values, the mean of the last FINAL_LOGS records (the log
    for a 'log ' key); None if not logged."""
    values = run.m.get(f"{key.removeprefix('log ')}_heads")
    if values is None:
        return None
    late = values[-FINAL_LOGS:].mean(0)
    return np.log(late) if key.startswith('log ') else late


def head_design(runs, keys):
    """Across the heads of runs: entropy, the columns of keys beside one intercept per layer, and
    each head's seed."""
    entropy, columns, seeds = [], [], []
    for run in runs:
        found = [late_heads(run, key) for key in ('entropy', *keys)]
        layers = np.repeat(np.eye(run.n_layer), found[0].shape[1], axis=0)
        entropy.append(found[0].ravel())
        columns.append(np.column_stack([layers, *(x.ravel() for x in found[1:])]))
        seeds += [run.seed] * len(layers)
    return np.concatenate(entropy), np.concatenate(columns), np.array(seeds)


def route_rows(study):
    """The routes results/cpu-wide-layers/README.md fixed: entropy across the none runs' heads on
    log logit_std (spread) and on it with the row's margin and kurtosis (shape), one intercept a
    layer, R^2 on held-out seeds; then each layer-targeted arm's controlled layer: the share of
    its dH that each route's coefficients (of the shape fit) times the pair's mean changes
    predict, jackknife-t over seeds. Each setting with such arms is fitted on its own none runs."""
    keys, fits, shares = ROUTES['spread'] + ROUTES['shape'], [], []
    for setting, arms in layer_targeted(study).items():
        base = [r for r in engine.uncontrolled(study.runs) if r.setting == setting]
        if len({r.seed for r in base}) < 2:
            continue
        fits += [{'setting': study.label[setting], 'route': name,
                  **held_out_r2(*head_design(base, ROUTES['spread'] + extra))}
                 for name, extra in (('spread', ()), ('shape', ROUTES['shape']))]
        entropy, design, _ = head_design(base, keys)
        coef = dict(zip(keys, stats.solve(design, entropy)[-len(keys):]))
        for arm, pairs in arms:
            shares += arm_routes(study, setting, arm, pairs, coef)
    return {'entropy_routes_fit': fits, 'entropy_routes': shares}


def layer_targeted(study):
    """{baseline setting: [(arm, pairs)]} of the arms with control_layers set whose runs log the
    row statistics."""
    found = {}
    for (setting, arm), pairs in study.arms.items():
        logged = all(late_heads(run, 'logit_margin') is not None for pair in pairs for run in pair)
        if dict(arm).get('control_layers', '') and logged:
            found.setdefault(setting, []).append((arm, pairs))
    return found


def held_out_r2(entropy, design, seeds):
    """R^2 of the least-squares fit on all seeds but one, read on that seed's heads: mean, lowest
    and highest over the seeds."""
    scores = []
    for held in np.unique(seeds):
        fit = stats.solve(design[seeds != held], entropy[seeds != held])
        error = entropy[seeds == held] - design[seeds == held] @ fit
        spread = entropy[seeds == held] - entropy[seeds == held].mean()
        scores.append(1 - (error @ error) / (spread @ spread))
    return {'heads': len(entropy), 'R2_held_out': float(np.mean(scores)),
            'lowest': float(np.min(scores)), 'highest': float(np.max(scores))}


def arm_routes(study, setting, arm, pairs, coef):
    """Per controlled layer of an arm: its dH and each route's share, jackknife-t over seeds."""
    rows, seeds = [], np.array([run.seed for run, _ in pairs])
    for layer in control.parse_layers(dict(arm)['control_layers'], pairs[0][0].n_layer):
        def change(key):
            layer_mean = [late_heads(run, key)[layer].mean() for pair in pairs for run in pair]
            return np.array(layer_mean[0::2]) - np.array(layer_mean[1::2])
        dH = change('entropy')
        _, dH_low, dH_high, _ = stats.t_interval(dH)
        margin = CONTROL['margin']
        moves = dH_low > margin or dH_high < -margin   # item 1: read only where the layer moves
        for route, keys in ROUTES.items():
            predicted = sum(coef[key] * change(key) for key in keys)
            def share(keep):
                with np.errstate(divide='ignore', invalid='ignore'):   # no change: no share
                    return predicted[keep].mean() / dH[keep].mean()
            through, low, high = stats.jackknife(share, seeds)
            reading = 'carries' if low > CARRIES else 'undecided'
            if -CARRIES <= low and high <= CARRIES:
                reading = 'carries none'
            if not moves:
                reading = 'not read: the layer does not move'
            rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                         'layer': layer, 'pairs': len(pairs), 'dH': float(dH.mean()),
                         'route': route, 'share': float(through), 'lo': float(low),
                         'hi': float(high), 'reading': reading})
    return rows


LAYER_MEDIATORS = ('log logit_std', 'logit_margin', 'logit_kurtosis')


def layer_mediation(study):
    """Per layer-targeted arm and mediator m, over its (seed pair, layer) units: dH = b_l dm + c dK
    with a slope per layer and no intercept (a pair of equal runs changes nothing), dK the change
    in log PR_K; c with its jackknife-t interval over seeds: the key spectrum acts beyond m where
    it excludes 0 (results/cpu-wide-layers/README.md, item 3)."""
    rows = []
    for setting, arms in layer_targeted(study).items():
        for arm, pairs in arms:
            rows += arm_mediation(study, setting, arm, pairs)
    return {'entropy_layer_mediation': rows}


def arm_mediation(study, setting, arm, pairs):
    """layer_mediation's rows of one arm, a row per mediator."""
    n_layer, rows = pairs[0][0].n_layer, []
    seeds = np.repeat([run.seed for run, _ in pairs], n_layer)
    def change(key):   # (pairs x layers,) of the layer means
        return np.concatenate([late_heads(run, key).mean(1) - late_heads(base, key).mean(1)
                               for run, base in pairs])
    dH, dK = change('entropy'), change('log pr_k')
    layers = np.tile(np.eye(n_layer), (len(pairs), 1))
    for mediator in LAYER_MEDIATORS:
        design = np.column_stack([layers * change(mediator)[:, None], dK])
        c, low, high = stats.jackknife(lambda keep: stats.solve(design[keep], dH[keep])[-1], seeds)
        rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                     'mediator': mediator, 'units': len(dH), 'c_dlogPR_K': float(c),
                     'lo': float(low), 'hi': float(high), 'reading': reach(low, high)})
    return rows


def reach(low, high):
    """c's reading: beyond m when its interval excludes 0."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return 'undecided (no interval)'
    return engine.side(low, high, 'beyond m', 'beyond m', 'not beyond m')


def self_match(study):
    """Across the none runs' heads within each layer (results/cpu-wide-layers/README.md, item
    4): the partial Spearman of qk_eig_mean with entropy given log logit_std, and the Spearman of
    qk_eig_mean with self_top; each a mean over runs with its t interval (descriptive)."""
    rows = []
    for setting in layer_targeted(study):
        rows += setting_self_match(study, setting)
    return {'entropy_self_match': rows}


def setting_self_match(study, setting):
    """self_match's rows for the none runs of one setting."""
    runs = [r for r in engine.uncontrolled(study.runs) if r.setting == setting]
    rows = []
    for layer in range(runs[0].n_layer if runs else 0):
        def ranked(run, key):
            return stats.ranks(late_heads(run, key)[layer])
        found = {'partial Spearman of qk_eig_mean with entropy | log logit_std': [
            float(stats.partial_rows(ranked(r, 'qk_eig_mean'), ranked(r, 'entropy'),
                                     ranked(r, 'log logit_std'))) for r in runs],
                 'Spearman of qk_eig_mean with self_top': [
            float(stats.pearson_rows(ranked(r, 'qk_eig_mean'), ranked(r, 'self_top')))
            for r in runs]}
        for statistic, values in found.items():
            mean, low, high, n = stats.t_interval(values)
            rows.append({'setting': study.label[setting], 'layer': layer,
                         'statistic': statistic, 'mean': mean, 'lo': max(low, -1.0),
                         'hi': min(high, 1.0), 'runs': n})
    return rows


SAME_SIZE = {'b': 0.25, 'd': 0.03, 'e': 0.03}   # results/sotu-wide/README.md fixed these


def across_texts(study):
    """Claims (b), (d), (e) on each text of runs that differ in their text alone, and how they
    compare (results/sotu-wide/README.md): the verdicts kept or changed, and the difference of
    the two texts' mean units with a two-sample (Welch) interval read against SAME_SIZE."""
    texts = group_by_text(study)
    if len(texts) != 2:
        return {}
    found = {key: [text_claim(study, key, settings) for settings in texts.values()]
             for key in SAME_SIZE}
    rows = []
    for key, (first, second) in found.items():
        if first is None or second is None:
            continue
        diff, low, high = welch(second['values'], first['values'])
        size = SAME_SIZE[key]
        reading = 'different' if low > size or high < -size else 'undecided'
        if -size <= low and high <= size:
            reading = 'the same'
        rows.append({'claim': key, 'text 1': first['text'], 'verdict 1': first['verdict'],
                     'text 2': second['text'], 'verdict 2': second['verdict'],
                     'verdicts': kept(first['verdict'], second['verdict']),
                     'difference (2 - 1)': diff, 'lo': low, 'hi': high, 'size': reading})
    return {'across_texts': rows}


def group_by_text(study):
    """{data_sha256: the settings of its runs} where the runs' settings but their control arm
    differ in the text alone; {} otherwise."""
    def rest(run):
        base = json.loads(run.base)
        base.pop('data_sha256', None)
        return json.dumps(base, sort_keys=True)
    if len({rest(run) for run in study.runs}) != 1:
        return {}
    texts = group(study.runs, lambda run: run.settings.get('data_sha256'))
    return {text: {run.setting for run in runs} for text, runs in texts.items()}


def text_claim(study, key, settings):
    """A claim judged on one text's runs: (b) over its uncontrolled runs, (d) and (e) on the spec
    arm the claims table reads; its verdict word and unit values."""
    claim = ALL[key]
    if claim.unit == 'pair':
        found = [pairs for setting, _, pairs, _ in engine.deciding(claim, study, 'spec')
                 if setting in settings and pairs]
        res = engine.judge(claim, found[0]) if found else None
    else:
        runs = [r for r in engine.uncontrolled(study.runs) if r.setting in settings]
        view = engine.view_of(engine.own_lens(claim), claim.window, study.from_iter)
        res = engine.judge(claim, runs, view) if runs else None
    if res is None or not res['n']:
        return None
    text = study.label[next(iter(settings))]
    return {'text': text, 'verdict': res['verdict'], 'values': np.array(res['values'], float)}


def kept(first, second):
    if 'undecided' in (first, second):
        return 'undecided'
    return 'kept' if first == second else 'changed'


def welch(values, others):
    """The difference of two samples' means with its 95% Welch interval."""
    var, var_other = values.var(ddof=1) / len(values), others.var(ddof=1) / len(others)
    se = math.sqrt(var + var_other)
    spread = var ** 2 / (len(values) - 1) + var_other ** 2 / (len(others) - 1)
    half = 0.0   # two samples without spread: their difference is exact
    if spread > 0:
        df = (var + var_other) ** 2 / spread   # Welch-Satterthwaite
        half = stats.t_quantile(0.5 + stats.LEVEL / 2, df) * se
    diff = float(values.mean() - others.mean())
    return diff, diff - half, diff + half


# The study's exploratory sections, outside the claims and Holm: fn(study) -> {table stem: rows}
EXPLORATORY = (token_layers, what_sets_entropy, layer_effects, route_rows, layer_mediation,
               self_match, across_texts)


# ----------------------------------------------------------------------------------- the analysis
def registries():
    """What the engine reads of this file, as it stands when the analysis runs."""
    return dict(claims=CLAIMS, stats={s.key: s for s in CLAIMS + STATS}, family=FAMILY,
                lenses=LENSES, windows=WINDOWS, references=REFERENCES, exploratory=EXPLORATORY)


def analyze(paths, out=None, figures=True, from_iter=None, log=print):
    """Load, compute, write; the Study. Skip (no usable run) or OutError (out refused) first."""
    study = engine.analyze(paths, registries(), out, from_iter, log)
    report.publish(study, figures, log)
    return study


def main(argv=None):
    p = argparse.ArgumentParser(description='REPORT.md, tables and figures from run folders')
    p.add_argument('dirs', nargs='+', help='folders searched for run folders (holding config.json)')
    p.add_argument('--out', default=None, help='where to write (default: <first dir>/analysis)')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    p.add_argument('--from_iter', type=int, default=None,
                   help="where 'from warm-up on' starts (default: warmup_iters)")
    a, t0 = p.parse_args(sys.argv[1:] if argv is None else list(argv)), time.time()
    try:
        bad = [d for d in a.dirs if not os.path.isdir(d)]
        if bad:
            raise Skip(f'{", ".join(bad)}: not a folder (pass the out_dir of train.py, or a folder '
                       'above it)')
        s = analyze(a.dirs, a.out, not a.no_figures, a.from_iter)
    except (Skip, OutError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{len(s.runs)} runs used, {len(s.skipped)} skipped, {len(s.label)} settings')
    for r in s.tables['claims']:
        print(f"{r['key']:<9} {r['verdict'][:46]:<46} {r['scope'][:60]}")
    print(f'wrote {len(s.files)} files in {time.time() - t0:.1f}s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
