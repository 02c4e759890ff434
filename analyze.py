"""
Run folders in, the study's evidence out: REPORT.md, tables, figures.

    python analyze.py out/ [more/] [--out=DIR] [--no_figures] [--from_iter=N]   # -> out/analysis/

A new logged metric (say `qk_cos` per layer) with a claim and a figure:
    1. a statistic:  def final_cos(run, view): return run.final('qk_cos', layers_of(run, view))
    2. a row:        Claim(key='g', text='(g) queries and keys align', stat='final qk_cos', fn=final_cos,
                     margin=0.05) in CLAIMS (the seed's claims), or Stat(...) in STATS (descriptive)
    3. a figure:     Figure('fig11_cos', fn(study, tables), 'Regime', 'its title') in plots.FIGURES

A statistic is fn(unit, view); a unit is a seed (a run), a seed pair (a controlled run and the none run of its
other settings and seed) or a model (a token series); (a), (b) give signs per trajectory (a layer of a run),
summarised per seed (stats.share). A view: a lens, a window, a layer position.

A random init's whole-matrix PR starts near C/2 and collapses for hundreds of iterations, so a reference there
tests the collapse. (a), (b) are judged after the init is forgotten, from the first record where
||W - W(0)||_F >= ||W(0)||_F for W_Q and W_K (the learned part then dominates), 25% and 50% of training.

(d), (e) are decided on the control_keep=spec arm: the top singular value kept, the spectrum changes shape and
the logits are not pushed up; the fro arm (a narrower spectrum, larger logits) is beside. (d) takes the
strongest shrink dose whose per-head PR_K change lies below WELL_BELOW.
"""
import argparse
import math
import os
import sys
import time
from collections import namedtuple
from dataclasses import dataclass

import numpy as np

import folders
import plots
import report
import stats
from folders import FINAL_LOGS, OutError, Skip, group
from report import shown, verdict_text
from stats import nanmean

WELL_BELOW = -0.20

