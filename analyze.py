"""
Turn run folders written by train.py into the study's evidence: tables, figures and a claims report in which
every verdict is computed by a rule printed in the report. The command line of every analysis, and the
weight-study tables; the rest is split by job:

    folders.py   finding and loading run folders, writing tables      plots.py    fig1-fig5, fig8
    stats.py     the statistics (numpy only)                          report.py   claims, verdict rules, REPORT.md
    tokens.py    the token-level analysis of checkpoints (ours and pretrained), fig6 and fig7
    regime.py    the statistics per regime point (runs that share every setting but the seed), their trends, fig9

    python analyze.py out/                           # every run folder under out/ -> out/analysis/
    python analyze.py out/ more_runs/ --out=results --pdf
    python analyze.py out/ --no_figures              # tables and REPORT.md only
    python analyze.py tokens out/                    # token-level analysis of checkpoints (tokens.py)
    python analyze.py pretrained --model=gpt2        # the same for a pretrained model (tokens.py; transformers)

A run folder is any folder holding a config.json (folders.py says how runs are read, checked and grouped);
unfinished or corrupt runs are skipped and bad records left out, each with a warning naming it. The runs a
sweep planned are read from the runs.txt that sweep.sh writes into its output folder; those without done.json
are listed as missing. Written to --out (default <first dir>/analysis/), each table as .csv and .md; the
folder's .analyze.json lists what each analysis wrote, and only those files are replaced or removed (other
files stay; an --out that is a file, a run folder or /, or holds files of these names that analyze.py did not
write, is refused with one line):

    REPORT.md                      the claims (statistic, value, verdict, rule), the robustness map, the tables below
    runs                           final losses and wall time, one row per run
    trajectories[_head|_tok|_learned]  PR_Q, PR_K per (depth, init, layer, window), seed means, in each lens
    trajectory_summary             per lens and window: how many trajectories keep PR_Q - PR_K > 0, have Q up, K down
    link_tests                     claim (c): per head, entropy with PR_K and PR_QK across the (layer, head) pairs of
                                   a run, levels at each checkpoint and changes between consecutive records
    attention_link[_runs]          within-run correlations of PR_K, PR_QK and entropy over training, of levels and of
                                   changes between records, per layer (descriptive: trends correlate, linked or not)
    scale_shape[_runs]             entropy against PR_K, PR_QK and the logit scale (Pearson, raw and partial given
                                   log ||W_QK^h||_2): across heads and over time
    robustness_map                 claims x ways of measuring them, a verdict per cell
    control, control_effects       the control experiment: per controlled run (an arm: control, dose shrink_to,
                                   control_keep; and a seed) against the same-seed baseline, and paired differences
    control_dose[_fit]             per arm the achieved change in per-head PR_K, qk_spec_norm, k_spec_norm and the
                                   entropy effect; the entropy effect against the PR_K change across shrink doses
    timeline                       PRs, scale and entropy over training, mean over the runs of each group
    regime, regime_trend           with two or more regime points: each statistic per point and its trend (regime.py)
    fig1..fig5, fig8, fig9, fig10 *.png (--pdf: also .pdf)

k_spec_norm (q_spec_norm) is the top singular value of a head's block W_K^h (W_Q^h), mean over heads and layers, read
from the run's snapshots/ (train.py does not log it); a run's final value of any metric is the mean over its last
FINAL_LOGS records.

Claims (a) and (b) are measured over all records and from the end of warm-up on (--from_iter, default each
run's warmup_iters), in four lenses (LENSES): whole-matrix and per-head weight PR, token-level PR, and the PR of
the learned part W - W(0); report.py holds the rules.

`tokens` and `pretrained` (tokens.py, whose docstring has the details) write tokens* / pretrained* tables and
fig6 / fig7 into their --out folder; `runs` (the default subcommand: `python analyze.py out/` is
`python analyze.py runs out/`) reads those tables from its --out folder into REPORT.md (claims f1, f2), so run
it after them. Token tables of our checkpoints count only for the runs they were made from (tokens_runs):
rows of other or retrained runs are left out, and runs without them named, each with a warning.
"""
import argparse
import os
import re
import shlex
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

import geometry
import plots
import regime
import report
import stats
from stats import HEAD_LINKS, SHAPE_STATS, mean_or_nan
import tokens
from report import ACROSS, ALL, CHANGES, FROM_WARMUP, NEAR_UNIFORM, OVER_TIME
from folders import (CONTROL_KINDS, FINAL_LOGS, SETTING_KEYS, OutError, Skip, check_out, collector, discover,
                     find_run_dirs, init_order, load_runs, moved, publish, read_table, run_identity, seed_stack,
                     staging, study_cells, write_table)

# -----------------------------------------------------------------------------
# what the tables measure (the verdict rules are report.py's; the study's grid is sweep.sh's, read from runs.txt)
# predicted sign of (controlled - none) per (metric, control): shrink sharpens attention, freeze softens it;
# shrink lowering the controlled PR (pr_k, pr_k_head; pr_q in the mirror, control_target=q) is the manipulation check
PREDICTED = {('entropy', 'shrink'): -1, ('entropy', 'freeze'): +1,
             ('entropy_norm', 'shrink'): -1, ('entropy_norm', 'freeze'): +1, ('pr_controlled', 'shrink'): -1}
SPEC_NORMS = ('k_spec_norm', 'q_spec_norm')      # from snapshots/ (see above)
CONTROL_METRICS = ('entropy', 'entropy_norm', 'pr_k', 'pr_k_head', 'pr_q', 'pr_q_head', 'pr_qk', 'qk_spec_norm',
                   *SPEC_NORMS, 'val_loss')
# paired per seed beside CONTROL_METRICS: the log ratio of the logit scale, and the change of the controlled
# projection's per-head PR relative to the baseline's (the achieved dose)
EFFECT_METRICS = CONTROL_METRICS + ('log_qk_spec_norm', 'pr_ctl_head_rel')
ARM = ('setting', 'n_layer', 'qk_init', 'target', 'keep', 'control', 'dose', 'arm')   # what a control arm is


@dataclass(frozen=True)
class Lens:
    """What "PR" is measured on: the logged keys of PR_Q, PR_K and PR_QK (per layer), and of PR_K and PR_QK per
    head (None: the lens has no per-head value)."""
    q: str
    k: str
    qk: str
    k_heads: str
    qk_heads: str
    what: str
    table: str                # the suffix of its trajectories table


