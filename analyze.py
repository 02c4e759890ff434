"""
Run folders in, the study's evidence out: REPORT.md, tables, figures.

    python analyze.py out/ [more/] [--out=DIR] [--no_figures] [--from_iter=N]   # -> out/analysis/

A new logged metric (say `qk_cos` per layer) with a claim and a figure:
    1. a statistic:  def final_cos(run, view): return run.final('qk_cos')
    2. a row:        Claim(key='g', text='(g) queries and keys align', stat='final qk_cos',
                     fn=final_cos, margin=0.05) in CLAIMS (outside Holm unless in FAMILY), or
                     Stat(...) in STATS (descriptive)
    3. a figure:     Figure('fig11_cos', fn(study, tables), 'Regime', 'its title') in plots.FIGURES

A statistic is fn(unit, view); a unit is a seed (a run), a seed pair (a controlled run and the none
run of its other settings and seed) or a model (a run or a pretrained series, read at its model
checkpoints); (a), (b) give signs per trajectory (a layer of a run), summarised per seed
(stats.share). A view: a lens and a window. Why (a), (b) start where the init is
forgotten and (d), (e) read the spec arm: README.md. (a), (b) read only the records of the regular
grid (every geom_interval-th iteration and the last): the log-spaced extra records move with a
run's length. (f1), (f2) read the token-level values of a model's checkpoints: train.py's
model_ckpts iterations in our runs, every record of a pretrained series.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import namedtuple
from dataclasses import dataclass
from functools import reduce
from itertools import product

import numpy as np

import control
import geometry
import plots
import report
from plumbing import folders, stats
from plumbing.folders import FINAL_LOGS, OutError, Skip, group
from plumbing.stats import nanmean
from report import shown, verdict_text

WELL_BELOW = -0.20
NOT_MEASURED = {   # why a statistic has no unit with a value, by its unit
    'seed': 'not logged, or no run with a value in this view',
    'pair': 'no seed pair with a value (not logged)',
    'model': 'no model with a value: a Spearman needs 3 or more checkpoints (heads) that differ',
    'trajectory': (f'no trajectory has a reference record before its last {FINAL_LOGS} records '
                   '(runs too short for this window)')}

# ------------------------------------------------------------------------------------------ views
Lens = namedtuple('Lens', 'q k qk size what')   # per-head lists: the key without _head, + _heads
LENSES = {'whole': Lens('pr_q', 'pr_k', 'pr_qk', 'C', 'whole-matrix weight PR'),
          'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'd', 'per-head weight PR'),
          'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'C', 'token-level PR'),
          'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'C', 'learned part W - W(0)')}
WINDOWS = {'all': 'all records', 'warmup': 'from warm-up on', 'post': 'after the init is forgotten'}
FORGOTTEN = ('init forgotten (the first record where ||W - W(0)||_F >= ||W(0)||_F for W_Q and '
             'W_K)')
REFERENCES = {'all': ('the first record',),
              'warmup': ('the end of warm-up', 'twice that', '10% of training'),
              'post': (FORGOTTEN, '25% of training', '50% of training')}
View = namedtuple('View', 'lens window from_iter', defaults=('whole', 'all', None))
NO_LENS = 'no lens'   # the map's column of a statistic that reads no lens


def view_of(lens, window, from_iter=None):
    """The View of a map cell's lens and window (a statistic with no lens is read as 'whole')."""
    return View('whole' if lens == NO_LENS else lens, window, from_iter)


def own_lens(stat):
    return stat.lenses[0] if stat.lenses else NO_LENS


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


def on_grid(run):
    """The run on its regular grid: its records at multiples of geom_interval and at max_iters."""
    if 'grid' not in run.memo:
        every, last = run.cfg.get('geom_interval'), run.cfg.get('max_iters')
        keep = np.ones(len(run.iters), bool)
        if type(every) is int and every > 0:
            keep = (run.iters % every == 0) | (run.iters == last)
        m = {k: v[keep] for k, v in run.m.items()}
        run.memo['grid'] = dataclasses.replace(run, iters=run.iters[keep], m=m, memo={})
        run.memo['grid'].use(run.settings)   # as the study read them (folders.load_runs)
    return run.memo['grid']


