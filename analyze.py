"""
Run folders in, the study's evidence out: REPORT.md, tables, figures.

    python analyze.py out/ [more/] [--out=DIR] [--no_figures] [--from_iter=N]   # -> out/analysis/

This file and exploratory.py hold what a research change touches; each change is one edit in one:
    a claim with its statistic:  def final_cos(run, view): return run.final('qk_cos'), then
        Claim(key='g', text='(g) queries and keys align', stat='final qk_cos', fn=final_cos,
              margin=0.05) in CLAIMS (judged outside Holm unless its key joins FAMILY)
    a descriptive statistic:     Stat(key=..., stat=..., fn=..., tables=('map', 'regime')) in STATS
    an exploratory section:      a function of the study and its name in exploratory.EXPLORATORY
    a figure:                    Figure(...) in plots.FIGURES
The engine (plumbing/engine.py) judges each statistic and builds the tables from registries() alone.

A statistic is fn(unit, view). A unit is a seed (a run), a seed pair (a controlled run and the none
run of its other settings and seed) or a model (a run or a pretrained series, read at its model
checkpoints); a view is a lens and a window. (a) and (b) give signs per trajectory (a layer of a
run), summarised per seed by stats.share, and read only the records of the regular grid (every
geom_interval-th iteration and the last), as the log-spaced extra records move with a run's length.
(f1) and (f2) read the token-level values of a model's checkpoints: train.py's model_ckpts
iterations in our runs, every record of a pretrained series. README.md says why (a) and (b) start
where the init is forgotten and why (d) and (e) read the spec arm.
"""
import argparse
import math
import os
import sys
import time
from collections import namedtuple

import numpy as np

import exploratory
import report
from plumbing import engine, stats
from plumbing.engine import WELL_BELOW, Claim, Stat, checkpoints, on_grid
from plumbing.folders import FINAL_LOGS, OutError, Skip
from plumbing.stats import nanmean

