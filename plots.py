"""
The figures: FIGURES, a list of Figure(file stem, fn(study, tables), the REPORT.md section it is shown in,
title); fn returns a Figure or a list of them, or raises folders.Skip with its reason (None: drawn by
analyze.py tokens or pretrained). PNGs in 256 colours (a third of the size). fig4 alone reads snapshots/.
"""
import glob
import io
import os
import re
import textwrap
from collections import namedtuple

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as Canvas
from PIL import Image

import geometry
import stats
from folders import Skip, families, group, stack

matplotlib.rcParams['axes.formatter.useoffset'] = False
Figure = namedtuple('Figure', 'stem fn section title')
PR, NON_DIGITS = 'participation ratio', r'\D'


def save(name, fig):
    """{name.png: bytes}."""
    buf, out = io.BytesIO(), io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    Image.open(buf).convert('RGB').quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                            dither=Image.Dither.NONE).save(out, format='png', optimize=True)
    return {f'{name}.png': out.getvalue()}


def draw(study, t, log=print):
    """{'files': {name: bytes}, 'notes': [why a figure was skipped]} of every figure in FIGURES."""
    files, notes = {}, []
    for f in (f for f in FIGURES if f.fn):
        try:
            made = f.fn(study, t)
        except Skip as e:
            notes.append(f'{f.stem}: {e}')
            log(f'note: {f.stem} skipped: {e}')
            continue
        for i, fig in enumerate(made if isinstance(made, list) else [made]):
            fig.suptitle(f.title + (f' ({i + 1})' if i else ''))
            files.update(save(f.stem + (f'_{i + 1}' if i else ''), fig))
    return {'files': files, 'notes': notes}


def iteration_axis(ax, ylabel=None, title=None):
    """Iterations on a symlog axis that starts at 0."""
    ax.set_xscale('symlog', linthresh=1)
    ax.set_xlim(left=0)
    ax.set(xlabel='iteration', ylabel=ylabel or ax.get_ylabel(), title=title or ax.get_title())


def settings_of(study):
    """{setting name: its uncontrolled runs with geometry records}."""
    groups = group([r for r in study.runs if r.control == 'none' and len(r.iters)],
                   lambda r: study.label[r.setting])
    if groups:
        return groups
    raise Skip('no uncontrolled runs with geometry records')