def seed_mean(runs):
    """One run: the per-layer mean over runs (a setting's seeds) at the grid records they share."""
    grids = [on_grid(r) for r in runs]
    its = reduce(np.intersect1d, [g.iters for g in grids])
    keys = {k for g in grids for k, v in g.m.items() if v.ndim == 2}
    m = {k: nanmean(folders.stack(grids, k, its)[1], axis=0) for k in sorted(keys)}
    mean = dataclasses.replace(grids[0], iters=its, m=m, memo={})
    mean.use(runs[0].settings)
    return mean


def checkpoints(run):
    """The indices of the records measured on a model checkpoint (all of a pretrained series')."""
    if run.pretrained:
        return np.arange(len(run.iters))
    return np.flatnonzero(np.isin(run.iters, sorted(geometry.model_ckpt_iters(run.cfg))))


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


@dataclass(frozen=True, kw_only=True)
class Stat:
    key: str
    stat: str                   # the statistic of one unit, in words
    fn: object                  # fn(unit, view): a number (a trajectory claim: signs, see moves)
    unit: str = 'seed'          # seed | pair | model | trajectory
    lenses: tuple = ()          # its own first; the map measures it in each (none: reads no lens)
    window: str = 'all'         # its own
    tables: tuple = ()          # map, regime, trend (REPORT.md, fig9), optimizer, control
    control: str = ''           # a pair's control kind ('': any)
    log: bool = False           # fn gives logs; intervals, ref and margin are shown as their exp
    limits: tuple = (-math.inf, math.inf)   # intervals are clipped to these (CORRELATION)


@dataclass(frozen=True, kw_only=True)
class Claim(Stat):
    text: str                   # what the paper says
    sign: int = +1              # the predicted sign of (statistic - ref)
    ref: float = 0.0            # in the units of the value shown (a log claim: a ratio)
    margin: float = 0.0         # no effect: the interval inside ref -/+ margin
    beside: tuple = ()          # 'key' or 'key@window' shown beside (a pair claim: the fro arm's)
    tables: tuple = ('map', 'regime')


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


def judge(stat, units, view=View()):
    """A statistic over units by its interval rule, judged if a Claim: {n, est, lo, hi, p, verdict,
    why, values}; a trajectory claim adds hits, mirror, seeds, per_ref, per_part."""
    found = [stat.fn(u, view) for u in units]
    res = shares(found) if stat.unit == 'trajectory' else interval(stat, found)
    res.update({'verdict': '', 'why': '', 'p': math.nan})
    if isinstance(stat, Claim):
        res.update(decide(stat, res))
    if not res['n']:
        res['verdict'], res['why'] = 'not measured', NOT_MEASURED[stat.unit]
    if stat.log:
        res.update(zip(('est', 'lo', 'hi'), np.exp([res['est'], res['lo'], res['hi']])))
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in res.items()}


def interval(stat, values):
    """The Student-t interval of the finite values, clipped to the statistic's limits."""
    v = np.array(values, dtype=float)
    v = v[np.isfinite(v)]
    est, lo, hi, n = stats.t_interval(v)
    return {'values': list(v), 'n': n, 'est': est, 'lo': max(lo, stat.limits[0]),
            'hi': min(hi, stat.limits[1]), 'df': n - 1,
            'se': float(v.std(ddof=1)) / math.sqrt(n) if n > 1 else 0}


def outcomes(signs):
    """Per trajectory: +1 if every sign it has (over references or records, and parts) is +1, -1
    if every one is -1, else 0; NaN with none."""
    fin = np.isfinite(signs)
    def every(x):
        return (np.where(fin, signs, x) == x).all((1, 2))
    found = np.where(every(1), 1.0, np.where(every(-1), -1.0, 0.0))
    return np.where(fin.any((1, 2)), found, np.nan)


