"""
Turn run folders written by train.py into the study's evidence: tables, figures and a claims report
in which every verdict is computed by a rule written below and stated in the report.

    python analyze.py out/                           # every run folder under out/ -> out/analysis/
    python analyze.py out/ more_runs/ --out=results --pdf
    python analyze.py out/ --no_figures              # tables and REPORT.md only

A run folder is any folder holding a config.json; runs without done.json (unfinished) or with a
corrupt config.json or metrics.jsonl are skipped with a warning naming them. Runs are grouped by
depth (n_layer), qk_init, control, control_target and seed; what is missing from the full study
(STUDY_* and CONTROL_* below) is listed. Written to --out (default <first dir>/analysis/):

    REPORT.md                      one row per claim of the study: statistic, value, verdict, rule
    runs                           final losses and wall time, one row per run
    trajectories[_head|_tok]       PR_Q, PR_K per (depth, init, layer), seed means; full-matrix, per-head, token-level
    trajectory_summary             per variant: how many trajectories keep PR_Q - PR_K > 0, have PR_Q up and PR_K down
    attention_link[_runs]          within-run Spearman of PR_K, PR_QK and entropy over training
    control, control_effects       the control experiment: per seed, and paired differences against none
    fig1..fig5 *.png (--pdf: also .pdf)

(tables are .csv and .md). The first argument may name a subcommand (SUBCOMMANDS at the bottom);
`runs` is the default, so `python analyze.py out/` and `python analyze.py runs out/` are the same.
Statistics use numpy only: seeded bootstrap, exact sign test, Spearman with average ranks for ties.
"""
import argparse
import csv
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import reduce

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure  # object-oriented matplotlib: headless, no pyplot state

import geometry

# -----------------------------------------------------------------------------
# the study (DESIGN.md, "The study"): what a full sweep holds, and the rules that turn numbers into verdicts
STUDY_DEPTHS = (4, 6, 8)
STUDY_INITS = ('normal', 'orthogonal', 'tied')
STUDY_SEEDS = (1, 2, 3, 4)
CONTROL_KINDS = ('none', 'shrink', 'freeze')
CONTROL_SEEDS = (1, 2, 3, 4, 5)
FINAL_LOGS = 3             # a run's "final" entropy or PR: mean over its last FINAL_LOGS logged iterations
N_BOOT = 10000             # bootstrap resamples
BOOT_SEED = 0              # every bootstrap draws from this seed: the report is reproducible
LEVEL = 0.95               # interval level
ALPHA = 0.05               # sign-test threshold
SHARE_HOLDS = 0.90         # share-of-trajectories claims hold at or above this share ...
SHARE_FAILS = 0.50         # ... and do not hold at or below this one
# predicted sign of (controlled - none) per (metric, control): shrink sharpens attention, freeze softens it;
# shrink lowering the controlled PR (pr_k; pr_q in the mirror, control_target=q) is the manipulation check
PREDICTED = {('entropy', 'shrink'): -1, ('entropy', 'freeze'): +1,
             ('entropy_norm', 'shrink'): -1, ('entropy_norm', 'freeze'): +1, ('pr_controlled', 'shrink'): -1}
CONTROL_METRICS = ('entropy', 'entropy_norm', 'pr_k', 'pr_q', 'pr_qk', 'val_loss')
# config keys that make two runs comparable (same training setup); the grid axes and bookkeeping are left out
SETTING_KEYS = ('n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'batch_size', 'grad_accum', 'max_iters',
                'lr', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'weight_decay', 'decay_qk', 'beta1', 'beta2',
                'grad_clip', 'data_file', 'data_sha256', 'min_char_count', 'eval_windows')
# trajectory variants: table suffix -> (query key, key key, what it is)
VARIANTS = {'': ('pr_q', 'pr_k', 'full-matrix weight PR'),
            '_head': ('pr_q_head', 'pr_k_head', 'per-head weight PR (mean over heads)'),
            '_tok': ('tok_pr_q', 'tok_pr_k', 'token-level PR of the query/key vectors')}
# the within-run correlations of table 2: name -> (x, y)
LINKS = {'pr_k~entropy': ('pr_k', 'entropy'), 'pr_k~pr_qk': ('pr_k', 'pr_qk'), 'pr_qk~entropy': ('pr_qk', 'entropy')}
HOLDS, FAILS, MIXED, NOT_MEASURED = 'holds', 'does not hold', 'mixed', 'not measured'


class Skip(Exception):
    """A run, table or figure left out, with the reason (printed and reported, never fatal)."""


# ----------------------------------------------------------------------------- loaders

@dataclass
class Run:
    path: str
    cfg: dict
    done: dict
    iters: np.ndarray        # every logged iteration, sorted
    train_loss: np.ndarray
    val_loss: np.ndarray
    geom_iters: np.ndarray   # the logged iterations that carry geometry ("layers")
    layers: dict             # per-layer scalar metric -> (len(geom_iters), n_layer) float64
    notes: list = field(default_factory=list)
    setting: str = 'A'       # which training setup (SETTING_KEYS) it shares with others; set by load_runs

    n_layer = property(lambda self: int(self.cfg['n_layer']))
    qk_init = property(lambda self: self.cfg['qk_init'])
    seed = property(lambda self: int(self.cfg['seed']))
    control = property(lambda self: self.cfg.get('control', 'none'))
    target = property(lambda self: self.cfg.get('control_target', 'k') if self.control != 'none' else '')
    has_geometry = property(lambda self: len(self.geom_iters) > 0)

    def metric(self, key):
        """(len(geom_iters), n_layer) values of a per-layer metric; NaN where it was not logged."""
        return self.layers.get(key, np.full((len(self.geom_iters), self.n_layer), np.nan))

    def final(self, key):
        """Mean over the last FINAL_LOGS logged iterations and over layers (NaN if not logged)."""
        v = self.metric(key)[-FINAL_LOGS:]
        return float(np.nanmean(v)) if np.isfinite(v).any() else float('nan')


def find_run_dirs(paths):
    """Every folder under paths that holds a config.json (a run folder holds no further runs)."""
    found = []
    for top in paths:
        for root, dirs, files in os.walk(top):
            if 'config.json' in files:
                found.append(os.path.normpath(root))
                dirs[:] = []
            else:
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    unique = {}
    for path in found:
        unique.setdefault(os.path.realpath(path), path)
    return sorted(unique.values())


