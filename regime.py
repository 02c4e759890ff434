"""
The regime analysis: do the study's statistics move with the training setup? A regime point is a group of
uncontrolled runs that share every setting but the seed (POINT_KEYS); its coordinates are the settings that vary
between points, found from config.json (n_embd, max_iters, lr, or whatever a user varies). A varying setting that
follows another one (n_head with n_embd, min_lr with lr: one value of it for each value of the other) is shown but
is not an axis of its own.

Per run, then per point as the mean over its seeds with the bootstrap interval over seeds (stats.py):

    q_up_k_down[_learned]   share of (run, layer) series with PR_Q up and PR_K down, from warm-up on (claim (a)),
                            whole matrix (pr_q, pr_k) and learned part W - W(0) (pr_dq, pr_dk)
    gap_end[_head|_learned] final PR_Q - PR_K over the largest PR it can have: / C whole matrix and learned part,
                            / d = C / n_head per head, so that widths compare (final: mean of the last FINAL_LOGS logs)
    c_pr_k~pr_qk, c_pr_k~entropy, c_dpr_k~dentropy   claim (c) as REPORT.md judges it: per record from warm-up on,
                            across the (layer, head) pairs, Spearman of per-head levels and of changes between records
    c2_pr_k~entropy|scale   claim (c2): per record from warm-up on, across (layer, head) pairs, Pearson partial
                            correlation of entropy with PR_K per head given log ||W_QK^h||_2, mean over records;
                            c2_scale~entropy the Pearson correlation of that scale with entropy
    d_entropy, d_qk_spec_norm, d_val_loss [label]   where controlled runs share the point: controlled - none, paired
                            by seed, per control label (freeze-k: claim (e) with control_keep fro; freeze-k-spec: spec)
    val_loss, train_val_gap final losses (done.json); a point overfits when its mean val - train exceeds OVERFIT_GAP

Every layered statistic is also given by layer position (POSITIONS): the first layer, the last, the ones between;
an effect that sits in one layer disappears in the mean over layers. (c2) by position pools the (layer, head) pairs
of that position's layers.

The trend along an axis is fitted on each line of points that differ only in that setting (TREND_RULE), per
doubling of the setting; nothing is projected beyond the points measured. Outputs: regime.csv/.md (every point,
statistic and position), regime_trend.csv/.md, fig9_regime*.png, and the REPORT.md section (report_lines).
"""
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

import stats
from stats import mean_or_nan
from folders import FINAL_LOGS, SETTING_KEYS, markdown_table, write_table
from plots import save_figure

# every setting but the seed: runs that share them are seeds of one regime point
POINT_KEYS = ('n_layer', 'qk_init') + tuple(k for k in SETTING_KEYS if k not in ('n_layer', 'qk_init'))
# settings that are an axis of their own whenever they vary, in this order; any other varying setting is an axis
# unless it follows one (n_head with n_embd, min_lr with lr). A partial ladder (width 128 done only at 8000 iterations)
# would otherwise make max_iters follow n_embd and put that point on the width line.
AXES = ('n_embd', 'max_iters', 'lr', 'n_layer', 'qk_init', 'weight_decay', 'decay_qk')
POSITIONS = ('all', 'first', 'middle', 'last')
OVERFIT_GAP = 0.05         # nats: a point whose mean final val_loss - train_loss exceeds this overfits
ROWS_PER_FIGURE = 4        # statistics (rows of panels) per fig9 file


@dataclass(frozen=True)
class Stat:
    what: str                # how the report describes it
    ref: float = 0.0         # crossing this level inside the ladder counts as a change of sign (None: not tested)
    signed: bool = True      # shown with its sign (shares and losses are not)