def shares(signs):
    """The per-seed shares of a trajectory claim and its mirror; counts per reference and part."""
    signs = [s for s in signs if np.size(s)]
    found = [outcomes(s) for s in signs]
    count = [int(np.isfinite(o).sum()) for o in found]
    hold = [int((o == 1).sum()) for o in found]
    mirror = [int((o == -1).sum()) for o in found]
    names = ('est', 'lo', 'hi', 'se_lo', 'se_hi', 'df')
    res = dict(zip(names, stats.share(hold, count)))
    res.update({f'mirror_{k}': v for k, v in zip(names, stats.share(mirror, count))})
    res.update({'values': [h / c for h, c in zip(hold, count) if c], 'n': sum(count),
                'hits': sum(hold), 'mirror': sum(mirror), 'seeds': sum(c > 0 for c in count)})
    if signs and len({s.shape[1:] for s in signs}) == 1 and signs[0].shape[2] > 1:
        cat = np.concatenate(signs)   # trajectories x references x parts
        refs, parts = range(cat.shape[1]), range(cat.shape[2])
        held = [int((cat[:, r] == 1).all(1).sum()) for r in refs]
        res['per_ref'] = [(k, int(np.isfinite(cat[:, r]).all(1).sum())) for k, r in zip(held, refs)]
        res['per_part'] = [int((outcomes(cat[..., p:p + 1]) == 1).sum()) for p in parts]
    return res


def decide(claim, res):
    """The verdict, why it could not decide, and the two-sided p of the interval's test."""
    if claim.unit == 'trajectory':   # holds, reversed (the mirror holds), fails (neither can)
        word, why = stats.verdict(res['lo'], res['hi'], claim.sign, claim.ref, 0,
                                  f"{res['seeds']} seeds", (res['mirror_lo'], res['mirror_hi']))
        def p(x, side):
            return stats.p_value(res[f'{x}est'], claim.ref, res[f'{x}se_{side}'], res['df'])
        found = {'holds': p('', 'lo'), 'reversed': p('mirror_', 'lo'),
                 'fails': max(p('', 'hi'), p('mirror_', 'hi'))}
        return {'verdict': word, 'why': why, 'p': found.get(word, 1.0)}
    to_value = np.exp if claim.log else float
    word, why = stats.verdict(to_value(res['lo']), to_value(res['hi']), claim.sign, claim.ref,
                              claim.margin, res['n'])
    ref, low, high = claim.ref, claim.ref - claim.margin, claim.ref + claim.margin
    if claim.log:   # ref and margin are in the units shown: the statistic is their log
        ref, low, high = (math.log(x) if x > 0 else -math.inf for x in (ref, low, high))
    if word == 'no effect':   # two one-sided tests, doubled to match the two-sided interval
        tails = [stats.t_sf((res['est'] - low) / res['se'], res['df']),
                 stats.t_sf((high - res['est']) / res['se'], res['df'])] if res['se'] else [0.0]
        p = 2 * max(tails)
    elif word == 'undecided':
        p = 1.0
    else:
        p = stats.p_value(res['est'], ref, res['se'], res['df'])
    return {'verdict': word, 'why': why, 'p': min(p, 1.0)}


# -------------------------------------------------------------------------------------- groupings
def uncontrolled(runs):
    return [r for r in runs if r.control == 'none' and not r.pretrained]


def arms(runs, rank):
    """{(the baseline's setting, arm): [(controlled, baseline run)] by seed}: settings in rank's
    order, then other control keys, shrink from the weakest dose."""
    base, found = {(r.base, r.seed): r for r in uncontrolled(runs)}, {}
    for r in sorted((r for r in runs if r.control != 'none'), key=lambda r: r.seed):
        b = base.get((r.base, r.seed))
        if b is not None:
            found.setdefault((b.setting, r.arm), []).append((r, b))

    def order(key):
        setting, arm = key
        rest = [sort_key(v) for n, v in arm if n not in control.DOSES]
        doses = [-dict(arm).get(key, 0) for key in control.DOSES]   # the weakest dose first
        return (rank[setting], *rest, *doses)
    return {key: found[key] for key in sorted(found, key=order)}