# ----------------------------------------------------------------------------- views
Lens = namedtuple('Lens', 'q k qk size what')   # a per-head list: the key without _head, with _heads
LENSES = {'whole': Lens('pr_q', 'pr_k', 'pr_qk', 'C', 'whole-matrix weight PR'),
          'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'd', 'per-head weight PR'),
          'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'C', 'token-level PR'),
          'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'C', 'learned part W - W(0)')}
WINDOWS = {'all': 'all records', 'warmup': 'from warm-up on', 'post': 'after the init is forgotten'}
REFERENCES = {'all': ('the first record',), 'warmup': ('the end of warm-up', 'twice that', '10% of training'),
              'post': ('init forgotten (the first record where ||W - W(0)||_F >= ||W(0)||_F for W_Q and W_K)',
                       '25% of training', '50% of training')}
POSITIONS = ('all', 'first', 'middle', 'last')
View = namedtuple('View', 'lens window position from_iter', defaults=('whole', 'all', 'all', None))


def layers_of(run, view):
    n = run.n_layer
    return {'all': list(range(n)), 'first': [0], 'middle': list(range(1, n - 1)), 'last': [n - 1]}[
        view.position]


def usable(run, it):
    """The index of the first record at or after iteration it, before the final records."""
    i = len(run.iters) if it is None else int(np.searchsorted(run.iters, it))
    return i if i < len(run.iters) - FINAL_LOGS else None


def references(run, view, layers):
    """The window's REFERENCES' iterations (None: not reached)."""
    m, w = run.cfg['max_iters'], run.cfg['warmup_iters'] if view.from_iter is None else view.from_iter
    if view.window != 'post':
        return [int(view.lens == 'learned')] if view.window == 'all' else [w, 2 * w, m / 10]
    gone = np.flatnonzero(np.all([run.m[k][:, layers] >= 1 for k in ('dq_rel', 'dk_rel') if k in run.m]
                                 or [[[False]]], (0, 2)))
    return [int(run.iters[gone[0]]) if len(gone) else None, m / 4, m / 2]


def start(run, view, layers):
    """The first iteration a window keeps (after the init is forgotten: the earliest usable reference)."""
    refs = references(run, view, layers)
    found = [run.iters[i] for i in (usable(run, it) for it in refs) if i is not None] + [math.inf]
    return max(min(found) if view.window == 'post' else refs[0], int(view.lens == 'learned'))


# ----------------------------------------------------------------------------- statistics of one unit
def series(run, key, i):
    return run.m[key][:, i] if key in run.m else np.full(len(run.iters), np.nan)


def moves(run, view):
    """(a), per trajectory and reference: the signs of PR_Q(end) - PR_Q(ref) and PR_K(ref) - PR_K(end)."""
    out, lens = [], LENSES[view.lens]
    for i in layers_of(run, view):
        q, k = series(run, lens.q, i), series(run, lens.k, i)
        q1, k1 = nanmean(q[-FINAL_LOGS:]), nanmean(k[-FINAL_LOGS:])
        at = [usable(run, it) for it in references(run, view, [i])]
        out.append([(np.nan, np.nan) if j is None else (np.sign(q1 - q[j]), np.sign(k[j] - k1)) for j in at])
    return np.array(out, dtype=float)


def gap_signs(run, view):
    """(b), per trajectory and record from the window's start (after iteration 0): sign(PR_Q - PR_K)."""
    lens = LENSES[view.lens]
    return np.array([np.where(run.iters >= max(start(run, view, [i]), 1), np.sign(
        series(run, lens.q, i) - series(run, lens.k, i)), np.nan)[:, None] for i in layers_of(run, view)])


def values(run, role, lens, heads, layers):
    """(records, values) of a role (k, qk: the lens' PR_K, PR_QK; entropy; scale: log ||W_QK^h||_2), per
    (layer, head) or per layer; None if not logged."""
    key = {'entropy': 'entropy', 'scale': 'qk_spec_norm'}.get(role) or getattr(LENSES[lens], role)
    key = key.removesuffix('_head') + '_heads' if heads else key
    if key not in run.m:
        return None
    a = run.m[key][:, layers]
    with np.errstate(divide='ignore', invalid='ignore'):
        return (np.log(np.where(a > 0, a, np.nan)) if role == 'scale' else a).reshape(len(a), -1)


def correlation(x, y, scope='heads', kind='spearman', changes=False):
    """A statistic of a run: the correlation of roles x, y (partial: given the scale), of levels or of changes
    between records; across each record's (layer, head) pairs, mean over records (heads), or over the run's
    records, mean over layers (time)."""
    roles = (x, y, 'scale') if kind == 'partial' else (x, y)
    corr = dict(spearman=stats.spearman_rows, pearson=stats.pearson_rows, partial=stats.partial_rows)[kind]

    def fn(run, view):
        layers = layers_of(run, view)
        vals = [values(run, role, view.lens, scope == 'heads', layers) for role in roles]
        if not layers or any(v is None for v in vals):
            return math.nan
        keep = run.iters >= start(run, view, layers)
        if scope == 'time':
            return nanmean(corr(*((np.diff(v[keep], axis=0) if changes else v[keep]).T for v in vals)))
        key = (x, y, kind, changes, view.lens, view.position)
        if key not in run.memo:   # every window of the run reads the same per-record correlations
            run.memo[key] = corr(*(np.diff(v, axis=0) if changes else v for v in vals))
        return nanmean(run.memo[key][keep[:-1] if changes else keep])
    return fn


def final_pr(stat):
    """A statistic of a run: final (PR_Q - PR_K) / C (/ d per head: comparable across widths), or log(PR_Q /
    PR_K)."""
    def fn(run, view):
        lens, layers = LENSES[view.lens], layers_of(run, view)
        q, k = (np.array([run.final(key, [i]) for i in layers]) for key in (lens.q, lens.k))
        with np.errstate(divide='ignore', invalid='ignore'):
            return nanmean(q - k) / getattr(run, lens.size) if stat == 'gap' else nanmean(np.log(q / k))
    return fn


def value(key, at='final'):
    """A statistic of a run: a metric's layer mean, final or at the first record."""
    return lambda run, view: run.final(key, layers_of(run, view)) if at == 'final' else \
        nanmean(run.m[key][0, layers_of(run, view)]) if key in run.m and len(run.iters) else math.nan


def conserved_imbalance(run, view):
    """The final qk_imbalance had D_h kept its norm: imbalance_h(0) gram_h(0) / gram_h(t)."""
    if not {'qk_imbalance_heads', 'qk_gram_heads'} <= set(run.m) or not len(run.iters):
        return math.nan
    imb, gram = (run.m[k][:, layers_of(run, view)] for k in ('qk_imbalance_heads', 'qk_gram_heads'))
    with np.errstate(divide='ignore', invalid='ignore'):
        return nanmean(imb[0] * gram[0] / gram[-FINAL_LOGS:])


def change(key, how='difference'):
    """A statistic of a seed pair: key's final value (pr_ctl_head: the controlled projection's per-head PR),
    controlled against baseline: difference, relative change or log ratio."""
    def fn(pair, view):
        name = f'pr_{pair[0].cfg["control_target"]}_head' if key == 'pr_ctl_head' else key
        a, b = (r.final_loss(name) if name.endswith('_loss') else r.final(name, layers_of(r, view))
                for r in pair)
        if how == 'difference':
            return a - b
        return (a / b - 1 if how == 'relative' else math.log(a / b)) if a > 0 and b > 0 else math.nan
    return fn


def token_column(column):
    """A statistic of a model: a column of its token summary (uncontrolled; q, k as attention uses)."""
    return lambda row, view: row[column] if (row.get('control') or 'none') == 'none' and (
        row.get('rope') or 'none') in ('none', 'after') else math.nan


# ----------------------------------------------------------------------------- the registries
@dataclass(frozen=True, kw_only=True)
class Stat:
    key: str
    stat: str                   # the statistic of one unit, in words
    fn: object                  # fn(unit, view): a number (a trajectory claim: signs, see moves)
    unit: str = 'seed'          # seed | pair | model | trajectory
    lenses: tuple = ('whole',)  # its own first; the map measures it in each
    window: str = 'warmup'      # its own
    tables: tuple = ()          # map, regime, trend (REPORT.md, fig9), optimizer, control
    control: str = ''           # a pair's control kind ('': any)
    log: bool = False           # logs, shown as exp of their mean
    limits: tuple = (-1, 1)     # an interval is clipped to these


@dataclass(frozen=True, kw_only=True)
class Claim(Stat):
    text: str                   # what the seed's study says
    sign: int = +1              # the predicted sign of (statistic - ref)
    ref: float = 0.0
    margin: float = 0.0         # no effect: the interval inside ref -/+ margin
    beside: tuple = ()          # 'key' or 'key@window' shown beside (a pair claim: the fro arm's)
    tables: tuple = ('map', 'regime')


ALL4, HEADS, INF = tuple(LENSES), ('head', 'tok', 'learned'), (-math.inf, math.inf)
PAIRS, D = 'across the (layer, head) pairs of a record, mean over records', 'controlled - baseline'
SHARE, C = dict(unit='trajectory', lenses=ALL4, window='post', ref=0.5), dict(lenses=HEADS, margin=0.1)
CLAIMS = [
    Claim(key='a', text='(a) PR_Q grows and PR_K falls over training', fn=moves, **SHARE,
          stat='PR_Q(end) > PR_Q(ref) and PR_K(end) < PR_K(ref) from every reference; mirror: PR_Q falls and '
          'PR_K rises from every one', beside=('a@warmup',)),
    Claim(key='b', text='(b) PR_Q - PR_K > 0 along every trajectory', fn=gap_signs, **SHARE,
          stat='PR_Q - PR_K > 0 at every record from the first reference; mirror: < 0 at every one',
          beside=('b@all', 'ratio_end', 'ratio_end_head')),
    Claim(key='c', text='(c) lower PR_K goes with lower attention entropy, across heads',
          stat=f'Spearman of PR_K with entropy {PAIRS}', fn=correlation('k', 'entropy'), **C),
    Claim(key='c-qk', text='(c) lower PR_K goes with a narrower QK^T spectrum, across heads',
          stat=f'Spearman of PR_K with PR_QK {PAIRS}', fn=correlation('k', 'qk'), **C),
    Claim(key='c-d', text='(c) changes of PR_K go with changes of entropy, across heads',
          stat='the same of the changes between records', fn=correlation('k', 'entropy', changes=True), **C),
    Claim(key='c-dqk', text='(c) changes of PR_K go with changes of PR_QK, across heads',
          stat='the same of PR_K with PR_QK', fn=correlation('k', 'qk', changes=True), **C),
    Claim(key='c2', text="(c2) the key spectrum's shape tracks entropy beyond the logit scale", **C,
          stat=f'Pearson partial correlation of PR_K with entropy given log ||W_QK^h||_2 {PAIRS}',
          fn=correlation('k', 'entropy', kind='partial')),
    *[Claim(key=key, text=text, stat=f'final attention entropy, {D}', fn=change('entropy'), unit='pair',
            sign=sign, margin=0.02, control=kind, beside=('d_qk_spec_norm',), tables=('regime',), limits=INF)
      for key, kind, sign, text in (('d', 'shrink', -1, '(d) shrinking the key spectrum sharpens attention'),
                                    ('e', 'freeze', +1, '(e) freezing the key spectrum softens attention'))],
    *[Claim(key=key, text=text, stat=stat, fn=token_column(col), unit='model', sign=sign, margin=0.1,
            tables=()) for key, text, col, sign, stat in (
        ('f1-early', '(f1) token-level PR_Q - PR_K rises early', 'rho_early', +1, 'Spearman of tok_pr_q - '
         "tok_pr_k with log(1 + step) over a model's early checkpoints (log step at or below its median), "
         'mean over layers'),
        ('f1-late', '(f1) ... and decays later', 'rho_late', -1,
         'the same over the late checkpoints (at or above the median)'),
        ('f2', '(f2) token-level interaction rank tracks attention entropy', 'link_rho', +1, 'Spearman of '
         "tok_pr_qk with entropy across the (layer, head) pairs of a model's last checkpoint"))],
]
TIME = 'within a run over its records, per layer, mean over layers'
STATS = [
    *[Stat(key=key, stat=f'{stat} {PAIRS}', fn=fn, lenses=HEADS, tables=('map',) + more)
      for key, stat, fn, more in (
        ('qk~entropy', 'Spearman of PR_QK with entropy', correlation('qk', 'entropy'), ()),
        ('k~entropy (r)', 'Pearson of PR_K with entropy', correlation('k', 'entropy', kind='pearson'), ()),
        ('qk~entropy|scale', 'Pearson partial of PR_QK with entropy given the log scale',
         correlation('qk', 'entropy', kind='partial'), ()),
        ('scale~entropy', 'Pearson of log ||W_QK^h||_2 with entropy',
         correlation('scale', 'entropy', kind='pearson'), ('regime',)))],
    *[Stat(key=key, stat=f'{stat} {TIME}', fn=fn, lenses=ALL4, window='all', tables=('map',))
      for key, stat, fn in (
        ('k~entropy over time', 'Spearman of PR_K with entropy (two trends correlate, linked or not)',
         correlation('k', 'entropy', 'time')),
        ('dk~dentropy over time', 'Spearman of their changes between records',
         correlation('k', 'entropy', 'time', changes=True)),
        ('k~qk over time', 'Spearman of PR_K with PR_QK', correlation('k', 'qk', 'time')),
        ('k~entropy|scale over time', 'Pearson partial of PR_K with entropy given the log scale',
         correlation('k', 'entropy', 'time', 'partial')))],
    *[Stat(key=f'{stat}_end{suffix}', stat=f'final {what} in the {LENSES[lens].what}', fn=final_pr(stat),
           lenses=(lens,), log=stat == 'ratio', limits=INF, tables=('regime',) + ('trend',) * (
               stat == 'ratio' and lens != 'learned') + ('optimizer',) * (lens == 'head' and stat == 'ratio'))
      for lens, suffix in (('whole', ''), ('head', '_head'), ('learned', '_learned'))
      for stat, what in (('gap', f'(PR_Q - PR_K) / {LENSES[lens].size}'), ('ratio', 'PR_Q / PR_K'))],
    *[Stat(key=key, stat=stat, fn=fn, tables=tables, limits=INF) for key, stat, fn, tables in (
        ('entropy_end', 'final attention entropy (nats)', value('entropy'), ('regime', 'trend')),
        ('imbalance_start', 'qk_imbalance at the first record', value('qk_imbalance', 'first'),
         ('optimizer',)),
        ('imbalance_end', 'final qk_imbalance', value('qk_imbalance'), ('regime', 'optimizer', 'trend')),
        ('imbalance_conserved', 'final qk_imbalance had D_h kept its initial norm', conserved_imbalance,
         ('optimizer',)),
        ('drift_end', 'final qk_drift, ||D_h(t) - D_h(0)||_F / gram(t)', value('qk_drift'),
         ('regime', 'optimizer')),
        ('dq_rel_end', 'final ||W_Q - W_Q(0)||_F / ||W_Q(0)||_F', value('dq_rel'), ('optimizer',)),
        ('val_loss', 'final validation loss', lambda r, view: r.final_loss('val_loss'),
         ('regime', 'optimizer')),
        ('train_val_gap', 'final val_loss - train_loss', lambda r, v: r.final_loss('val_loss') -
         r.final_loss('train_loss'), ('regime', 'trend')))],
    *[Stat(key=f'd_{key}', stat=f'{stat}, {D}', fn=fn, unit='pair', tables=('control',) + more, limits=INF)
      for key, stat, fn, more in (
        ('entropy', 'final entropy', change('entropy'), ()),
        ('pr_head', 'final per-head PR of the controlled projection', change('pr_ctl_head'), ()),
        ('pr_head_rel', "the same relative to the baseline's", change('pr_ctl_head', 'relative'), ()),
        ('qk_spec_norm', 'final qk_spec_norm', change('qk_spec_norm'), ('map', 'regime')),
        ('log_qk_spec_norm', 'final log qk_spec_norm', change('qk_spec_norm', 'log'), ()),
        ('k_spec_norm', 'final k_spec_norm (top singular value of W_K^h)', change('k_spec_norm'), ()),
        ('q_spec_norm', 'final q_spec_norm', change('q_spec_norm'), ()),
        ('val_loss', 'final val_loss', change('val_loss'), ('map', 'regime')))],
]
ALL = {s.key: s for s in CLAIMS + STATS}


def judge(stat, units, view=View()):
    """A statistic over units by its interval rule, judged if a Claim: {n, est, lo, hi, p, verdict, why,
    values}; a trajectory claim adds hits, mirror, seeds, per_ref, per_part."""
    if stat.unit == 'trajectory':
        res = shares([stat.fn(u, view) for u in units])
    else:
        v = np.array([stat.fn(u, view) for u in units], dtype=float)
        v = v[np.isfinite(v)]
        est, lo, hi, n = stats.t_interval(v)
        res = {'values': list(v), 'n': n, 'est': est, 'lo': max(lo, stat.limits[0]), 'df': n - 1,
               'hi': min(hi, stat.limits[1]), 'se': float(v.std(ddof=1)) / math.sqrt(n) if n > 1 else 0}
    res.update({'verdict': '', 'why': '', 'p': math.nan})
    res.update(decide(stat, res) if isinstance(stat, Claim) else {})
    if not res['n']:
        res['verdict'], res['why'] = 'not measured', 'no trajectory has a reference record before its last ' \
            f'{FINAL_LOGS} records (runs too short for this window)' if stat.unit == 'trajectory' else \
            'not logged, or no unit with a value in this view'
    if stat.log:
        res.update(zip(('est', 'lo', 'hi'), np.exp([res['est'], res['lo'], res['hi']])))
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in res.items()}