STATS = {
    'q_up_k_down': Stat('share of (run, layer) series with PR_Q up and PR_K down from warm-up on, whole matrix '
                        '(claim (a))', 0.5, signed=False),
    'q_up_k_down_learned': Stat('the same in the learned part W - W(0) (pr_dq, pr_dk)', 0.5, signed=False),
    'gap_end': Stat('final (PR_Q - PR_K) / C, whole matrix'),
    'gap_end_head': Stat('final (PR_Q - PR_K) / d per head, mean over heads (d = C / n_head)'),
    'gap_end_learned': Stat('final (pr_dq - pr_dk) / C, learned part'),
    'c_pr_k~pr_qk': Stat('claim (c): per record from warm-up on, across (layer, head) pairs, Spearman of per-head '
                         'PR_K with PR_QK, mean over records'),
    'c_pr_k~entropy': Stat('claim (c): the same of per-head PR_K with entropy'),
    'c_dpr_k~dentropy': Stat('claim (c): the same of their changes between consecutive records'),
    'c2_pr_k~entropy|scale': Stat('claim (c2): per record from warm-up on, across (layer, head) pairs, Pearson '
                                  'partial correlation of per-head PR_K with entropy given log ||W_QK^h||_2, mean '
                                  'over records'),
    'c2_scale~entropy': Stat('the same, Pearson of log ||W_QK^h||_2 with entropy'),
    'val_loss': Stat('final validation loss', None, signed=False),
    'train_val_gap': Stat(f'final val_loss - train_loss (overfits above {OVERFIT_GAP})', OVERFIT_GAP),
}
HEAD_STATS = ('c_pr_k~pr_qk', 'c_pr_k~entropy', 'c_dpr_k~dentropy', 'c2_pr_k~entropy|scale', 'c2_scale~entropy')
CONTROL_STATS = {'d_entropy': Stat('final entropy, controlled - none paired by seed ((e) for freeze, (d) for '
                                   'shrink)'),
                 'd_qk_spec_norm': Stat('final qk_spec_norm, controlled - none paired by seed'),
                 'd_val_loss': Stat('final val_loss, controlled - none paired by seed')}
TREND_RULE = (f'a line is the points that differ only in one setting (an axis); the trend is the least-squares slope '
              f'of the point means (means over seeds) against log2 of the setting, per doubling; its {stats.LEVEL:.0%} '
              f'interval is the percentile interval of the slopes refitted on {stats.N_BOOT} resamples of the seeds '
              f'within each point (none where a point has one seed); up or down when the interval excludes 0, else no '
              f'clear trend. A statistic changes sign inside the ladder when its point means along a line lie on both '
              f'sides of its reference (0; one half for shares; {OVERFIT_GAP} for train_val_gap): clearly when one '
              f'point\'s interval lies wholly above it and another\'s wholly below, else in the means only. Trends are '
              f'fitted between the smallest and the largest value measured on each line and are not projected beyond '
              f'them')


@dataclass
class Point:
    coords: dict                                 # every varying setting -> its value here
    runs: list                                   # the uncontrolled runs (seeds)
    values: dict = field(default_factory=dict)   # (statistic, position) -> per-seed values (np.ndarray)
    controls: dict = field(default_factory=dict)  # control label -> [(controlled run, uncontrolled run)] by seed


# ----------------------------------------------------------------------------- per run

def point_key(cfg):
    return tuple((k, json.dumps(cfg.get(k))) for k in POINT_KEYS)


def position_layers(n_layer):
    """{position: layer indices}: all, the first, the ones between the first and the last, the last."""
    return {'all': list(range(n_layer)), 'first': [0], 'middle': list(range(1, n_layer - 1)), 'last': [n_layer - 1]}


def by_position(per_layer, n_layer):
    """{position: mean of a per-layer array over that position's layers} (NaN where none, as the middle of 2)."""
    return {pos: mean_or_nan(np.asarray(per_layer)[idx]) for pos, idx in position_layers(n_layer).items()}


def final_layers(run, key):
    """Per layer, the mean over the last FINAL_LOGS logged records (folders.Run.final before its layer mean)."""
    return np.array([mean_or_nan(col) for col in run.metric(key)[-FINAL_LOGS:].T])


def q_up_k_down(run, q_key, k_key, start):
    """Per layer: 1 if PR_Q ends above and PR_K below where they were at the first record from start on, else 0;
    NaN where fewer than 2 records or the metric was not logged."""
    keep = run.geom_iters >= start
    q, k = run.metric(q_key)[keep], run.metric(k_key)[keep]
    out = np.full(run.n_layer, np.nan)
    if len(q) < 2:
        return out
    ends = np.stack([q[0], q[-1], k[0], k[-1]])
    ok = np.isfinite(ends).all(axis=0)
    out[ok] = ((q[-1] > q[0]) & (k[-1] < k[0]))[ok]
    return out


