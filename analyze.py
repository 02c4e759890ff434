"""
Turn run folders written by train.py into the study's evidence: tables, figures and a claims report in which
every verdict is computed by a rule written below and printed in the report.

    python analyze.py out/                           # every run folder under out/ -> out/analysis/
    python analyze.py out/ more_runs/ --out=results --pdf
    python analyze.py out/ --no_figures              # tables and REPORT.md only
    python analyze.py tokens out/                    # token-level analysis of checkpoints (tokens.py)
    python analyze.py pretrained --model=gpt2        # the same for a pretrained model (tokens.py; transformers)

A run folder is any folder holding a config.json; runs without done.json (unfinished) or with a corrupt
config.json or metrics.jsonl are skipped with a warning naming them. Runs are grouped by training setup,
depth (n_layer), qk_init, control label (control.control_label) and seed. The runs a sweep planned are read
from the runs.txt that sweep.sh writes into its output folder; those without done.json are listed as missing.
Written to --out (default <first dir>/analysis/), each table as .csv and .md:

    REPORT.md                      one row per claim of the study: statistic, value, verdict, rule
    runs                           final losses and wall time, one row per run
    trajectories[_head|_tok]       PR_Q, PR_K per (depth, init, layer), seed means; full-matrix, per-head, token-level
    trajectory_summary             per variant: how many trajectories keep PR_Q - PR_K > 0, have PR_Q up and PR_K down
    attention_link[_runs]          within-run Spearman of PR_K, PR_QK and entropy over training
    control, control_effects       the control experiment: per seed, and paired differences against none
    timeline                       PRs and entropy over training, mean over the runs of each group (which moves when)
    fig1..fig5 *.png (--pdf: also .pdf)

`tokens` and `pretrained` (tokens.py, whose docstring has the details) write tokens* / pretrained* tables and
fig6 / fig7 into their --out folder; `runs` (the default subcommand: `python analyze.py out/` is
`python analyze.py runs out/`) reads those tables from its --out folder into REPORT.md (claims f1, f2), so run
it after them. Statistics use numpy only: seeded bootstrap, exact sign test, Spearman with average ranks.
"""
import argparse
import csv
import io
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import reduce

import matplotlib
import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure  # object-oriented matplotlib: headless, no pyplot state
from PIL import Image

matplotlib.rcParams['axes.formatter.useoffset'] = False   # axes read '1e-6+2.04477' with it: every tick in full

import control
import geometry
import report
import stats
import train

# -----------------------------------------------------------------------------
# what the tables measure (the verdict rules are report.py's; the study's grid is sweep.sh's, read from runs.txt)
CONTROL_KINDS = ('none', 'shrink', 'freeze')
FINAL_LOGS = 3             # a run's "final" entropy or PR: mean over its last FINAL_LOGS logged iterations
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


# the files `runs` writes into its --out folder (stale ones from an earlier analysis are removed)
RUNS_OUTPUTS = re.compile(r'(runs|trajectories\w*|trajectory_summary|attention_link\w*|control|control_effects|timeline'
                          r'|scale_shape\w*|robustness\w*)\.(csv|md)|fig[1-58]_\w+\.(png|pdf)')


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
    heads: dict = field(default_factory=dict)   # per-head metric (a list per layer) -> (len(geom_iters), n_layer, n_head)
    setting: str = 'A'       # which training setup (SETTING_KEYS) it shares with others; set by load_runs

    n_layer = property(lambda self: int(self.cfg['n_layer']))
    qk_init = property(lambda self: self.cfg['qk_init'])
    seed = property(lambda self: int(self.cfg['seed']))
    control = property(lambda self: self.cfg.get('control', 'none'))
    target = property(lambda self: target_of(self.cfg))
    label = property(lambda self: control.control_label(self.cfg))   # '' for none, e.g. 'shrink-k', 'freeze-k-spec'
    has_geometry = property(lambda self: len(self.geom_iters) > 0)

    def metric(self, key):
        """(len(geom_iters), n_layer) values of a per-layer metric; NaN where it was not logged."""
        return self.layers.get(key, np.full((len(self.geom_iters), self.n_layer), np.nan))

    @property
    def too_short(self):
        """Fewer than FINAL_LOGS records after the end of warm-up: its final values still average over warm-up."""
        its = self.geom_iters if self.has_geometry else self.iters
        return int((its > self.cfg.get('warmup_iters', 0)).sum()) < FINAL_LOGS

    def final(self, key):
        """Mean over the last FINAL_LOGS logged iterations and over layers (NaN if not logged)."""
        v = self.metric(key)[-FINAL_LOGS:]
        return float(np.nanmean(v)) if np.isfinite(v).any() else float('nan')


