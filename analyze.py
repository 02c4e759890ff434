"""
Turn the run folders train.py writes into the study's evidence: REPORT.md, tables and figures, every verdict computed
by a rule generated from its CLAIMS row and printed beside it.

    python analyze.py out/ [more/] [--out=DIR] [--no_figures] [--from_iter=N]   # -> out/analysis/
    python analyze.py tokens out/ [--data_file=...]         # token level of our checkpoints (tokens.py)
    python analyze.py pretrained --model=EleutherAI/pythia-160m --revisions=pythia   # a pretrained series

Adding a metric that train.py logs, with a claim and a figure (say it now logs `qk_cos` per layer):
    1. a statistic, a function of one unit (here a run) and the view it is measured in:
           def final_cos(run, view):
               return run.final('qk_cos', layers_of(run, view))
    2. a CLAIMS row; the claims table, the robustness map, the regime table, its trends and the rule follow:
           Claim('g', '(g) queries and keys align', 'final qk_cos', 'seed', final_cos, sign=+1, margin=0.05),
    3. a figure: a function of the Study and its tables in plots.py, added to plots.FIGURES.
    A definitional range for the value, if it has one: folders.bounds.

Units, each independent and giving one value: a seed (a run), a seed pair (a controlled run and the control='none'
run of the same other settings and seed), a trajectory (the seed mean of one layer of one setting), a model (token
level). Intervals and verdicts are stats.py's. A claim is measured in a view: a lens (LENSES; the learned part starts
after iteration 0), a window (all records, or from the end of warm-up: warmup_iters, or --from_iter) and a layer
position. A run's final value of a metric is its mean over its last folders.FINAL_LOGS records.

Every table of claims is judge() over another grouping of units: the robustness map (every claim in every lens x
window over the uncontrolled runs, in its own view per weight decay on W_Q, W_K, and (d), (e) per (setting, arm));
the claims table (its cells in each claim's own view); the regime table (each claim per uncontrolled setting and layer
position, with trends along each numeric setting on lines holding the others fixed; a setting that is a constant
multiple of the axis, as min_lr = lr / 10, moves with it). (a) counts a trajectory when PR_Q ends above and PR_K
below their values at each of three references: the end of warm-up, twice that, and 10% of training. (d) is judged
at the strongest shrink dose whose per-head PR_K change has its interval below WELL_BELOW.

Outputs in --out (default <first dir>/analysis; folders.py says what it never overwrites): REPORT.md, the tables it
links (.csv, .md), the figures (plots.py); the token tables written there enter (f1), (f2) for the runs measured.
"""
import argparse
import math
import os
import sys
import time
from collections import namedtuple
from dataclasses import dataclass
from functools import reduce

import numpy as np

import folders
import plots
import report
import stats
import tokens
from folders import FINAL_LOGS, OutError, Skip, group
from report import shown, verdict_text
from stats import nanmean

WELL_BELOW = -0.20

# ----------------------------------------------------------------------------- views
Lens = namedtuple('Lens', 'q k qk q_heads k_heads qk_heads size what')   # size: a gap is divided by C or d
LENSES = {'whole': Lens('pr_q', 'pr_k', 'pr_qk', None, None, None, 'C', 'whole-matrix weight PR'),
          'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'pr_q_heads', 'pr_k_heads', 'pr_qk_heads', 'd',
                       'per-head weight PR'),
          'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'tok_pr_q_heads', 'tok_pr_k_heads', 'tok_pr_qk_heads', 'C',
                      'token-level PR'),
          'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'pr_dq_heads', 'pr_dk_heads', 'pr_qk_heads', 'C',
                          'learned part W - W(0)')}
WINDOWS = {'all': 'all records', 'warmup': 'from warm-up on'}
POSITIONS = ('all', 'first', 'middle', 'last')

View = namedtuple('View', 'lens window position from_iter', defaults=('whole', 'all', 'all', None))


def start(cfg, view):
    """The first iteration a view keeps (the learned part: after iteration 0, where W - W(0) = 0)."""
    s = 0 if view.window == 'all' else view.from_iter if view.from_iter is not None else cfg['warmup_iters']
    return max(s, 1) if view.lens == 'learned' else s


def layers_of(run, view):
    n = run.n_layer
    return {'all': list(range(n)), 'first': [0], 'middle': list(range(1, n - 1)), 'last': [n - 1]}[view.position]


# ----------------------------------------------------------------------------- statistics of one unit
Trajectory = namedtuple('Trajectory', 'setting cfg layer its q k view n_seeds')


def seed_mean(runs, key, its):
    """(len(its), n_layer): the mean over the seeds that logged key (NaN where none did)."""
    return nanmean(folders.stack(runs, key, its)[1], 0)


def trajectories(runs, view):
    """Per setting and layer: seed means of the lens' PR_Q, PR_K at the window's iterations every seed logged."""
    key, memo = ('traj', tuple(r.path for r in runs), view), runs[0].memo if runs else {}
    if key not in memo:
        memo[key], lens = [], LENSES[view.lens]
        for setting, rs in group(runs, lambda r: r.setting).items():
            its = reduce(np.intersect1d, [r.iters for r in rs])
            its = its[its >= start(rs[0].cfg, view)]
            q, k = seed_mean(rs, lens.q, its), seed_mean(rs, lens.k, its)
            memo[key] += [Trajectory(setting, rs[0].cfg, i, its, q[:, i], k[:, i], view, len(rs))
                          for i in layers_of(rs[0], view)] if len(its) > 1 else []
    return memo[key]