def outcomes(signs):
    """Per trajectory: +1 if every sign it has (over references or records, and parts) is +1, -1 if every one
    is -1, else 0; NaN with none."""
    fin = np.isfinite(signs)
    every = lambda x: (np.where(fin, signs, x) == x).all((1, 2))
    return np.where(fin.any((1, 2)), np.where(every(1), 1.0, np.where(every(-1), -1.0, 0.0)), np.nan)


def shares(signs):
    """The per-seed shares of a trajectory claim and its mirror; with parts, counts per reference and part."""
    signs = [s for s in signs if np.size(s)]
    o = [outcomes(s) for s in signs]
    count, hold, mirror = ([int(x.sum()) for x in (np.isfinite(v) if w is None else v == w for v in o)]
                           for w in (None, 1, -1))
    (est, lo, hi, n_eff, df), m = stats.share(hold, count), stats.share(mirror, count)
    res = {'values': [h / c for h, c in zip(hold, count) if c], 'n': sum(count), 'est': est, 'lo': lo,
           'hi': hi, 'hits': sum(hold), 'mirror': sum(mirror), 'seeds': sum(c > 0 for c in count),
           'n_eff': n_eff, 'df': df, **dict(zip(('mirror_est', 'mirror_lo', 'mirror_hi', 'mirror_n_eff'), m))}
    if signs and len({s.shape[1:] for s in signs}) == 1 and signs[0].shape[2] > 1:   # references x parts
        cat = np.concatenate(signs)
        res['per_ref'] = [(int((cat[:, r] == 1).all(1).sum()), int(np.isfinite(cat[:, r]).all(1).sum()))
                          for r in range(cat.shape[1])]
        res['per_part'] = [int((outcomes(cat[..., p:p + 1]) == 1).sum()) for p in range(cat.shape[2])]
    return res