# ------------------------------------------------------------------------------------------ views
Lens = namedtuple('Lens', 'q k qk size what')   # metric keys; size: the run attribute PR is at most
LENSES = {'whole': Lens('pr_q', 'pr_k', 'pr_qk', 'C', 'whole-matrix weight PR'),
          'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'd', 'per-head weight PR'),
          'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'C', 'token-level PR'),
          'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'C', 'learned part W - W(0)')}
WINDOWS = {'all': 'all records', 'warmup': 'from warm-up on', 'post': 'after the init is forgotten'}
FORGOTTEN = 'init forgotten (the first record where ||W - W(0)||_F >= ||W(0)||_F for W_Q and W_K)'
REFERENCES = {'all': ('the first record',),
              'warmup': ('the end of warm-up', 'twice that', '10% of training'),
              'post': (FORGOTTEN, '25% of training', '50% of training')}


def usable(run, iteration):
    """The index of the first record at or after the iteration, if it precedes the final records."""
    index = len(run.iters) if iteration is None else int(np.searchsorted(run.iters, iteration))
    return index if index < len(run.iters) - FINAL_LOGS else None


def references(run, view, layers):
    """The window's REFERENCES' iterations (None: not reached)."""
    max_iters = run.cfg['max_iters']
    warmup = run.cfg['warmup_iters'] if view.from_iter is None else view.from_iter
    if view.window == 'all':
        return [int(view.lens == 'learned')]   # the learned part is 0 at iteration 0
    if view.window == 'warmup':
        return [warmup, 2 * warmup, max_iters / 10]
    moved = [run.m[key][:, layers] >= 1 for key in ('dq_rel', 'dk_rel') if key in run.m]
    forgotten = np.flatnonzero(np.all(moved, (0, 2))) if moved else []
    return [int(run.iters[forgotten[0]]) if len(forgotten) else None, max_iters / 4, max_iters / 2]


def start(run, view, layers):
    """The first iteration a window keeps ('post': its earliest usable reference)."""
    iterations = references(run, view, layers)
    records = [usable(run, iteration) for iteration in iterations]
    reached = [run.iters[record] for record in records if record is not None]
    first = min(reached, default=math.inf) if view.window == 'post' else iterations[0]
    return max(first, int(view.lens == 'learned'))


# ------------------------------------------------------------------------ statistics of one unit
def series(run, key, layer):
    return run.m[key][:, layer] if key in run.m else np.full(len(run.iters), np.nan)


def moves(run, view):
    """(a), per trajectory and reference: signs of PR_Q(end) - PR_Q(ref), PR_K(ref) - PR_K(end)."""
    run, lens, signs = on_grid(run), LENSES[view.lens], []
    for layer in range(run.n_layer):
        pr_q, pr_k = series(run, lens.q, layer), series(run, lens.k, layer)
        q_end, k_end = nanmean(pr_q[-FINAL_LOGS:]), nanmean(pr_k[-FINAL_LOGS:])
        refs = [usable(run, iteration) for iteration in references(run, view, [layer])]
        signs.append([(np.nan, np.nan) if ref is None else
                      (np.sign(q_end - pr_q[ref]), np.sign(pr_k[ref] - k_end)) for ref in refs])
    return np.array(signs, dtype=float)


def gap_signs(run, view):
    """(b), per trajectory and record from the window's start (after iteration 0): the gap sign."""
    run, lens, signs = on_grid(run), LENSES[view.lens], []
    for layer in range(run.n_layer):
        in_window = run.iters >= max(start(run, view, [layer]), 1)
        pr_gap = series(run, lens.q, layer) - series(run, lens.k, layer)
        signs.append(np.where(in_window, np.sign(pr_gap), np.nan)[:, None])
    return np.array(signs)


def gap_share(run, view):
    """The share of (b)'s records with PR_Q - PR_K > 0 (of its iterations: the grid is regular)."""
    signs = gap_signs(run, view)
    signed = np.isfinite(signs)
    return float((signs[signed] > 0).mean()) if signed.any() else math.nan


def values(run, role, lens, heads):
    """A role's values as (records, values), per (layer, head) or per layer; None if not logged.
    Roles: q, k, qk (the lens' PR_Q, PR_K, PR_QK), entropy, scale (log ||W_QK^h||_2)."""
    key = {'entropy': 'entropy', 'scale': 'qk_spec_norm'}.get(role) or getattr(LENSES[lens], role)
    key = key.removesuffix('_head') + '_heads' if heads else key
    if key not in run.m:
        return None
    logged = run.m[key]
    if role == 'scale':
        with np.errstate(divide='ignore', invalid='ignore'):
            logged = np.log(np.where(logged > 0, logged, np.nan))
    return logged.reshape(len(logged), -1)


def correlation(role, other, scope='heads', kind='spearman', changes=False):
    """A statistic of a run: the correlation of two roles (partial: given the scale), of their
    levels or of their changes between records. Scope 'heads': across each record's (layer, head)
    pairs, mean over records; scope 'time': across the run's records, mean over layers."""
    roles = (role, other, 'scale') if kind == 'partial' else (role, other)
    correlate = {'spearman': stats.spearman_rows, 'pearson': stats.pearson_rows,
                 'partial': stats.partial_rows}[kind]
    def statistic(run, view):
        levels = [values(run, each, view.lens, scope == 'heads') for each in roles]
        if any(level is None for level in levels):
            return math.nan
        in_window = run.iters >= start(run, view, list(range(run.n_layer)))
        if changes:   # a change is in the window where its earlier record is
            levels, in_window = [np.diff(level, axis=0) for level in levels], in_window[:-1]
        if scope == 'time':
            return nanmean(correlate(*(level[in_window].T for level in levels)))
        memo_key = (role, other, kind, changes, view.lens)
        if memo_key not in run.memo:   # the per-record correlations every window reads
            run.memo[memo_key] = correlate(*levels)
        return nanmean(run.memo[memo_key][in_window])
    return statistic


def final_pr(measure):
    """A statistic of a run: final (PR_Q - PR_K) / C (/ d per head), or log(PR_Q / PR_K)."""
    def statistic(run, view):
        lens, layers = LENSES[view.lens], range(run.n_layer)
        pr_q = np.array([run.final(lens.q, [layer]) for layer in layers])
        pr_k = np.array([run.final(lens.k, [layer]) for layer in layers])
        if measure == 'gap':
            return nanmean(pr_q - pr_k) / getattr(run, lens.size)
        with np.errstate(divide='ignore', invalid='ignore'):
            return nanmean(np.log(pr_q / pr_k))
    return statistic


def value(key):
    """A statistic of a run: a metric's final layer mean."""
    return lambda run, view: run.final(key)


def conserved_imbalance(run, view):
    """The final qk_imbalance had D_h kept its norm: imbalance_h(0) gram_h(0) / gram_h(t)."""
    if not {'qk_imbalance_heads', 'qk_gram_heads'} <= set(run.m) or not len(run.iters):
        return math.nan
    imbalance, gram = run.m['qk_imbalance_heads'], run.m['qk_gram_heads']
    with np.errstate(divide='ignore', invalid='ignore'):
        return nanmean(imbalance[0] * gram[0] / gram[-FINAL_LOGS:])


def change(key, how='difference'):
    """A statistic of a seed pair: key's final value (pr_ctl_head: the controlled projection's
    per-head PR), controlled against baseline: a difference, relative change or log ratio."""
    def statistic(pair, view):
        name = f'pr_{pair[0].cfg["control_target"]}_head' if key == 'pr_ctl_head' else key
        controlled, baseline = (run.final_loss(name) if name.endswith('_loss') else run.final(name)
                                for run in pair)
        if how == 'difference':
            return controlled - baseline
        if not (controlled > 0 and baseline > 0):
            return math.nan
        return controlled / baseline - 1 if how == 'relative' else math.log(controlled / baseline)
    return statistic


def contrast_rho(phase):
    """A statistic of a model: Spearman of tok_pr_q - tok_pr_k with log(1 + step) over its early
    (log step at or below the median) or late (at or above) checkpoints, mean over layers."""
    def statistic(run, view):
        ckpts = checkpoints(run)
        log_step = np.log1p(run.iters[ckpts].astype(float))
        if not len(log_step):
            return math.nan
        median = np.median(log_step)
        in_phase = log_step <= median if phase == 'early' else log_step >= median
        layer_rhos = []
        for layer in range(run.n_layer):
            contrast = series(run, 'tok_pr_q', layer) - series(run, 'tok_pr_k', layer)
            layer_rhos.append(stats.spearman(log_step[in_phase], contrast[ckpts][in_phase]))
        return nanmean(layer_rhos)
    return statistic


def token_link(run, view):
    """A statistic of a model: Spearman of tok_pr_qk with entropy at its last checkpoint's heads."""
    ckpts = checkpoints(run)
    if not len(ckpts) or not {'tok_pr_qk_heads', 'entropy_heads'} <= set(run.m):
        return math.nan
    pr_qk, entropy = (run.m[key][ckpts[-1]].ravel() for key in ('tok_pr_qk_heads', 'entropy_heads'))
    return stats.spearman(pr_qk, entropy)


# ---------------------------------------------------------------------------------- the registries
CORRELATION = (-1.0, 1.0)   # the limits of a correlation
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
          stat='PR_Q(end) > PR_Q(ref) and PR_K(end) < PR_K(ref) from every reference,'
               ' on the grid records; mirror: PR_Q falls and PR_K rises from every one'),
    Claim(key='b', text='(b) PR_Q - PR_K > 0 along every trajectory', fn=gap_signs, **SHARE,
          beside=('gap_share', 'b@all', 'ratio_end', 'ratio_end_head'),
          stat='PR_Q - PR_K > 0 at every grid record from the first reference;'
               ' mirror: < 0 at every one'),
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
          stat=f'final attention entropy, {CONTROLLED}, at the strongest shrink dose'
               f" whose per-head PR_K change lies below {WELL_BELOW:.0%} of the baseline's",
          fn=change('entropy'), sign=-1, control='shrink', **CONTROL),
    Claim(key='e', text='(e) freezing the key spectrum softens attention', control='freeze',
          stat=f'final attention entropy, {CONTROLLED}', fn=change('entropy'), **CONTROL),
    Claim(key='f1-early', text='(f1) token-level PR_Q - PR_K rises early', fn=contrast_rho('early'),
          **TOKEN, stat='Spearman of tok_pr_q - tok_pr_k with log(1 + step)'
                        " over a model's early checkpoints (log step at or below its median),"
                        ' mean over layers'),
    Claim(key='f1-late', text='(f1) ... and decays later', fn=contrast_rho('late'), **TOKEN,
          sign=-1, stat='the same over the late checkpoints (at or above the median)'),
    Claim(key='f2', text='(f2) token-level interaction rank tracks attention entropy', **TOKEN,
          fn=token_link, stat="Spearman of tok_pr_qk with entropy across the (layer, head) pairs"
                              " of a model's last checkpoint"),
]
# The pre-registered family: Holm adjusts over these claims' rows only. A claim a fork adds to
# CLAIMS is judged and reported beside them, outside Holm, unless its key is added here.
FAMILY = ('a', 'b', 'c', 'c-qk', 'c-d', 'c-dqk', 'c2', 'd', 'e', 'f1-early', 'f1-late', 'f2')