def rises_and_falls(t):
    """(a), per reference record: PR_Q(end) > PR_Q(ref) and PR_K(end) < PR_K(ref); None if not measurable."""
    s, out = t.its[0], []
    for ref in (s,) if t.view.window == 'all' else (s, 2 * s, t.cfg['max_iters'] / 10):
        i = int(np.searchsorted(t.its, ref))
        if i >= len(t.its) - 1 or not np.isfinite([t.q[i], t.q[-1], t.k[i], t.k[-1]]).all():
            return None
        out.append(bool(t.q[-1] > t.q[i] and t.k[-1] < t.k[i]))
    return tuple(out)


def gap_throughout(t):
    """(b): PR_Q - PR_K > 0 at every record after iteration 0 (tied init starts at exactly 0)."""
    gap = (t.q - t.k)[t.its > 0]
    return bool((gap[np.isfinite(gap)] > 0).all()) if np.isfinite(gap).any() else None


def values(run, role, lens, heads, layers):
    """(records, values): a role's values (k, qk: the lens' PR_K, PR_QK; entropy; scale: log ||W_QK^h||_2) at the
    layers, per (layer, head) pair with heads, else per layer; None when not logged."""
    key = {'entropy': 'entropy', 'scale': 'qk_spec_norm'}.get(role)
    key = key + '_heads' * heads if key else getattr(LENSES[lens], role + '_heads' * heads)
    if key not in run.m:
        return None
    a = run.m[key][:, layers]
    if role == 'scale':
        with np.errstate(divide='ignore', invalid='ignore'):
            a = np.log(np.where(a > 0, a, np.nan))
    return a.reshape(len(a), -1)


def correlation(x, y, scope='heads', kind='spearman', changes=False):
    """A statistic of a run: the correlation of roles x and y (partial: given the scale), of levels or of changes
    between consecutive records. heads: across the (layer, head) pairs of each record, mean over the window's
    records (steps); time: within the run over the window's records, per layer, mean over layers."""
    roles = (x, y, 'scale') if kind == 'partial' else (x, y)
    corr = {'spearman': stats.spearman_rows, 'pearson': stats.pearson_rows, 'partial': stats.partial_rows}[kind]

    def fn(run, view):
        layers = layers_of(run, view)
        vals = [values(run, role, view.lens, scope == 'heads', layers) for role in roles]
        if not layers or any(v is None for v in vals):
            return math.nan
        keep = run.iters >= start(run.cfg, view)
        if scope == 'time':
            vals = [np.diff(v[keep], axis=0) if changes else v[keep] for v in vals]
            return nanmean(corr(*(v.T for v in vals)))
        key = (x, y, kind, changes, view.lens, view.position)
        if key not in run.memo:   # every window of the run reads the same per-record correlations
            run.memo[key] = corr(*(np.diff(v, axis=0) if changes else v for v in vals))
        return nanmean(run.memo[key][keep[:-1] if changes else keep])
    fn.limits = (-1, 1)
    return fn


def final_layers(run, key, layers):
    return nanmean(run.m[key][-FINAL_LOGS:, layers], 0) if key in run.m else np.full(len(layers), np.nan)


def final_pr(stat):
    """A statistic of a run: final (PR_Q - PR_K) / C (whole matrix; / d per head: comparable across widths), or
    log(PR_Q / PR_K) (shown as the geometric mean of the ratio)."""
    def fn(run, view):
        lens, layers = LENSES[view.lens], layers_of(run, view)
        q, k = final_layers(run, lens.q, layers), final_layers(run, lens.k, layers)
        with np.errstate(divide='ignore', invalid='ignore'):
            return nanmean(q - k) / getattr(run, lens.size) if stat == 'gap' else nanmean(np.log(q / k))
    return fn


def value(key, at='final'):
    """A statistic of a run: a metric's mean over the layers of the view, at its first record or final."""
    return lambda run, view: run.final(key, layers_of(run, view)) if at == 'final' else \
        nanmean(run.m[key][0, layers_of(run, view)]) if key in run.m else math.nan


def conserved_imbalance(run, view):
    """What the final qk_imbalance would be had D_h kept its initial norm: imbalance_h(0) gram_h(0) / gram_h(t)."""
    if not {'qk_imbalance_heads', 'qk_gram_heads'} <= set(run.m):
        return math.nan
    imb, gram = (run.m[k][:, layers_of(run, view)] for k in ('qk_imbalance_heads', 'qk_gram_heads'))
    with np.errstate(divide='ignore', invalid='ignore'):
        return nanmean(imb[0] * gram[0] / gram[-FINAL_LOGS:])