def walk_folders(paths, warn=None):
    """(run folders, plans) under paths: every folder that holds a config.json (a run folder holds no further
    runs; one reached twice counts once) and every runs.txt outside them (sweep.sh's plan). With warn, a folder
    with metrics.jsonl but no config.json and a symbolic link to a folder (not followed) are named."""
    warn = warn or (lambda msg: None)
    found, plans = [], []
    for top in paths:
        for root, dirs, files in os.walk(top):
            if 'config.json' in files:
                found.append(os.path.normpath(root))
                dirs[:] = []
                continue
            if 'metrics.jsonl' in files:
                warn(f'skipped {root}: it holds metrics.jsonl but no config.json (a run folder train.py did not '
                     f'finish setting up, or a copy missing it)')
            for d in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                warn(f'skipped {os.path.join(root, d)}: a symbolic link to {os.path.realpath(os.path.join(root, d))},'
                     f' not followed; pass that folder itself')
            dirs[:] = sorted(d for d in dirs if not d.startswith('.') and not os.path.islink(os.path.join(root, d)))
            if 'runs.txt' in files:
                plans.append(os.path.normpath(os.path.join(root, 'runs.txt')))
    unique = {}
    for path in found:
        unique.setdefault(os.path.realpath(path), path)
    return sorted(unique.values()), list(dict.fromkeys(plans))


def find_run_dirs(paths):
    return walk_folders(paths)[0]


def discover(paths, warn=None):
    """walk_folders, or Skip naming the folders when they hold no run folder (every subcommand starts here)."""
    run_dirs, plans = walk_folders(paths, warn)
    if not run_dirs:
        raise Skip(f'no run folder (a folder with config.json) found under {", ".join(paths)}')
    return run_dirs, plans


def collector(log):
    """(warnings, warn): warn(msg) logs 'warning: msg' and keeps msg in the list, for the report."""
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')
    return warnings, warn


def read_json(path):
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__}: {str(e)[:80]})') from None
    if not isinstance(obj, dict):
        raise Skip(f'{os.path.basename(path)} does not hold a JSON object')
    return obj


def load_run(path):
    """A finished run folder as a Run; Skip (with the reason) for an unfinished or corrupt one. Records with a
    value that is not a finite number are left out, each with a note naming its iteration and key."""
    cfg = read_json(os.path.join(path, 'config.json'))
    lacking = [k for k in ('n_layer', 'qk_init', 'seed') if k not in cfg]
    if lacking:
        raise Skip(f"config.json lacks {', '.join(lacking)}")
    if not (type(cfg['n_layer']) is int and type(cfg['seed']) is int and isinstance(cfg['qk_init'], str)):
        raise Skip('config.json: n_layer and seed must be integers and qk_init a string')
    if not os.path.exists(os.path.join(path, 'done.json')):
        raise Skip('unfinished (no done.json)')
    done = read_json(os.path.join(path, 'done.json'))
    if not os.path.isfile(os.path.join(path, 'metrics.jsonl')):
        raise Skip('no metrics.jsonl')
    notes = []  # a line that is not a record is left out, with a note naming it (a cut last line: silently)
    recs = usable_records(train.read_metrics(os.path.join(path, 'metrics.jsonl'), notes.append), cfg['n_layer'],
                          notes.append)
    if not recs:
        raise Skip('metrics.jsonl holds no usable records')
    geo = [r for r in recs if r.get('layers')]
    scalars = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items() if not isinstance(v, list)})
    lists = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items() if isinstance(v, list)})
    run = Run(path, cfg, done, np.array([r['iter'] for r in recs], dtype=np.int64),
              np.array([r.get('train_loss') for r in recs], dtype=float),
              np.array([r.get('val_loss') for r in recs], dtype=float),
              np.array([r['iter'] for r in geo], dtype=np.int64),
              {k: np.array([[layer.get(k) for layer in r['layers']] for r in geo], dtype=float) for k in scalars},
              notes, per_head(geo, lists, notes.append))
    if not run.has_geometry:
        run.notes.append('no geometry logged (geom_interval=0): losses only')
    return run


def finite(v):
    return type(v) in (int, float) and math.isfinite(v)