def deciding(claim, study, keep):
    """[(setting, arm, pairs or None, why)] deciding a control claim on W_K per family of one keep:
    every freeze arm; the strongest shrink dose moving PR_K well below the baseline."""
    out, rel = [], ALL['d_pr_head_rel']
    for (setting, rest), keys in folders.families(study.arms, claim.control).items():
        if (dict(rest).get('control_target'), dict(rest).get('control_keep')) != ('k', keep):
            continue
        if claim.control == 'freeze':
            out += [(setting, key[1], study.arms[key], '') for key in keys]
            continue
        found = {key: judge(rel, study.arms[key]) for key in keys}
        strong = [key for key in keys if found[key]['hi'] < WELL_BELOW]
        if strong:
            out.append((setting, strong[-1][1], study.arms[strong[-1]], ''))
            continue
        doses = ', '.join(f"shrink_to {dict(k[1])['shrink_to']:g}: {shown(rel, found[k])}"
                          for k in keys)
        why = f'no dose moves per-head PR_K well below the baseline ({doses})'
        out.append((setting, keys[0][1], None, why))
    return out


def twins(arm):
    """What a spec arm and its fro arm share: the arm without its keep and its dose."""
    return tuple(x for x in folders.undosed(arm) if x[0] != 'control_keep')


def robustness_cells(study):
    """The map: each map statistic in every lens x window over the uncontrolled runs; claims in
    their own view per weight decay on W_Q, W_K; (d), (e) per deciding arm and keep."""
    pool, cells = uncontrolled(study.runs), []
    split = group(pool, lambda r: bool(r.cfg['decay_qk'] and r.cfg['weight_decay'] > 0))
    for s in (s for s in CLAIMS + STATS if s.unit in ('trajectory', 'seed') and 'map' in s.tables):
        lenses = s.lenses or (NO_LENS,)
        views = [(lens, window, 'pooled', pool) for lens, window in product(lenses, WINDOWS)]
        if isinstance(s, Claim) and len(split) > 1:
            views += [(lenses[0], s.window, d, runs) for d, runs in split.items()]
        for lens, window, d, runs in views:
            res = judge(s, runs, view_of(lens, window, study.from_iter))
            cells.append({'key': s.key, 'lens': lens, 'window': window, 'decay': d, 'keep': '',
                          **res})
    for c in (c for c in CLAIMS if c.unit == 'pair'):
        for keep in ('spec', 'fro'):
            for setting, arm, pairs, why in deciding(c, study, keep):
                res = judge(c, pairs) if pairs else {'n': 0, 'verdict': 'not measured', 'why': why}
                cells.append({'key': c.key, 'lens': '', 'window': '', 'decay': '', 'keep': keep,
                              'pairs': pairs, 'setting': study.label[setting], 'twins': twins(arm),
                              'arm': study.arm_name(arm), **res})
    return cells


def beside(claim, study, pool, cell):
    """Shown beside a claim's verdict: Claim.beside (a pair claim: the fro arm's); a trajectory
    claim's count over seed-averaged trajectories; (a)'s counts per reference and part."""
    if claim.unit == 'pair':
        if not cell.get('pairs'):
            return ''
        more = [f"{k} {shown(ALL[k], judge(ALL[k], cell['pairs']))}" for k in claim.beside]
        return '; '.join([f"keep=fro ({cell['arm']}): {shown(claim, cell)}"] + more)
    out, view = [], view_of(own_lens(claim), claim.window, study.from_iter)
    if claim.unit == 'trajectory':   # the paper's unit: a setting's layer averaged over its seeds
        settings = group(pool, lambda r: r.setting).values()
        res = shares([claim.fn(seed_mean(rs), view) for rs in settings])
        hits, mirror, n = res['hits'], res['mirror'], res['n']
        out.append(f'seed-averaged layers: {hits}/{n}, mirror {mirror}/{n}')
    if cell.get('per_ref'):
        names = [name.split(' (')[0] for name in REFERENCES[claim.window]]
        counts = ', '.join(f'{name} {k}/{n}' for name, (k, n) in zip(names, cell['per_ref']))
        rises, falls = cell['per_part']
        out.append(f'from each reference: {counts}; PR_Q rises in {rises}, PR_K falls in {falls}')
    for key, _, window in (entry.partition('@') for entry in claim.beside):
        s = ALL[key]
        res = judge(s, pool, view_of(own_lens(s), window or s.window, study.from_iter))
        where = f' ({WINDOWS[window]})' if window else ''
        out.append(f'{key}{where}: {shown(s, res)}')
    return '; '.join(out)