def change(key, how='difference'):
    """A statistic of a seed pair: the final value of key (pr_ctl_head: the per-head PR of the controlled
    projection; *_loss: done.json's), controlled against baseline: difference, relative change or log ratio."""
    def fn(ctl, base, view):
        name = f'pr_{ctl.cfg["control_target"]}_head' if key == 'pr_ctl_head' else key
        a, b = ((r.final_loss(name) if name.endswith('_loss') else r.final(name, layers_of(r, view)))
                for r in (ctl, base))
        if how == 'difference':
            return a - b
        return (a / b - 1 if how == 'relative' else math.log(a / b)) if a > 0 and b > 0 else math.nan
    return fn


def token_column(column):
    """A statistic of a model: a column of its token summary row (uncontrolled; q, k as attention uses them)."""
    return lambda rows: [r[column] for r in rows if (r.get('control') or 'none') == 'none'
                         and (r.get('rope') or 'none') in ('none', 'after')]


# ----------------------------------------------------------------------------- the claims
@dataclass(frozen=True)
class Claim:
    key: str
    text: str                  # what it says ('' for a statistic without a prediction)
    stat: str                  # the statistic of one unit
    unit: str                  # trajectory | seed | pair | model
    fn: object
    sign: int = 0              # the predicted sign of (statistic - ref); 0: descriptive, no verdict
    ref: float = 0.0
    margin: float = 0.0        # no effect: the interval inside ref -/+ margin
    lenses: tuple = ('whole',)  # its own lens first; the robustness map measures it in each
    window: str = 'all'        # its own window
    control: str = ''          # a pair claim: the arms it judges
    log: bool = False          # values are logs, shown as exp of their mean (a geometric mean)
    where: str = 'map regime'  # the tables it is in beside its own: the map (descriptive), the regime table