LENSES = {
    'whole': Lens('pr_q', 'pr_k', 'pr_qk', None, None, 'whole-matrix weight PR', ''),
    'head': Lens('pr_q_head', 'pr_k_head', 'pr_qk', 'pr_k_heads', 'pr_qk_heads', 'per-head weight PR (mean over '
                 'heads)', '_head'),
    'tok': Lens('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'tok_pr_k_heads', 'tok_pr_qk_heads', 'token-level PR of the '
                'query/key vectors', '_tok'),
    'learned': Lens('pr_dq', 'pr_dk', 'pr_qk', 'pr_dk_heads', 'pr_qk_heads', 'PR of the learned part W - W(0), '
                    'whole matrix (PR_QK: of W_QK itself)', '_learned'),
}
WINDOWS = (ALL, FROM_WARMUP)      # the windows of records a claim is measured over
VIEWS = [(lens, window, None) for window in WINDOWS for lens in LENSES]   # decay None: the main setting A
# the within-run correlations of the attention_link table: name -> (x, y), PR_K and PR_QK of the lens; each also
# of the changes between consecutive records (dpr_k~dentropy)
LINKS = {'pr_k~entropy': ('pr_k', 'entropy'), 'pr_k~pr_qk': ('pr_k', 'pr_qk'), 'pr_qk~entropy': ('pr_qk', 'entropy')}
# the files `runs` writes into its --out folder: a folder holding one of these that analyze.py did not write is refused
RUNS_OUTPUTS = re.compile(r'(runs|trajectories(_head|_tok|_learned)?|trajectory_summary|attention_link(_runs)?'
                          r'|link_tests|control(_effects|_dose|_dose_fit)?|timeline|scale_shape(_runs)?|robustness_map'
                          r'|regime(_trend)?)\.(csv|md)|REPORT\.md|fig(1_pr_over_training|2_pr_gap'
                          r'|3_entropy_and_pr|4_spectra|5_control_[kq](_\d+)?|8_scale_shape|9_regime(_\d+)?'
                          r'|10_dose_response)\.(png|pdf)')


# ----------------------------------------------------------------------------- tables

def runs_table(runs, skipped):
    rows = []
    for r in sorted(runs, key=lambda r: (r.control != 'none', r.n_layer, init_order(r.qk_init), r.label, r.seed)):
        rows.append({'run': os.path.basename(r.path), 'path': r.path, 'n_layer': r.n_layer, 'qk_init': r.qk_init,
                     'control': r.control, 'control_target': r.target, 'control_keep': keep_of(r.cfg),
                     'seed': r.seed, 'setting': r.setting, 'iters': int(r.iters[-1]),
                     'train_loss': r.done.get('train_loss', float(r.train_loss[-1])),
                     'val_loss': r.done.get('val_loss', float(r.val_loss[-1])), 'wall_time': r.done.get('wall_time'),
                     'geometry_share': r.done.get('geometry_share'), 'note': '; '.join(r.notes)})
    for path, reason in skipped:
        rows.append({'run': os.path.basename(path), 'path': path, 'note': f'skipped: {reason}'})
    return rows


def keep_of(cfg):
    """What a controlled run's reshaping kept: 'fro' or 'spec' (absent from older config.json: fro); '' for none."""
    return cfg.get('control_keep', 'fro') if cfg.get('control', 'none') != 'none' else ''


def decays(cfg):
    """Whether weight decay acts on W_Q and W_K in a run."""
    return bool(cfg.get('decay_qk', True)) and (cfg.get('weight_decay') or 0) > 0


def window_start(runs, lens, window, from_iter):
    """The first iteration a window keeps: ALL from 0, FROM_WARMUP from --from_iter, else the runs' warmup_iters.
    The learned part starts after iteration 0, where W - W(0) = 0 and its PR is 0 by convention, not measured."""
    start = 0 if window == ALL else from_iter if from_iter is not None else max(r.cfg.get('warmup_iters', 0)
                                                                              for r in runs)
    return max(start, 1) if lens == 'learned' else start


def trajectory_rows(cells, lens, window, from_iter, warn):
    """One row per (depth, init, layer): the seed-mean PR_Q and PR_K trajectories of a lens over the records of a
    window, summarised; (b) counts the records after iteration 0 (where tied init has PR_Q = PR_K exactly)."""
    rows = []
    for (depth, init), runs in cells.items():
        try:
            iters, Q = seed_stack(runs, LENSES[lens].q)
            K = seed_stack(runs, LENSES[lens].k)[1]
        except Skip as e:
            warn(f'trajectories L{depth} {init}: {e}')
            continue
        keep = iters >= window_start(runs, lens, window, from_iter)
        iters, Q, K = iters[keep], Q.mean(0)[keep], K.mean(0)[keep]   # (T, n_layer) seed means
        for layer in range(depth) if len(iters) > 1 else ():
            if np.isfinite(Q[:, layer]).all() and np.isfinite(K[:, layer]).all():  # else not logged
                rows.append({'n_layer': depth, 'qk_init': init, 'layer': layer, 'n_seeds': len(runs), 'window': window,
                             **trajectory(iters, Q[:, layer], K[:, layer])})
    return rows


def trajectory(iters, q, k):
    gap, after = q - k, iters > 0
    return {'iter_start': int(iters[0]), 'iter_end': int(iters[-1]),
            'pr_q_start': q[0], 'pr_q_end': q[-1], 'pr_q_change': q[-1] - q[0],
            'pr_k_start': k[0], 'pr_k_end': k[-1], 'pr_k_change': k[-1] - k[0], 'gap_end': gap[-1],
            'gap_min_after_0': float(gap[after].min()) if after.any() else float('nan'),
            'gap_positive_share': float((gap[after] > 0).mean()) if after.any() else float('nan'),
            'gap_positive_throughout': bool(after.any() and (gap[after] > 0).all()),
            'q_up_k_down': bool(q[-1] > q[0] and k[-1] < k[0])}


def trajectory_summary(rows, lens, window):
    n = len(rows)
    count = lambda pred: sum(1 for r in rows if pred(r))
    return {'variant': lens, 'measure': LENSES[lens].what, 'window': window, 'trajectories': n,
            'gap_positive_throughout': count(lambda r: r['gap_positive_throughout']),
            'q_up_k_down': count(lambda r: r['q_up_k_down']),
            'q_up': count(lambda r: r['pr_q_change'] > 0), 'k_down': count(lambda r: r['pr_k_change'] < 0),
            'both_down': count(lambda r: r['pr_q_change'] < 0 and r['pr_k_change'] < 0),
            'gap_end_positive': count(lambda r: r['gap_end'] > 0)}