def bad_value(rec, n_layer):
    """What makes a record unusable ('iteration 50: layer 0 pr_k = nan ...'), or None when every value is a
    finite number (lists: of finite numbers) and it has n_layer layers."""
    for key in ('train_loss', 'val_loss', 'lr'):
        if key in rec and rec[key] is not None and not finite(rec[key]):
            return f'{key} = {str(rec[key])[:40]} is not a finite number'
    layers = rec.get('layers') or []
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        return 'layers is not a list of objects'
    if layers and len(layers) != n_layer:
        return f'{len(layers)} layers logged, config.json says n_layer={n_layer}'
    for i, layer in enumerate(layers):
        for key, v in layer.items():
            if not (finite(v) or isinstance(v, list) and v and all(finite(x) for x in v)):
                return f'layer {i} {key} = {str(v)[:40]} is not a finite number'
    return None


def usable_records(rows, n_layer, note):
    """The records by iteration, without those bad_value rejects; a repeated iteration keeps its last record.
    Each record left out, and each repeat, gets a note naming the iteration."""
    counts = Counter(r['iter'] for r in rows)
    by_iter = {}
    for rec in rows:
        problem = bad_value(rec, n_layer)
        if problem:
            note(f"metrics.jsonl iteration {rec['iter']}: {problem}; that record is left out")
        else:
            by_iter[rec['iter']] = rec
    for it, n in sorted(counts.items()):
        if n > 1:
            note(f'metrics.jsonl has {n} records at iteration {it}: the last one is used')
    return [by_iter[it] for it in sorted(by_iter)]


def per_head(geo, keys, note):
    """{key: (records, n_layer, n_head)} of the per-head lists; a key whose lists differ in length is left out."""
    out = {}
    for key in keys:
        try:
            out[key] = np.array([[layer.get(key, []) for layer in r['layers']] for r in geo], dtype=float)
        except ValueError:
            note(f'metrics.jsonl: the lists of {key} differ in length between layers or records; left out')
    return {k: v for k, v in out.items() if v.ndim == 3}


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
        key = (run.setting, run.n_layer, run.qk_init, run.label, run.seed)
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
    inits = list(train.QK_INITS)
    return inits.index(name) if name in inits else len(inits)


def target_of(cfg):
    """The controlled projection ('k' or 'q') of a controlled run, '' for an uncontrolled one."""
    return cfg.get('control_target', 'k') if cfg.get('control', 'none') != 'none' else ''


def group_label(cfg):
    """How figures name a configuration: 'L4 normal', 'L4 normal shrink-k', 'L4 normal freeze-k-spec'."""
    label = control.control_label(cfg)
    return f"L{cfg.get('n_layer')} {cfg.get('qk_init')}" + (f' {label}' if label else '')


def seed_stack(runs, key, layer_mean=False):
    """The iterations logged by every run and a metric over them: (iters (T,), values (S, T, n_layer)), or
    with layer_mean each run's mean over its layers, (S, T), which also stacks runs of different depths."""
    common = reduce(np.intersect1d, [r.geom_iters for r in runs])
    if len(common) == 0:
        raise Skip(f'runs {", ".join(r.path for r in runs)} share no logged iteration')
    values = [r.metric(key)[np.searchsorted(r.geom_iters, common)] for r in runs]
    return common, np.stack([v.mean(axis=1) for v in values] if layer_mean else values)


# ----------------------------------------------------------------------------- tables

def write_table(rows, out, stem, columns=None):
    """rows (list of dicts) as stem.csv and stem.md; returns the paths written."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    csv_path, md_path = os.path.join(out, stem + '.csv'), os.path.join(out, stem + '.md')
    with open(csv_path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([['' if row.get(c) is None else row.get(c) for c in columns] for row in rows])
    with open(md_path, 'w') as f:
        f.write(report.markdown_table(rows, columns))
    return [csv_path, md_path]


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
        rhos = [stats.spearman(X[:, layer], Y[:, layer]) for layer in range(run.n_layer)]
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
        s = stats.mean_ci(values[name])
        row['n_runs'] = s['n']
        row.update({f'{name}': s['mean'], f'{name}_lo': s['lo'], f'{name}_hi': s['hi']})
    return row


def control_rows(runs, target):
    """Per (setting, depth, init, seed) of the control experiment with control_target = target: final
    entropy, PRs and validation loss of none, shrink and freeze, and the differences against none."""
    labels = {kind: control.control_label({'control': kind, 'control_target': target}) for kind in CONTROL_KINDS}
    controlled = [r for r in runs if r.control != 'none' and r.label in labels.values()]
    cells = sorted({(r.setting, r.n_layer, r.qk_init) for r in controlled},
                   key=lambda c: (c[0], c[1], init_order(c[2])))
    index = {(r.setting, r.n_layer, r.qk_init, r.label, r.seed): r for r in runs}
    rows = []
    for setting, depth, init in cells:
        seeds = sorted({r.seed for r in runs if (r.setting, r.n_layer, r.qk_init) == (setting, depth, init)
                        and r.label in labels.values()})
        for seed in seeds:
            row = {'target': target, 'setting': setting, 'n_layer': depth, 'qk_init': init, 'seed': seed}
            for kind in CONTROL_KINDS:
                r = index.get((setting, depth, init, labels[kind], seed))
                row.update({f'{metric}_{kind}': final_value(r, metric) for metric in CONTROL_METRICS})
            row.update({f'd_{metric}_{kind}': difference(row[f'{metric}_{kind}'], row[f'{metric}_none'])
                        for kind in ('shrink', 'freeze') for metric in CONTROL_METRICS})
            rows.append(row)
    return rows


def difference(a, b):
    return a - b if a is not None and b is not None else None


def final_value(run, metric):
    """A run's final value of a metric (Run.final; val_loss: the last logged), None without the run or geometry."""
    if run is None or (metric != 'val_loss' and not run.has_geometry):
        return None
    return float(run.val_loss[-1]) if metric == 'val_loss' else run.final(metric)