def read_json(path):
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__}: {str(e)[:80]})') from None
    if not isinstance(obj, dict):
        raise Skip(f'{os.path.basename(path)} does not hold a JSON object')
    return obj


def read_metrics(path):
    """Records of a metrics.jsonl, and whether its last line was cut short (a kill mid-write) and dropped.
    A corrupt line before the last is a Skip."""
    if not os.path.isfile(path):
        raise Skip('no metrics.jsonl')
    with open(path, errors='replace') as f:
        lines = f.read().split('\n')
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    rows, truncated = [], False
    for i in nonempty:
        try:
            row = json.loads(lines[i])
        except ValueError:
            if i != nonempty[-1]:
                raise Skip(f'metrics.jsonl line {i + 1} is corrupt') from None
            truncated = True
            continue
        if not isinstance(row, dict) or 'iter' not in row:
            raise Skip(f'metrics.jsonl line {i + 1} is not a record with an "iter"')
        rows.append(row)
    return rows, truncated


def load_run(path):
    """A finished run folder as a Run; Skip (with the reason) for an unfinished or corrupt one."""
    cfg = read_json(os.path.join(path, 'config.json'))
    lacking = [k for k in ('n_layer', 'qk_init', 'seed') if k not in cfg]
    if lacking:
        raise Skip(f"config.json lacks {', '.join(lacking)}")
    if not (type(cfg['n_layer']) is int and type(cfg['seed']) is int and isinstance(cfg['qk_init'], str)):
        raise Skip('config.json: n_layer and seed must be integers and qk_init a string')
    if not os.path.exists(os.path.join(path, 'done.json')):
        raise Skip('unfinished (no done.json)')
    done = read_json(os.path.join(path, 'done.json'))
    rows, truncated = read_metrics(os.path.join(path, 'metrics.jsonl'))
    if not rows:
        raise Skip('metrics.jsonl holds no records')
    try:
        by_iter = {int(r['iter']): r for r in rows}  # a repeated iteration: the last record wins
        iters = np.array(sorted(by_iter), dtype=np.int64)
        recs = [by_iter[i] for i in iters]
        geo = [r for r in recs if r.get('layers')]
        n_layer = int(cfg['n_layer'])
        bad = [int(r['iter']) for r in geo if len(r['layers']) != n_layer]
        if bad:
            first = next(r for r in geo if len(r['layers']) != n_layer)
            raise Skip(f"metrics.jsonl at iteration {bad[0]} has {len(first['layers'])} layers, "
                       f"config.json says n_layer={n_layer}")
        keys = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        layers = {k: np.array([[layer.get(k) for layer in r['layers']] for r in geo], dtype=float) for k in keys}
        run = Run(path, cfg, done, iters,
                  np.array([r.get('train_loss') for r in recs], dtype=float),
                  np.array([r.get('val_loss') for r in recs], dtype=float),
                  np.array([int(r['iter']) for r in geo], dtype=np.int64), layers)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Skip(f'metrics.jsonl is malformed ({type(e).__name__}: {str(e)[:80]})') from None
    if truncated:
        run.notes.append('truncated last line of metrics.jsonl dropped')
    if not run.has_geometry:
        run.notes.append('no geometry logged (geom_interval=0): losses only')
    return run


def setting_of(cfg):
    return tuple((k, json.dumps(cfg.get(k))) for k in SETTING_KEYS)


def load_runs(run_dirs, warn):
    """Load every folder; returns (runs used, skipped [(path, reason)], settings {letter: setting}).

    Runs are labelled by training setup (SETTING_KEYS): A = the setup of most uncontrolled runs, then B, C, ...
    Two runs with the same setup, depth, init, control, target and seed are one cell of the grid twice:
    the first (in path order) is used, the other reported."""
    runs, skipped = [], []
    for path in run_dirs:
        try:
            runs.append(load_run(path))
        except Skip as e:
            skipped.append((path, str(e)))
            warn(f'skipped {path}: {e}')
    # A = the setup of most uncontrolled runs (the study grid), then of most runs
    uncontrolled = Counter(setting_of(r.cfg) for r in runs if r.control == 'none')
    counts = Counter(setting_of(r.cfg) for r in runs)
    ranked = sorted(counts, key=lambda s: (-uncontrolled[s], -counts[s]))
    letters = {s: chr(ord('A') + i) if i < 26 else f'S{i}' for i, s in enumerate(ranked)}
    seen, used = {}, []
    for run in runs:
        run.setting = letters[setting_of(run.cfg)]
        key = (run.setting, run.n_layer, run.qk_init, run.control, run.target, run.seed)
        if key in seen:
            skipped.append((run.path, f'duplicate of {seen[key].path} (same settings, depth, init, control, seed)'))
            warn(f'skipped {run.path}: duplicate of {seen[key].path}')
            continue
        seen[key] = run
        used.append(run)
        for note in run.notes:
            warn(f'{run.path}: {note}')
    return used, skipped, {v: dict(k) for k, v in letters.items()}


def study_cells(runs):
    """{(depth, init): [runs by seed]} of the uncontrolled runs with geometry, in the main setting A."""
    cells = defaultdict(list)
    for r in runs:
        if r.control == 'none' and r.setting == 'A' and r.has_geometry:
            cells[(r.n_layer, r.qk_init)].append(r)
    order = sorted(cells, key=lambda cell: (cell[0], init_order(cell[1])))
    return {cell: sorted(cells[cell], key=lambda r: r.seed) for cell in order}


def init_order(name):
    return STUDY_INITS.index(name) if name in STUDY_INITS else len(STUDY_INITS)


def seed_stack(runs, key):
    """The iterations logged by every run and a metric over them: (iters (T,), values (S, T, n_layer))."""
    common = reduce(np.intersect1d, [r.geom_iters for r in runs])
    if len(common) == 0:
        raise Skip(f'runs {", ".join(r.path for r in runs)} share no logged iteration')
    return common, np.stack([r.metric(key)[np.searchsorted(r.geom_iters, common)] for r in runs])


# ----------------------------------------------------------------------------- statistics

def rankdata(x):
    """Ranks 1..n of x; tied values get the average of the ranks they span."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind='mergesort')
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + 1 + ends) / 2, ends - starts)
    return ranks


def spearman(x, y):
    """Spearman rank correlation: the Pearson correlation of the (average-tied) ranks. Pairs with a NaN
    are dropped; NaN with fewer than 3 pairs or a constant series."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return float('nan')
    rx, ry = rankdata(x[ok]), rankdata(y[ok])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float('nan')