def link_of_run(run, lens, start):
    """The within-run links over the logged iterations from start on, per layer, mean over layers: the Spearman
    correlations of LINKS (the lens' PR_K and PR_QK) of the levels, and of the changes between consecutive records
    (dpr_k~dentropy, ...). Descriptive only: two series that trend, or slow down, together correlate in both."""
    keep = run.geom_iters >= start
    m = {role: run.metric(key)[keep] for role, key in (('pr_k', LENSES[lens].k), ('pr_qk', LENSES[lens].qk),
                                                      ('entropy', 'entropy'))}
    per_layer = defaultdict(list)
    for layer in range(run.n_layer):
        col = {role: v[:, layer] for role, v in m.items()}
        for name, (x, y) in LINKS.items():
            per_layer[name].append(stats.spearman(col[x], col[y]))
            per_layer[f'd{x}~d{y}'].append(stats.spearman(np.diff(col[x]), np.diff(col[y])))
    return {name: mean_or_nan(v) for name, v in per_layer.items()}


def attention_link_tables(cells, link_of):
    """(per-run rows, per-configuration rows with a pooled row last) of the links link_of(run) gives."""
    run_rows, config_rows, pooled = [], [], defaultdict(list)
    for (depth, init), runs in cells.items():
        per = defaultdict(list)
        for r in runs:
            link = link_of(r)
            run_rows.append({'n_layer': depth, 'qk_init': init, 'seed': r.seed, 'run': r.path, **link})
            for name, v in link.items():
                per[name].append(v)
                pooled[name].append(v)
        config_rows.append(summarise({'n_layer': depth, 'qk_init': init}, per))
    if run_rows:
        config_rows.append(summarise({'n_layer': 'pooled', 'qk_init': 'all'}, pooled))
    return run_rows, config_rows


def summarise(head, values):
    """head, then n_runs (the most runs any statistic has) and per statistic its mean over runs with the bootstrap
    interval (name, name_lo, name_hi)."""
    row = {**head, 'n_runs': 0}
    for name, v in values.items():
        s = stats.mean_ci(v)
        row['n_runs'] = max(row['n_runs'], s['n'])
        row.update({f'{name}': s['mean'], f'{name}_lo': s['lo'], f'{name}_hi': s['hi']})
    return row


# ---- claim (c): across the (layer, head) pairs of a run, where a trend every head shares cannot make a link

def head_links(run, lens):
    """stats.head_links of the run's entropy and the lens' per-head PR_K and PR_QK: {ACROSS: (iterations,
    {link: values}), CHANGES: (iteration of each step's earlier record, {link: values})}, or None when the run did
    not log them."""
    keys = ('entropy_heads', LENSES[lens].k_heads, LENSES[lens].qk_heads)
    if not all(key and key in run.heads for key in keys):
        return None
    levels, changes = stats.head_links(*(run.heads[key] for key in keys))
    return {ACROSS: (run.geom_iters, levels), CHANGES: (run.geom_iters[:-1], changes)}


def head_links_of_run(run, lens, start, memo):
    """{(scope, link): (mean over the run's records or steps from start on, how many are > 0, how many are finite)}
    of head_links, or None."""
    found = cached(memo, ('heads', run.path, lens), lambda: head_links(run, lens))
    if found is None:
        return None
    out = {}
    for scope, (its, links) in found.items():
        for name, values in links.items():
            v = np.asarray(values)[its >= start]
            out[(scope, name)] = (mean_or_nan(v), int((v > 0).sum()), int(np.isfinite(v).sum()))
    return out


def link_test_rows(per_run, lens, window):
    """link_tests of one view: per scope (ACROSS, CHANGES) and link, over the runs (per_run: head_links_of_run's),
    the mean of the runs' means with its bootstrap interval, the runs with a positive mean and the sign test of
    that count, the share of positive correlations over every record (step) of every run, and the verdict."""
    rows = []
    for scope, name in ((scope, name) for scope in (ACROSS, CHANGES) for name in HEAD_LINKS):
        found = [r[(scope, name)] for r in per_run]
        means = [m for m, _, _ in found if np.isfinite(m)]
        s, positive, finite = stats.mean_ci(means), sum(p for _, p, _ in found), sum(n for _, _, n in found)
        n_pos = sum(m > 0 for m in means)
        row = {'lens': lens, 'window': window, 'scope': scope, 'link': name, 'n_runs': s['n'], 'mean': s['mean'],
               'ci_lo': s['lo'], 'ci_hi': s['hi'], 'runs_positive': n_pos,
               'sign_p': stats.sign_test_p(n_pos, sum(m != 0 for m in means)),
               'share_positive': positive / finite if finite else float('nan')}
        rows.append({**row, 'verdict': report.link_verdict(row)})
    return rows


# ---- scale against shape (c2): one correlation family, Pearson, raw and given the log logit scale

def across_heads(run, lens):
    """Per record, across its (layer, head) pairs: stats.shape_stats of entropy, the logit scale log ||W_QK^h||_2
    and the lens' per-head PR_K and PR_QK; None when the run did not log them."""
    keys = ('entropy_heads', 'qk_spec_norm_heads', LENSES[lens].k_heads, LENSES[lens].qk_heads)
    if not all(key in run.heads for key in keys):
        return None
    H, S, K, QK = (run.heads[key] for key in keys)            # (records, n_layer, n_head)
    return stats.head_shapes(H, np.log(S), K, QK)


def shape_over_time(run, lens, start):
    """shape_stats within a run over its records from start on, per layer (the layer values of entropy, of the
    lens' PR_K and PR_QK and the log of the heads' mean ||W_QK^h||_2), mean over layers."""
    keep = run.geom_iters >= start
    H, S, K, QK = (run.metric(key)[keep] for key in ('entropy', 'qk_spec_norm', LENSES[lens].k, LENSES[lens].qk))
    per_layer = [stats.shape_stats(H[:, i], np.log(S[:, i]), K[:, i], QK[:, i]) for i in range(run.n_layer)]
    return {n: mean_or_nan([p[n] for p in per_layer]) for n in SHAPE_STATS}


def shape_of_run(run, lens, start, memo):
    """Scale against shape in one run over its records from start on: {ACROSS: the across_heads statistics, mean
    over the records; OVER_TIME: shape_over_time}."""
    per_record = cached(memo, ('across', run.path, lens), lambda: across_heads(run, lens))
    if per_record is None:
        return None
    kept = [s for s, it in zip(per_record, run.geom_iters) if it >= start]
    over_time = cached(memo, ('shape', run.path, lens, start), lambda: shape_over_time(run, lens, start))
    return {ACROSS: {n: mean_or_nan([s[n] for s in kept]) for n in SHAPE_STATS}, OVER_TIME: over_time}


def near_uniform(runs, start):
    """(records with near-uniform attention, records) over the runs' records from start on: a record is near uniform
    when its layer-mean entropy_norm is at least NEAR_UNIFORM."""
    norms = [r.metric('entropy_norm')[r.geom_iters >= start[r.path]].mean(axis=1) for r in runs]
    return int(sum((v >= NEAR_UNIFORM).sum() for v in norms)), int(sum(len(v) for v in norms))


