"""
The figures of the weight study, each a function named after what it shows (fig6 and fig7, token level, are
tokens.py's). Object-oriented matplotlib (Figure, no pyplot state), headless; written as 256-colour PNGs.

    fig1_pr_over_training   PR_Q (solid) and PR_K (dashed) over training, a panel per depth x init, a line per layer
    fig2_pr_gap             PR_Q - PR_K along every (depth, init, layer) trajectory
    fig3_entropy_and_pr     entropy over training; PR_K and PR_QK against entropy
    fig4_spectra            singular values of W_Q, W_K and W_QK at the first and the last snapshot
    fig5_control_k (_q)     the control experiment, a row per control setup, a line per arm (shrink doses, freeze)
    fig8_scale_shape        entropy against the logit scale log ||W_QK||_2, coloured by PR_K
    fig10_dose_response     the entropy effect against the achieved change in per-head PR_K, per control_keep
"""
import io
import os

import matplotlib
import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure  # object-oriented matplotlib: headless, no pyplot state
from PIL import Image

import geometry
import runfolder
import stats
from folders import Skip, init_order, seed_stack

matplotlib.rcParams['axes.formatter.useoffset'] = False   # axes read '1e-6+2.04477' with it: every tick in full



def draw_figures(res, runs, out, pdf, log, warn):
    """fig1..fig5, fig8 and fig10 in out: (paths written, notes on the figures skipped and why)."""
    cells = res['cells']
    ctl_rows = {target: [r for r in res['ctl_rows'] if r['target'] == target] for target in ('k', 'q')}
    plots = [('fig1_pr_over_training', lambda: plot_pr_over_training(cells)),
             ('fig2_pr_gap', lambda: plot_pr_gap(cells)),
             ('fig3_entropy_and_pr', lambda: plot_entropy_and_pr(cells)),
             ('fig4_spectra', lambda: plot_spectra(cells, warn)),
             ('fig5_control_k', lambda: plot_control(runs, ctl_rows['k'], 'k')),
             ('fig8_scale_shape', lambda: plot_scale_shape(cells)),
             ('fig10_dose_response', lambda: plot_dose_response(res['ctl_rows'], res['dose_fits']))]
    if ctl_rows['q']:
        plots.insert(5, ('fig5_control_q', lambda: plot_control(runs, ctl_rows['q'], 'q')))
    written, notes = [], []
    for stem, make in plots:
        try:
            written += save_figure(make(), out, stem, pdf)
        except Skip as e:
            notes.append(f'{stem}: {e}')
            log(f'note: {stem} skipped: {e}')
    return written, notes


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
    fig.legend(handles, labels, loc='outside right center', fontsize=9, title='solid PR_Q\ndashed PR_K',
               title_fontsize=9)   # centred beside the panels: at the top it would cover the title
    fig.suptitle('PR_Q and PR_K over training' + ('\n' if len(inits) == 1 else ' ') + '(seed mean, min-max band)')
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
    """Per init, the runs that may stand for it in fig4, in order: by seed at the middle depth found, then at the
    other depths, nearest first (the next one is used where a run's snapshots cannot be read)."""
    depths = sorted({d for d, _ in cells})
    middle = depths[len(depths) // 2]
    order = sorted(cells, key=lambda cell: (abs(cell[0] - middle), cell[0]))
    inits = sorted({i for _, i in cells}, key=init_order)
    return [(init, [r for cell in order if cell[1] == init for r in cells[cell]]) for init in inits]


def snapshot_files(run):
    """[(iteration, path)] of the Q/K snapshots train.py wrote in a run's snapshots/, by iteration."""
    return runfolder.listing(run.path, 'snapshots')


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


def first_and_last_snapshot(run, warn):
    """[(iteration, (W_Q, W_K, n_head))] of a run's middle layer at its first and last snapshot; None (with a
    warning when they are unreadable) where it has none to show."""
    files = snapshot_files(run)
    if not files:
        return None
    try:
        return [(it, read_snapshot(run, it, path, run.n_layer // 2)) for it, path in (files[0], files[-1])]
    except Skip as e:
        warn(f'{e}; left out of fig4')
        return None


def plot_spectra(cells, warn=print):
    """Figure 4: singular values of W_Q, W_K and W_QK (head mean of each rank) at the first and the last
    snapshot, for the middle layer of one representative run per init. Reads two snapshots per run; a run
    whose snapshot cannot be read is left out with a warning and the next run of its init stands in."""
    reps = []
    for init, candidates in representative_runs(cells) if cells else []:
        for run in candidates:
            snaps = first_and_last_snapshot(run, warn)
            if snaps:
                reps.append((run, snaps))
                break
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
    """Figure 5, a row per control setup (training setting, depth, init, control_keep): PR of the controlled
    projection and attention entropy over training for the baseline and every arm (seed mean, min-max band), and
    the per-seed paired entropy differences of each arm with the mean and its bootstrap interval."""
    if not rows:
        raise Skip(f'no controlled runs (control_target={target})')
    setup = lambda r: (r['setting'], r['n_layer'], r['qk_init'], r['keep'])
    cells = sorted({setup(r) for r in rows}, key=lambda c: (c[0], c[1], init_order(c[2]), c[3]))
    fig = Figure(layout='constrained', figsize=(15, 4.3 * len(cells)))
    for axes, cell in zip(fig.subplots(len(cells), 3, squeeze=False), cells):
        setting, depth, init, keep = cell
        found = [r for r in rows if setup(r) == cell]
        labels = list(dict.fromkeys(r['arm'] for r in found))   # arm_order: shrink weak to strong, then freeze
        same = lambda r: (r.setting, r.n_layer, r.qk_init) == (setting, depth, init) and r.has_geometry
        groups = {'none': [r for r in runs if same(r) and r.control == 'none']}
        groups.update({arm: [r for r in runs if same(r) and r.label == arm] for arm in labels})
        colors = arm_colors(labels)
        draw_control_curves(axes[0], axes[1], groups, colors, target)
        draw_control_effects(axes[2], [[r['d_entropy'] for r in found if r['arm'] == arm] for arm in labels],
                             labels, colors)
        axes[0].set_title(f'setting {setting}, L{depth} {init}, keep {keep}: ' + axes[0].get_title(), fontsize=9)
    fig.suptitle(f'control experiment (control_target={target})')
    return fig


def arm_colors(arms):
    """{arm: colour}: the baseline black, freeze red, shrink doses in blues that darken as the dose strengthens."""
    shrinks = [a for a in arms if a.startswith('shrink')]
    blues = colormaps['Blues'](np.linspace(0.45, 0.95, max(len(shrinks), 1)))
    return {'none': 'k', **{a: blues[shrinks.index(a)] if a in shrinks else 'tab:red' for a in arms}}


def draw_control_curves(ax_pr, ax_h, groups, colors, target):
    """The controlled PR and the entropy over training of each group {arm: runs}: layer mean, seed mean and band.
    The PR shown is the one the control acts on: per head (mean over heads) in head scope, else the whole matrix."""
    scopes = {r.cfg.get('control_scope', 'head') for arm, group in groups.items() if arm != 'none' for r in group}
    ctl_pr = ('pr_k' if target == 'k' else 'pr_q') + ('_head' if scopes == {'head'} else '')
    for arm, group in groups.items():
        for ax, key in ((ax_pr, ctl_pr), (ax_h, 'entropy')) if group else ():
            iters, v = seed_stack(group, key)
            v = np.nanmean(v, axis=2)   # layer mean, (S, T)
            ax.plot(iters, v.mean(0), color=colors[arm], label=f'{arm} ({len(group)} seeds)')
            ax.fill_between(iters, v.min(0), v.max(0), color=colors[arm], alpha=0.2, lw=0)
    for ax, name in ((ax_pr, ctl_pr.upper().replace('_HEAD', ' per head')), (ax_h, 'attention entropy (nats)')):
        iteration_axis(ax)
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    ax_pr.set_title(f'controlled PR ({ctl_pr}, layer mean)', fontsize=9)
    ax_h.set_title('entropy (layer mean)', fontsize=9)


def draw_control_effects(ax, diffs, labels, colors):
    """Per arm, the paired final entropy differences (controlled - none) of each seed, with their mean and
    bootstrap interval."""
    for x, (d, arm) in enumerate(zip(diffs, labels)):
        d = np.array([v for v in d if v is not None], dtype=float)
        if len(d) == 0:
            continue
        jitter = np.linspace(-0.12, 0.12, len(d)) if len(d) > 1 else np.zeros(1)
        ax.scatter(x + jitter, d, color=colors[arm], s=18, zorder=3)
        lo, hi = stats.bootstrap_ci(d)
        if np.isfinite(lo):
            ax.errorbar([x + 0.3], [d.mean()], yerr=[[d.mean() - lo], [hi - d.mean()]], fmt='D', color='k',
                        capsize=4, zorder=4)
    ax.axhline(0, color='k', lw=1)
    ax.set_xticks(range(len(labels)), [f'{arm} - none' for arm in labels], fontsize=7, rotation=20)
    ax.set_xlim(-0.5, len(labels) - 0.4)
    ax.set_ylabel('paired final entropy difference (nats)')
    ax.set_title(f'per seed, mean and {stats.LEVEL:.0%} bootstrap interval', fontsize=9)


def plot_dose_response(rows, fits):
    """Figure 10: the paired final entropy change against the achieved change in the controlled projection's
    per-head PR, a panel per control_keep (target k): a point per shrink arm and seed, coloured by dose, each arm's
    mean with its seed intervals on both axes, and the fitted slope with its interval (control_dose_fit)."""
    rows = [r for r in rows if r['target'] == 'k' and r['control'] == 'shrink' and r['d_entropy'] is not None
            and r['d_pr_k_head'] is not None]
    if not rows:
        raise Skip('no shrink runs of control_target=k paired with a baseline')
    keeps = list(dict.fromkeys(r['keep'] for r in rows))
    fig = Figure(layout='constrained', figsize=(5.5 * len(keeps), 4.4))
    for ax, keep in zip(fig.subplots(1, len(keeps), squeeze=False)[0], keeps):
        found = [r for r in rows if r['keep'] == keep]
        arms = list(dict.fromkeys(r['arm'] for r in found))
        colors = arm_colors(arms)
        for arm in arms:
            x, y = (np.array([r[k] for r in found if r['arm'] == arm]) for k in ('d_pr_k_head', 'd_entropy'))
            ax.scatter(x, y, color=colors[arm], s=16, alpha=0.7, label=arm)
            (xlo, xhi), (ylo, yhi) = stats.bootstrap_ci(x), stats.bootstrap_ci(y)
            if np.isfinite(xlo) and np.isfinite(ylo):
                ax.errorbar([x.mean()], [y.mean()], xerr=[[x.mean() - xlo], [xhi - x.mean()]],
                            yerr=[[y.mean() - ylo], [yhi - y.mean()]], fmt='D', color=colors[arm], mec='k', capsize=3)
        fit = next((f for f in fits if f['target'] == 'k' and f['keep'] == keep), None)
        if fit:   # least squares passes through the points' mean
            draw_slope(ax, fit, *(np.array([r[k] for r in found]) for k in ('d_pr_k_head', 'd_entropy')))
        ax.axhline(0, color='k', lw=0.8)
        ax.axvline(0, color='k', lw=0.8)
        ax.set_xlabel('achieved change in per-head PR_K (controlled - none)')
        ax.set_ylabel('paired final entropy change (nats)')
        ax.set_title(f'control_keep={keep}', fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle('dose response: entropy effect against the achieved PR_K change (shrink, per seed)')
    return fig


def draw_slope(ax, fit, x, y):
    """The fitted line through the points' mean, and dashed the lines of the slopes at the ends of its interval."""
    grid = np.linspace(min(x.min(), 0), max(x.max(), 0), 20)
    line = lambda slope: y.mean() + slope * (grid - x.mean())
    ax.plot(grid, line(fit['slope']), 'k-', lw=1.2,
            label=f'slope {fit["slope"]:+.3g} [{fit["slope_lo"]:+.3g}, {fit["slope_hi"]:+.3g}]')
    for slope in (fit['slope_lo'], fit['slope_hi']):
        if np.isfinite(slope):
            ax.plot(grid, line(slope), 'k--', lw=0.7)


def plot_scale_shape(cells):
    """Figure 8: attention entropy against the logit scale log10 ||W_QK^h||_2, a point per (run, layer, head,
    record from the end of warm-up on), coloured by the head's PR_K; left all uncontrolled runs, right the
    same points binned by scale, the mean PR_K of each bin's low- and high-entropy halves (shape beyond scale)."""
    points = [scale_shape_points(r) for rs in cells.values() for r in rs]
    points = [p for p in points if p is not None]
    if not points:
        raise Skip('no per-head entropy, PR_K and qk_spec_norm logged')
    scale, ent, pr_k = (np.concatenate(v) for v in zip(*points))
    if len(scale) == 0:
        raise Skip('no record from the end of warm-up (warmup_iters) on: the runs end before it')
    fig = Figure(layout='constrained', figsize=(13, 4.6))
    ax, ax_bins = fig.subplots(1, 2)
    order = np.argsort(pr_k)[::-1]   # low PR_K drawn last, on top
    sc = ax.scatter(scale[order], ent[order], c=pr_k[order], s=5, cmap='viridis', alpha=0.7, lw=0)
    fig.colorbar(sc, ax=ax, label='PR_K of the head')
    ax.set_xlabel('log10 ||W_QK^h||_2 (logit scale)')
    ax.set_ylabel('attention entropy of the head (nats)')
    ax.set_title(f'{len(scale)} (run, layer, head, record) points from the end of warm-up on', fontsize=9)
    edges = np.quantile(scale, np.linspace(0, 1, 9))
    bins = np.clip(np.searchsorted(edges, scale, side='right') - 1, 0, 7)
    for half, style in ((0, 'o-'), (1, 's--')):
        mids, means = [], []
        for b in range(8):
            inside = bins == b
            if inside.sum() >= 4:
                high = ent[inside] >= np.median(ent[inside])
                mids.append(scale[inside].mean())
                means.append(pr_k[inside][high if half else ~high].mean())
        ax_bins.plot(mids, means, style, label=('higher' if half else 'lower') + '-entropy half of the bin')
    ax_bins.set_xlabel('log10 ||W_QK^h||_2 (8 bins of equal count)')
    ax_bins.set_ylabel('mean PR_K')
    ax_bins.set_title('at the same logit scale, does the higher-entropy half have the larger PR_K?', fontsize=9)
    ax_bins.legend(fontsize=8)
    fig.suptitle('attention entropy against the logit scale, coloured by the key spectrum\'s shape')
    return fig


def scale_shape_points(run):
    """(log10 scale, entropy, PR_K) per (layer, head, record from warm-up on) of a run, or None if not logged."""
    keys = ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads')
    if not all(k in run.heads for k in keys):
        return None
    keep = run.geom_iters >= run.cfg.get('warmup_iters', 0)
    scale, ent, pr_k = (run.heads[k][keep].ravel() for k in keys)
    ok = (scale > 0) & np.isfinite(ent) & np.isfinite(pr_k)
    return np.log10(scale[ok]), ent[ok], pr_k[ok]