ALL4, HEADS, PAIRS = tuple(LENSES), ('head', 'tok', 'learned'), 'across the (layer, head) pairs of a record'
TIME, D = 'within a run over its records, per layer, mean over layers', 'controlled - baseline'
CLAIMS = [
    Claim('a', '(a) PR_Q grows and PR_K falls over training', 'PR_Q(end) > PR_Q(ref) and PR_K(end) < PR_K(ref) from '
          'every reference record', 'trajectory', rises_and_falls, +1, 0.5, 0.1, ALL4, 'warmup'),
    Claim('b', '(b) PR_Q - PR_K > 0 along every trajectory', 'PR_Q - PR_K > 0 at every record after iteration 0',
          'trajectory', gap_throughout, +1, 0.9, 0.0, ALL4),
    Claim('c', '(c) lower PR_K goes with lower attention entropy, across heads', f'Spearman of PR_K with entropy '
          f'{PAIRS}, mean over records', 'seed', correlation('k', 'entropy'), +1, 0, 0.1, HEADS, 'warmup'),
    Claim('c-qk', '(c) lower PR_K goes with a narrower QK^T spectrum, across heads', f'Spearman of PR_K with PR_QK '
          f'{PAIRS}, mean over records', 'seed', correlation('k', 'qk'), +1, 0, 0.1, HEADS, 'warmup'),
    Claim('c-d', '(c) changes of PR_K go with changes of entropy, across heads', 'the same of the changes between '
          'consecutive records, mean over steps', 'seed', correlation('k', 'entropy', changes=True), +1, 0, 0.1, HEADS,
          'warmup'),
    Claim('c-dqk', '(c) changes of PR_K go with changes of PR_QK, across heads', 'the same of PR_K with PR_QK', 'seed',
          correlation('k', 'qk', changes=True), +1, 0, 0.1, HEADS, 'warmup'),
    Claim('c2', "(c2) the key spectrum's shape tracks entropy beyond the logit scale", 'Pearson partial correlation '
          f'of PR_K with entropy given log ||W_QK^h||_2 {PAIRS}, mean over records', 'seed',
          correlation('k', 'entropy', kind='partial'), +1, 0, 0.1, HEADS, 'warmup'),
    Claim('qk~entropy', '', f'Spearman of PR_QK with entropy {PAIRS}', 'seed', correlation('qk', 'entropy'),
          lenses=HEADS, window='warmup', where='map'),
    Claim('k~entropy (r)', '', f'Pearson of PR_K with entropy {PAIRS}', 'seed',
          correlation('k', 'entropy', kind='pearson'), lenses=HEADS, window='warmup', where='map'),
    Claim('qk~entropy|scale', '', f'Pearson partial of PR_QK with entropy given the log scale {PAIRS}', 'seed',
          correlation('qk', 'entropy', kind='partial'), lenses=HEADS, window='warmup', where='map'),
    Claim('scale~entropy', '', f'Pearson of log ||W_QK^h||_2 with entropy {PAIRS}', 'seed',
          correlation('scale', 'entropy', kind='pearson'), lenses=HEADS, window='warmup'),
    *[Claim(key, '', f'{stat} {TIME}', 'seed', fn, lenses=ALL4, where='map') for key, stat, fn in (
        ('k~entropy over time', 'Spearman of PR_K with entropy (two trends correlate, linked or not)',
         correlation('k', 'entropy', 'time')),
        ('dk~dentropy over time', 'Spearman of their changes between records',
         correlation('k', 'entropy', 'time', changes=True)),
        ('k~qk over time', 'Spearman of PR_K with PR_QK', correlation('k', 'qk', 'time')),
        ('k~entropy|scale over time', 'Pearson partial of PR_K with entropy given the log scale',
         correlation('k', 'entropy', 'time', 'partial')))],
    *[Claim(f'{stat}_end{suffix}', '', f'final {what} in the {LENSES[lens].what}', 'seed', fn, lenses=(lens,),
            log=stat == 'ratio', where='regime') for lens, suffix in (('whole', ''), ('head', '_head'),
                                                                       ('learned', '_learned'))
      for stat, what, fn in (('gap', f'(PR_Q - PR_K) / {LENSES[lens].size}', final_pr('gap')),
                             ('ratio', 'PR_Q / PR_K (geometric mean)', final_pr('ratio')))],
    *[Claim(key, '', stat, 'seed', fn, where='regime') for key, stat, fn in (
        ('imbalance_start', 'qk_imbalance at the first record', value('qk_imbalance', 'first')),
        ('imbalance_end', 'final qk_imbalance', value('qk_imbalance')),
        ('imbalance_conserved', 'final qk_imbalance had D_h kept its initial norm', conserved_imbalance),
        ('drift_end', 'final qk_drift, ||D_h(t) - D_h(0)||_F / gram(t)', value('qk_drift')),
        ('dq_rel_end', 'final ||W_Q - W_Q(0)||_F / ||W_Q(0)||_F: how far training moved W_Q', value('dq_rel')),
        ('val_loss', 'final validation loss', lambda r, view: r.final_loss('val_loss')),
        ('train_val_gap', 'final val_loss - train_loss', lambda r, v: r.final_loss('val_loss') -
         r.final_loss('train_loss')))],
    Claim('d', '(d) shrinking the key spectrum sharpens attention', f'final attention entropy, {D}', 'pair',
          change('entropy'), -1, 0, 0.02, control='shrink'),
    Claim('e', '(e) freezing the key spectrum softens attention', f'final attention entropy, {D}', 'pair',
          change('entropy'), +1, 0, 0.02, control='freeze'),
    *[Claim(f'd_{key}', '', f'{stat}, {D}', 'pair', fn, where=where) for key, stat, fn, where in (
        ('entropy', 'final entropy', change('entropy'), ''),
        ('pr_head', 'final per-head PR of the controlled projection', change('pr_ctl_head'), ''),
        ('pr_head_rel', "the same relative to the baseline's", change('pr_ctl_head', 'relative'), ''),
        ('qk_spec_norm', 'final qk_spec_norm', change('qk_spec_norm'), 'map regime'),
        ('log_qk_spec_norm', 'final log qk_spec_norm', change('qk_spec_norm', 'log'), ''),
        ('k_spec_norm', 'final k_spec_norm (top singular value of W_K^h)', change('k_spec_norm'), ''),
        ('q_spec_norm', 'final q_spec_norm', change('q_spec_norm'), ''),
        ('val_loss', 'final val_loss', change('val_loss'), 'map regime'))],
    Claim('f1-early', '(f1) token-level PR_Q - PR_K rises early', "Spearman of tok_pr_q - tok_pr_k with log(1 + step) "
          "over a model's early checkpoints (log step at or below its median), mean over layers", 'model',
          token_column('rho_early'), +1, 0, 0.1),
    Claim('f1-late', '(f1) ... and decays later', 'the same over the late checkpoints (at or above the median)',
          'model', token_column('rho_late'), -1, 0, 0.1),
    Claim('f2', '(f2) token-level interaction rank tracks attention entropy', "Spearman of tok_pr_qk with entropy "
          "across the (layer, head) pairs of a model's last checkpoint", 'model', token_column('link_rho'), +1, 0, 0.1),
]
CLAIM = {c.key: c for c in CLAIMS}


def judge(claim, units, view=View()):
    """A claim's statistic over a group of units (runs; (controlled, baseline) pairs; token summary rows),
    summarised by the one interval rule and judged: {n, est, lo, hi, verdict, why, values, hits, counts}; counts:
    how many trajectories hold from each reference record of (a)."""
    if claim.unit == 'trajectory':
        found = [v for v in map(claim.fn, trajectories(units, view)) if v is not None]
        hits = [all(v) if isinstance(v, tuple) else v for v in found]
        counts = list(map(sum, zip(*found))) if found and isinstance(found[0], tuple) and len(found[0]) > 1 else None
        res, n = {'values': [float(h) for h in hits], 'hits': sum(hits), 'counts': counts}, len(hits)
        est, lo, hi = stats.wilson(sum(hits), n)
    else:
        found = [claim.fn(*u, view) if claim.unit == 'pair' else claim.fn(u, view) for u in units] \
            if claim.unit != 'model' else claim.fn(units)
        res = {'values': [v for v in found if v is not None and np.isfinite(v)], 'counts': None}
        est, lo, hi, n = stats.t_interval(res['values'])
        lo, hi = np.clip([lo, hi], *getattr(claim.fn, 'limits', (-np.inf, np.inf)))
    word, why = stats.verdict(lo, hi, claim.sign, claim.ref, claim.margin, n) if claim.sign else ('', '')
    if n == 0:
        word, why = 'not measured', 'not logged, or no unit with values'
    if claim.log:
        est, lo, hi = np.exp([est, lo, hi])
    return {**res, 'n': n, 'est': float(est), 'lo': float(lo), 'hi': float(hi), 'verdict': word, 'why': why}