def dose_of(cfg):
    """A shrink run's dose, shrink_to; None for the other controls."""
    return cfg['shrink_to'] if cfg.get('control') == 'shrink' else None


def arm_order(r):
    """Control arms in reading order: setting, depth, init, target, keep, then shrink from the weakest dose (largest
    shrink_to) to the strongest, then freeze; seeds last."""
    return (r.setting, r.n_layer, init_order(r.qk_init), r.target, keep_of(r.cfg), CONTROL_KINDS.index(r.control),
            -(dose_of(r.cfg) or 0), r.seed)


def control_rows(runs, warn):
    """One row per controlled run (an arm, ARM, and a seed): its final values of CONTROL_METRICS, those of the
    same-seed uncontrolled run of its setting, depth and init (the paired baseline; None without one) and the
    differences d_*, with d_log_qk_spec_norm (log ratio) and d_pr_ctl_head_rel (the change of the controlled
    projection's per-head PR relative to the baseline's: the achieved dose)."""
    base = {(r.setting, r.n_layer, r.qk_init, r.seed): r for r in runs if r.control == 'none'}
    norms, rows = {}, []
    for r in sorted((r for r in runs if r.control != 'none'), key=arm_order):
        b = base.get((r.setting, r.n_layer, r.qk_init, r.seed))
        row = {'setting': r.setting, 'n_layer': r.n_layer, 'qk_init': r.qk_init, 'target': r.target,
               'keep': keep_of(r.cfg), 'control': r.control, 'dose': dose_of(r.cfg), 'arm': r.label, 'seed': r.seed}
        for metric in CONTROL_METRICS:
            v, v0 = (final_value(run, metric, norms, warn) for run in (r, b))
            row.update({metric: v, f'{metric}_none': v0, f'd_{metric}': difference(v, v0)})
        row['d_log_qk_spec_norm'] = log_ratio(row['qk_spec_norm'], row['qk_spec_norm_none'])
        pr = f'pr_{r.target}_head'
        row['d_pr_ctl_head_rel'] = row[f'd_{pr}'] / row[f'{pr}_none'] if row[f'd_{pr}'] is not None and \
            positive(row[f'{pr}_none']) else None
        rows.append(row)
    return rows


def difference(a, b):
    return a - b if a is not None and b is not None else None


def positive(*values):
    return all(v is not None and v > 0 for v in values)


def log_ratio(a, b):
    return float(np.log(a / b)) if positive(a, b) else None


def final_value(run, metric, norms, warn):
    """A run's final value of a metric (Run.final; val_loss: the last logged; SPEC_NORMS: from its snapshots, kept
    in norms by run), None without the run or its geometry."""
    if run is None or (metric != 'val_loss' and not run.has_geometry):
        return None
    if metric in SPEC_NORMS:
        return cached(norms, run.path, lambda: spec_norms(run, warn))[metric]
    return float(run.val_loss[-1]) if metric == 'val_loss' else run.final(metric)


def spec_norms(run, warn):
    """{k_spec_norm, q_spec_norm}: the top singular value of each head's block of W_K, W_Q (geometry.singular_values
    of geometry.split_heads), mean over heads and layers, then over the snapshots of the run's last FINAL_LOGS
    records that are on disk; NaN without any. A snapshot that cannot be read is left out with a warning."""
    on_disk = dict(plots.snapshot_files(run))
    found = defaultdict(list)
    for it in (it for it in run.geom_iters[-FINAL_LOGS:] if it in on_disk):
        try:
            q, k, n_head = (np.stack(w) for w in zip(*(plots.read_snapshot(run, it, on_disk[it], layer)
                                                       for layer in range(run.n_layer))))
        except Skip as e:
            warn(f'{e}; left out of k_spec_norm and q_spec_norm')
            continue
        for name, W in (('k_spec_norm', k), ('q_spec_norm', q)):
            tops = [geometry.singular_values(geometry.split_heads(w, int(n_head[0])))[:, 0] for w in W]
            found[name].append(float(torch.stack(tops).mean()))
    return {name: float(np.mean(found[name])) if found[name] else float('nan') for name in SPEC_NORMS}


def control_effect_rows(rows):
    """Per arm and metric (EFFECT_METRICS): the paired differences against the baseline, summarised
    (stats.paired_effect, with the predicted sign where there is one)."""
    out = []
    for arm in dict.fromkeys(tuple(r[k] for k in ARM) for r in rows):
        head = dict(zip(ARM, arm))
        group = [r for r in rows if tuple(r[k] for k in ARM) == arm]
        for metric in EFFECT_METRICS:
            d = [r[f'd_{metric}'] for r in group if r[f'd_{metric}'] is not None]
            controlled = (f'pr_{head["target"]}', f'pr_{head["target"]}_head', 'pr_ctl_head_rel')
            role = 'pr_controlled' if metric in controlled else metric
            if d:
                out.append({**head, 'metric': metric, **stats.paired_effect(d, PREDICTED.get((role, head['control'])))})
    return out


# ---- the dose response: the entropy effect against the achieved change in per-head PR of the controlled projection

DOSE_METRICS = {'pr_head': None, 'pr_ctl_head_rel': 'pr_ctl_head_rel', 'qk_spec_norm': 'qk_spec_norm',
                'k_spec_norm': 'k_spec_norm', 'entropy': 'entropy'}   # column -> effect metric (pr_head: the target's)


def dose_rows(effects, rows):
    """control_dose: one row per arm, from its effects: the baseline's final per-head PR of the controlled
    projection, then per DOSE_METRICS the mean paired change with its seed interval, whether the PR is well below
    the baseline (report.well_below) and the entropy effect's sign count, sign test and verdict (report.py's rule for
    the arm's control)."""
    out = []
    for arm in dict.fromkeys(tuple(e[k] for k in ARM) for e in effects):
        head = dict(zip(ARM, arm))
        found = {e['metric']: e for e in effects if tuple(e[k] for k in ARM) == arm}
        pr = f'pr_{head["target"]}_head'
        row = {**head, 'n': found.get('entropy', {}).get('n'),
               'pr_head_none': mean_or_nan([r[f'{pr}_none'] for r in rows if tuple(r[k] for k in ARM) == arm
                                            and r[f'{pr}_none'] is not None])}
        for column, metric in DOSE_METRICS.items():
            e = found.get(metric or pr, {})
            row.update({f'd_{column}': e.get('mean'), f'd_{column}_lo': e.get('ci_lo'),
                        f'd_{column}_hi': e.get('ci_hi')})
        row['well_below'] = report.well_below(found.get('pr_ctl_head_rel'))
        e = found.get('entropy')
        row.update(entropy_predicted=e and e['n_predicted'], sign_p=e and e['sign_p'],
                   verdict=report.effect_verdict(e, head['control']) if e else report.NOT_MEASURED)
        out.append(row)
    return out