def models(study):
    """{source: the units of a model claim}: uncontrolled runs, pretrained series (q, k as used)."""
    ours = uncontrolled(study.runs)
    series = [r for r in study.series if r.cfg.get('rope') in (None, 'none', 'after')]
    return {name: rs for name, rs in (('our checkpoints', ours), ('pretrained models', series))
            if rs}


def claims_table(study, cells):
    """Each claim in its own view, (d), (e) per setting, (f1), (f2) per source; Holm over them."""
    pool, rows = uncontrolled(study.runs), []
    where = f'{len(pool)} uncontrolled runs in {len(group(pool, lambda r: r.setting))} settings'
    for c in (c for c in CLAIMS if study.runs or c.unit == 'model'):   # a series: model claims
        if c.unit == 'pair':
            fro = {(x['setting'], x['twins']): x for x in cells
                   if x['key'] == c.key and x['keep'] == 'fro'}
            spec = [x for x in cells if x['key'] == c.key and x['keep'] == 'spec']
            spec = spec or [dict(x, n=0, verdict='not measured', why='no control_keep=spec arm')
                            for x in fro.values()]
            found = [(x, f"{x['setting']}, {x['arm']}",
                      beside(c, study, pool, fro.get((x['setting'], x['twins']), {})))
                     for x in spec]
        elif c.unit == 'model':
            found = [(judge(c, rs), f'{source}: {len(rs)} series', '')
                     for source, rs in models(study).items()]
        else:
            own = (c.key, own_lens(c), c.window, 'pooled')
            x = next(x for x in cells if (x['key'], x['lens'], x['window'], x['decay']) == own)
            lens = f'{LENSES[c.lenses[0]].what}, ' if c.lenses else ''
            scope = f'{where}; {lens}{WINDOWS[c.window]}'
            found = [(x, scope, beside(c, study, pool, x))]
        for x, scope, also in found:
            rows.append({'key': c.key, 'claim': c.text, 'scope': scope, 'n': x['n'],
                         'est': x.get('est'), 'lo': x.get('lo'), 'hi': x.get('hi'),
                         'p': x.get('p', math.nan), 'value': shown(c, x) if x['n'] else x['why'],
                         'beside': also, 'verdict': verdict_text(x) if x['n'] else x['verdict']})
    judged = [r for r in rows if np.isfinite(r['p']) and r['key'] in FAMILY]
    for r, p in zip(judged, stats.holm([r['p'] for r in judged])):
        r.update(p_holm=p, holm=r['verdict'].split(' (')[0] if p < stats.ALPHA else 'undecided')
    return rows


# ------------------------------------------------------------------------------------- the regime
def regime(study):
    """(a row per statistic and point (uncontrolled setting), all layers; their trends); none below
    2 points."""
    points = group(uncontrolled(study.runs), lambda r: r.setting)
    if len(points) < 2:
        return [], []
    shown_here = [s for s in CLAIMS + STATS
                  if s.unit in ('trajectory', 'seed') and {'regime', 'optimizer'} & set(s.tables)]
    rows, found = [], {}
    for setting, runs in points.items():
        for s in shown_here:
            res = judge(s, runs, view_of(own_lens(s), s.window, study.from_iter))
            found[(setting, s.key)] = res
            rows.append({'point': study.label[setting], 'statistic': s.key, 'seeds': len(runs),
                         'n': res['n'], 'est': res['est'], 'lo': res['lo'], 'hi': res['hi'],
                         'value': shown(s, res), 'verdict': res['verdict']})
    return rows, trends(study, points, found)