# ----------------------------------------------------------------------------- groupings
def uncontrolled(runs):
    return [r for r in runs if r.control == 'none']


def arms(runs):
    """{(the baseline's setting, arm): [(controlled run, baseline run)] by seed}, in reading order: setting, the
    other control keys, shrink from the weakest dose to the strongest."""
    base, found = {(r.base, r.seed): r for r in uncontrolled(runs)}, {}
    for r in sorted((r for r in runs if r.control != 'none'), key=lambda r: r.seed):
        if (r.base, r.seed) in base:
            found.setdefault((base[(r.base, r.seed)].setting, r.arm), []).append((r, base[(r.base, r.seed)]))
    order = lambda key: (key[0], *(str(v) for k, v in key[1] if k != 'shrink_to'), -dict(key[1])['shrink_to'])
    return {key: found[key] for key in sorted(found, key=order)}


def deciding(claim, study):
    """[(setting, arm, pairs or None, why)] that decide a control claim per arm family (of W_K): (e) every freeze arm;
    (d) the strongest shrink dose whose per-head PR_K change has its interval below WELL_BELOW."""
    out, rel = [], CLAIM['d_pr_head_rel']
    mine = {k: v for k, v in folders.families(study.arms, claim.control).items() if dict(k[1])['control_target'] == 'k'}
    for (setting, _), keys in mine.items():
        if claim.control == 'freeze':
            out += [(setting, key[1], study.arms[key], '') for key in keys]
            continue
        found = {key: judge(rel, study.arms[key]) for key in keys}
        strong = [key for key in keys if found[key]['hi'] < WELL_BELOW]
        why = 'no dose moves per-head PR_K well below the baseline (' + ', '.join(
            f"shrink_to {dict(k[1])['shrink_to']:g}: {shown(rel, found[k])}" for k in keys) + ')'
        out.append((setting, strong[-1][1], study.arms[strong[-1]], '') if strong else (setting, keys[0][1], None, why))
    return out


def robustness_cells(study):
    """The map's cells: the claims and descriptive statistics (where 'map') in every lens x window over every
    uncontrolled run; the claims in their own view per weight decay on W_Q, W_K (when the runs have both); (d), (e)
    per deciding (setting, arm), with what else the arm changed."""
    pool, cells = uncontrolled(study.runs), []
    split = group(pool, lambda r: r.cfg['decay_qk'] and r.cfg['weight_decay'] > 0)   # weight decay on W_Q, W_K
    split = split if len(split) > 1 else {}
    for c in (c for c in CLAIMS if c.unit in ('trajectory', 'seed') and 'map' in c.where):
        for lens, window, d, runs in [(lens, w, 'pooled', pool) for lens in c.lenses for w in WINDOWS] + \
                [(c.lenses[0], c.window, d, rs) for d, rs in split.items() if c.sign]:
            res = judge(c, runs, View(lens, window, 'all', study.from_iter))
            cells.append({'key': c.key, 'lens': lens, 'window': window, 'decay': d, 'keep': '', **res})
    for c in (c for c in CLAIMS if c.unit == 'pair' and c.sign):
        for setting, arm, pairs, why in deciding(c, study):
            also = '; '.join(f'{k[2:]} {shown(CLAIM[k], judge(CLAIM[k], pairs))}' for k in
                             ('d_pr_head_rel', 'd_qk_spec_norm', 'd_k_spec_norm', 'd_val_loss')) if pairs else ''
            cells.append({'key': c.key, 'lens': '', 'window': '', 'decay': '', 'keep': dict(arm)['control_keep'],
                          'setting': study.label[setting], 'arm': study.arm_name(arm), 'also': also,
                          **(judge(c, pairs) if pairs else {'n': 0, 'verdict': 'not measured', 'why': why})})
    return cells


def claims_table(study, cells):
    """Each claim's cell of the map in its own view; (d), (e) per deciding (setting, arm); (f1), (f2) per source."""
    pool, rows = uncontrolled(study.runs), []
    for c in (c for c in CLAIMS if c.sign):
        scope = f'{len(pool)} uncontrolled runs in {len(group(pool, lambda r: r.setting))} settings; ' \
                f'{LENSES[c.lenses[0]].what}, {WINDOWS[c.window]}'
        mine = [(x, f"{x['setting']}, {x['arm']}" if c.unit == 'pair' else scope) for x in cells if x['key'] == c.key
                and (c.unit == 'pair' or (x['lens'], x['window'], x['decay']) == (c.lenses[0], c.window, 'pooled'))]
        mine += [(judge(c, found), f'{source}: {len(found)} series')
                 for source, found in study.tokens.items()] if c.unit == 'model' else []
        rows += [{'key': c.key, 'claim': c.text, 'scope': scope, 'n': x['n'], 'est': x.get('est'), 'lo': x.get('lo'),
                  'hi': x.get('hi'), 'value': shown(c, x) if x['n'] else x['why'], 'also': x.get('also'),
                  'verdict': verdict_text(x) if x['n'] else x['verdict']} for x, scope in mine]
    return rows