def control_effect_rows(rows, target):
    """Per (control, metric): the paired differences against none, summarised (stats.paired_effect)."""
    out = []
    for kind in ('shrink', 'freeze'):
        for metric in CONTROL_METRICS:
            d = [r[f'd_{metric}_{kind}'] for r in rows if r[f'd_{metric}_{kind}'] is not None]
            if not d:
                continue
            role = 'pr_controlled' if metric == f'pr_{target}' else metric
            out.append({'target': target, 'contrast': f'{kind} - none', 'metric': metric,
                        **stats.paired_effect(d, PREDICTED.get((role, kind)))})
    return out


TIMELINE_KEYS = ('pr_q', 'pr_k', 'pr_q_head', 'pr_k_head', 'pr_qk', 'entropy', 'entropy_norm')


def timeline_rows(runs):
    """Which quantity moves when: means over runs (of layer means) at every iteration that all runs of a
    group logged. Groups are (setting, depth, init, control, target), plus every uncontrolled run of a
    setting pooled (n_layer and qk_init 'all'); the numbers behind fig3 (left) and fig5."""
    groups = defaultdict(list)
    for r in runs:
        if r.has_geometry:
            groups[(r.setting, r.n_layer, r.qk_init, r.control, r.target)].append(r)
            if r.control == 'none':
                groups[(r.setting, 'all', 'all', 'none', '')].append(r)
    order = lambda g: (g[0], g[1] != 'all', str(g[1]), init_order(g[2]), CONTROL_KINDS.index(g[3]), g[4])
    rows = []
    for (setting, depth, init, control, target) in sorted(groups, key=order):
        group = groups[(setting, depth, init, control, target)]
        keys = [k for k in TIMELINE_KEYS if all(k in r.layers for r in group)]
        try:  # (runs, iterations) per key: each run's mean over its layers, so every run weighs the same
            stacks = {k: seed_stack(group, k, layer_mean=True) for k in keys}
        except Skip:
            continue  # no iteration logged by every run of the group: nothing to average
        for i, it in enumerate(stacks[keys[0]][0] if keys else []):
            rows.append({'setting': setting, 'n_layer': depth, 'qk_init': init, 'control': control,
                         'control_target': target, 'n_runs': len(group), 'iter': int(it),
                         **{k: float(v[:, i].mean()) for k, (_, v) in stacks.items()}})
    return rows


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

TEXT_COLUMNS = {'model', 'family', 'rope', 'revision', 'qk_init', 'control', 'target'}