def axes(points):
    """The settings varying between points but a constant multiple of an earlier one (lr / 10)."""
    cfgs = [runs[0].settings for runs in points.values()]
    def numeric(k):
        return all(type(c.get(k)) in folders.NUMBER and c.get(k) for c in cfgs)
    out = []
    for k in (k for k in folders.varying(cfgs) if k not in control.KEYS):
        def ratio(a):
            return {round(c[k] / c[a], 12) for c in cfgs}
        multiple = any(numeric(a) and numeric(k) and len(ratio(a)) == 1 for a in out)
        if not multiple:
            out.append(k)
    return out


def trends(study, points, found):
    """Per numeric axis, each line of points equal in every other axis: its line_trends."""
    ax, cfg, out = axes(points), {s: runs[0].settings for s, runs in points.items()}, []
    for axis in (a for a in ax if all(type(c.get(a)) in folders.NUMBER for c in cfg.values())):
        def others(s):
            return tuple((a, cfg[s].get(a)) for a in ax if a != axis)
        for fixed, line in group(points, others).items():
            head = {'axis': axis, 'line': ', '.join(f'{a}={v}' for a, v in fixed) or 'all points'}
            at = {s: cfg[s][axis] for s in sorted(line, key=lambda s: cfg[s][axis])}
            out += line_trends(study, found, head, at)
    return out


def line_trends(study, found, head, at):
    """Each statistic's stats.trend over a line's points (at: setting -> its value on the axis; x
    is its log2 where every value is positive), the trend's reading and the point verdicts."""
    log2, out = all(v > 0 for v in at.values()), []
    for key in dict.fromkeys(k for _, k in found):
        have = [s for s in at if found[(s, key)]['values']]
        if len(have) < 2:
            continue
        units = [found[(s, key)]['values'] for s in have]
        fit = stats.trend([math.log2(at[s]) if log2 else at[s] for s in have], units)
        means = [np.mean(u) for u in units]
        out.append({**head, 'members': ' | '.join(study.label[s] for s in have),
                    'statistic': key, **fit,
                    'reading': reading(fit, np.exp(means) if ALL[key].log else means),
                    'verdicts': ', '.join(found[(s, key)]['verdict'] or '-' for s in have)})
    return out


def side(lo, hi, up, down, neither):
    """The word for an interval: up above 0, down below 0, else neither."""
    return up if lo > 0 else down if hi < 0 else neither


def reading(fit, means):
    """The line (up, down, no clear slope, or not a line by lack of fit) and the monotone trend."""
    line = side(fit['lo'], fit['hi'], 'up', 'down', 'no clear slope')
    if fit['lof_p'] < stats.ALPHA:
        line = 'not a line: point means ' + ', '.join(f'{m:.3g}' for m in means)
    elif fit['points'] == 2:
        line += ' (2 points: no lack-of-fit test)'
    mono = side(fit['rho_lo'], fit['rho_hi'], 'rises monotonically', 'falls monotonically',
                'no monotone trend')
    return f'{line}; {mono}' if np.isfinite(fit['rho_lo']) else line


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


# ------------------------------------------------------------------------------- the other tables
def control_dose(study):
    """Each paired statistic over an arm's seed pairs, with (d) or (e)'s verdict."""
    dose, paired = [], [s for s in STATS if 'control' in s.tables]
    for (setting, arm), pairs in study.arms.items():
        kind, target = dict(arm)['control'], dict(arm)['control_target']
        claim = next((c for c in CLAIMS if c.control == kind), None)
        res = {s.key: judge(s, pairs) for s in paired}
        row = {'setting': study.label[setting], 'arm': study.arm_name(arm), 'n': len(pairs),
               'baseline PR/head': nanmean([b.final(f'pr_{target}_head') for _, b in pairs])}
        row.update({s.key[2:]: shown(s, res[s.key]) for s in paired})
        row['well below'] = bool(res['d_pr_head_rel']['hi'] < WELL_BELOW)
        row.update(predicted(claim, pairs, target))
        dose.append(row)
    return dose