# ----------------------------------------------------------------------------- the regime
def regime(study):
    """Each statistic per point (a setting's uncontrolled runs) and layer position, and trends; None below 2 points."""
    points = group(uncontrolled(study.runs), lambda r: r.setting)
    if len(points) < 2:
        return None
    rows, units = [], {}
    for setting, runs in points.items():
        tasks = [(c, c.key, runs, c.lenses[0], c.window) for c in CLAIMS if c.unit in ('trajectory', 'seed')
                 and 'regime' in c.where]
        tasks += [(c, f'{c.key} [{study.arm_name(arm)}]', pairs, 'whole', 'all') for (s, arm), pairs in
                  study.arms.items() if s == setting for c in CLAIMS if c.unit == 'pair' and 'regime' in c.where
                  and c.control in ('', dict(arm)['control'])]
        for (c, key, group_, lens, window), pos in ((task, pos) for task in tasks for pos in POSITIONS):
            res = judge(c, group_, View(lens, window, pos, study.from_iter))
            units[(setting, key, pos)] = res['values']
            rows.append({'point': study.label[setting], 'statistic': key, 'position': pos, 'seeds': len(runs),
                         'n': res['n'], 'est': res['est'], 'lo': res['lo'], 'hi': res['hi'], 'value': shown(c, res),
                         'verdict': res['verdict']})
    rows = [r for r in rows if r['n'] or r['position'] == 'all']
    return {'rows': rows, 'trends': trends(study, points, units, rows)}


def axes(points):
    """The settings that vary between points, but for one that is a constant multiple of an earlier axis (min_lr =
    lr / 10): it moves with that axis."""
    cfgs = [runs[0].settings for runs in points.values()]
    numeric = lambda k: all(type(c.get(k)) in folders.NUMBER and c.get(k) for c in cfgs)
    out = []
    for k in (k for k in folders.varying(cfgs) if k not in folders.CONTROL_KEYS):
        out += [] if any(numeric(a) and numeric(k) and len({round(c[k] / c[a], 12) for c in cfgs}) == 1
                         for a in out) else [k]
    return out


def trends(study, points, units, rows):
    """Per numeric axis, line (points equal in every other axis) of 2+ points, statistic and position: the slope per
    doubling fitted to the units' values (stats.trend), its reading, and the point verdicts along the line."""
    ax, cfg, out = axes(points), {s: runs[0].settings for s, runs in points.items()}, []
    verdicts = {(r['point'], r['statistic'], r['position']): r['verdict'] for r in rows}
    for axis in (a for a in ax if all(type(c.get(a)) in folders.NUMBER for c in cfg.values())):
        for fixed, line in group(points, lambda s: tuple((a, cfg[s].get(a)) for a in ax if a != axis)).items():
            line = sorted(line, key=lambda s: cfg[s][axis])
            x = {s: math.log2(cfg[s][axis]) if all(cfg[t][axis] > 0 for t in line) else cfg[s][axis] for s in line}
            for key, pos in dict.fromkeys((k, p) for (s, k, p) in units if s in line) if len(line) > 1 else ():
                have = [s for s in line if units.get((s, key, pos))]
                fit = stats.trend(*zip(*[(x[s], v, s) for s in have for v in units[(s, key, pos)]])) if have else {}
                if fit.get('points', 0) > 1:
                    out.append({'axis': axis, 'line': ', '.join(f'{a}={v}' for a, v in fixed) or 'all points',
                                'members': ' | '.join(study.label[s] for s in have), 'statistic': key,
                                'position': pos, **fit, 'reading': reading(fit, [units[(s, key, pos)] for s in have]),
                                'verdicts': ', '.join(verdicts[(study.label[s], key, pos)] or '-' for s in have)})
    return out


def reading(fit, samples):
    """up, down or no clear slope; 'no linear trend' with the point means when the lack-of-fit test rejects a line."""
    if fit['lof_p'] < stats.ALPHA:
        return 'no linear trend: point means ' + ', '.join(f'{np.mean(s):+.3g}' for s in samples)
    word = 'up' if fit['lo'] > 0 else 'down' if fit['hi'] < 0 else 'no clear slope'
    return word + ('' if fit['points'] > 2 else ' (2 points: no lack-of-fit test)')


# ----------------------------------------------------------------------------- the other tables
def trajectory_rows(study):
    """trajectories: per setting, layer, lens and window, the seed-mean trajectory's ends, gap, ratio, (a), (b)."""
    rows = []
    for lens, window in ((lens, w) for lens in LENSES for w in WINDOWS):
        for t in trajectories(uncontrolled(study.runs), View(lens, window, 'all', study.from_iter)):
            a = rises_and_falls(t)
            rows.append({'setting': study.label[t.setting], 'layer': t.layer, 'lens': lens, 'window': window,
                         'seeds': t.n_seeds, 'iter_start': int(t.its[0]), 'iter_end': int(t.its[-1]),
                         'pr_q_start': t.q[0], 'pr_q_end': t.q[-1], 'pr_k_start': t.k[0], 'pr_k_end': t.k[-1],
                         'gap_end/size': (t.q[-1] - t.k[-1]) / t.cfg['n_embd'] * (t.cfg['n_head'] if
                                                                                  LENSES[lens].size == 'd' else 1),
                         'ratio_end': t.q[-1] / t.k[-1], 'b': gap_throughout(t),
                         'a per reference': ' '.join('yes' if v else 'no' for v in a) if a else None})
    return rows