def panels(n, width=4.2, height=3.2, cols=4):
    """A figure of n panels, up to cols a row, without empty ones."""
    cols, rows = min(n, cols), -(-n // cols)
    fig = Canvas(layout='constrained', figsize=(width * cols, height * rows))
    axes = fig.subplots(rows, cols, squeeze=False).flat
    for ax in axes[n:]:
        ax.remove()
    return fig, axes[:n]


def mean_line(runs, key):
    """(iterations, the mean over seeds and layers of key)."""
    its, v = stack(runs, key)
    return its, stats.nanmean(stats.nanmean(v, 0), 1)


def band(ax, its, v, **kw):
    """The seed mean of v (seeds, iterations) with its min-max band."""
    ok = np.isfinite(v).any(0)
    ax.plot(its[ok], stats.nanmean(v, 0)[ok], lw=1.1, **kw)
    ax.fill_between(its[ok], np.nanmin(v[:, ok], 0), np.nanmax(v[:, ok], 0), color=kw['color'], alpha=0.15)


def pr_over_training(study, t):
    groups = settings_of(study)
    fig, axes = panels(len(groups))
    colors = colormaps['viridis'](np.linspace(0, 0.9, max(r.n_layer for g in groups.values() for r in g)))
    for ax, (name, runs) in zip(axes, groups.items()):
        for key, style in (('pr_q', '-'), ('pr_k', '--')):
            its, v = stack(runs, key)
            for i in range(v.shape[2]):
                band(ax, its, v[:, :, i], ls=style, color=colors[i], label=f'layer {i}' * (style == '-'))
        iteration_axis(ax, f'whole-matrix {PR}', f'{name} ({len(runs)} seeds)')
    axes[0].legend(fontsize=7, title='solid PR_Q, dashed PR_K', title_fontsize=7)
    return fig


def pr_gap(study, t):
    fig, (ax,) = panels(1, 8, 4.5)
    for i, (name, runs) in enumerate(settings_of(study).items()):
        its, q = stack(runs, 'pr_q')
        gap = stats.nanmean(q, 0) - stats.nanmean(stack(runs, 'pr_k', its)[1], 0)
        ax.plot(its, gap, color=colormaps['tab20'](i % 20), lw=0.9, label=[name] + [None] * (len(gap.T) - 1))
    ax.axhline(0, color='k', lw=1)
    iteration_axis(ax, 'PR_Q - PR_K (whole matrix, seed mean)', 'a line per layer, a colour per setting')
    ax.legend(fontsize=6, ncol=2)
    return fig


def entropy_and_pr(study, t):
    groups = settings_of(study)
    fig, (ax_h, *scatter, ax_s) = panels(4, 5, 4.3)
    for name, runs in groups.items():
        ax_h.plot(*mean_line(runs, 'entropy'), label=name)
    iteration_axis(ax_h, 'attention entropy (nats)', 'seed and layer mean')
    ax_h.legend(fontsize=6)
    runs = [r for g in groups.values() for r in g if 'entropy' in r.m]
    flat = lambda key, rs=runs, warm=False: np.concatenate(
        [r.m[key][r.iters >= r.cfg['warmup_iters'] * warm].ravel() for r in rs] or [np.zeros(0)])
    color = np.log10(1 + np.concatenate([np.repeat(r.iters, r.n_layer) for r in runs]))
    for ax, key, what in zip(scatter, ('pr_k', 'pr_qk'), ('PR_K (whole matrix)', 'PR_QK (mean over heads)')):
        x = np.concatenate([r.m.get(key, r.m['entropy'] * np.nan).ravel() for r in runs])
        sc = ax.scatter(x, flat('entropy'), c=color, s=4, alpha=0.6, lw=0)
        ax.set(xlabel=what, ylabel='attention entropy (nats)', title='each run, layer and record')
    fig.colorbar(sc, ax=scatter, label='log10(1 + iteration)')
    keys = ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads')   # shape beyond scale, from warm-up on
    s, h, k = (flat(key, [r for r in runs if set(keys) <= set(r.m)], True) for key in keys)
    order = np.argsort(k)[::-1]
    fig.colorbar(ax_s.scatter(np.log10(s[order]), h[order], c=k[order], s=5, alpha=0.7, lw=0), ax=ax_s,
                 label='PR_K of the head')
    ax_s.set(xlabel='log10 ||W_QK^h||_2 (logit scale)', ylabel='entropy of the head (nats)',
             title='per head and record from the end of warm-up on')
    return fig


def spectra(study, t):
    reps = [(name, rs[0], sorted(glob.glob(f'{rs[0].path}/snapshots/qk_*.npz'))) for name, rs in
            settings_of(study).items()]
    reps = [(name, run, [paths[0], paths[-1]]) for name, run, paths in reps if len(paths) > 1][:3]
    if not reps:
        raise Skip('no run kept snapshots/ (save_snapshots=False, or compact logs only)')
    fig, grid = panels(3 * len(reps), 13 / 3, 3.3, 3)
    for row, (name, run, paths) in zip(grid.reshape(-1, 3), reps):
        i = run.n_layer // 2
        for path, color in zip(paths, ('tab:blue', 'tab:red')):
            with np.load(path) as z:
                q, k = z['q'][i], z['k'][i]
                s_qk = geometry.interaction_singular_values(q, k, int(z['n_head'])).mean(0)
            for ax, s, what in zip(row, (geometry.singular_values(q), geometry.singular_values(k), s_qk),
                                   ('W_Q', 'W_K', 'W_QK (head mean)')):
                ax.semilogy(np.arange(1, len(s) + 1), np.maximum(s.numpy(), 1e-12), color=color,
                            label=f"iteration {int(re.sub(NON_DIGITS, '', os.path.basename(path)))}")
                ax.set(title=f'{what}, {name}, layer {i}', xlabel='index', ylabel='singular value')
                ax.legend(fontsize=7)
    return fig


def control(study, t):
    fams = families(study.arms)
    if not fams:
        raise Skip('no controlled runs paired with a baseline')
    fig, grid = panels(3 * len(fams), 5, 4.2, 3)
    fits = {(r['setting'], r['arm']): r for r in t['control_dose_fit']}
    for axes, ((setting, rest), keys) in zip(grid.reshape(-1, 3), fams.items()):
        key = f"pr_{dict(rest)['control_target']}_head"
        colors = colormaps['Blues'](np.linspace(0.45, 0.95, len(keys)))
        lines = [('none', list(dict.fromkeys(b for k in keys for _, b in study.arms[k])), 'k')]
        for label, runs, color in lines + [(study.arm_name(k[1]), [c for c, _ in study.arms[k]], col)
                                           for col, k in zip(colors, keys)]:
            for ax, metric in zip(axes, (key, 'entropy')):
                ax.plot(*mean_line(runs, metric), color=color, label=f'{label} ({len(runs)})')
        xs, ys = [], []
        for color, k in zip(colors, keys):   # the dose response: each pair at the change it achieved
            x, y = ([c.final(m) - b.final(m) for c, b in study.arms[k]] for m in (key, 'entropy'))
            axes[2].scatter(x, y, color=color, s=16)
            xs, ys = xs + x, ys + y
            (mx, *_), (my, lo, hi, _) = stats.t_interval(x), stats.t_interval(y)
            axes[2].errorbar([mx], [my], yerr=np.nan_to_num([[my - lo], [hi - my]]), fmt='D', color=color,
                             mec='k', capsize=4)
        fit = fits.get((study.label[setting], study.arm_name(rest)))
        if fit and np.isfinite(fit['slope']):   # least squares passes through the points' mean
            x0 = np.array([min(xs), max(xs)])
            axes[2].plot(x0, np.nanmean(ys) + fit['slope'] * (x0 - np.nanmean(xs)), 'k:', label='least sq.')
            axes[2].legend(fontsize=7)
        axes[2].axhline(0, color='k', lw=0.8)
        axes[2].set(xlabel=f'change in {key}', ylabel='change in final entropy (nats)',
                    title='controlled - baseline per seed pair; arm mean, t interval')
        iteration_axis(axes[0], f'{key} (layer mean)', study.label[setting])
        iteration_axis(axes[1], 'attention entropy (nats, layer mean)')
        axes[0].legend(fontsize=7)
    return fig


def trended(stat):
    """Whether REPORT.md and fig9 show a statistic's trends: the claims, and the statistics tagged 'trend'."""
    return hasattr(stat, 'sign') or 'trend' in getattr(stat, 'tables', ())


def regime_points(study, t):
    """Each statistic with trends, per point along each axis: a line per line of points, a point alone too."""
    shown = {k for k, s in study.stats.items() if trended(s) and s.unit != 'pair'}
    trends = [r for r in t['regime_trend'] if r['position'] == 'all' and r['statistic'] in shown]
    names, axes = (list(dict.fromkeys(r[k] for r in trends)) for k in ('statistic', 'axis'))
    if not names:
        raise Skip('no numeric setting with two points on a line')
    at = {study.label[r.setting]: r.settings for r in study.runs}
    rows, figs = {(r['point'], r['statistic']): r for r in t['regime_rows'] if r['position'] == 'all'}, []
    for chunk in (names[i:i + 4] for i in range(0, len(names), 4)):
        fig, grid = panels(len(chunk) * len(axes), 4.6, 3.2, len(axes))
        for ax, (name, axis) in zip(grid, ((n, a) for n in chunk for a in axes)):
            lines = [(r['members'].split(' | '), r['line']) for r in trends
                     if (r['statistic'], r['axis']) == (name, axis)]
            on = {p for r in trends if r['statistic'] == name for p in r['members'].split(' | ')}
            lines += [([p], p) for p in at if (p, name) in rows and p not in on and f'{axis}=' in p]
            for j, (members, label) in enumerate(lines):
                m, lo, hi = (np.array([rows[p, name][k] for p in members]) for k in ('est', 'lo', 'hi'))
                ax.errorbar([at[p][axis] for p in members], m, yerr=np.nan_to_num([m - lo, hi - m]), ms=4,
                            marker='os^D'[j % 4], capsize=2, ls=('-', '--', ':', '-.')[j % 4], label=label)
            ax.legend(fontsize=6)
            ticks = sorted({c[axis] for c in at.values() if axis in c})
            if all(v > 0 for v in ticks):
                ax.set_xscale('log', base=2)
            ax.set_xticks(ticks, [f'{v:g}' for v in ticks], minor=False)
            ax.minorticks_off()
            s = study.stats[name]
            ax.set(xlabel=axis, ylabel=name + ': share of trajectories' * (s.unit == 'trajectory'))
            ax.set_title(textwrap.fill(getattr(s, 'text', '') or s.stat, 48), fontsize=9)
        figs.append(fig)
    return figs


def imbalance(study, t):
    """qk_imbalance, qk_drift over training per uncontrolled setting; per head, the final PR gap against
    imbalance."""
    groups = {n: [r for r in rs if 'qk_imbalance_heads' in r.m] for n, rs in settings_of(study).items()}
    if not any(groups.values()):
        raise Skip('qk_imbalance is not logged (runs trained before train.py logged it)')
    fig, (ax_t, ax_s) = panels(2, 7, 4.8)
    for i, (name, runs) in enumerate((n, rs) for n, rs in groups.items() if rs):
        color = colormaps['tab20'](i % 20)
        for key, style in (('qk_imbalance', '-'), ('qk_drift', '--')):
            ax_t.plot(*mean_line(runs, key), style, color=color, label=name if style == '-' else None)
        gap = np.concatenate([(r.m['pr_q_heads'][-1] - r.m['pr_k_heads'][-1]).ravel() / r.d for r in runs])
        x = np.concatenate([r.m['qk_imbalance_heads'][-1].ravel() for r in runs])
        ax_s.scatter(x, gap, s=12, color=color)
    iteration_axis(ax_t, '||D_h||_F / Gram norm', 'qk_imbalance (solid), qk_drift (dashed): layer, seed mean')
    ax_t.legend(fontsize=6)
    ax_s.axhline(0, color='k', lw=0.8)
    ax_s.set(xlabel='final qk_imbalance of the head', ylabel='final (PR_Q^h - PR_K^h) / d',
             title='run x layer x head')
    return fig


FIGURES = [
    Figure('fig1_pr_over_training', pr_over_training, 'Trajectories',
           'PR_Q and PR_K over training per setting (seed mean, min-max band)'),
    Figure('fig2_pr_gap', pr_gap, 'Trajectories', 'PR_Q - PR_K along every trajectory'),
    Figure('fig3_entropy_and_pr', entropy_and_pr, 'Descriptive statistics',
           'Attention entropy over training; PR_K and PR_QK against entropy; entropy against the logit '
           'scale, coloured by PR_K'),
    Figure('fig4_spectra', spectra, 'Trajectories',
           'Singular values of W_Q, W_K and W_QK at the first and last snapshot'),
    Figure('fig5_control', control, 'Control experiment',
           'The controlled PR and the entropy over training per arm family; the dose response'),
    Figure('fig9_regime', regime_points, 'Regime',
           'Each statistic per regime point (all layers): estimate and 95% interval'),
    Figure('fig10_imbalance', imbalance, 'Queries, keys and the optimizer',
           'The Q/K imbalance and its drift over training; the per-head PR gap against the imbalance'),
    Figure('fig6_tokens', None, 'Token level', 'Token-level contrast and entropy over our checkpoints'),
    Figure('fig7_pretrained', None, 'Token level', 'Token-level contrast and entropy, a pretrained series'),
]