def decide(claim, res):
    """The verdict, why it could not decide, and the two-sided p of the test its interval inverts."""
    if claim.unit == 'trajectory':
        word, why = stats.verdict(res['lo'], res['hi'], claim.sign, claim.ref, 0, f"{res['seeds']} seeds",
                                  (res['mirror_lo'], res['mirror_hi']))
        se = lambda n_eff: math.sqrt(claim.ref * (1 - claim.ref) / n_eff)
        p = [stats.p_value(res[f'{x}est'], claim.ref, se(res[f'{x}n_eff']), res['df']) if res[f'{x}n_eff']
             else 1.0 for x in ('', 'mirror_')]
        return {'verdict': word, 'why': why, 'p': dict(holds=p[0], reversed=p[1], fails=max(p)).get(word, 1)}
    word, why = stats.verdict(res['lo'], res['hi'], claim.sign, claim.ref, claim.margin, res['n'])
    if word == 'no effect':   # two one-sided tests, doubled to match the two-sided interval
        p = 2 * max(stats.t_sf((res['est'] - claim.ref + s * claim.margin) * s / res['se'], res['df'])
                    for s in (1, -1)) if res['se'] else 0.0
    else:
        p = stats.p_value(res['est'], claim.ref, res['se'], res['df']) if word != 'undecided' else 1.0
    return {'verdict': word, 'why': why, 'p': min(p, 1.0)}