def dose_fits(rows):
    """control_dose_fit: per (setting, depth, init, target, keep) with 2 or more shrink doses, across its shrink arms
    x seeds: the slope of d_entropy on the change in the controlled projection's per-head PR, and the fit of
    d_entropy on that change and d_log_qk_spec_norm together; coefficients with jackknife-t intervals over
    seeds (stats.fit_groups: the arms of one seed share its baseline)."""
    out = []
    for key in dict.fromkeys(tuple(r[k] for k in ARM[:5]) for r in rows if r['control'] == 'shrink'):
        group = [r for r in rows if tuple(r[k] for k in ARM[:5]) == key and r['control'] == 'shrink'
                 and r['d_entropy'] is not None and r['d_log_qk_spec_norm'] is not None]
        doses = sorted({r['dose'] for r in group})
        if len(doses) < 2:
            continue
        pr = f'd_pr_{key[3]}_head'
        y, seeds = [r['d_entropy'] for r in group], [r['seed'] for r in group]
        one = stats.fit_groups(y, [r[pr] for r in group], seeds)
        two = stats.fit_groups(y, [[r[pr], r['d_log_qk_spec_norm']] for r in group], seeds)
        row = {**dict(zip(ARM[:5], key)), 'doses': ' '.join(f'{d:g}' for d in doses), 'n_points': len(group),
               'n_seeds': len(set(seeds))}
        for name, fit, i in (('slope', one, 1), ('pr_coef', two, 1), ('scale_coef', two, 2)):
            row.update({name: float(fit['coef'][i]), f'{name}_lo': float(fit['lo'][i]),
                        f'{name}_hi': float(fit['hi'][i])})
        out.append({**row, 'follows': report.follows(row)})
    return out


TIMELINE_KEYS = ('pr_q', 'pr_k', 'pr_q_head', 'pr_k_head', 'pr_qk', 'pr_dq', 'pr_dk', 'qk_spec_norm', 'entropy',
                 'entropy_norm')


def timeline_rows(runs):
    """Which quantity moves when: means over runs (of layer means) at every iteration that all runs of a
    group logged. Groups are (setting, depth, init, control label), plus every uncontrolled run of a
    setting pooled (n_layer and qk_init 'all'); the numbers behind fig3 (left) and fig5."""
    groups, arm = defaultdict(list), {}
    for r in runs:
        if r.has_geometry:
            groups[(r.setting, r.n_layer, r.qk_init, r.label)].append(r)
            arm[r.label] = arm_order(r)[3:7]
            if r.control == 'none':
                groups[(r.setting, 'all', 'all', '')].append(r)
    order = lambda g: (g[0], g[1] != 'all', str(g[1]), init_order(g[2]), arm.get(g[3], ()), g[3])
    rows = []
    for (setting, depth, init, label) in sorted(groups, key=order):
        group = groups[(setting, depth, init, label)]
        keys = [k for k in TIMELINE_KEYS if all(k in r.layers for r in group)]
        try:  # (runs, iterations) per key: each run's mean over its layers, so every run weighs the same
            stacks = {k: seed_stack(group, k, layer_mean=True) for k in keys}
        except Skip:
            continue  # no iteration logged by every run of the group: nothing to average
        for i, it in enumerate(stacks[keys[0]][0] if keys else []):
            rows.append({'setting': setting, 'n_layer': depth, 'qk_init': init, 'control': group[0].control,
                         'dose': dose_of(group[0].cfg), 'control_target': group[0].target,
                         'control_keep': keep_of(group[0].cfg), 'n_runs': len(group), 'iter': int(it),
                         **{k: float(v[:, i].mean()) for k, (_, v) in stacks.items()}})
    return rows


# ----------------------------------------------------------------------------- lenses and windows: the views
# Every claim is measured in several ways (report.py's robustness map). A view is one way: a lens, a window of
# records and a set of runs (the main setting A, or the main setting of the runs with or without weight decay
# on W_Q, W_K); it holds what the claims need: the trajectory summary (a, b), the tests of (c) across heads with the
# descriptive within-run links, and the pooled scale against shape (c2).

def study_tables(runs, from_iter, warn):
    """The rows of every table of the weight study and the views behind the claims, from the loaded runs."""
    cells, memo, decay = study_cells(runs), {}, decay_settings(runs)
    # the map's weight-decay columns: the claims' own lenses and windows
    wanted = VIEWS + [(lens, window, d) for d in decay for lens in ('whole', 'head') for window in WINDOWS]
    views = {(lens, window, d): view(study_cells(runs, decay.get(d, 'A')), lens, window, from_iter, memo, warn)
             for lens, window, d in wanted}
    traj = {lens: [r for window in WINDOWS for r in views[(lens, window, None)]['rows']] for lens in LENSES}
    whole = views[('whole', ALL, None)]
    ctl_rows = control_rows(runs, warn)
    effects = control_effect_rows(ctl_rows)
    return {'cells': cells, 'views': views, 'traj': traj,
            'summaries': [v['summary'] for (_, _, decay), v in views.items() if decay is None],
            'summary': whole['summary'] if whole['summary']['trajectories'] else None,
            'link_runs': whole['link_runs'], 'link_rows': whole['link_rows'],
            'link_tests': [row for (_, _, decay), v in views.items() if decay is None for row in v['tests']],
            'ctl_rows': ctl_rows, 'effects': effects, 'dose': dose_rows(effects, ctl_rows),
            'dose_fits': dose_fits(ctl_rows), 'scale_shape_runs': shape_rows(cells, from_iter, memo),
            'timeline': timeline_rows(runs)}


def decay_settings(runs):
    """{False: setting, True: setting}: the setting with the most uncontrolled runs without and with weight
    decay on W_Q, W_K, when the runs hold both; else {}."""
    found = {}
    for d in (False, True):
        counts = Counter(r.setting for r in runs if r.control == 'none' and r.has_geometry and decays(r.cfg) == d)
        if counts:
            found[d] = min(counts, key=lambda s: (-counts[s], s))
    return found if len(found) == 2 else {}