def described(key, stat, role, other, scope='heads', kind='spearman', changes=False,
              tables=('map',)):
    """A descriptive correlation of two roles: across the (layer, head) pairs of each record in the
    head lenses, or within a run over its records (scope 'time') in every lens."""
    views = {'lenses': HEADS, 'window': 'warmup'} if scope == 'heads' else {'lenses': ALL4}
    return Stat(key=key, stat=f"{stat} {PAIRS if scope == 'heads' else TIME}", tables=tables,
                fn=correlation(role, other, scope, kind, changes), limits=CORRELATION, **views)


def final_stats(lens, suffix, tables):
    """The final PR gap and ratio in a weight lens (the ratio on the log scale)."""
    size, what = LENSES[lens].size, LENSES[lens].what
    return [Stat(key=f'gap_end{suffix}', stat=f'final (PR_Q - PR_K) / {size} in the {what}',
                 fn=final_pr('gap'), lenses=(lens,), tables=('regime',)),
            Stat(key=f'ratio_end{suffix}', stat=f'final PR_Q / PR_K in the {what}',
                 fn=final_pr('ratio'), lenses=(lens,), log=True, tables=tables)]


def paired(key, stat, statistic):
    """A final value of a seed pair, controlled - baseline."""
    return Stat(key=f'd_{key}', stat=f'{stat}, {CONTROLLED}', fn=statistic, unit='pair',
                tables=('control',))