# ----------------------------------------------------------------------------- groupings
def uncontrolled(runs):
    return [r for r in runs if r.control == 'none']


def arms(runs):
    """{(the baseline's setting, arm): [(controlled, baseline run)] by seed}: setting, other control keys,
    shrink from the weakest dose."""
    base, found = {(r.base, r.seed): r for r in uncontrolled(runs)}, {}
    for r in sorted((r for r in runs if r.control != 'none'), key=lambda r: r.seed):
        if (r.base, r.seed) in base:
            found.setdefault((base[(r.base, r.seed)].setting, r.arm), []).append((r, base[(r.base, r.seed)]))
    order = lambda k: (k[0], *(str(v) for n, v in k[1] if n != 'shrink_to'), -dict(k[1]).get('shrink_to', 0))
    return {key: found[key] for key in sorted(found, key=order)}


def deciding(claim, study, keep):
    """[(setting, arm, pairs or None, why)] deciding a control claim on W_K per family of one keep: every
    freeze arm; the strongest shrink dose moving PR_K well below the baseline."""
    out, rel = [], ALL['d_pr_head_rel']
    for (setting, rest), keys in folders.families(study.arms, claim.control).items():
        if (dict(rest).get('control_target'), dict(rest).get('control_keep')) != ('k', keep):
            continue
        if claim.control == 'freeze':
            out += [(setting, key[1], study.arms[key], '') for key in keys]
            continue
        found = {key: judge(rel, study.arms[key]) for key in keys}
        strong = [key for key in keys if found[key]['hi'] < WELL_BELOW]
        why = 'no dose moves per-head PR_K well below the baseline (' + ', '.join(
            f"shrink_to {dict(k[1])['shrink_to']:g}: {shown(rel, found[k])}" for k in keys) + ')'
        out.append((setting, strong[-1][1], study.arms[strong[-1]], '') if strong else
                   (setting, keys[0][1], None, why))
    return out


def robustness_cells(study):
    """The map: each map statistic in every lens x window over the uncontrolled runs; claims in their own view
    per weight decay on W_Q, W_K; (d), (e) per deciding arm and keep."""
    pool, cells = uncontrolled(study.runs), []
    split = group(pool, lambda r: r.cfg['decay_qk'] and r.cfg['weight_decay'] > 0)
    for s in (s for s in CLAIMS + STATS if s.unit in ('trajectory', 'seed') and 'map' in s.tables):
        views = [(lens, w, 'pooled', pool) for lens in s.lenses for w in WINDOWS]
        for lens, window, d, runs in views + [(s.lenses[0], s.window, d, rs) for d, rs in split.items()
                                              if isinstance(s, Claim) and len(split) > 1]:
            cells.append({'key': s.key, 'lens': lens, 'window': window, 'decay': d, 'keep': '',
                          **judge(s, runs, View(lens, window, 'all', study.from_iter))})
    for c, keep in ((c, keep) for c in CLAIMS if c.unit == 'pair' for keep in ('spec', 'fro')):
        for setting, arm, pairs, why in deciding(c, study, keep):
            cells.append({'key': c.key, 'lens': '', 'window': '', 'decay': '', 'keep': keep, 'pairs': pairs,
                          'setting': study.label[setting], 'arm': study.arm_name(arm),
                          **(judge(c, pairs) if pairs else {'n': 0, 'verdict': 'not measured', 'why': why})})
    return cells