PAIRED = [c for c in CLAIMS if c.unit == 'pair' and not c.sign]


def control_tables(study):
    """(control: every paired statistic per seed pair; control_dose: each over the pairs of an arm)."""
    per_pair, dose = [], []
    for (setting, arm), pairs in study.arms.items():
        head, kind = {'setting': study.label[setting], 'arm': study.arm_name(arm)}, dict(arm)['control']
        res, ent = {c.key: judge(c, pairs) for c in PAIRED}, judge(CLAIM['d' if kind == 'shrink' else 'e'], pairs)
        per_pair += [{**head, 'seed': c.seed, 'run': c.path, 'baseline': b.path,
                      **{p.key: p.fn(c, b, View()) for p in PAIRED}} for c, b in pairs]
        k = sum(v * {'shrink': -1, 'freeze': 1}[kind] > 0 for v in ent['values'])
        dose.append({**head, 'n': len(pairs), 'baseline PR/head': nanmean([b.final(
            f"pr_{dict(arm)['control_target']}_head") for _, b in pairs]), **{c.key[2:]: shown(c, res[c.key])
                                                                             for c in PAIRED},
            'well below': bool(res['d_pr_head_rel']['hi'] < WELL_BELOW), 'predicted sign': f"{k}/{ent['n']}",
            'verdict': verdict_text(ent) if dict(arm)['control_target'] == 'k' else 'mirror: no verdict'})
    return per_pair, dose


def dose_fits(study):
    """Per arm family with 2+ shrink doses: the entropy change against the per-head PR change, alone and with the
    change in log qk_spec_norm; jackknife-t over seeds (the arms of a seed share its baseline)."""
    out = []
    for (setting, rest), keys in folders.families(study.arms, 'shrink').items():
        pairs = [p for k in keys for p in study.arms[k]]
        f = lambda key: [CLAIM[key].fn(c, b, View()) for c, b in pairs]
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


TIMELINE = ('pr_q', 'pr_k', 'pr_q_head', 'pr_k_head', 'pr_qk', 'pr_dq', 'pr_dk', 'qk_spec_norm', 'entropy',
            'entropy_norm', 'qk_imbalance', 'qk_drift')


def timeline_rows(study):
    """Per setting: the mean over seeds of the layer means, at every iteration all its seeds logged."""
    rows = []
    for setting, rs in group(study.runs, lambda r: r.setting).items():
        its = reduce(np.intersect1d, [r.iters for r in rs])
        means = {k: nanmean(seed_mean(rs, k, its), 1) for k in TIMELINE if any(k in r.m for r in rs)}
        rows += [{'setting': study.label[setting], 'seeds': len(rs), 'iter': int(it),
                  **{k: float(v[i]) for k, v in means.items()}} for i, it in enumerate(its)]
    return rows


def runs_rows(study):
    return [{'run': r.name, 'setting': study.label[r.setting], 'seed': r.seed, 'arm': study.arm_name(r.arm),
             'records': len(r.iters), 'last_iter': int(r.iters[-1]) if len(r.iters) else None,
             'train_loss': r.final_loss('train_loss'), 'val_loss': r.final_loss('val_loss'),
             'wall_time': r.done.get('wall_time'), 'notes': len(r.notes), 'path': r.path} for r in study.runs] + \
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
    label: dict = None          # setting key -> its name: the values in which it differs from the others
    arms: dict = None
    tokens: dict = None
    tables: dict = None
    files: list = None
    arm_keys: tuple = ()        # the control keys that vary between arms, beyond those arm_label always names

    def arm_name(self, arm):
        return folders.arm_label(dict(arm), self.arm_keys)


def load(paths, out=None, from_iter=None, log=print):
    warnings = []
    warn = lambda msg: (warnings.append(msg), log(f'warning: {msg}'))
    runs, skipped = folders.load_runs(paths, warn)
    study = Study(list(paths), out or os.path.join(paths[0], 'analysis'), runs, skipped, warnings, from_iter)
    groups = group(runs, lambda r: r.setting)
    cfgs = [rs[0].settings for rs in groups.values()]
    names = folders.labels(cfgs, folders.varying(cfgs), [r.settings for r in uncontrolled(runs)])
    study.label, study.arms = dict(zip(groups, names)), arms(runs)
    named = ('control', 'control_target', 'control_keep', 'shrink_to')   # arm_label names these itself
    study.arm_keys = [k for k in folders.varying([dict(r.arm) for r in runs if r.control != 'none']) if k not in named]
    paired = {c for pairs in study.arms.values() for c, _ in pairs}
    for r in (r for r in runs if r.control != 'none' and r not in paired):
        warn(f'{r.path}: no control=none run with the same other settings and seed: left out of the control tables')
    study.tokens = tokens.token_tables(study.out, runs, warn)
    return study