def bootstrap_means(x, n_boot=N_BOOT, seed=BOOT_SEED):
    """Means of n_boot resamples (with replacement) of x, from a fixed seed."""
    x = np.asarray(x, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    return x[idx].mean(1)


def bootstrap_ci(x, level=LEVEL, n_boot=N_BOOT, seed=BOOT_SEED):
    """Percentile bootstrap interval of the mean of x (NaNs dropped); (nan, nan) for fewer than 2 values,
    where resampling says nothing."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float('nan'), float('nan')
    lo, hi = np.percentile(bootstrap_means(x, n_boot, seed), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def sign_test_p(n_predicted, n):
    """Exact one-sided sign test: P(X >= n_predicted) for X ~ Binomial(n, 1/2); NaN when n = 0."""
    if n == 0:
        return float('nan')
    return sum(math.comb(n, i) for i in range(n_predicted, n + 1)) / 2 ** n


def paired_effect(diffs, sign=None):
    """Mean paired difference with its bootstrap interval; with a predicted sign (+1 or -1) also the
    count with that sign, the sign test (exact zeros dropped) and the directional confidence: the share
    of bootstrap means with the predicted sign."""
    d = np.asarray([v for v in diffs if np.isfinite(v)], dtype=float)
    out = {'n': len(d), 'mean': float(d.mean()) if len(d) else float('nan')}
    out['ci_lo'], out['ci_hi'] = bootstrap_ci(d)
    out.update(predicted='' if sign is None else '+' if sign > 0 else '-', n_predicted=None, sign_p=None,
               confidence=None)
    if sign is not None and len(d):
        nonzero = d[d != 0]
        out['n_predicted'] = int((sign * nonzero > 0).sum())
        out['sign_p'] = sign_test_p(out['n_predicted'], len(nonzero))
        out['confidence'] = float((sign * bootstrap_means(d) > 0).mean())
    return out


def mean_ci(values):
    """{'mean', 'lo', 'hi', 'n'} of the finite values: mean and bootstrap interval."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    lo, hi = bootstrap_ci(v)
    return {'mean': float(v.mean()) if len(v) else float('nan'), 'lo': lo, 'hi': hi, 'n': len(v)}


# ---- verdict rules (each stated in the report by the text beside it)

SHARE_RULE = (f'holds if >= {SHARE_HOLDS:.0%} of trajectories do; does not hold if <= {SHARE_FAILS:.0%} do; '
              f'else mixed')
EFFECT_RULE = (f'holds if the mean paired difference has the predicted sign, its {LEVEL:.0%} bootstrap interval '
               f'excludes 0 and the sign-test p < {ALPHA}; does not hold if the interval excludes 0 with the '
               f'opposite sign; else mixed')
LINK_RULE = (f'each correlation holds if its mean over runs is > 0 with a {LEVEL:.0%} bootstrap interval (over '
             f'runs) above 0, does not hold if the interval is below 0, else mixed; the claim holds if both '
             f'hold, does not hold if both do not, else mixed')


def share_verdict(count, total):
    if not total:
        return NOT_MEASURED
    share = count / total
    return HOLDS if share >= SHARE_HOLDS else FAILS if share <= SHARE_FAILS else MIXED


def interval_verdict(mean, lo, hi, sign, p=None):
    """Rule for an effect with a predicted sign; p (sign test) is required only when given."""
    if not np.isfinite(mean):
        return NOT_MEASURED
    if sign * mean > 0 and min(sign * lo, sign * hi) > 0 and (p is None or p < ALPHA):
        return HOLDS
    if max(sign * lo, sign * hi) < 0:
        return FAILS
    return MIXED


def combine_verdicts(verdicts):
    if all(v == HOLDS for v in verdicts):
        return HOLDS
    if all(v == FAILS for v in verdicts):
        return FAILS
    if all(v == NOT_MEASURED for v in verdicts):
        return NOT_MEASURED
    return MIXED


# ----------------------------------------------------------------------------- tables

def fmt(v):
    """A cell for Markdown: 4 significant digits for floats, blank for None."""
    if v is None:
        return ''
    if isinstance(v, float):
        return 'nan' if v != v else f'{v:.4g}'
    return str(v)


def write_table(rows, out, stem, columns=None):
    """rows (list of dicts) as stem.csv and stem.md; returns the paths written."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    csv_path, md_path = os.path.join(out, stem + '.csv'), os.path.join(out, stem + '.md')
    with open(csv_path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([['' if row.get(c) is None else row.get(c) for c in columns] for row in rows])
    with open(md_path, 'w') as f:
        f.write(markdown_table(rows, columns))
    return [csv_path, md_path]


def markdown_table(rows, columns):
    lines = ['| ' + ' | '.join(columns) + ' |', '|' + ' --- |' * len(columns)]
    lines += ['| ' + ' | '.join(fmt(row.get(c)) for c in columns) + ' |' for row in rows]
    return '\n'.join(lines) + '\n'


def runs_table(runs, skipped):
    rows = []
    for r in sorted(runs, key=lambda r: (r.control != 'none', r.n_layer, init_order(r.qk_init), r.control,
                                         r.target, r.seed)):
        rows.append({'run': os.path.basename(r.path), 'path': r.path, 'n_layer': r.n_layer, 'qk_init': r.qk_init,
                     'control': r.control, 'control_target': r.target, 'seed': r.seed, 'setting': r.setting,
                     'iters': int(r.iters[-1]), 'train_loss': r.done.get('train_loss', float(r.train_loss[-1])),
                     'val_loss': r.done.get('val_loss', float(r.val_loss[-1])), 'wall_time': r.done.get('wall_time'),
                     'geometry_share': r.done.get('geometry_share'), 'note': '; '.join(r.notes)})
    for path, reason in skipped:
        rows.append({'run': os.path.basename(path), 'path': path, 'note': f'skipped: {reason}'})
    return rows


def trajectory_rows(cells, q_key, k_key, warn):
    """One row per (depth, init, layer): the seed-mean PR_Q and PR_K trajectories, summarised."""
    rows = []
    for (depth, init), runs in cells.items():
        try:
            iters, Q = seed_stack(runs, q_key)
            K = seed_stack(runs, k_key)[1]
        except Skip as e:
            warn(f'trajectories L{depth} {init}: {e}')
            continue
        Q, K = Q.mean(0), K.mean(0)   # (T, n_layer) seed means
        after = iters > 0
        for layer in range(depth):
            q, k = Q[:, layer], K[:, layer]
            if not (np.isfinite(q).all() and np.isfinite(k).all()):
                continue  # not logged (an older run, or token-level metrics off)
            gap = q - k
            rows.append({'n_layer': depth, 'qk_init': init, 'layer': layer, 'n_seeds': len(runs),
                         'iter_start': int(iters[0]), 'iter_end': int(iters[-1]),
                         'pr_q_start': q[0], 'pr_q_end': q[-1], 'pr_q_change': q[-1] - q[0],
                         'pr_k_start': k[0], 'pr_k_end': k[-1], 'pr_k_change': k[-1] - k[0],
                         'gap_end': gap[-1],
                         'gap_min_after_0': float(gap[after].min()) if after.any() else float('nan'),
                         'gap_positive_share': float((gap[after] > 0).mean()) if after.any() else float('nan'),
                         'gap_positive_throughout': bool(after.any() and (gap[after] > 0).all()),
                         'q_up_k_down': bool(q[-1] > q[0] and k[-1] < k[0])})
    return rows


def trajectory_summary(rows, variant, what):
    n = len(rows)
    count = lambda pred: sum(1 for r in rows if pred(r))
    return {'variant': variant or 'full', 'measure': what, 'trajectories': n,
            'gap_positive_throughout': count(lambda r: r['gap_positive_throughout']),
            'q_up_k_down': count(lambda r: r['q_up_k_down']),
            'q_up': count(lambda r: r['pr_q_change'] > 0), 'k_down': count(lambda r: r['pr_k_change'] < 0),
            'both_down': count(lambda r: r['pr_q_change'] < 0 and r['pr_k_change'] < 0),
            'gap_end_positive': count(lambda r: r['gap_end'] > 0)}


def link_of_run(run):
    """Per link: the Spearman correlation over logged iterations, per layer, then the mean over layers."""
    out = {}
    for name, (x, y) in LINKS.items():
        X, Y = run.metric(x), run.metric(y)
        rhos = [spearman(X[:, layer], Y[:, layer]) for layer in range(run.n_layer)]
        out[name] = float(np.nanmean(rhos)) if np.isfinite(rhos).any() else float('nan')
    return out


def attention_link_tables(cells):
    """(per-run rows, per-configuration rows with a pooled row last)."""
    run_rows, config_rows, pooled = [], [], defaultdict(list)
    for (depth, init), runs in cells.items():
        per = defaultdict(list)
        for r in runs:
            link = link_of_run(r)
            run_rows.append({'n_layer': depth, 'qk_init': init, 'seed': r.seed, 'run': r.path, **link})
            for name, v in link.items():
                per[name].append(v)
                pooled[name].append(v)
        config_rows.append(link_row({'n_layer': depth, 'qk_init': init}, per))
    if run_rows:
        config_rows.append(link_row({'n_layer': 'pooled', 'qk_init': 'all'}, pooled))
    return run_rows, config_rows


def link_row(head, values):
    row = dict(head)
    for name in LINKS:
        s = mean_ci(values[name])
        row['n_runs'] = s['n']
        row.update({f'{name}': s['mean'], f'{name}_lo': s['lo'], f'{name}_hi': s['hi']})
    return row


def control_rows(runs, target):
    """Per (setting, depth, init, seed) of the control experiment with control_target = target: final
    entropy, PRs and validation loss of none, shrink and freeze, and the differences against none."""
    controlled = [r for r in runs if r.control in ('shrink', 'freeze') and r.target == target]
    cells = sorted({(r.setting, r.n_layer, r.qk_init) for r in controlled},
                   key=lambda c: (c[0], c[1], init_order(c[2])))
    index = {(r.setting, r.n_layer, r.qk_init, r.control, r.target, r.seed): r for r in runs}
    rows = []
    for setting, depth, init in cells:
        seeds = sorted({r.seed for r in runs if (r.setting, r.n_layer, r.qk_init) == (setting, depth, init)
                        and (r.control == 'none' or r.target == target)})
        for seed in seeds:
            row = {'target': target, 'setting': setting, 'n_layer': depth, 'qk_init': init, 'seed': seed}
            for kind in CONTROL_KINDS:
                r = index.get((setting, depth, init, kind, '' if kind == 'none' else target, seed))
                for metric in CONTROL_METRICS:
                    if r is None or (metric != 'val_loss' and not r.has_geometry):
                        row[f'{metric}_{kind}'] = None
                    else:
                        row[f'{metric}_{kind}'] = float(r.val_loss[-1]) if metric == 'val_loss' else r.final(metric)
            for kind in ('shrink', 'freeze'):
                for metric in CONTROL_METRICS:
                    a, b = row[f'{metric}_{kind}'], row[f'{metric}_none']
                    row[f'd_{metric}_{kind}'] = a - b if a is not None and b is not None else None
            rows.append(row)
    return rows


def control_effect_rows(rows, target):
    """Per (control, metric): the paired differences against none, summarised (paired_effect)."""
    out = []
    for kind in ('shrink', 'freeze'):
        for metric in CONTROL_METRICS:
            d = [r[f'd_{metric}_{kind}'] for r in rows if r[f'd_{metric}_{kind}'] is not None]
            if not d:
                continue
            role = 'pr_controlled' if metric == f'pr_{target}' else metric
            out.append({'target': target, 'contrast': f'{kind} - none', 'metric': metric,
                        **paired_effect(d, PREDICTED.get((role, kind)))})
    return out


def missing_runs(runs):
    """Lines naming what the full study lacks: the grid of uncontrolled runs (setting A) and the control
    experiment (none, shrink, freeze x CONTROL_SEEDS where controlled runs were found)."""
    have = {(r.setting, r.n_layer, r.qk_init, r.control, r.target, r.seed) for r in runs}
    lines = []
    for depth in STUDY_DEPTHS:
        for init in STUDY_INITS:
            seeds = [s for s in STUDY_SEEDS if ('A', depth, init, 'none', '', s) not in have]
            if seeds:
                lines.append(f'L{depth} {init}: seed {", ".join(map(str, seeds))}')
    controlled = {(r.setting, r.n_layer, r.qk_init, r.target) for r in runs if r.control != 'none'}
    if not any(t == 'k' for *_, t in controlled):
        lines.append(f'control experiment (control_target=k): no shrink/freeze runs found '
                     f'(expected none, shrink, freeze x {len(CONTROL_SEEDS)} seeds)')
    for setting, depth, init, target in sorted(controlled):
        for kind in CONTROL_KINDS:
            seeds = [s for s in CONTROL_SEEDS
                     if (setting, depth, init, kind, '' if kind == 'none' else target, s) not in have]
            if seeds:
                lines.append(f'control L{depth} {init} (setting {setting}) {kind}'
                             f'{"" if kind == "none" else "-" + target}: seed {", ".join(map(str, seeds))}')
    return list(dict.fromkeys(lines))  # none baselines are shared by the k and q experiments


# ----------------------------------------------------------------------------- figures

def save_figure(fig, out, stem, pdf):
    paths = [os.path.join(out, stem + '.png')]
    fig.savefig(paths[0], dpi=110, bbox_inches='tight')
    if pdf:
        paths.append(os.path.join(out, stem + '.pdf'))
        fig.savefig(paths[1], bbox_inches='tight')
    return paths


def iteration_axis(ax):
    """Iterations 0, 1, 2, 4, ... on a symlog axis: 0 is plotted, the log-spaced early logs spread out."""
    ax.set_xscale('symlog', linthresh=1)
    ax.set_xlabel('iteration')
    ax.set_xlim(left=0)


def plot_pr_over_training(cells):
    """Figure 1: PR_Q (solid) and PR_K (dashed) over training, a panel per depth x init, a line per layer,
    min-max band over seeds."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    depths = sorted({d for d, _ in cells})
    inits = sorted({i for _, i in cells}, key=init_order)
    fig = Figure(layout='constrained', figsize=(4.2 * len(inits), 3.2 * len(depths)))
    axes = fig.subplots(len(depths), len(inits), squeeze=False, sharex=True)
    for (depth, init), runs in cells.items():
        ax = axes[depths.index(depth)][inits.index(init)]
        iters, Q = seed_stack(runs, 'pr_q')
        K = seed_stack(runs, 'pr_k')[1]
        colors = colormaps['viridis'](np.linspace(0, 0.9, depth))
        for layer in range(depth):
            for vals, style in ((Q, '-'), (K, '--')):
                v = vals[:, :, layer]
                ax.plot(iters, v.mean(0), style, color=colors[layer], lw=1.2,
                        label=f'layer {layer}' if style == '-' else None)
                if len(runs) > 1:
                    ax.fill_between(iters, v.min(0), v.max(0), color=colors[layer], alpha=0.15, lw=0)
        ax.set_title(f'L{depth} {init} ({len(runs)} seeds)', fontsize=9)
        ax.set_ylabel('PR')
        iteration_axis(ax)
    axes[-1][0].legend(fontsize=6, title='solid PR_Q, dashed PR_K', title_fontsize=6, ncol=2)  # deepest: every layer
    fig.suptitle('PR_Q and PR_K over training (seed mean, min-max band)')
    return fig


def plot_pr_gap(cells):
    """Figure 2: PR_Q - PR_K along every (depth, init, layer) trajectory (seed means), zero marked."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    fig = Figure(layout='constrained', figsize=(7, 4.5))
    ax = fig.subplots()
    colors = {init: colormaps['tab10'](i) for i, init in enumerate(sorted({i for _, i in cells}, key=init_order))}
    styles = ['-', '--', ':', '-.']
    depths = sorted({d for d, _ in cells})
    for (depth, init), runs in cells.items():
        iters, Q = seed_stack(runs, 'pr_q')
        gap = Q.mean(0) - seed_stack(runs, 'pr_k')[1].mean(0)
        for layer in range(depth):
            ax.plot(iters, gap[:, layer], styles[depths.index(depth) % 4], color=colors[init], lw=0.9, alpha=0.8,
                    label=f'L{depth} {init}' if layer == 0 else None)
    ax.axhline(0, color='k', lw=1)
    iteration_axis(ax)
    ax.set_ylabel('PR_Q - PR_K')
    ax.set_title('PR_Q - PR_K, every trajectory (line style = depth, colour = init)', fontsize=10)
    ax.legend(fontsize=6, ncol=3)
    return fig


def plot_entropy_and_pr(cells):
    """Figure 3: attention entropy over training (seed and layer mean per configuration), and PR_K and
    PR_QK against entropy for every run, layer and logged iteration, coloured by iteration."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_h, ax_k, ax_qk = fig.subplots(1, 3)
    for (depth, init), runs in cells.items():
        iters, H = seed_stack(runs, 'entropy')
        ax_h.plot(iters, np.nanmean(H, axis=(0, 2)), lw=1.2, label=f'L{depth} {init}')
    iteration_axis(ax_h)
    ax_h.set_ylabel('attention entropy (nats)')
    ax_h.legend(fontsize=6, ncol=2)
    runs = [r for rs in cells.values() for r in rs]
    it = np.concatenate([np.repeat(r.geom_iters, r.n_layer) for r in runs])
    ent = np.concatenate([r.metric('entropy').ravel() for r in runs])
    color = np.log10(1 + it)
    for ax, key, name in ((ax_k, 'pr_k', 'PR_K'), (ax_qk, 'pr_qk', 'PR_QK')):
        x = np.concatenate([r.metric(key).ravel() for r in runs])
        sc = ax.scatter(x, ent, c=color, s=4, cmap='viridis', alpha=0.6, lw=0)
        ax.set_xlabel(name)
        ax.set_ylabel('attention entropy (nats)')
        ax.set_title(f'{name} against entropy (all runs, layers, iterations)', fontsize=9)
    fig.colorbar(sc, ax=[ax_k, ax_qk], label='log10(1 + iteration)')
    ax_h.set_title('entropy over training (seed and layer mean)', fontsize=9)
    return fig


def representative_runs(cells):
    """Per init, the lowest-seed run at the middle depth found; its middle layer is the one shown."""
    depths = sorted({d for d, _ in cells})
    depth = depths[len(depths) // 2]
    return [(init, runs[0]) for (d, init), runs in cells.items() if d == depth]


def plot_spectra(cells):
    """Figure 4: singular values of W_Q, W_K and W_QK (head mean of each rank) at the first and the last
    snapshot, for the middle layer of one representative run per init. Reads two snapshots per run."""
    reps = []
    for init, run in representative_runs(cells) if cells else []:
        folder = os.path.join(run.path, 'snapshots')
        files = sorted(f for f in os.listdir(folder) if f.startswith('qk_') and f.endswith('.npz')) \
            if os.path.isdir(folder) else []
        if files:
            reps.append((init, run, files[0], files[-1]))
    if not reps:
        raise Skip('no Q/K snapshots in the uncontrolled runs')
    fig = Figure(layout='constrained', figsize=(13, 3.3 * len(reps)))
    axes = fig.subplots(len(reps), 3, squeeze=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: several threads on a busy machine spin-wait (seen: 1000x slower)
    try:
        draw_spectra(axes, reps)
    finally:
        torch.set_num_threads(threads)
    fig.suptitle('singular value spectra at the start and the end')
    return fig


def draw_spectra(axes, reps):
    for row, (init, run, first, last) in enumerate(reps):
        layer = run.n_layer // 2
        for name, color in ((first, 'tab:blue'), (last, 'tab:red')):
            with np.load(os.path.join(run.path, 'snapshots', name)) as z:
                q, k, n_head = z['q'][layer], z['k'][layer], int(z['n_head'])
            it = int(name[3:-4])
            s_qk = geometry.interaction_singular_values(q, k, n_head)
            spectra = ((geometry.singular_values(q), geometry.matrix_pr(q)),
                       (geometry.singular_values(k), geometry.matrix_pr(k)),
                       (s_qk.mean(0), geometry.participation_ratio(s_qk ** 2).mean().item()))  # pr_qk: mean of head PRs
            for col, (s, pr) in enumerate(spectra):
                s = s.numpy()
                axes[row][col].semilogy(np.arange(1, len(s) + 1), np.maximum(s, 1e-12), color=color,
                                        label=f'iter {it}: PR {pr:.1f}')
        for col, title in enumerate(('W_Q', 'W_K', 'W_QK (head mean)')):
            ax = axes[row][col]
            ax.set_title(f'{title}, {os.path.basename(run.path)} layer {layer}', fontsize=9)
            ax.set_xlabel('index')
            ax.set_ylabel('singular value')
            ax.legend(fontsize=7)


def plot_control(runs, rows, target):
    """Figure 5: PR of the controlled projection and attention entropy over training for none, shrink and
    freeze (seed mean, min-max band), and the per-seed paired entropy differences with the mean and its
    bootstrap interval."""
    if not rows:
        raise Skip(f'no controlled runs (control_target={target})')
    ctl_pr = 'pr_k' if target == 'k' else 'pr_q'
    cells = {(r['setting'], r['n_layer'], r['qk_init']) for r in rows}
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_pr, ax_h, ax_d = fig.subplots(1, 3)
    colors = {'none': 'k', 'shrink': 'tab:blue', 'freeze': 'tab:red'}
    for kind in CONTROL_KINDS:
        group = [r for r in runs if (r.setting, r.n_layer, r.qk_init) in cells and r.control == kind
                 and r.target == ('' if kind == 'none' else target) and r.has_geometry]
        if not group:
            continue
        for ax, key in ((ax_pr, ctl_pr), (ax_h, 'entropy')):
            iters, v = seed_stack(group, key)
            v = np.nanmean(v, axis=2)   # layer mean, (S, T)
            ax.plot(iters, v.mean(0), color=colors[kind], label=f'{kind} ({len(group)} seeds)')
            ax.fill_between(iters, v.min(0), v.max(0), color=colors[kind], alpha=0.2, lw=0)
    for ax, name in ((ax_pr, 'PR_K' if target == 'k' else 'PR_Q'), (ax_h, 'attention entropy (nats)')):
        iteration_axis(ax)
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    ax_pr.set_title(f'controlled PR ({ctl_pr}, layer mean)', fontsize=9)
    ax_h.set_title('entropy (layer mean)', fontsize=9)
    for x, kind in enumerate(('shrink', 'freeze')):
        d = np.array([r[f'd_entropy_{kind}'] for r in rows if r[f'd_entropy_{kind}'] is not None], dtype=float)
        if len(d) == 0:
            continue
        jitter = np.linspace(-0.12, 0.12, len(d)) if len(d) > 1 else np.zeros(1)
        ax_d.scatter(x + jitter, d, color=colors[kind], s=18, zorder=3)
        lo, hi = bootstrap_ci(d)
        ax_d.errorbar([x + 0.3], [d.mean()], yerr=[[d.mean() - lo], [hi - d.mean()]], fmt='D', color='k',
                      capsize=4, zorder=4)
    ax_d.axhline(0, color='k', lw=1)
    ax_d.set_xticks([0, 1], ['shrink - none', 'freeze - none'])
    ax_d.set_xlim(-0.5, 1.6)
    ax_d.set_ylabel('paired final entropy difference (nats)')
    ax_d.set_title(f'per seed, mean and {LEVEL:.0%} bootstrap interval', fontsize=9)
    fig.suptitle(f'control experiment (control_target={target})')
    return fig


# ----------------------------------------------------------------------------- report

def claims(summary, link_pooled, effects):
    """The claims of the study as report rows: claim, statistic, value, verdict, rule."""
    rows = []
    n = summary['trajectories'] if summary else 0
    c = summary['q_up_k_down'] if summary else 0
    rows.append({'claim': '(a) PR_Q grows and PR_K falls over training',
                 'statistic': 'share of (depth, init, layer) trajectories (seed means) with PR_Q(end) > PR_Q(0) '
                              'and PR_K(end) < PR_K(0)',
                 'value': f'{c}/{n} = {c / n:.0%}' if n else 'no trajectories', 'verdict': share_verdict(c, n),
                 'rule': SHARE_RULE})
    c = summary['gap_positive_throughout'] if summary else 0
    rows.append({'claim': '(b) PR_Q - PR_K > 0 along every trajectory',
                 'statistic': 'share of trajectories with PR_Q - PR_K > 0 at every logged iteration after 0',
                 'value': f'{c}/{n} = {c / n:.0%}' if n else 'no trajectories', 'verdict': share_verdict(c, n),
                 'rule': SHARE_RULE})
    if link_pooled:
        parts, values = [], []
        for name in ('pr_k~pr_qk', 'pr_k~entropy'):
            m, lo, hi = link_pooled[name], link_pooled[f'{name}_lo'], link_pooled[f'{name}_hi']
            v = interval_verdict(m, lo, hi, +1)
            parts.append(v)
            values.append(f'{name}: {m:.2f} [{lo:.2f}, {hi:.2f}] ({v})')
        rows.append({'claim': '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy',
                     'statistic': f'within-run Spearman over logged iterations (per layer, mean over layers), '
                                  f'mean over {link_pooled["n_runs"]} uncontrolled runs',
                     'value': '; '.join(values), 'verdict': combine_verdicts(parts), 'rule': LINK_RULE})
    else:
        rows.append({'claim': '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy',
                     'statistic': 'within-run Spearman PR_K~PR_QK and PR_K~entropy', 'value': 'no runs',
                     'verdict': NOT_MEASURED, 'rule': LINK_RULE})
    for label, kind, sign, word in (('(d) shrinking the key spectrum sharpens attention', 'shrink', -1, 'lower'),
                                    ('(e) freezing the key spectrum softens attention', 'freeze', +1, 'higher')):
        e = next((e for e in effects if e['target'] == 'k' and e['contrast'] == f'{kind} - none'
                  and e['metric'] == 'entropy'), None)
        stat = (f'final attention entropy (mean of the last {FINAL_LOGS} logs and of layers), {kind} - none '
                f'paired by seed; predicted {word}')
        if e is None:
            rows.append({'claim': label, 'statistic': stat, 'value': f'no {kind}/none pairs',
                         'verdict': NOT_MEASURED, 'rule': EFFECT_RULE})
            continue
        value = (f'mean {e["mean"]:+.4f} [{e["ci_lo"]:+.4f}, {e["ci_hi"]:+.4f}], {e["n_predicted"]}/{e["n"]} '
                 f'{word}, sign test p = {e["sign_p"]:.3g}, directional confidence {e["confidence"]:.2f}')
        rows.append({'claim': label, 'statistic': stat, 'value': value,
                     'verdict': interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], sign, e['sign_p']),
                     'rule': EFFECT_RULE})
    rows.append({'claim': '(f) token-level: the PR_Q - PR_K contrast in pretrained models is not universal, '
                          'appears early and decays; PR_QK ~ entropy link visible in several models',
                 'statistic': 'token-level analysis of checkpoints (python analyze.py tokens / pretrained)',
                 'value': 'not implemented yet', 'verdict': NOT_MEASURED, 'rule': '-'})
    return rows


def confound_notes(runs, cells, traj_rows):
    """The known confounds (DESIGN.md), as measured in these runs."""
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
        notes.append(f'{both}/{len(traj_rows)} trajectories end with both PR_Q and PR_K below their start.')
    lrs = Counter((r.cfg.get('lr'), r.cfg.get('warmup_iters'), r.cfg.get('max_iters')) for r in runs)
    notes.append('learning rate, warm-up and length change how fast both PRs move: '
                 + '; '.join(f'lr {a}, warmup_iters {b}, max_iters {c} in {n} run(s)' for (a, b, c), n in
                             sorted(lrs.items(), key=str)) + '.')
    return notes


def setting_notes(runs, settings):
    """What the training setups B, C, ... change against A, and what they are used for."""
    notes = []
    base = settings.get('A', {})
    for letter, s in sorted(settings.items()):
        if letter == 'A':
            continue
        diff = ', '.join(f'{k}={s[k]} (A: {base.get(k)})' for k in SETTING_KEYS if s[k] != base.get(k))
        n = sum(1 for r in runs if r.setting == letter)
        notes.append(f'setting {letter} ({n} run(s)) differs from A in {diff}: its uncontrolled runs are left out of '
                     f'the trajectory and attention tables and serve only as control baselines in setting {letter}.')
    return notes


def write_report(path, ctx):
    L = ['# qkgeom: claims report', '',
         f'Generated by `python analyze.py {" ".join(ctx["paths"])}` on {time.strftime("%Y-%m-%d %H:%M")}. '
         f'Every value and verdict below is computed from the run folders by the rules stated here; '
         f'none is typed by hand.', '',
         f'Runs: {ctx["n_found"]} run folders found, {len(ctx["runs"])} used, {len(ctx["skipped"])} skipped; '
         f'{sum(len(v) for v in ctx["cells"].values())} uncontrolled runs in {len(ctx["cells"])} (depth, init) '
         f'configurations give {ctx["summary"]["trajectories"] if ctx["summary"] else 0} layer trajectories.', '',
         '## Claims', '',
         markdown_table(ctx['claims'], ['claim', 'statistic', 'value', 'verdict']),
         '### Verdict rules', '']
    for rule in dict.fromkeys(c['rule'] for c in ctx['claims'] if c['rule'] != '-'):
        which = ', '.join(c['claim'][:3] for c in ctx['claims'] if c['rule'] == rule)
        L.append(f'- {which}: {rule}.')
    L += ['', f'Intervals are {LEVEL:.0%} percentile bootstrap intervals of the mean ({N_BOOT} resamples, seed '
              f'{BOOT_SEED}); the sign test is exact and one-sided, exact zeros dropped; the directional '
              f'confidence is the share of bootstrap means with the predicted sign; Spearman uses average ranks '
              f'for ties. Trajectories are seed means over the iterations every seed logged.', '',
          '## Trajectory summary', '',
          markdown_table(ctx['summaries'], list(ctx['summaries'][0]) if ctx['summaries'] else ['variant']),
          '## Attention link', '',
          markdown_table(ctx['link_rows'], list(ctx['link_rows'][0]) if ctx['link_rows'] else ['n_layer']),
          '## Control experiment', '']
    if ctx['effects']:
        L.append('control_target=q (if shown) is the mirror experiment: listed for comparison, no verdict.\n')
        L.append(markdown_table(ctx['effects'], list(ctx['effects'][0])))
    else:
        L += ['No controlled runs.', '']
    L += ['## Notes: known confounds', ''] + [f'- {n}' for n in ctx['confounds']] + ['']
    if ctx['setting_notes']:
        L += ['## Notes: training setups', ''] + [f'- {n}' for n in ctx['setting_notes']] + ['']
    L += ['## Missing from the full study', '',
          f'The full study: depths {", ".join(map(str, STUDY_DEPTHS))} x inits {", ".join(STUDY_INITS)} x seeds '
          f'{", ".join(map(str, STUDY_SEEDS))} (uncontrolled), and none, shrink, freeze x seeds '
          f'{", ".join(map(str, CONTROL_SEEDS))} (control).', '']
    L += [f'- {m}' for m in ctx['missing']] or ['- nothing']
    L += ['', '## Skipped runs and warnings', '']
    L += [f'- {w}' for w in ctx['warnings']] or ['- none']
    L += ['', '## Files', '']
    L += [f'- [{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['tables'] if p.endswith('.md')]
    L += [f'- figure skipped: {n}' for n in ctx['figure_notes']]
    L += [''] + [f'![{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['figures'] if p.endswith('.png')]
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


# ----------------------------------------------------------------------------- the analysis

def analyze(paths, out=None, pdf=False, figures=True, log=print):
    """Everything: load the runs under paths, write tables, figures and REPORT.md to out. Returns a dict
    with the claims, the files written, the warnings and what is missing. Raises Skip when no run
    folder is found."""
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')

    run_dirs = find_run_dirs(paths)
    if not run_dirs:
        raise Skip(f'no run folder (a folder with config.json) found under {", ".join(paths)}')
    runs, skipped, settings = load_runs(run_dirs, warn)
    out = out or os.path.join(paths[0], 'analysis')
    os.makedirs(out, exist_ok=True)
    cells = study_cells(runs)
    tables = write_table(runs_table(runs, skipped), out, 'runs')

    # 1. trajectories
    traj, summaries = {}, []
    for suffix, (q_key, k_key, what) in VARIANTS.items():
        traj[suffix] = trajectory_rows(cells, q_key, k_key, warn)
        if traj[suffix]:
            tables += write_table(traj[suffix], out, 'trajectories' + suffix)
            summaries.append(trajectory_summary(traj[suffix], suffix.strip('_'), what))
    if summaries:
        tables += write_table(summaries, out, 'trajectory_summary')
    summary = summaries[0] if summaries and summaries[0]['variant'] == 'full' else None

    # 2. attention link
    link_runs, link_rows = attention_link_tables(cells)
    if link_rows:
        tables += write_table(link_runs, out, 'attention_link_runs')
        tables += write_table(link_rows, out, 'attention_link')

    # 3. control
    ctl_rows, effects = {}, []
    for target in ('k', 'q'):
        ctl_rows[target] = control_rows(runs, target)
        effects += control_effect_rows(ctl_rows[target], target)
    if ctl_rows['k'] or ctl_rows['q']:
        tables += write_table(ctl_rows['k'] + ctl_rows['q'], out, 'control')
    if effects:
        tables += write_table(effects, out, 'control_effects')

    # figures
    written, figure_notes = [], []
    if figures:
        plots = [('fig1_pr_over_training', lambda: plot_pr_over_training(cells)),
                 ('fig2_pr_gap', lambda: plot_pr_gap(cells)),
                 ('fig3_entropy_and_pr', lambda: plot_entropy_and_pr(cells)),
                 ('fig4_spectra', lambda: plot_spectra(cells)),
                 ('fig5_control_k', lambda: plot_control(runs, ctl_rows['k'], 'k'))]
        if ctl_rows['q']:
            plots.append(('fig5_control_q', lambda: plot_control(runs, ctl_rows['q'], 'q')))
        for stem, make in plots:
            try:
                written += save_figure(make(), out, stem, pdf)
            except Skip as e:
                figure_notes.append(f'{stem}: {e}')
                log(f'note: {stem} skipped: {e}')

    # report
    link_pooled = link_rows[-1] if link_rows else None
    result = {'paths': list(paths), 'out': out, 'n_found': len(run_dirs), 'runs': runs, 'skipped': skipped,
              'cells': cells, 'summary': summary, 'summaries': summaries, 'link_rows': link_rows,
              'effects': effects, 'claims': claims(summary, link_pooled, effects),
              'confounds': confound_notes(runs, cells, traj['']), 'setting_notes': setting_notes(runs, settings),
              'missing': missing_runs(runs), 'warnings': warnings, 'tables': tables, 'figures': written,
              'figure_notes': figure_notes}
    report = os.path.join(out, 'REPORT.md')
    write_report(report, result)
    result['files'] = tables + written + [report]
    return result


def runs_command(argv):
    """python analyze.py [runs] DIR [DIR ...] [--out OUT] [--pdf] [--no_figures]"""
    p = argparse.ArgumentParser(prog='analyze.py', description='Tables, figures and the claims report (REPORT.md) '
                                'from run folders written by train.py.')
    p.add_argument('dirs', nargs='+', help='folders searched recursively for run folders (folders with config.json)')
    p.add_argument('--out', default=None, help='where to write; default <first dir>/analysis/')
    p.add_argument('--pdf', action='store_true', help='write every figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables and REPORT.md only (faster)')
    args = p.parse_args(argv)
    absent = [d for d in args.dirs if not os.path.isdir(d)]
    if absent:
        print(f'error: {", ".join(absent)}: no such folder', file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        res = analyze(args.dirs, args.out, args.pdf, not args.no_figures)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    print(f'{res["n_found"]} run folders found: {len(res["runs"])} used, {len(res["skipped"])} skipped')
    for path, reason in res['skipped']:
        print(f'  skipped {path}: {reason}')
    if not res['runs']:
        print(f'error: none of the {res["n_found"]} run folders is usable (reasons above; '
              f'{os.path.join(res["out"], "REPORT.md")} lists them too)', file=sys.stderr)
        return 1
    print('missing from the full study:' + ('' if res['missing'] else ' nothing'))
    for line in res['missing']:
        print(f'  {line}')
    for c in res['claims']:
        print(f'{c["claim"][:3]} {c["verdict"]:<14} {c["value"][:100]}')
    print(f'wrote {len(res["files"])} files to {res["out"]} in {time.time() - t0:.1f}s: '
          f'{len(res["tables"]) // 2} tables (csv, md), {len(res["figures"])} figure files, REPORT.md')
    return 0


# a later issue adds 'tokens' (token-level analysis of our checkpoints) and 'pretrained' here
SUBCOMMANDS = {'runs': runs_command}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return runs_command(argv)


if __name__ == '__main__':
    sys.exit(main())