def predicted(claim, pairs, target):
    """The predicted sign's count and the verdict of a kind's claim on an arm's pairs; a kind with
    no claim (a fork's new one) and the mirror get no verdict."""
    if claim is None:
        return {'predicted sign': '-', 'verdict': 'no claim on this kind: no verdict'}
    eff = judge(claim, pairs)
    k = sum(v * claim.sign > 0 for v in eff['values'])
    return {'predicted sign': f"{k}/{eff['n']}",
            'verdict': verdict_text(eff) if target == 'k' else 'mirror: no verdict'}


def dose_fits(study):
    """Per family of 2+ shrink doses: the entropy change on the per-head PR change, alone and with
    the change in log qk_spec_norm; jackknife-t over seeds (a seed's arms share its baseline)."""
    out = []
    for (setting, rest), keys in folders.families(study.arms, 'shrink').items():
        if len(keys) < 2:
            continue
        pairs = [p for k in keys for p in study.arms[k]]
        def over_pairs(key):
            return [ALL[key].fn(p, View()) for p in pairs]
        y, seeds = over_pairs('d_entropy'), [c.seed for c, _ in pairs]
        pr_k, scale = over_pairs('d_pr_head'), over_pairs('d_log_qk_spec_norm')
        one = stats.fit_groups(y, pr_k, seeds)
        two = stats.fit_groups(y, np.column_stack([pr_k, scale]), seeds)
        doses = ' '.join(f"{dict(k[1])['shrink_to']:g}" for k in keys)
        row = {'setting': study.label[setting], 'arm': study.arm_name(rest), 'doses': doses,
               'pairs': len(pairs)}
        for name, fit, i in (('slope', one, 1), ('pr_coef', two, 1), ('scale_coef', two, 2)):
            row.update({name: fit['coef'][i], f'{name}_lo': fit['lo'][i],
                        f'{name}_hi': fit['hi'][i]})
        row['entropy follows PR_K'] = side(row['pr_coef_lo'], row['pr_coef_hi'], 'follows',
                                           'goes against', 'undecided')
        out.append(row)
    return out


def runs_rows(study):
    rows = [{'run': r.name, 'setting': study.label[r.setting], 'seed': r.seed,
             'arm': study.arm_name(r.arm), 'records': len(r.iters),
             'last_iter': int(r.iters[-1]) if len(r.iters) else None,
             'train_loss': r.final_loss('train_loss'), 'val_loss': r.final_loss('val_loss'),
             'wall_time': r.done.get('wall_time'), 'notes': len(r.notes), 'path': r.path}
            for r in study.runs]
    return rows + [{'run': os.path.basename(p), 'path': p, 'notes': f'skipped: {why}'}
                   for p, why in study.skipped]


def setting_rows(study):
    groups, rows = group(study.runs, lambda r: r.setting), []
    keys = folders.varying([rs[0].settings for rs in groups.values()])
    for s, rs in groups.items():
        seeds = ' '.join(str(r.seed) for r in rs)
        row = {'setting': study.label[s], 'runs': len(rs), 'seeds': seeds}
        rows.append({**row, **{k: rs[0].settings.get(k) for k in keys}})
    return rows


def token_rows(study):
    """A row per model of each source: its checkpoints and the statistics of (f1), (f2)."""
    rows = []
    for source, runs in models(study).items():
        for r in runs:
            steps = r.iters[checkpoints(r)]
            row = {'source': source, 'model': r.name, 'setting': study.label.get(r.setting, r.name),
                   'seed': r.seed, 'checkpoints': len(steps),
                   'first_step': int(steps[0]) if len(steps) else None,
                   'last_step': int(steps[-1]) if len(steps) else None}
            rows.append({**row, **{c.key: c.fn(r, View()) for c in CLAIMS if c.unit == 'model'}})
    return rows