def view(cells, lens, window, from_iter, memo, warn):
    """One view: trajectory rows and summary, the tests of (c) across heads, the within-run links (per run, per
    configuration, pooled), the pooled scale against shape and how many records have near-uniform attention, of the
    runs in cells, measured in a lens over a window. memo keeps each run's links and shapes (views share runs)."""
    runs = [r for rs in cells.values() for r in rs]
    start = {r.path: window_start(rs, lens, window, from_iter) for rs in cells.values() for r in rs}
    link_of = lambda r: cached(memo, ('link', r.path, lens, start[r.path]),
                               lambda: link_of_run(r, lens, start[r.path]))
    rows = trajectory_rows(cells, lens, window, from_iter, warn)
    link_runs, link_rows = attention_link_tables(cells, link_of)
    shapes = [shape_of_run(r, lens, start[r.path], memo) for r in runs]
    shapes = [s[ACROSS] for s in shapes if s]
    heads = [head_links_of_run(r, lens, start[r.path], memo) for r in runs]
    heads = [h for h in heads if h]
    keys = [k for k in (LENSES[lens].q, LENSES[lens].k) if not any(k in r.layers for r in runs)]
    keys += [k for k in (LENSES[lens].k_heads,) if k and not any(k in r.heads for r in runs)]
    return {'rows': rows, 'window': window, 'summary': trajectory_summary(rows, lens, window), 'link_runs': link_runs,
            'link_rows': link_rows, 'shape': summarise({}, {n: [s[n] for s in shapes] for n in SHAPE_STATS})
            if shapes else None, 'tests': link_test_rows(heads, lens, window) if heads else [], 'missing': keys,
            'start': sorted(set(start.values())), 'near_uniform': near_uniform(runs, start)}


def cached(memo, key, compute):
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def shape_rows(cells, from_iter, memo):
    """scale_shape_runs: per uncontrolled run of setting A, lens with per-head values, window and scope."""
    rows = []
    for lens, window in ((lens, window) for lens in LENSES if LENSES[lens].k_heads for window in WINDOWS):
        for runs in cells.values():
            start = window_start(runs, lens, window, from_iter)
            for r in runs:
                shape = shape_of_run(r, lens, start, memo)
                rows += [{'run': r.path, 'n_layer': r.n_layer, 'qk_init': r.qk_init, 'seed': r.seed, 'lens': lens,
                          'window': window, 'iter_start': start, 'scope': scope, **values}
                         for scope, values in (shape or {}).items()]
    return rows


def scale_shape_table(rows):
    """scale_shape: per (lens, window, scope), each statistic's mean over runs with its bootstrap interval."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r['lens'], r['window'], r['scope'])].append(r)
    return [summarise({'lens': lens, 'window': window, 'scope': scope}, {n: [r[n] for r in rs] for n in SHAPE_STATS})
            for (lens, window, scope), rs in groups.items()]


def missing_runs(plans):
    """Lines naming the planned runs without done.json, one per runs.txt (sweep.sh writes the runs it plans,
    `NAME --key=value ...` per line, into its output folder); None when no runs.txt was found."""
    if not plans:
        return None
    lines = []
    for plan in plans:
        with open(plan, errors='replace') as f:
            names = [line.split()[0] for line in f if line.strip() and not line.startswith('#')]
        folder = os.path.dirname(plan)
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n, 'done.json'))]
        if missing:
            lines.append(f'{plan}: {len(missing)} of {len(names)} planned runs have no done.json: {", ".join(missing)}')
    return lines


# ---- the token-level tables (tokens.py writes them; the report reads them back)


def token_results(out, runs, warn):
    """{prefix: (trend rows, link rows, summary rows)} of the token-level tables found in out (written by
    `tokens` and `pretrained`), for the report. Rows of our checkpoints count only for the runs they were made
    from (tokens_runs: name and config.json, done.json digests): those of other or changed runs are left out, and
    runs without them are named, each with a warning."""
    found = {}
    for prefix in report.TOKEN_SOURCES:
        paths = [os.path.join(out, f'{prefix}_{kind}.csv') for kind in ('trend', 'link', 'summary')]
        if all(os.path.isfile(p) for p in paths):
            found[prefix] = tuple(read_table(p) for p in paths)
    if 'tokens' in found:
        models = token_models(out, runs, warn)
        found['tokens'] = tuple([r for r in rows if r['model'] in models] for rows in found['tokens'])
        if not found['tokens'][0]:
            del found['tokens']
    return found


def token_models(out, runs, warn):
    """The models (run folders as `tokens` named them) of out's token tables that are runs of this analysis."""
    command = f'`python analyze.py tokens RUN_FOLDERS --out={shlex.quote(out)}`'
    path = os.path.join(out, 'tokens_runs.csv')
    if not os.path.isfile(path):
        warn(f'the token tables in {out} do not name the runs they were made from (tokens_runs.csv): left out of '
             f'(f1), (f2); {command} writes them again')
        return set()
    made_from = read_table(path)
    ours = {tuple(run_identity(r.path).values()) for r in runs}
    identity = lambda row: (row['run'], row['config_sha256'], row['done_sha256'] or '')
    models = {row['model'] for row in made_from if identity(row) in ours}
    others = [row['run'] for row in made_from if identity(row) not in ours]
    if others:
        warn(f'the token tables in {out} hold {len(others)} run(s) not among these runs, or trained again since '
             f'(e.g. {others[0]}): left out of (f1), (f2)')
    measured = {identity(row) for row in made_from}
    lacking = [r.path for r in runs if tokens.model_checkpoints(r.path)
               and tuple(run_identity(r.path).values()) not in measured]
    if lacking:
        warn(f'{len(lacking)} of these runs have model checkpoints but no token tables in {out} (e.g. {lacking[0]}): '
             f'(f1), (f2) use the {len(models)} run(s) measured; {command} measures them all')
    return models


# ----------------------------------------------------------------------------- notes for the report

def confound_notes(runs, cells, traj_rows):
    """The known confounds (weight decay on W_Q, W_K; the random init's PR near C/2), as measured in these runs."""
    notes = []
    wd = Counter((r.cfg.get('weight_decay'), r.cfg.get('decay_qk')) for r in runs)
    for (w, d), n in sorted(wd.items(), key=str):
        on = 'applied to W_Q and W_K' if d and w else 'not applied to W_Q and W_K'
        notes.append(f'weight decay {w} {on} (decay_qk={d}) in {n} run(s): decay shrinks both spectra, '
                     f'so it can move PR_Q and PR_K together.')
    study = [r for rs in cells.values() for r in rs]
    if study:
        by_init = defaultdict(list)
        for r in study:
            C = r.cfg.get('n_embd')
            if C and r.geom_iters[0] == 0:
                by_init[r.qk_init].append((np.nanmean(r.metric('pr_q')[0]) / C, np.nanmean(r.metric('pr_k')[0]) / C))
        parts = [f'{init}: PR_Q/C = {np.mean([a for a, _ in v]):.2f}, PR_K/C = {np.mean([b for _, b in v]):.2f}'
                 for init, v in sorted(by_init.items(), key=lambda kv: init_order(kv[0]))]
        if parts:
            notes.append('a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), so early training '
                         'tends to lower every PR; at step 0, ' + '; '.join(parts) + '.')
    if traj_rows:
        both = sum(1 for r in traj_rows if r['pr_q_change'] < 0 and r['pr_k_change'] < 0)
        notes.append(f'{both}/{len(traj_rows)} (depth, init, layer) trajectories (seed means, all records) end with '
                     f'both PR_Q and PR_K below their start.')
    lrs = Counter((r.cfg.get('lr'), r.cfg.get('warmup_iters'), r.cfg.get('max_iters')) for r in runs)
    notes.append('learning rate, warm-up and length change how fast both PRs move: '
                 + '; '.join(f'lr {a}, warmup_iters {b}, max_iters {c} in {n} run(s)' for (a, b, c), n in
                             sorted(lrs.items(), key=str)) + '.')
    return notes