STATS = [
    described('qk~entropy', 'Spearman of PR_QK with entropy', 'qk', 'entropy'),
    described('scale~entropy', 'Pearson of log ||W_QK^h||_2 with entropy', 'scale', 'entropy',
              kind='pearson', tables=('map', 'regime')),
    described('k~entropy over time', 'Spearman of PR_K with entropy'
              ' (two trends correlate, linked or not)', 'k', 'entropy', 'time'),
    described('dk~dentropy over time', 'Spearman of their changes between records',
              'k', 'entropy', 'time', changes=True),
    described('k~entropy|scale over time', 'Pearson partial of PR_K with entropy'
              ' given the log scale', 'k', 'entropy', 'time', 'partial'),
    Stat(key='gap_share', stat="the share of (b)'s grid records with PR_Q - PR_K > 0"
                               ' (of the iterations from the reference on), over layers',
         fn=gap_share, lenses=ALL4, window='post', tables=('regime',), limits=(0.0, 1.0)),
    *final_stats('whole', '', ('regime', 'trend')),
    *final_stats('head', '_head', ('regime', 'trend', 'optimizer')),
    *final_stats('learned', '_learned', ('regime',)),
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
    Stat(key='train_val_gap', stat='final val_loss - train_loss', tables=('regime', 'trend'),
         fn=lambda run, view: run.final_loss('val_loss') - run.final_loss('train_loss')),
    paired('entropy', 'final entropy', change('entropy')),
    paired('pr_head', 'final per-head PR of the controlled projection', change('pr_ctl_head')),
    paired('pr_head_rel', "the same relative to the baseline's", change('pr_ctl_head', 'relative')),
    paired('qk_spec_norm', 'final qk_spec_norm', change('qk_spec_norm')),
    paired('log_qk_spec_norm', 'final log qk_spec_norm', change('qk_spec_norm', 'log')),
    paired('k_spec_norm', 'final k_spec_norm (top singular value of W_K^h)', change('k_spec_norm')),
    paired('q_spec_norm', 'final q_spec_norm', change('q_spec_norm')),
    paired('val_loss', 'final val_loss', change('val_loss')),
]
ALL = {stat.key: stat for stat in CLAIMS + STATS}


# ----------------------------------------------------------------------------------- the analysis
def registries():
    """What the engine reads of this file, as it stands when the analysis runs."""
    return dict(claims=CLAIMS, stats={stat.key: stat for stat in CLAIMS + STATS}, family=FAMILY,
                lenses=LENSES, windows=WINDOWS, references=REFERENCES,
                exploratory=exploratory.EXPLORATORY)


def analyze(paths, out=None, figures=True, from_iter=None, log=print):
    """Load, compute, write; the Study. Skip (no usable run) or OutError (out refused) first."""
    study = engine.analyze(paths, registries(), out, from_iter, log)
    report.publish(study, figures, log)
    return study


def main(argv=None):
    parser = argparse.ArgumentParser(description='REPORT.md, tables and figures from run folders')
    parser.add_argument('dirs', nargs='+',
                        help='folders searched for run folders (holding config.json)')
    parser.add_argument('--out', help='where to write (default: <first dir>/analysis)')
    parser.add_argument('--no_figures', action='store_true', help='tables only')
    parser.add_argument('--from_iter', type=int, default=None,
                        help="where 'from warm-up on' starts (default: warmup_iters)")
    args, started = parser.parse_args(argv), time.time()
    try:
        missing = [folder for folder in args.dirs if not os.path.isdir(folder)]
        if missing:
            raise Skip(f'{", ".join(missing)}: not a folder'
                       ' (pass the out_dir of train.py, or a folder above it)')
        study = analyze(args.dirs, args.out, not args.no_figures, args.from_iter)
    except (Skip, OutError) as error:
        print(f'error: {error}', file=sys.stderr)
        return 2
    print(f'{len(study.runs)} runs used, {len(study.skipped)} skipped, {len(study.label)} settings')
    for claim in study.tables['claims']:
        print(f"{claim['key']:<9} {claim['verdict'][:46]:<46} {claim['scope'][:60]}")
    print(f'wrote {len(study.files)} files in {time.time() - started:.1f}s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