def across_heads(run, start):
    """(c) and (c2) by position: {statistic: {position: value}}, the claims' per-record statistics across the
    (layer, head) pairs of the position's layers (stats.head_links, stats.head_shapes; REPORT.md's per-head lens),
    mean over the records (steps) from iteration start on. None where per-head values were not logged."""
    keys = ('entropy_heads', 'qk_spec_norm_heads', 'pr_k_heads', 'pr_qk_heads')
    if not all(k in run.heads for k in keys):
        return None
    H, S, K, QK = (run.heads[k] for k in keys)
    with np.errstate(divide='ignore', invalid='ignore'):
        S = np.log(S)
    keep, steps = run.geom_iters >= start, run.geom_iters[:-1] >= start
    mean = lambda values, kept: mean_or_nan(np.asarray(values)[kept])
    out = {name: {} for name in HEAD_STATS}
    for pos, idx in position_layers(run.n_layer).items():
        levels, changes = stats.head_links(H[:, idx], K[:, idx], QK[:, idx])
        shapes = stats.head_shapes(H[:, idx], S[:, idx], K[:, idx], QK[:, idx])
        out['c_pr_k~pr_qk'][pos] = mean(levels['pr_k~pr_qk'], keep)
        out['c_pr_k~entropy'][pos] = mean(levels['pr_k~entropy'], keep)
        out['c_dpr_k~dentropy'][pos] = mean(changes['pr_k~entropy'], steps)
        out['c2_pr_k~entropy|scale'][pos] = mean([s['pr_k~entropy|scale'] for s in shapes], keep)
        out['c2_scale~entropy'][pos] = mean([s['scale~entropy'] for s in shapes], keep)
    return out


def final_loss(run, key):
    """The final train_loss or val_loss: done.json's, else the last one logged."""
    v = run.done.get(key)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    logged = run.train_loss if key == 'train_loss' else run.val_loss
    logged = logged[np.isfinite(logged)]
    return float(logged[-1]) if len(logged) else float('nan')


def run_stats(run, from_iter=None):
    """{statistic: {position: value}} of one uncontrolled run (STATS); from_iter: where 'from warm-up' starts
    (None: the run's warmup_iters). The learned part starts after iteration 0, where W - W(0) = 0."""
    start = run.cfg.get('warmup_iters', 0) if from_iter is None else from_iter
    C = run.cfg.get('n_embd') or float('nan')
    d = C / (run.cfg.get('n_head') or float('nan'))
    gap = lambda q, k, size: (final_layers(run, q) - final_layers(run, k)) / size
    per_layer = {'q_up_k_down': q_up_k_down(run, 'pr_q', 'pr_k', start),
                 'q_up_k_down_learned': q_up_k_down(run, 'pr_dq', 'pr_dk', max(start, 1)),
                 'gap_end': gap('pr_q', 'pr_k', C), 'gap_end_head': gap('pr_q_head', 'pr_k_head', d),
                 'gap_end_learned': gap('pr_dq', 'pr_dk', C)}
    out = {name: by_position(v, run.n_layer) for name, v in per_layer.items()}
    out.update(across_heads(run, start) or {name: {pos: float('nan') for pos in POSITIONS} for name in HEAD_STATS})
    val, train = final_loss(run, 'val_loss'), final_loss(run, 'train_loss')
    out.update(val_loss={'all': val}, train_val_gap={'all': val - train})
    return out


def pair_stats(ctl, base):
    """{statistic: {position: value}} of one controlled run against the uncontrolled run of its seed (CONTROL_STATS)."""
    diff = lambda key: by_position(final_layers(ctl, key) - final_layers(base, key), base.n_layer)
    return {'d_entropy': diff('entropy'), 'd_qk_spec_norm': diff('qk_spec_norm'),
            'd_val_loss': {'all': final_loss(ctl, 'val_loss') - final_loss(base, 'val_loss')}}


# ----------------------------------------------------------------------------- points and axes

def find_points(runs):
    """The regime points: {point key: Point} of the uncontrolled runs with geometry, with the controlled runs
    of the same settings paired by seed; and (axes, derived {setting: the axis it follows})."""
    groups = defaultdict(list)
    for r in runs:
        if r.control == 'none' and r.has_geometry:
            groups[point_key(r.cfg)].append(r)
    settings = {key: dict(key) for key in groups}
    varying = [k for k in POINT_KEYS if len({s[k] for s in settings.values()}) > 1]
    order = sorted(varying, key=lambda k: (AXES.index(k) if k in AXES else len(AXES), POINT_KEYS.index(k)))
    axes, derived = [], {}
    for k in order:
        leader = None if k in AXES else next((a for a in axes if follows(settings.values(), k, a)), None)
        if leader:
            derived[k] = leader
        else:
            axes.append(k)
    points = {}
    for key, rs in groups.items():
        coords = {k: json.loads(settings[key][k]) for k in order}
        points[key] = Point(coords, sorted(rs, key=lambda r: r.seed))
    for r in runs:
        point = points.get(point_key(r.cfg)) if r.control != 'none' and r.has_geometry else None
        base = next((b for b in point.runs if b.seed == r.seed), None) if point else None
        if base is not None:
            point.controls.setdefault(r.label, []).append((r, base))
    return points, axes, derived