def beside(claim, study, pool, cell):
    """Shown beside a claim's verdict: Claim.beside (a pair claim: the fro arm's); (a)'s counts per reference
    and half."""
    if claim.unit == 'pair':
        return f"keep=fro ({cell['arm']}): {shown(claim, cell)}; " + '; '.join(
            f"{k} {shown(ALL[k], judge(ALL[k], cell['pairs']))}" for k in claim.beside) \
            if cell.get('pairs') else ''
    out = [f'from each reference: ' + ', '.join(f"{name.split(' (')[0]} {k}/{n}" for name, (k, n) in zip(
        REFERENCES[claim.window], cell['per_ref'])) + '; PR_Q rises in {}, PR_K falls in {}'.format(
        *cell['per_part'])] if cell.get('per_ref') else []
    for key, _, window in (entry.partition('@') for entry in claim.beside):
        s = ALL[key]
        res = judge(s, pool, View(s.lenses[0], window or s.window, 'all', study.from_iter))
        out.append(f"{key}{f' ({WINDOWS[window]})' if window else ''}: {shown(ALL[key], res)}")
    return '; '.join(out)


def claims_table(study, cells):
    """Each claim in its own view; (d), (e) per setting on the spec arm; (f1), (f2) per source; Holm over the
    rows judged."""
    pool, rows = uncontrolled(study.runs), []
    where = f'{len(pool)} uncontrolled runs in {len(group(pool, lambda r: r.setting))} settings'
    for c in CLAIMS:
        if c.unit == 'pair':
            fro = {x['setting']: x for x in cells if x['key'] == c.key and x['keep'] == 'fro'}
            spec = [x for x in cells if x['key'] == c.key and x['keep'] == 'spec'] or [
                dict(x, n=0, verdict='not measured', why='no control_keep=spec arm') for x in fro.values()]
            found = [(x, f"{x['setting']}, {x['arm']}", beside(c, study, pool, fro.get(x['setting'], {})))
                     for x in spec]
        elif c.unit == 'model':
            found = [(judge(c, rs), f'{source}: {len(rs)} series', '') for source, rs in study.tokens.items()]
        else:
            x = next(x for x in cells if (x['key'], x['lens'], x['window'], x['decay']) == (
                c.key, c.lenses[0], c.window, 'pooled'))
            scope = f'{where}; {LENSES[c.lenses[0]].what}, {WINDOWS[c.window]}'
            found = [(x, scope, beside(c, study, pool, x))]
        rows += [{'key': c.key, 'claim': c.text, 'scope': scope, 'n': x['n'], 'est': x.get('est'),
                  'lo': x.get('lo'), 'hi': x.get('hi'), 'p': x.get('p', math.nan),
                  'value': shown(c, x) if x['n'] else x['why'], 'beside': also,
                  'verdict': verdict_text(x) if x['n'] else x['verdict']} for x, scope, also in found]
    judged = [r for r in rows if np.isfinite(r['p'])]
    for r, p in zip(judged, stats.holm([r['p'] for r in judged])):
        r.update(p_holm=p, holm=r['verdict'].split(' (')[0] if p < stats.ALPHA else 'undecided')
    return rows


# ----------------------------------------------------------------------------- the regime
def regime(study):
    """Each statistic per point (a setting's uncontrolled runs) and layer position, and trends; None below 2
    points."""
    points = group(uncontrolled(study.runs), lambda r: r.setting)
    if len(points) < 2:
        return None
    rows, units = [], {}
    for setting, runs in points.items():
        tasks = [(s, s.key, runs) for s in CLAIMS + STATS if s.unit in ('trajectory', 'seed') and
                 {'regime', 'optimizer'} & set(s.tables)]
        tasks += [(s, f'{s.key} [{study.arm_name(arm)}]', pairs) for (p, arm), pairs in study.arms.items()
                  if p == setting for s in CLAIMS + STATS if s.unit == 'pair' and 'regime' in s.tables
                  and s.control in ('', dict(arm)['control'])]
        for (s, key, units_), pos in ((task, pos) for task in tasks for pos in POSITIONS):
            res = judge(s, units_, View(s.lenses[0], s.window, pos, study.from_iter))
            units[(setting, key, pos)] = res['values']
            rows.append({'point': study.label[setting], 'statistic': key, 'position': pos, 'seeds': len(runs),
                         'n': res['n'], 'est': res['est'], 'lo': res['lo'], 'hi': res['hi'],
                         'value': shown(s, res), 'verdict': res['verdict']})
    rows = [r for r in rows if r['n'] or r['position'] == 'all']
    return {'rows': rows, 'trends': trends(study, points, units, rows)}