def analyze(paths, out=None, figures=True, from_iter=None, log=print):
    """Load, compute, write; the Study. Skip (no usable run) or OutError (out refused) before anything is written."""
    study = load(paths, out, from_iter, log)
    folders.check_out(study.out)
    if not study.runs:
        raise Skip(f'no usable run folder under {", ".join(paths)} ({len(study.skipped)} skipped)')
    (per_pair, dose), reg, cells = control_tables(study), regime(study) or {}, robustness_cells(study)
    t = study.tables = {'claims': claims_table(study, cells), 'cells': cells, 'regime': reg, 'control': per_pair,
                        'trajectories': trajectory_rows(study), 'control_dose': dose, 'control_dose_fit':
                        dose_fits(study), 'timeline': timeline_rows(study), 'runs': runs_rows(study),
                        'settings': setting_rows(study), 'regime_rows': reg.get('rows', []),
                        'regime_trend': reg.get('trends', [])}
    figs = plots.draw(study, t, log) if figures else {'files': {}, 'notes': []}
    files = {**figs['files'], **report.map_tables(t['cells'], CLAIM), **folders.table('regime', t['regime_rows'])}
    for stem in ('claims', 'trajectories', 'control', 'control_dose', 'control_dose_fit', 'timeline', 'runs',
                 'settings', 'regime_trend'):
        files.update(folders.table(stem, t[stem]))
    files['REPORT.md'] = report.write(study, t, CLAIMS, figs['notes'], files)
    study.files = folders.write_files(study.out, files)
    return study


# ----------------------------------------------------------------------------- the command line
OPTIONS = {'runs': [('from_iter', int, None, "where 'from warm-up on' starts; default each run's warmup_iters")],
           'tokens': [(k, str, '', f"the runs' {k}, where it moved") for k in ('data_file', 'data_dir', 'cache_dir')],
           'pretrained': [('model', str, None, 'a local folder or a model name'),
                          ('revisions', str, '', 'comma-separated revisions, or the preset pythia'),
                          ('text', str, '', "a UTF-8 text; default wiki.test.raw in train.py's data_dir"),
                          ('rope', str, 'after', 'rotary families: q, k after the rotary embedding (as attention uses '
                           'them) or before it'), ('n_seqs', int, 8, 'windows of the text'),
                          ('seq_len', int, 256, 'tokens per window')]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    what = argv.pop(0) if argv[:1] and argv[0] in OPTIONS else 'runs'
    p = argparse.ArgumentParser(prog=f'analyze.py {what}', description='REPORT.md, tables and figures from run '
                                'folders; tokens: the token level of their model checkpoints; pretrained: of a '
                                'pretrained model (needs transformers).')
    if what != 'pretrained':
        p.add_argument('dirs', nargs='+', help='folders searched for run folders (folders holding config.json)')
    p.add_argument('--out', default=os.path.join('out', 'analysis') if what == 'pretrained' else None,
                   help='where to write; default <first dir>/analysis (pretrained: out/analysis)')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    p.add_argument('--device', default='cpu', help='where models run (token level)')
    for name, kind, default, text in OPTIONS[what]:
        p.add_argument(f'--{name}', type=kind, default=default, help=text, required=name == 'model')
    a, t0 = p.parse_args(argv), time.time()
    try:
        bad = [d for d in getattr(a, 'dirs', []) if not os.path.isdir(d)]
        if bad:
            raise Skip(f'{", ".join(bad)}: not a folder (pass the out_dir of train.py, or a folder above it)')
        if what == 'runs':
            s = analyze(a.dirs, a.out, not a.no_figures, a.from_iter)
            res = {'files': s.files, 'lines': [f'{len(s.runs)} runs used, {len(s.skipped)} skipped, {len(s.label)} '
                                               f'settings'] + [f"{r['key']:<9} {r['verdict'][:46]:<46} "
                                                               f"{r['scope'][:60]}" for r in s.tables['claims']]}
        elif what == 'tokens':
            res = tokens.analyze_tokens(a.dirs, a.out, (a.data_file, a.data_dir, a.cache_dir), a.device,
                                        not a.no_figures)
        else:
            revisions = tokens.REVISION_PRESETS.get(a.revisions) or [r for r in a.revisions.split(',') if r] or [None]
            res = tokens.analyze_pretrained(a.model, list(revisions), a.text, a.out, a.rope, a.n_seqs, a.seq_len,
                                            a.device, not a.no_figures)
    except (Skip, OutError) + ((ImportError, ValueError, OSError) if what == 'pretrained' else ()) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    model = [(c, judge(c, res.get('summary', []))) for c in CLAIMS if c.unit == 'model']
    print('\n'.join(res.get('lines') or [f'{c.key:<9} {verdict_text(j):<46} {shown(c, j)}' for c, j in model]))
    hint = f"; `python analyze.py {' '.join(a.dirs)}{' --out=' + a.out if a.out else ''}` puts (f1), (f2) into its " \
           f"REPORT.md" if what == 'tokens' else ''
    print(f"wrote {len(res['files'])} files in {time.time() - t0:.1f}s{hint}" if res['files'] else
          'error: nothing could be measured (reasons above)', file=sys.stdout if res['files'] else sys.stderr)
    return 0 if res['files'] else 1


if __name__ == '__main__':
    sys.exit(main())