def follows(settings, k, a):
    """Whether setting k has one value for each value of setting a over the points."""
    seen = {}
    return all(seen.setdefault(s[a], s[k]) == s[k] for s in settings)


def numeric(values):
    return all(type(v) in (int, float) for v in values)


def point_order(axes):
    return lambda p: tuple((0, p.coords[a], '') if type(p.coords[a]) in (int, float) else (1, 0, str(p.coords[a]))
                           for a in axes)


def lines(points, axes, axis):
    """The lines along a numeric axis: [(the other axes' values, points sorted by the axis)] with 2 or more points."""
    found = defaultdict(list)
    for p in points:
        found[tuple((a, p.coords[a]) for a in axes if a != axis)].append(p)
    return [(fixed, sorted(ps, key=lambda p: p.coords[axis])) for fixed, ps in found.items() if len(ps) > 1]


# ----------------------------------------------------------------------------- the regime table and its trends

def fill_values(points, from_iter):
    """Each point's per-seed values of every statistic and position (Point.values); returns the statistics found,
    {name: Stat}, the control ones named 'd_entropy [freeze-k]' and so on."""
    found = dict(STATS)
    for p in points:
        per_run = [run_stats(r, from_iter) for r in p.runs]
        for name in STATS:
            for pos in per_run[0][name]:
                p.values[(name, pos)] = np.array([s[name][pos] for s in per_run])
        for label, pairs in sorted(p.controls.items()):
            per_pair = [pair_stats(ctl, base) for ctl, base in pairs]
            for name, stat in CONTROL_STATS.items():
                found[f'{name} [{label}]'] = stat
                for pos in per_pair[0][name]:
                    p.values[(f'{name} [{label}]', pos)] = np.array([s[name][pos] for s in per_pair])
    return found


def summary(values):
    """{'mean', 'lo', 'hi', 'n'} of the finite per-seed values (the interval: bootstrap over seeds)."""
    v = values[np.isfinite(values)]
    lo, hi = stats.bootstrap_ci(v)
    return {'mean': float(v.mean()) if len(v) else float('nan'), 'lo': lo, 'hi': hi, 'n': len(v)}


def table_rows(points, names, axes):
    """regime.csv: one row per (point, statistic, position), with every coordinate."""
    rows = []
    for p in points:
        for name in names:
            for pos in (pos for pos in POSITIONS if (name, pos) in p.values):
                s = summary(p.values[(name, pos)])
                if s['n']:
                    rows.append({'point': label_of(p, points, axes), **p.coords, 'n_runs': len(p.runs),
                                 'statistic': name, 'position': pos, **s, 'note': overfit_note(name, s)})
    return rows


def overfit_note(name, s):
    return f'overfits (mean > {OVERFIT_GAP})' if name == 'train_val_gap' and s['mean'] > OVERFIT_GAP else ''


def label_of(point, points, axes):
    """A point's name: the first axis' value, then the other axes where they differ from their most common value."""
    common = {a: Counter(json.dumps(p.coords[a]) for p in points).most_common(1)[0][0] for a in axes}
    shown = [a for i, a in enumerate(axes) if i == 0 or json.dumps(point.coords[a]) != common[a]]
    return ', '.join(f'{a}={point.coords[a]}' for a in shown)


def slope(x, y):
    """Least-squares slopes of y (..., P) against x (P,); rounding residue of a flat line (1e-18) reads 0."""
    xc = x - x.mean()
    s = (y - y.mean(axis=-1, keepdims=True)) @ xc / (xc @ xc)
    return np.where(np.abs(s) < 1e-12 * (np.abs(y).max() + 1e-300) / np.ptp(x), 0.0, s)