def axes(points):
    """The settings that vary between points, but for a constant multiple of an earlier axis (min_lr = lr /
    10)."""
    cfgs = [runs[0].settings for runs in points.values()]
    numeric = lambda k: all(type(c.get(k)) in folders.NUMBER and c.get(k) for c in cfgs)
    out = []
    for k in (k for k in folders.varying(cfgs) if k not in folders.CONTROL_KEYS):
        out += [] if any(numeric(a) and numeric(k) and len({round(c[k] / c[a], 12) for c in cfgs}) == 1
                         for a in out) else [k]
    return out


def trends(study, points, units, rows):
    """Per numeric axis, line of 2+ points equal in every other axis, statistic and position: stats.trend over
    the units' values, its reading and the point verdicts."""
    ax, cfg, out = axes(points), {s: runs[0].settings for s, runs in points.items()}, []
    verdicts = {(r['point'], r['statistic'], r['position']): r['verdict'] for r in rows}
    for axis in (a for a in ax if all(type(c.get(a)) in folders.NUMBER for c in cfg.values())):
        others = lambda s: tuple((a, cfg[s].get(a)) for a in ax if a != axis)
        for fixed, line in group(points, others).items():
            line = sorted(line, key=lambda s: cfg[s][axis])
            log2 = all(cfg[s][axis] > 0 for s in line)
            x = {s: math.log2(cfg[s][axis]) if log2 else cfg[s][axis] for s in line}
            for key, pos in dict.fromkeys((k, p) for (s, k, p) in units if s in line and len(line) > 1):
                have = [s for s in line if units.get((s, key, pos))]
                fit = stats.trend(*zip(*[(x[s], v, s) for s in have for v in units[(s, key, pos)]])) \
                    if have else {}
                if fit.get('points', 0) < 2:
                    continue
                means = [np.mean(units[(s, key, pos)]) for s in have]
                log = ALL.get(key.split(' [')[0], STATS[0]).log
                out.append({'axis': axis, 'line': ', '.join(f'{a}={v}' for a, v in fixed) or 'all points',
                            'members': ' | '.join(study.label[s] for s in have), 'statistic': key,
                            'position': pos, **fit, 'reading': reading(fit, np.exp(means) if log else means),
                            'verdicts': ', '.join(verdicts[(study.label[s], key, pos)] or '-' for s in have)})
    return out


def reading(fit, means):
    """The line (up, down, no clear slope; not a line where lack of fit rejects it) and the monotone trend."""
    word = lambda lo, hi, up, down, none: up if lo > 0 else down if hi < 0 else none
    line = word(fit['lo'], fit['hi'], 'up', 'down', 'no clear slope')
    if fit['lof_p'] < stats.ALPHA:
        line = 'not a line: point means ' + ', '.join(f'{m:.3g}' for m in means)
    elif fit['points'] == 2:
        line += ' (2 points: no lack-of-fit test)'
    mono = word(fit['rho_lo'], fit['rho_hi'], 'rises monotonically', 'falls monotonically',
                'no monotone trend')
    return f'{line}; {mono}' if np.isfinite(fit['rho_lo']) else line


# ----------------------------------------------------------------------------- the other tables
def control_tables(study):
    """(control: every paired statistic per seed pair; control_dose: each over an arm's pairs)."""
    per_pair, dose, paired = [], [], [s for s in STATS if 'control' in s.tables]
    for (setting, arm), pairs in study.arms.items():
        head, kind = {'setting': study.label[setting], 'arm': study.arm_name(arm)}, dict(arm)['control']
        claim = next(c for c in CLAIMS if c.control == kind)
        res, eff = {s.key: judge(s, pairs) for s in paired}, judge(claim, pairs)
        per_pair += [{**head, 'seed': c.seed, 'run': c.path, 'baseline': b.path,
                      **{s.key: s.fn((c, b), View()) for s in paired}} for c, b in pairs]
        k = sum(v * claim.sign > 0 for v in eff['values'])
        dose.append({**head, 'n': len(pairs), 'baseline PR/head': nanmean([b.final(
            f"pr_{dict(arm)['control_target']}_head") for _, b in pairs]),
            **{s.key[2:]: shown(s, res[s.key]) for s in paired}, 'well below': bool(
                res['d_pr_head_rel']['hi'] < WELL_BELOW), 'predicted sign': f"{k}/{eff['n']}",
            'verdict': verdict_text(eff) if dict(arm)['control_target'] == 'k' else 'mirror: no verdict'})
    return per_pair, dose


def dose_fits(study):
    """Per family of 2+ shrink doses: the entropy change on the per-head PR change, alone and with the change
    in log qk_spec_norm; jackknife-t over seeds (a seed's arms share its baseline)."""
    out = []
    for (setting, rest), keys in folders.families(study.arms, 'shrink').items():
        pairs = [p for k in keys for p in study.arms[k]]
        f = lambda key: [ALL[key].fn(p, View()) for p in pairs]
        y, seeds = f('d_entropy'), [c.seed for c, _ in pairs]
        one = stats.fit_groups(y, f('d_pr_head'), seeds)
        two = stats.fit_groups(y, np.column_stack([f('d_pr_head'), f('d_log_qk_spec_norm')]), seeds)
        row = {'setting': study.label[setting], 'arm': study.arm_name(rest), 'doses': ' '.join(
            f"{dict(k[1])['shrink_to']:g}" for k in keys), 'pairs': len(pairs)}
        for name, fit, i in (('slope', one, 1), ('pr_coef', two, 1), ('scale_coef', two, 2)):
            row.update({name: fit['coef'][i], f'{name}_lo': fit['lo'][i], f'{name}_hi': fit['hi'][i]})
        row['entropy follows PR_K'] = 'follows' if row['pr_coef_lo'] > 0 else 'goes against' if \
            row['pr_coef_hi'] < 0 else 'undecided'
        out += [row] if len(keys) > 1 else []
    return out