def parse_cell(key, text):
    """A CSV cell written by write_table back to a value: '' -> None, True/False, int, float, else the text."""
    if key in TEXT_COLUMNS:
        return text
    if text == '':
        return None
    if text in ('True', 'False'):
        return text == 'True'
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_table(path):
    with open(path, newline='') as f:
        return [{k: parse_cell(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def token_results(out):
    """{prefix: (trend rows, link rows, summary rows)} of the token-level tables found in out (written by
    `tokens` and `pretrained`), for the report."""
    found = {}
    for prefix in report.TOKEN_SOURCES:
        paths = [os.path.join(out, f'{prefix}_{kind}.csv') for kind in ('trend', 'link', 'summary')]
        if all(os.path.isfile(p) for p in paths):
            found[prefix] = tuple(read_table(p) for p in paths)
    return found


# ----------------------------------------------------------------------------- figures

def save_figure(fig, out, stem, pdf):
    """stem.png as a 256-colour palette PNG: line plots look the same and the file is about 3x smaller,
    which matters for figures committed with results (PIL comes with matplotlib)."""
    paths = [os.path.join(out, stem + '.png')]
    buf = io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    rgb = Image.open(buf).convert('RGB')
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(paths[0], optimize=True)
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
        draw_pr_layers(ax, runs, depth, depths[-1])
        ax.set_title(f'L{depth} {init} ({len(runs)} seeds)', fontsize=9)
        ax.set_ylabel('PR')
        iteration_axis(ax)
        if depth != depths[-1]:
            ax.set_xlabel('')  # the axes are shared: name them once, on the bottom row
    handles, labels = axes[-1][0].get_legend_handles_labels()   # the deepest panel has every layer
    fig.legend(handles, labels, loc='outside right upper', fontsize=9, title='solid PR_Q\ndashed PR_K',
               title_fontsize=9)
    fig.suptitle('PR_Q and PR_K over training (seed mean, min-max band)')
    return fig


def draw_pr_layers(ax, runs, depth, deepest):
    """PR_Q (solid) and PR_K (dashed) of every layer of runs of one depth: seed mean, min-max band. Layer i has
    the same colour at every depth (one legend for the figure)."""
    iters, Q = seed_stack(runs, 'pr_q')
    K = seed_stack(runs, 'pr_k')[1]
    colors = colormaps['viridis'](np.linspace(0, 0.9, deepest))
    for layer in range(depth):
        for vals, style in ((Q, '-'), (K, '--')):
            v = vals[:, :, layer]
            ax.plot(iters, v.mean(0), style, color=colors[layer], lw=1.2,
                    label=f'layer {layer}' if style == '-' else None)
            if len(runs) > 1:
                ax.fill_between(iters, v.min(0), v.max(0), color=colors[layer], alpha=0.15, lw=0)


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


def snapshot_files(run):
    """[(iteration, path)] of the Q/K snapshots train.py wrote in a run's snapshots/, by iteration."""
    folder = os.path.join(run.path, 'snapshots')
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted((int(n[3:-4]), os.path.join(folder, n)) for n in names
                  if n.startswith('qk_') and n.endswith('.npz') and n[3:-4].isdigit())


def read_snapshot(run, it, path, layer):
    """(W_Q, W_K, n_head) of one layer in a snapshot; Skip naming the run and iteration when it is unreadable."""
    try:
        with np.load(path) as z:
            q, k, n_head = z['q'][layer], z['k'][layer], int(z['n_head'])
    except Exception as e:  # a truncated or foreign file: zipfile, OSError, KeyError, ValueError, ...
        raise Skip(f'{run.path}: the snapshot of iteration {it} ({os.path.basename(path)}) is unreadable '
                   f'({type(e).__name__}: {str(e)[:60]})') from None
    if not (np.isfinite(q).all() and np.isfinite(k).all()):
        raise Skip(f'{run.path}: the snapshot of iteration {it} holds values that are not finite')
    return q, k, n_head


def plot_spectra(cells, warn=print):
    """Figure 4: singular values of W_Q, W_K and W_QK (head mean of each rank) at the first and the last
    snapshot, for the middle layer of one representative run per init. Reads two snapshots per run; a run
    whose snapshot cannot be read is left out with a warning."""
    reps = []
    for init, run in representative_runs(cells) if cells else []:
        files = snapshot_files(run)
        try:
            snaps = [(it, read_snapshot(run, it, path, run.n_layer // 2)) for it, path in (files[0], files[-1])]
        except IndexError:
            continue  # no snapshots
        except Skip as e:
            warn(f'{e}; left out of fig4')
            continue
        reps.append((run, snaps))
    if not reps:
        raise Skip('no readable Q/K snapshots in the uncontrolled runs')
    fig = Figure(layout='constrained', figsize=(13, 3.3 * len(reps)))
    axes = fig.subplots(len(reps), 3, squeeze=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: several threads on a busy machine spin-wait (seen: 1000x slower)
    try:
        for row, (run, snaps) in zip(axes, reps):
            draw_spectra(row, run, snaps)
    finally:
        torch.set_num_threads(threads)
    fig.suptitle('singular value spectra at the start and the end')
    return fig


def draw_spectra(axes, run, snaps):
    """One row of figure 4: the spectra of W_Q, W_K and W_QK of a run's middle layer at two snapshots."""
    for (it, (q, k, n_head)), color in zip(snaps, ('tab:blue', 'tab:red')):
        s_qk = geometry.interaction_singular_values(q, k, n_head)
        spectra = ((geometry.singular_values(q), geometry.matrix_pr(q)),
                   (geometry.singular_values(k), geometry.matrix_pr(k)),
                   (s_qk.mean(0), geometry.participation_ratio(s_qk ** 2).mean().item()))  # pr_qk: mean of head PRs
        for ax, (s, pr) in zip(axes, spectra):
            s = s.numpy()
            ax.semilogy(np.arange(1, len(s) + 1), np.maximum(s, 1e-12), color=color, label=f'iter {it}: PR {pr:.1f}')
    for ax, title in zip(axes, ('W_Q', 'W_K', 'W_QK (head mean)')):
        ax.set_title(f'{title}, {os.path.basename(run.path)} layer {run.n_layer // 2}', fontsize=9)
        ax.set_xlabel('index')
        ax.set_ylabel('singular value')
        ax.legend(fontsize=7)


def plot_control(runs, rows, target):
    """Figure 5, a row per control setup (training setting, depth, init): PR of the controlled projection and
    attention entropy over training for none, shrink and freeze (seed mean, min-max band), and the per-seed
    paired entropy differences with the mean and its bootstrap interval."""
    if not rows:
        raise Skip(f'no controlled runs (control_target={target})')
    cells = sorted({(r['setting'], r['n_layer'], r['qk_init']) for r in rows},
                   key=lambda c: (c[0], c[1], init_order(c[2])))
    labels = {kind: control.control_label({'control': kind, 'control_target': target}) for kind in CONTROL_KINDS}
    fig = Figure(layout='constrained', figsize=(15, 4.3 * len(cells)))
    for axes, cell in zip(fig.subplots(len(cells), 3, squeeze=False), cells):
        groups = {kind: [r for r in runs if (r.setting, r.n_layer, r.qk_init) == cell and r.label == labels[kind]
                         and r.has_geometry] for kind in CONTROL_KINDS}
        draw_control_curves(axes[0], axes[1], groups, target)
        draw_control_effects(axes[2], [r for r in rows if (r['setting'], r['n_layer'], r['qk_init']) == cell])
        axes[0].set_title(f'setting {cell[0]}, L{cell[1]} {cell[2]}: ' + axes[0].get_title(), fontsize=9)
    fig.suptitle(f'control experiment (control_target={target})')
    return fig


CONTROL_COLORS = {'none': 'k', 'shrink': 'tab:blue', 'freeze': 'tab:red'}


def draw_control_curves(ax_pr, ax_h, groups, target):
    """The controlled PR and the entropy over training of each group {kind: runs}: layer mean, seed mean and band.
    The PR shown is the one the control acts on: per head (mean over heads) in head scope, else the whole matrix."""
    scopes = {r.cfg.get('control_scope', 'head') for kind in ('shrink', 'freeze') for r in groups[kind]}
    ctl_pr = ('pr_k' if target == 'k' else 'pr_q') + ('_head' if scopes == {'head'} else '')
    for kind, group in groups.items():
        for ax, key in ((ax_pr, ctl_pr), (ax_h, 'entropy')) if group else ():
            iters, v = seed_stack(group, key)
            v = np.nanmean(v, axis=2)   # layer mean, (S, T)
            ax.plot(iters, v.mean(0), color=CONTROL_COLORS[kind], label=f'{kind} ({len(group)} seeds)')
            ax.fill_between(iters, v.min(0), v.max(0), color=CONTROL_COLORS[kind], alpha=0.2, lw=0)
    for ax, name in ((ax_pr, ctl_pr.upper().replace('_HEAD', ' per head')), (ax_h, 'attention entropy (nats)')):
        iteration_axis(ax)
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    ax_pr.set_title(f'controlled PR ({ctl_pr}, layer mean)', fontsize=9)
    ax_h.set_title('entropy (layer mean)', fontsize=9)


def draw_control_effects(ax, rows):
    """Per seed, the paired final entropy differences shrink - none and freeze - none, with their mean and
    bootstrap interval."""
    for x, kind in enumerate(('shrink', 'freeze')):
        d = np.array([r[f'd_entropy_{kind}'] for r in rows if r[f'd_entropy_{kind}'] is not None], dtype=float)
        if len(d) == 0:
            continue
        jitter = np.linspace(-0.12, 0.12, len(d)) if len(d) > 1 else np.zeros(1)
        ax.scatter(x + jitter, d, color=CONTROL_COLORS[kind], s=18, zorder=3)
        lo, hi = stats.bootstrap_ci(d)
        ax.errorbar([x + 0.3], [d.mean()], yerr=[[d.mean() - lo], [hi - d.mean()]], fmt='D', color='k',
                    capsize=4, zorder=4)
    ax.axhline(0, color='k', lw=1)
    ax.set_xticks([0, 1], ['shrink - none', 'freeze - none'])
    ax.set_xlim(-0.5, 1.6)
    ax.set_ylabel('paired final entropy difference (nats)')
    ax.set_title(f'per seed, mean and {stats.LEVEL:.0%} bootstrap interval', fontsize=9)


# ----------------------------------------------------------------------------- notes for the report

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


# ----------------------------------------------------------------------------- the analysis

def analyze(paths, out=None, pdf=False, figures=True, log=print):
    """Everything: load the runs under paths, write tables, figures and REPORT.md to out. Returns a dict
    with the claims, the files written, the warnings and what is missing. Raises Skip when no run
    folder is found. Everything is written into a staging folder first and moved into out at the end."""
    warnings, warn = collector(log)
    run_dirs, plans = discover(paths, warn)
    runs, skipped, settings = load_runs(run_dirs, warn)
    out = out or os.path.join(paths[0], 'analysis')
    res = study_tables(runs, warn)
    # the report, with the token-level results written earlier into out by `tokens` and `pretrained`
    res.update(paths=list(paths), out=out, n_found=len(run_dirs), runs=runs, skipped=skipped,
               token=token_results(out), final_logs=FINAL_LOGS, short=[r.path for r in runs if r.too_short])
    res.update(claims=report.claims(res), confounds=confound_notes(runs, res['cells'], res['traj']['']),
               setting_notes=setting_notes(runs, settings), missing=missing_runs(plans), warnings=warnings)
    with staging(out) as staged:
        tables = write_tables(res, runs, skipped, staged)
        written, figure_notes = draw_figures(res, runs, staged, pdf, log, warn) if figures else ([], [])
        res.update(tables=moved(tables, out), figures=moved(written, out), figure_notes=figure_notes)
        report.write_report(os.path.join(staged, 'REPORT.md'), res)
        publish(staged, out, RUNS_OUTPUTS)
    res['files'] = res['tables'] + res['figures'] + [os.path.join(out, 'REPORT.md')]
    return res


@contextmanager
def staging(out):
    """A fresh hidden folder inside out to write an analysis into (publish moves it into out); removed on the
    way out, so a crash halfway leaves out as it was."""
    os.makedirs(out, exist_ok=True)
    staged = tempfile.mkdtemp(prefix='.staging-', dir=out)
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish(staged, out, owned):
    """Move the files written into staged into out. First REPORT.md goes, and every file of the same kind of
    analysis (owned, a regex) from an earlier one that was not written again, so that a report never sits beside
    tables of another analysis; a new REPORT.md comes last. Returns whether an old REPORT.md was removed."""
    new = sorted(os.listdir(staged), key=lambda name: name == 'REPORT.md')
    old_report = os.path.isfile(os.path.join(out, 'REPORT.md'))
    for name in os.listdir(out):
        if name == 'REPORT.md' or (owned.fullmatch(name) and name not in new):
            os.remove(os.path.join(out, name))
    for name in new:
        os.replace(os.path.join(staged, name), os.path.join(out, name))
    return old_report and 'REPORT.md' not in new


def moved(paths, out):
    return [os.path.join(out, os.path.basename(p)) for p in paths]


def study_tables(runs, warn):
    """The rows of every table of the weight study, computed from the loaded runs."""
    cells = study_cells(runs)
    traj = {suffix: trajectory_rows(cells, q_key, k_key, warn) for suffix, (q_key, k_key, _) in VARIANTS.items()}
    summaries = [trajectory_summary(traj[suffix], suffix.strip('_'), what)
                 for suffix, (_, _, what) in VARIANTS.items() if traj[suffix]]
    link_runs, link_rows = attention_link_tables(cells)
    ctl_rows = {target: control_rows(runs, target) for target in ('k', 'q')}
    effects = [e for target in ('k', 'q') for e in control_effect_rows(ctl_rows[target], target)]
    return {'cells': cells, 'traj': traj, 'summaries': summaries,
            'summary': summaries[0] if summaries and summaries[0]['variant'] == 'full' else None,
            'link_runs': link_runs, 'link_rows': link_rows, 'ctl_rows': ctl_rows, 'effects': effects,
            'timeline': timeline_rows(runs)}


def write_tables(res, runs, skipped, out):
    """Every table that has rows, as .csv and .md in out; returns the paths written."""
    tables = [('runs', runs_table(runs, skipped))]
    tables += [('trajectories' + suffix, rows) for suffix, rows in res['traj'].items()]
    tables += [('trajectory_summary', res['summaries'])]
    if res['link_rows']:
        tables += [('attention_link_runs', res['link_runs']), ('attention_link', res['link_rows'])]
    tables += [('control', res['ctl_rows']['k'] + res['ctl_rows']['q']), ('control_effects', res['effects']),
               ('timeline', res['timeline'])]
    return [path for stem, rows in tables if rows for path in write_table(rows, out, stem)]


def draw_figures(res, runs, out, pdf, log, warn):
    """fig1..fig5 in out: (paths written, notes on the figures skipped and why)."""
    cells, ctl_rows = res['cells'], res['ctl_rows']
    plots = [('fig1_pr_over_training', lambda: plot_pr_over_training(cells)),
             ('fig2_pr_gap', lambda: plot_pr_gap(cells)),
             ('fig3_entropy_and_pr', lambda: plot_entropy_and_pr(cells)),
             ('fig4_spectra', lambda: plot_spectra(cells, warn)),
             ('fig5_control_k', lambda: plot_control(runs, ctl_rows['k'], 'k'))]
    if ctl_rows['q']:
        plots.append(('fig5_control_q', lambda: plot_control(runs, ctl_rows['q'], 'q')))
    written, notes = [], []
    for stem, make in plots:
        try:
            written += save_figure(make(), out, stem, pdf)
        except Skip as e:
            notes.append(f'{stem}: {e}')
            log(f'note: {stem} skipped: {e}')
    return written, notes


def folders_parser(prog, description):
    """The arguments every folder-reading subcommand shares."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument('dirs', nargs='+', help='folders searched recursively for run folders (folders with config.json)')
    p.add_argument('--out', default=None, help='where to write; default <first dir>/analysis/')
    p.add_argument('--pdf', action='store_true', help='write every figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables (and REPORT.md) only: faster')
    return p


def folders_exist(dirs):
    absent = [d for d in dirs if not os.path.isdir(d)]
    if absent:
        print(f'error: {", ".join(absent)}: no such folder', file=sys.stderr)
    return not absent


def runs_command(argv):
    """python analyze.py [runs] DIR [DIR ...] [--out OUT] [--pdf] [--no_figures]"""
    p = folders_parser('analyze.py', 'Tables, figures and the claims report (REPORT.md) from run folders '
                       'written by train.py.')
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
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
    print_missing(res['missing'])
    if res['short']:
        print(f'note: {report.short_note(res)}; the verdicts below are plumbing checks')
    for c in res['claims']:
        print(f'{report.claim_label(c):<4} {c["verdict"]:<14} {report.clip(c["value"], 100)}')
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
        print(f'(the REPORT.md there reported the earlier token tables: removed until that command writes it again)')


def tokens_command(argv):
    """python analyze.py tokens DIR [DIR ...] [--out OUT] [--data_file F] [--data_dir D] [--cache_dir C] ..."""
    import tokens  # here, not at the top: tokens.py imports this module
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
    if not res['measured']:
        print(f'error: none of the {res["n_found"]} run folders could be measured (reasons above)', file=sys.stderr)
        return 1
    print(f'{len(res["measured"])} of {res["n_found"]} runs measured in {time.time() - t0:.1f}s')
    print_token_result(res, args.dirs)
    return 0


def pretrained_command(argv):
    """python analyze.py pretrained --model=NAME_OR_PATH [--revisions=...] [--text=FILE] [--rope=after] ..."""
    import tokens
    p = argparse.ArgumentParser(prog='analyze.py pretrained', description='Token-level query/key geometry and '
                                'attention entropy of a pretrained model (each revision: a checkpoint series) on a '
                                'fixed text sample. Needs transformers. Families: ' + ', '.join(
                                    t for fam in tokens.FAMILIES.values() for t in fam.model_types) + '.')
    p.add_argument('--model', required=True, help='a local folder or a HF name (from the cache, else the hub)')
    p.add_argument('--revisions', default='', help='comma-separated revisions (a local folder MODEL/REVISION is '
                   'used if there), or a preset: ' + ', '.join(tokens.REVISION_PRESETS) + '; default: the default revision')
    p.add_argument('--text', default='', help=f'UTF-8 text to sample (first {tokens.SAMPLE_CHARS} characters); '
                   f'default {os.path.normpath(tokens.SAMPLE_FILE)}')
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
    except (ImportError, ValueError, OSError) as e:  # OSError: a checkpoint neither local nor downloadable
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
    import analyze  # run as the module `analyze`: tokens.py imports it, and both must share one Skip class
    sys.exit(analyze.main())