def fit_trend(xs, samples, ref):
    """The trend of one statistic along one line: xs (P,) the axis values, samples the per-seed values of each
    point. Slope per doubling (per unit where a value is not positive) with its bootstrap interval over seeds,
    and whether the point means cross ref inside the line (TREND_RULE)."""
    keep = [i for i, s in enumerate(samples) if np.isfinite(s).any()]
    if len(keep) < 2:
        return None
    xs = np.asarray(xs, dtype=float)[keep]
    samples = [samples[i][np.isfinite(samples[i])] for i in keep]
    x = np.log2(xs) if (xs > 0).all() else xs
    means = np.array([s.mean() for s in samples])
    lo = hi = float('nan')   # a point with one seed has no spread to resample: no interval
    if min(len(s) for s in samples) > 1:
        boot = np.stack([stats.bootstrap_means(s, seed=stats.BOOT_SEED + i) for i, s in enumerate(samples)], axis=1)
        lo, hi = np.percentile(slope(x, boot), [50 * (1 - stats.LEVEL), 50 * (1 + stats.LEVEL)])
    out = {'n_points': len(keep), 'x_from': xs.min(), 'x_to': xs.max(), 'per': 'doubling' if (xs > 0).all() else
           'unit', 'slope': float(slope(x, means)), 'lo': float(lo), 'hi': float(hi)}
    out['trend'] = ('up' if lo > 0 else 'down' if hi < 0 else 'no clear trend') if np.isfinite(lo) else \
        'no interval (one seed at a point)'
    out['crosses'] = crossing(samples, means, ref)
    return out


def crossing(samples, means, ref):
    if ref is None:
        return ''
    cis = [stats.bootstrap_ci(s) for s in samples]   # the intervals of the regime table
    if any(lo > ref for lo, _ in cis) and any(hi < ref for _, hi in cis):
        return 'yes'
    return 'means only' if (means > ref).any() and (means < ref).any() else 'no'


def trend_rows(points, names, axes, found):
    """regime_trend.csv: per numeric axis, line, statistic and position, the trend (fit_trend)."""
    rows = []
    for axis in (a for a in axes if numeric(p.coords[a] for p in points)):
        for fixed, line in lines(points, axes, axis):
            where = ', '.join(f'{a}={v}' for a, v in fixed) or 'every point'
            for name in names:
                for pos in POSITIONS:
                    fit = fit_trend([p.coords[axis] for p in line],
                                    [p.values.get((name, pos), np.full(1, np.nan)) for p in line], found[name].ref)
                    if fit:
                        rows.append({'axis': axis, 'line': where, 'statistic': name, 'position': pos, **fit})
    return rows


def regime(runs, from_iter=None):
    """The regime analysis of loaded runs (folders.load_runs): None with fewer than two regime points; else
    {'points', 'axes', 'derived', 'stats', 'rows', 'trends'}."""
    points, axes, derived = find_points(runs)
    if len(points) < 2:
        return None
    points = sorted(points.values(), key=point_order(axes + list(derived)))
    found = fill_values(points, from_iter)
    names = list(found)
    return {'points': points, 'axes': axes, 'derived': derived, 'stats': found,
            'rows': table_rows(points, names, axes), 'trends': trend_rows(points, names, axes, found)}


def write_tables(reg, out):
    """regime.csv/.md and regime_trend.csv/.md in out; returns the paths written."""
    if reg is None:
        return []
    paths = write_table(reg['rows'], out, 'regime')
    return paths + (write_table(reg['trends'], out, 'regime_trend') if reg['trends'] else [])


# ----------------------------------------------------------------------------- fig9

POSITION_STYLE = {'all': ('k', 'o'), 'first': ('tab:blue', 'v'), 'middle': ('tab:green', 's'), 'last': ('tab:red', '^')}
LINE_STYLES = ('-', '--', ':', '-.')