def setting_notes(runs, settings, decay_settings):
    """What the training setups B, C, ... change against A, and what they are used for."""
    notes = []
    base = settings.get('A', {})
    for letter, s in sorted(settings.items()):
        if letter == 'A':
            continue
        diff = ', '.join(f'{k}={s[k]} (A: {base.get(k)})' for k in SETTING_KEYS if s[k] != base.get(k))
        n = sum(1 for r in runs if r.setting == letter)
        use = ('the robustness map\'s weight-decay columns and ' if letter in decay_settings.values() else '') + \
            f'the control baselines of setting {letter}'
        notes.append(f'setting {letter} ({n} run(s)) differs from A in {diff}: its uncontrolled runs are left out of '
                     f'the trajectory and attention tables and serve only {use}.')
    return notes


# ----------------------------------------------------------------------------- the analysis

def analyze(paths, out=None, pdf=False, figures=True, log=print, from_iter=None):
    """Everything: load the runs under paths, write tables, figures and REPORT.md to out. Returns a dict
    with the claims, the files written, the warnings and what is missing. Raises Skip when no run folder is
    found, OutError when out must not or cannot be written (folders.check_out). Everything is written into a
    staging folder first and moved into out at the end, replacing only files analyze.py wrote (folders.publish).
    from_iter: where the 'from warm-up' window starts; None: at each run's warmup_iters."""
    warnings, warn = collector(log)
    out = out or os.path.join(paths[0], 'analysis')
    check_out(out, RUNS_OUTPUTS)
    run_dirs, plans = discover(paths, warn)
    runs, skipped, settings = load_runs(run_dirs, warn)
    with one_thread():
        res = study_tables(runs, from_iter, warn)
    # the report, with the token-level results written earlier into out by `tokens` and `pretrained`
    res.update(paths=list(paths), out=out, n_found=len(run_dirs), runs=runs, skipped=skipped, from_iter=from_iter,
               token=token_results(out, runs, warn), final_logs=FINAL_LOGS, short=[r.path for r in runs if r.too_short],
               decays=decay_settings(runs), scale_shape=scale_shape_table(res['scale_shape_runs']),
               few_seeds=bool(res['cells']) and max(map(len, res['cells'].values())) < report.MIN_SEEDS)
    res['claims'] = report.claims(res)
    res['regime'] = regime.regime(runs, from_iter)   # None with fewer than two regime points
    res.update(map=report.robustness_map(res), warnings=warnings,
               confounds=confound_notes(runs, res['cells'], [r for r in res['traj']['whole'] if r['window'] == ALL]),
               setting_notes=setting_notes(runs, settings, res['decays']), missing=missing_runs(plans))
    with staging(out) as staged:
        tables = write_tables(res, runs, skipped, staged) + regime.write_tables(res['regime'], staged)
        written, figure_notes = plots.draw_figures(res, runs, staged, pdf, log, warn) if figures else ([], [])
        written += regime.draw_figures(res['regime'], staged, pdf) if figures else []
        res.update(tables=moved(tables, out), figures=moved(written, out), figure_notes=figure_notes)
        report.write_report(os.path.join(staged, 'REPORT.md'), res)
        publish(staged, out, 'runs')
    res['files'] = res['tables'] + res['figures'] + [os.path.join(out, 'REPORT.md')]
    return res


@contextmanager
def one_thread():
    """Torch on one thread: the analysis' matrices are tiny, and several threads on a busy machine spin-wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_tables(res, runs, skipped, out):
    """Every table that has rows, as .csv and .md in out; returns the paths written."""
    tables = [('runs', runs_table(runs, skipped))]
    tables += [('trajectories' + LENSES[lens].table, rows) for lens, rows in res['traj'].items()]
    tables += [('trajectory_summary', res['summaries'])]
    if res['link_rows']:
        tables += [('attention_link_runs', res['link_runs']), ('attention_link', res['link_rows'])]
    tables += [('link_tests', res['link_tests']), ('scale_shape_runs', res['scale_shape_runs']),
               ('scale_shape', res['scale_shape']),
               ('robustness_map', [{k: v for k, v in row.items() if k != 'key'} for row in res['map']]),
               ('control', res['ctl_rows']), ('control_effects', res['effects']), ('control_dose', res['dose']),
               ('control_dose_fit', res['dose_fits']), ('timeline', res['timeline'])]
    return [path for stem, rows in tables if rows for path in write_table(rows, out, stem)]


def folders_parser(prog, description):
    """The arguments every folder-reading subcommand shares."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument('dirs', nargs='+', help='folders searched recursively for run folders (folders with config.json)')
    p.add_argument('--out', default=None, help='where to write; default <first dir>/analysis/')
    p.add_argument('--pdf', action='store_true', help='write every figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables (and REPORT.md) only: faster')
    return p


def folders_exist(dirs):
    """Whether every dir is a folder; else one line naming the files and the missing ones."""
    files = [d for d in dirs if os.path.exists(d) and not os.path.isdir(d)]
    absent = [d for d in dirs if not os.path.exists(d)]
    problems = [f'{", ".join(files)}: a file, not a folder (pass the run folder that holds it, or a folder above '
                f'it)'] * bool(files) + [f'{", ".join(absent)}: no such folder'] * bool(absent)
    if problems:
        print(f'error: {"; ".join(problems)}', file=sys.stderr)
    return not problems