def token_layer_rows(study):
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
    return rows


# ----------------------------------------------------------------------------------- the analysis
@dataclass
class Study:
    """The loaded runs and what is computed from them (the figures and the report read it)."""
    paths: list
    out: str
    runs: list                  # runs of train.py
    skipped: list
    warnings: list
    series: list = ()           # pretrained series: read by the model claims only
    from_iter: int = None
    label: dict = None          # setting -> its name: the values where it differs from the others
    arms: dict = None
    tables: dict = None
    files: list = None
    arm_keys: tuple = ()        # control keys that vary between arms beyond those arm_label names
    stats: dict = None          # the registries: key -> Stat or Claim

    def arm_name(self, arm):
        return control.label(dict(arm), self.arm_keys)


def sort_key(value):
    """Orders a setting's values: numbers by size, the rest by their JSON text, absent last."""
    if type(value) in folders.NUMBER:
        return (0, value, '')
    return (1, 0, json.dumps(value)) if value is not None else (2, 0, '')


def by_value(runs):
    """The runs, settings in the order of their values (keys in config order), then seed; ranks."""
    settings = {r.setting: r.settings for r in runs}
    keys = folders.varying(list(settings.values()))
    def key(s):
        return tuple(sort_key(settings[s].get(k)) for k in keys)
    rank = {s: i for i, s in enumerate(sorted(settings, key=key))}
    return sorted(runs, key=lambda r: (rank[r.setting], r.seed)), rank


def load(paths, out=None, from_iter=None, log=print):
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')
    loaded, skipped = folders.load_runs(paths, warn)
    series = [r for r in loaded if r.pretrained]
    runs, rank = by_value([r for r in loaded if not r.pretrained])
    study = Study(list(paths), out or os.path.join(paths[0], 'analysis'), runs, skipped, warnings,
                  series, from_iter, stats=ALL)
    groups = group(runs, lambda r: r.setting)
    cfgs = [rs[0].settings for rs in groups.values()]
    names = folders.labels(cfgs, folders.varying(cfgs), [r.settings for r in uncontrolled(runs)])
    study.label, study.arms = dict(zip(groups, names)), arms(runs, rank)
    controlled = [dict(r.arm) for r in runs if r.control != 'none']
    named = ('control', 'control_target', 'control_keep', *control.DOSES)   # in the label
    study.arm_keys = [k for k in folders.varying(controlled) if k not in named]
    paired = {c for pairs in study.arms.values() for c, _ in pairs}
    for r in (r for r in runs if r.control != 'none' and r not in paired):
        warn(f'{r.path}: no control=none run with the same other settings and seed: left out of '
             'the control tables')
    return study


def analyze(paths, out=None, figures=True, from_iter=None, log=print):
    """Load, compute, write; the Study. Skip (no usable run) or OutError (out refused) first."""
    study = load(paths, out, from_iter, log)
    folders.check_out(study.out)
    if not study.runs and not study.series:
        raise Skip(f'no usable run folder under {", ".join(paths)} ({len(study.skipped)} skipped)')
    cells, (points, lines) = robustness_cells(study) if study.runs else [], regime(study)
    t = study.tables = dict(claims=claims_table(study, cells), cells=cells, regime=points,
                            regime_trend=lines, control_dose=control_dose(study),
                            control_dose_fit=dose_fits(study), runs=runs_rows(study),
                            settings=setting_rows(study), token_series=token_rows(study),
                            token_layers=token_layer_rows(study),
                            **what_sets_entropy(study))
    figs = plots.draw(study, t, log) if figures else {'files': {}, 'notes': []}
    files = {**figs['files'], **report.map_tables(cells, ALL)}
    for stem in sorted(set(t) - {'cells'}):
        files.update(folders.table(stem, t[stem]))
    files['REPORT.md'] = report.write(study, t, CLAIMS, ALL, figs['notes'], files, REFERENCES,
                                      FAMILY)
    study.files = folders.write_files(study.out, files)
    return study


# -------------------------------------------------------------------------------- the command line
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