def draw_figures(reg, out, pdf):
    """fig9_regime.png (then _2, _3, ...: ROWS_PER_FIGURE statistics each): each statistic against each numeric
    axis with a line of points, a curve per layer position and line, point means with their intervals over seeds.
    Returns the paths written (none without a line of points: the report's trends section says so)."""
    if reg is None:
        return []
    axes = [a for a in reg['axes'] if any(t['axis'] == a for t in reg['trends'])]
    names = [n for n in reg['stats'] if any(t['statistic'] == n and t['axis'] in axes for t in reg['trends'])]
    if not names:
        return []
    written = []
    for i in range(0, len(names), ROWS_PER_FIGURE):
        chunk = names[i:i + ROWS_PER_FIGURE]
        fig = Figure(layout='constrained', figsize=(4.6 * len(axes) + 1.6, 3.0 * len(chunk)))
        grid = fig.subplots(len(chunk), len(axes), squeeze=False)
        for row, name in zip(grid, chunk):
            for ax, axis in zip(row, axes):
                draw_panel(ax, reg, name, axis)
        for ax, axis in zip(grid[0], axes):   # which line is which, where an axis has several
            shown = lines(reg['points'], reg['axes'], axis)
            if len(shown) > 1:
                ax.legend([Line2D([], [], color='0.3', ls=LINE_STYLES[k % len(LINE_STYLES)]) for k in
                           range(len(shown))], [', '.join(f'{a}={v}' for a, v in f) for f, _ in shown], fontsize=6)
        fig.legend([Line2D([], [], color=c, marker=m, ms=4) for c, m in POSITION_STYLE.values()],
                   [f'{pos} layer{"s" if pos in ("all", "middle") else ""}' for pos in POSITION_STYLE],
                   loc='outside right upper', fontsize=8, title='layer position', title_fontsize=8)
        fig.suptitle(f'each statistic per regime point: mean over seeds with its {stats.LEVEL:.0%} bootstrap interval '
                     f'(none with one seed), by layer position', fontsize=10)
        stem = 'fig9_regime' + (f'_{i // ROWS_PER_FIGURE + 1}' if i else '')
        written += save_figure(fig, out, stem, pdf)
    return written


def draw_panel(ax, reg, name, axis):
    """One statistic against one axis: every line along it (a line style each), every layer position (a colour
    each, shifted a little sideways so that the intervals do not hide each other)."""
    for k, (_, line) in enumerate(lines(reg['points'], reg['axes'], axis)):
        xs = np.array([p.coords[axis] for p in line], dtype=float)
        for j, pos in enumerate(POSITIONS):
            found = [summary(p.values[(name, pos)]) if (name, pos) in p.values else None for p in line]
            if not any(s and s['n'] for s in found):
                continue
            m, lo, hi = (np.array([s[key] if s else np.nan for s in found]) for key in ('mean', 'lo', 'hi'))
            x = xs * 2 ** (0.03 * (j - 1.5)) if (xs > 0).all() else xs + 0.01 * (j - 1.5) * np.ptp(xs)
            color, marker = POSITION_STYLE[pos]
            ax.errorbar(x, m, yerr=np.nan_to_num(np.stack([m - lo, hi - m])), color=color, marker=marker, ms=4,
                        ls=LINE_STYLES[k % len(LINE_STYLES)], capsize=2, lw=1)
    ref = reg['stats'][name].ref
    if ref is not None:
        ax.axhline(ref, color='0.6', lw=0.8, ls=':')
    values = [p.coords[axis] for p in reg['points']]
    if all(v > 0 for v in values):
        ax.set_xscale('log', base=2)
        ticks = sorted(set(values))
        ax.set_xticks(ticks, [f'{v:g}' for v in ticks])
        ax.minorticks_off()
    ax.set_xlabel(axis + (' (log2 axis)' if all(v > 0 for v in values) else ''))
    ax.set_title(name, fontsize=9)


# ----------------------------------------------------------------------------- REPORT.md

def num(v, signed=True):
    return (f'{v:+.3g}' if signed else f'{v:.3g}') if np.isfinite(v) else 'n/a'


def interval(m, lo, hi, signed=True):
    """'m [lo, hi]' to 3 significant digits; m alone without an interval (one seed)."""
    return num(m, signed) + (f' [{num(lo, signed)}, {num(hi, signed)}]' if np.isfinite(lo) else '')