def runs_rows(study):
    return [{'run': r.name, 'setting': study.label[r.setting], 'seed': r.seed, 'arm': study.arm_name(r.arm),
             'records': len(r.iters), 'last_iter': int(r.iters[-1]) if len(r.iters) else None,
             'train_loss': r.final_loss('train_loss'), 'val_loss': r.final_loss('val_loss'),
             'wall_time': r.done.get('wall_time'), 'notes': len(r.notes), 'path': r.path}
            for r in study.runs] + \
        [{'run': os.path.basename(p), 'path': p, 'notes': f'skipped: {why}'} for p, why in study.skipped]


def setting_rows(study):
    groups = group(study.runs, lambda r: r.setting)
    keys = folders.varying([rs[0].settings for rs in groups.values()])
    return [{'setting': study.label[s], 'runs': len(rs), 'seeds': ' '.join(str(r.seed) for r in rs),
             **{k: rs[0].settings.get(k) for k in keys}} for s, rs in groups.items()]


# ----------------------------------------------------------------------------- the analysis
@dataclass
class Study:
    """The loaded runs and what is computed from them (the figures and the report read it)."""
    paths: list
    out: str
    runs: list
    skipped: list
    warnings: list
    from_iter: int = None
    label: dict = None          # setting -> its name: the values in which it differs from the others
    arms: dict = None
    tokens: dict = None
    tables: dict = None
    files: list = None
    arm_keys: tuple = ()        # control keys that vary between arms beyond those arm_label names
    stats: dict = None          # the registries: key -> Stat or Claim

    def arm_name(self, arm):
        return folders.arm_label(dict(arm), self.arm_keys)


def load(paths, out=None, from_iter=None, log=print):
    warnings = []
    warn = lambda msg: (warnings.append(msg), log(f'warning: {msg}'))
    runs, skipped = folders.load_runs(paths, warn)
    study = Study(list(paths), out or os.path.join(paths[0], 'analysis'), runs, skipped, warnings, from_iter,
                  stats=ALL)
    groups = group(runs, lambda r: r.setting)
    cfgs = [rs[0].settings for rs in groups.values()]
    names = folders.labels(cfgs, folders.varying(cfgs), [r.settings for r in uncontrolled(runs)])
    study.label, study.arms = dict(zip(groups, names)), arms(runs)
    study.arm_keys = [k for k in folders.varying([dict(r.arm) for r in runs if r.control != 'none'])
                      if k not in ('control', 'control_target', 'control_keep', 'shrink_to')]
    paired = {c for pairs in study.arms.values() for c, _ in pairs}
    for r in (r for r in runs if r.control != 'none' and r not in paired):
        warn(f'{r.path}: no control=none run with the same other settings and seed: left out of the control '
             'tables')
    study.tokens = {}
    return study


def analyze(paths, out=None, figures=True, from_iter=None, log=print):
    """Load, compute, write; the Study. Skip (no usable run) or OutError (out refused) before writing."""
    study = load(paths, out, from_iter, log)
    folders.check_out(study.out)
    if not study.runs:
        raise Skip(f'no usable run folder under {", ".join(paths)} ({len(study.skipped)} skipped)')
    (per_pair, dose), reg, cells = control_tables(study), regime(study) or {}, robustness_cells(study)
    t = study.tables = dict(claims=claims_table(study, cells), cells=cells, regime=reg, control=per_pair,
                            control_dose=dose, runs=runs_rows(study),
                            control_dose_fit=dose_fits(study), settings=setting_rows(study),
                            regime_rows=reg.get('rows', []), regime_trend=reg.get('trends', []))
    figs = plots.draw(study, t, log) if figures else {'files': {}, 'notes': []}
    files = {**figs['files'], **report.map_tables(cells, ALL)}
    for stem in sorted(set(t) - {'cells', 'regime'}):
        files.update(folders.table(stem.replace('regime_rows', 'regime'), t[stem]))
    files['REPORT.md'] = report.write(study, t, CLAIMS, ALL, figs['notes'], files, REFERENCES)
    study.files = folders.write_files(study.out, files)
    return study


# ----------------------------------------------------------------------------- the command line
OPTIONS = [('from_iter', int, None, "where 'from warm-up on' starts (default: warmup_iters)")]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(usage='python analyze.py [options] DIR [DIR ...]',
                                description='REPORT.md, tables and figures from run folders')
    p.add_argument('dirs', nargs='+', help='folders searched for run folders (holding config.json)')
    p.add_argument('--out', default=None, help='where to write (default: <first dir>/analysis)')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    for name, kind, default, text in OPTIONS:
        p.add_argument(f'--{name}', type=kind, default=default, help=text)
    a, t0 = p.parse_args(argv), time.time()
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