def runs_command(argv):
    """python analyze.py [runs] DIR [DIR ...] [--out OUT] [--pdf] [--no_figures]"""
    p = folders_parser('analyze.py', 'Tables, figures and the claims report (REPORT.md) from run folders '
                       'written by train.py.')
    p.add_argument('--from_iter', type=int, default=None, help="where the 'from warm-up' window starts (claims (a), "
                   "(b), the robustness map); default: each run's warmup_iters from config.json")
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
        return 2
    if args.from_iter is not None and args.from_iter < 0:
        print(f'error: --from_iter={args.from_iter}: an iteration is 0 or more', file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        res = analyze(args.dirs, args.out, args.pdf, not args.no_figures, from_iter=args.from_iter)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    except OutError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{res["n_found"]} run folders found: {len(res["runs"])} used, {len(res["skipped"])} skipped')
    for path, reason in res['skipped']:
        print(f'  skipped {path}: {reason}')
    if not res['runs']:
        print(f'error: none of the {res["n_found"]} run folders is usable (reasons above; '
              f'{os.path.join(res["out"], "REPORT.md")} lists them too)', file=sys.stderr)
        return 1
    print_missing(res['missing'])
    if res['short']:
        print(f'note: {report.short_note(res)}; the verdicts below are plumbing checks')
    elif res['few_seeds']:
        print(f'note: small sample: {report.small_note(res)}')
    for c in res['claims']:
        print(f'({c["key"]})'.ljust(18) + f'{c["verdict"]:<14} {report.clip(c["value"], 90)}')
    print(f'wrote {len(res["files"])} files to {res["out"]} in {time.time() - t0:.1f}s: '
          f'{len(res["tables"]) // 2} tables (csv, md), {len(res["figures"])} figure files, REPORT.md')
    return 0


def print_missing(missing):
    if missing is None:
        print('missing from the planned runs: not checked (no runs.txt, which sweep.sh writes, found)')
        return
    print('missing from the planned runs:' + ('' if missing else ' nothing'))
    for line in missing:
        print(f'  {line}')


def print_token_result(res, dirs=None):
    """The token-level claims, the files, and the exact command that puts the claims into a REPORT.md: the runs
    analysed (dirs), else the run folders above an --out named analysis/ (pretrained models)."""
    for c in res['claims']:
        print(f'{report.claim_label(c):<4} {c["verdict"]:<14} {report.clip(c["value"], 110)}')
    out = res['out']
    if dirs is None and os.path.basename(os.path.normpath(out)) == 'analysis':
        parent = os.path.dirname(os.path.normpath(out)) or '.'
        dirs = [parent] if find_run_dirs([parent]) else None
    if dirs is None:
        hint = f'`python analyze.py RUN_FOLDERS --out={shlex.quote(out)}` (RUN_FOLDERS: the out_dir of your runs)'
    else:
        default = os.path.normpath(os.path.join(dirs[0], 'analysis')) == os.path.normpath(out)
        hint = '`python analyze.py ' + ' '.join(map(shlex.quote, [*dirs] + ([] if default else [f'--out={out}']))) + '`'
    print(f'wrote {len(res["files"])} files to {out}; {hint} puts claims (f1), (f2) into its REPORT.md')
    if res.get('report_removed'):
        print('(the REPORT.md there was written before these token tables: removed until that command writes it '
              'again)')


def tokens_command(argv):
    """python analyze.py tokens DIR [DIR ...] [--out OUT] [--data_file F] [--data_dir D] [--cache_dir C] ..."""
    p = folders_parser('analyze.py tokens', 'Token-level query/key geometry and attention entropy of every saved '
                       'model checkpoint (models/*.pt) of the runs, on the fixed evaluation batch of each run, '
                       'rebuilt from its config.json.')
    p.add_argument('--data_file', default='', help="the runs' training text, where config.json's data_file moved")
    p.add_argument('--data_dir', default='', help="the folder holding wiki.{train,valid}.raw (dataset runs), if moved")
    p.add_argument('--cache_dir', default='', help="where encoded data is cached; default: each run's config")
    p.add_argument('--device', default=tokens.default_device(), help='cuda if available, else cpu')
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
        return 2
    t0 = time.time()
    try:
        res = tokens.analyze_tokens(args.dirs, args.out, args.data_file, args.data_dir, args.cache_dir, args.device,
                                    args.pdf, not args.no_figures)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    except OutError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if not res['measured']:
        print(f'error: none of the {res["n_found"]} run folders could be measured (reasons above)', file=sys.stderr)
        return 1
    print(f'{len(res["measured"])} of {res["n_found"]} runs measured in {time.time() - t0:.1f}s')
    print_token_result(res, args.dirs)
    return 0


def pretrained_command(argv):
    """python analyze.py pretrained --model=NAME_OR_PATH [--revisions=...] [--text=FILE] [--rope=after] ..."""
    p = argparse.ArgumentParser(prog='analyze.py pretrained', description='Token-level query/key geometry and '
                                'attention entropy of a pretrained model (each revision: a checkpoint series) on a '
                                'fixed text sample. Needs transformers. Families: ' + ', '.join(
                                    t for fam in tokens.FAMILIES.values() for t in fam.model_types) + '.')
    p.add_argument('--model', required=True, help='a local folder or a HF name (from the cache, else the hub)')
    p.add_argument('--revisions', default='', help='comma-separated revisions (a local folder MODEL/REVISION is '
                   'used if there), or a preset: ' + ', '.join(tokens.REVISION_PRESETS) + '; default: the default '
                   'revision')
    p.add_argument('--text', default='', help=f'UTF-8 text to sample (first {tokens.SAMPLE_CHARS} characters); '
                   f"default wiki.test.raw in train.py's data_dir ({os.path.normpath(tokens.default_text())})")
    p.add_argument('--rope', default='after', choices=('after', 'before', 'both'),
                   help='rotary families: q and k after the rotary embedding (as attention uses them), before it '
                        '(as projected), or both')
    p.add_argument('--n_seqs', type=int, default=8, help='windows of the text')
    p.add_argument('--seq_len', type=int, default=256, help='tokens per window, special tokens included')
    p.add_argument('--out', default=os.path.join('out', 'analysis'), help='where to write (default out/analysis, '
                   'where `python analyze.py out/` reads it)')
    p.add_argument('--device', default=tokens.default_device(), help='cuda if available, else cpu')
    p.add_argument('--pdf', action='store_true', help='write the figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    args = p.parse_args(argv)
    revisions = tokens.REVISION_PRESETS.get(args.revisions) or [r for r in args.revisions.split(',') if r] or [None]
    t0 = time.time()
    try:
        res = tokens.analyze_pretrained(args.model, list(revisions), args.text, args.out, args.rope, args.n_seqs,
                                 args.seq_len, args.device, args.pdf, not args.no_figures)
    except (ImportError, ValueError, OSError, OutError) as e:  # OSError: a checkpoint neither local nor downloadable
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{args.model}: {len(revisions)} checkpoint(s) in {time.time() - t0:.1f}s')
    print_token_result(res)
    return 0


SUBCOMMANDS = {'runs': runs_command, 'tokens': tokens_command, 'pretrained': pretrained_command}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return runs_command(argv)


if __name__ == '__main__':
    sys.exit(main())