def report_lines(reg, figures=()):
    """REPORT.md's regime section: the points and their axes, the regime table (every layer), overfitting, the
    trends with their rule, the changes of sign, fig9 (figures: the paths written, fig9 among them)."""
    L = ['## Regime', '']
    if reg is None:
        return L + ['Every uncontrolled run shares all settings but the seed (one regime point, or none): '
                    'nothing to compare across settings.', '']
    points, axes = reg['points'], reg['axes']
    follow = '; '.join(f'{k} follows {a}' for k, a in reg['derived'].items())
    L += [f'{len(points)} regime points, groups of uncontrolled runs that share every setting but the seed '
          f'({sum(len(p.runs) for p in points)} runs), differ in {", ".join(axes)}' + (f' ({follow})' if follow
                                                                                       else '') + '. '
          f'Each statistic is computed per run (per layer, then over the layers of each position: all, the first, '
          f'the ones between, the last) and averaged over the seeds of its point, with the {stats.LEVEL:.0%} '
          f'bootstrap interval over seeds (none with one seed). (c2) by position pools the (layer, head) pairs of '
          f'the position\'s layers: n_head pairs per checkpoint in the first and the last layer, a noisy partial '
          f'correlation with few heads. The table shows all layers; regime.md has every position, regime_trend.md '
          f'every trend, fig9 the positions apart.', '']
    L += point_table(reg) + [f'- {n}: {s.what}' for n, s in reg['stats'].items()] + ['']
    over = [r['point'] for r in reg['rows'] if r['note']]
    L += [f'Overfitting (mean final val_loss - train_loss above {OVERFIT_GAP} nats): '
          + ('; '.join(over) if over else 'no point') + '.', '']
    L += trend_lines(reg)
    L += [f'![{os.path.basename(p)}]({os.path.basename(p)})' for p in figures
          if os.path.basename(p).startswith('fig9_') and p.endswith('.png')]
    return L + ['']


def point_table(reg):
    """Statistics (all layers) down, points across."""
    points, axes = reg['points'], reg['axes']
    labels = [label_of(p, points, axes) for p in points]
    rows = [{'statistic': 'runs (seeds)', **{lab: str(len(p.runs)) for lab, p in zip(labels, points)}}]
    for name in reg['stats']:
        found = {lab: summary(p.values[(name, 'all')]) for lab, p in zip(labels, points) if (name, 'all') in p.values}
        cells = {lab: interval(s['mean'], s['lo'], s['hi'], reg['stats'][name].signed)
                 for lab, s in found.items() if s['n']}
        if cells:
            rows.append({'statistic': name, **cells})
    return ['### Regime table (all layers)', '', markdown_table(rows, ['statistic'] + labels)]


def trend_lines(reg):
    """Per axis and line, the trend of each statistic by position; then the changes of sign."""
    L = ['### Trends', '', f'Rule: {TREND_RULE}.', '']
    if not reg['trends']:
        return L + ['No numeric axis has two or more points that differ only in it: no trend.', '']
    groups = defaultdict(list)
    for t in reg['trends']:
        groups[(t['axis'], t['line'])].append(t)
    for (axis, where), rows in groups.items():
        t = rows[0]
        L += [f'Along {axis}, {t["x_from"]:g} to {t["x_to"]:g} ({t["n_points"]} points; {where}), slope per '
              f'{t["per"]} of {axis}:', '']
        table = defaultdict(dict)
        for r in rows:
            table[r['statistic']][r['position']] = (interval(r['slope'], r['lo'], r['hi'])
                                                   + (f', crosses {reg["stats"][r["statistic"]].ref:g}'
                                                      if r['crosses'] == 'yes' else ''))
        L.append(markdown_table([{'statistic': n, **cells} for n, cells in table.items()], ['statistic', *POSITIONS]))
    L += ['Changes of sign inside the ladder (the reference: 0; one half for shares; '
          f'{OVERFIT_GAP} for train_val_gap):', ''] + sign_changes(reg['trends']) + ['']
    ranges = '; '.join(f'{a} {min(p.coords[a] for p in reg["points"]):g} to {max(p.coords[a] for p in reg["points"]):g}'
                       for a in reg['axes'] if numeric(p.coords[a] for p in reg['points']))
    L += [f'Every value above was measured inside the ladder ({ranges}); no trend is projected beyond it: a value '
          f'outside these ranges would be an extrapolation, and none is given.', '']
    return L


def sign_changes(trends):
    """One line per (statistic, axis, line) whose point means cross the reference: clearly (intervals on both
    sides) at which positions, and in the means only at which."""
    found = defaultdict(lambda: defaultdict(list))
    for t in trends:
        if t['crosses'] in ('yes', 'means only'):
            found[(t['statistic'], t['axis'], t['line'])][t['crosses']].append(t['position'])
    out = []
    for (name, axis, where), kinds in found.items():
        parts = ([f'clearly at {", ".join(kinds["yes"])}'] if kinds['yes'] else []) + \
            ([f'in the means only at {", ".join(kinds["means only"])}'] if kinds['means only'] else [])
        out.append(f'- {name} along {axis} ({where}): ' + '; '.join(parts))
    return out or ['- none']
