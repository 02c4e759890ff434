"""
The figures: FIGURES, a list of (file stem, function of the Study and its tables), each returning a matplotlib
Figure or raising folders.Skip with the reason (the report lists it). Object-oriented matplotlib, headless; PNGs in
256 colours (line plots look the same, the files are a third of the size).

    fig1_pr_over_training   PR_Q (solid), PR_K (dashed) per layer, a panel per uncontrolled setting (seed mean, band)
    fig2_pr_gap             PR_Q - PR_K along every trajectory
    fig3_entropy_and_pr     entropy over training per setting; PR_K and PR_QK against entropy
    fig4_spectra            singular values of W_Q, W_K, W_QK at the first and last snapshot: the one figure read
                            from snapshots/, drawn for the runs that kept them and skipped with one line otherwise
    fig5_control            per (setting, arm family): the controlled PR, the entropy, the paired entropy changes
    fig8_scale_shape        per-head entropy against the logit scale, coloured by PR_K
    fig9_regime             each claim per regime point along each axis, a line per line of points
    fig10_dose_response     the entropy change against the achieved per-head PR_K change, per shrink arm family
    fig11_imbalance         qk_imbalance and qk_drift over training per setting; the per-head PR gap against the
                            per-head imbalance at the end
"""
import io
import os
from functools import reduce

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from PIL import Image

import folders
import geometry
import stats
from folders import Skip

matplotlib.rcParams['axes.formatter.useoffset'] = False


def png(fig):
    buf, out = io.BytesIO(), io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    Image.open(buf).convert('RGB').quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                            dither=Image.Dither.NONE).save(out, format='png', optimize=True)
    return out.getvalue()


def pdf(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format='pdf', bbox_inches='tight')
    return buf.getvalue()


def draw(study, t, with_pdf=False, log=print):
    """{'files': {name: bytes}, 'notes': [why a figure was skipped]} of every figure in FIGURES."""
    files, notes = {}, []
    for stem, make in FIGURES:
        try:
            made = make(study, t)
        except Skip as e:
            notes.append(f'{stem}: {e}')
            log(f'note: {stem} skipped: {e}')
            continue
        for i, fig in enumerate(made if isinstance(made, list) else [made]):
            name = stem + (f'_{i + 1}' if i else '')
            files[name + '.png'] = png(fig)
            if with_pdf:
                files[name + '.pdf'] = pdf(fig)
    return {'files': files, 'notes': notes}


def iteration_axis(ax):
    ax.set_xscale('symlog', linthresh=1)
    ax.set_xlabel('iteration')


def settings_of(study, control=False):
    """{setting name: its runs}, uncontrolled only unless control."""
    groups = {}
    for r in study.runs:
        if control or r.control == 'none':
            groups.setdefault(study.label[r.setting], []).append(r)
    if not groups:
        raise Skip('no uncontrolled runs')
    return groups


def stack(runs, key):
    """(iterations every run logged, (runs, iterations, layers) values of key; NaN for a run without it)."""
    its = reduce(np.intersect1d, [r.iters for r in runs])
    rows = [r.m[key][np.searchsorted(r.iters, its)] if key in r.m else np.full((len(its), r.n_layer), np.nan)
            for r in runs]
    return its, np.stack(rows) if len({x.shape for x in rows}) == 1 else np.stack([x.mean(1, keepdims=True)
                                                                                     for x in rows])


def grid(n, w=4.2, h=3.2):
    cols = min(n, 4)
    fig = Figure(layout='constrained', figsize=(w * cols, h * -(-n // cols)))
    return fig, list(fig.subplots(-(-n // cols), cols, squeeze=False).flat)


def pr_over_training(study, t):
    groups = settings_of(study)
    fig, axes = grid(len(groups))
    deepest = max(r.n_layer for g in groups.values() for r in g)
    colors = colormaps['viridis'](np.linspace(0, 0.9, deepest))
    for ax, (name, runs) in zip(axes, groups.items()):
        for key, style in (('pr_q', '-'), ('pr_k', '--')):
            its, v = stack(runs, key)
            for layer in range(v.shape[2]):
                ax.plot(its, np.nanmean(v[:, :, layer], 0), style, color=colors[layer], lw=1.1,
                        label=f'layer {layer}' if style == '-' else None)
                ax.fill_between(its, v[:, :, layer].min(0), v[:, :, layer].max(0), color=colors[layer], alpha=0.15)
        ax.set_title(f'{name} ({len(runs)} seeds)', fontsize=8)
        iteration_axis(ax)
    axes[0].legend(fontsize=7, title='solid PR_Q, dashed PR_K', title_fontsize=7)
    fig.suptitle('PR_Q and PR_K over training (seed mean, min-max band)')
    return fig


def pr_gap(study, t):
    groups = settings_of(study)
    fig = Figure(layout='constrained', figsize=(8, 4.5))
    ax = fig.subplots()
    for i, (name, runs) in enumerate(groups.items()):
        its, q = stack(runs, 'pr_q')
        gap = np.nanmean(q, 0) - np.nanmean(stack(runs, 'pr_k')[1], 0)
        ax.plot(its, gap, color=colormaps['tab20'](i % 20), lw=0.9, label=[name] + [None] * (gap.shape[1] - 1))
    ax.axhline(0, color='k', lw=1)
    iteration_axis(ax)
    ax.set_ylabel('PR_Q - PR_K')
    ax.legend(fontsize=6, ncol=2)
    ax.set_title('PR_Q - PR_K along every trajectory (a line per layer, a colour per setting)', fontsize=10)
    return fig


def entropy_and_pr(study, t):
    groups = settings_of(study)
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_h, ax_k, ax_qk = fig.subplots(1, 3)
    for name, runs in groups.items():
        its, h = stack(runs, 'entropy')
        ax_h.plot(its, np.nanmean(h, (0, 2)), lw=1.1, label=name)
    iteration_axis(ax_h)
    ax_h.set(ylabel='attention entropy (nats)', title='entropy over training (seed and layer mean)')
    ax_h.legend(fontsize=6)
    runs = [r for g in groups.values() for r in g if 'entropy' in r.m]
    it = np.concatenate([np.repeat(r.iters, r.n_layer) for r in runs])
    ent = np.concatenate([r.m['entropy'].ravel() for r in runs])
    for ax, key in ((ax_k, 'pr_k'), (ax_qk, 'pr_qk')):
        x = np.concatenate([r.m[key].ravel() if key in r.m else np.full(r.m['entropy'].size, np.nan) for r in runs])
        sc = ax.scatter(x, ent, c=np.log10(1 + it), s=4, cmap='viridis', alpha=0.6, lw=0)
        ax.set(xlabel=key, ylabel='attention entropy (nats)', title=f'{key} against entropy (runs, layers, records)')
    fig.colorbar(sc, ax=[ax_k, ax_qk], label='log10(1 + iteration)')
    return fig


def snapshots(run):
    folder = os.path.join(run.path, 'snapshots')
    names = sorted(n for n in os.listdir(folder) if n.startswith('qk_') and n.endswith('.npz')) \
        if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in names]


def spectra(study, t):
    reps = [(name, runs[0], snapshots(runs[0])) for name, runs in settings_of(study).items()]
    reps = [r for r in reps if len(r[2]) > 1][:3]
    if not reps:
        raise Skip('no run kept snapshots/ (save_snapshots=False, or compact logs only)')
    fig = Figure(layout='constrained', figsize=(13, 3.3 * len(reps)))
    for row, (name, run, files) in zip(fig.subplots(len(reps), 3, squeeze=False), reps):
        for path, color in ((files[0], 'tab:blue'), (files[-1], 'tab:red')):
            try:
                with np.load(path) as z:
                    q, k, n_head = z['q'][run.n_layer // 2], z['k'][run.n_layer // 2], int(z['n_head'])
            except Exception as e:   # a truncated or foreign file
                raise Skip(f'{path} is unreadable ({type(e).__name__})') from None
            s_qk = geometry.interaction_singular_values(q, k, n_head)
            for ax, s in zip(row, (geometry.singular_values(q), geometry.singular_values(k), s_qk.mean(0))):
                ax.semilogy(np.arange(1, len(s) + 1), np.maximum(s.numpy(), 1e-12), color=color,
                            label=os.path.basename(path))
        for ax, what in zip(row, ('W_Q', 'W_K', 'W_QK (head mean)')):
            ax.set(title=f'{what}, {name}, layer {run.n_layer // 2}', xlabel='index', ylabel='singular value')
            ax.legend(fontsize=7)
    return fig


def control(study, t):
    families = folders_of_arms(study)
    if not families:
        raise Skip('no controlled runs paired with a baseline')
    fig = Figure(layout='constrained', figsize=(15, 4.2 * len(families)))
    for axes, ((setting, rest), keys) in zip(fig.subplots(len(families), 3, squeeze=False), families.items()):
        target = dict(rest)['control_target']
        key = f'pr_{target}_head'
        base = list(dict.fromkeys(b for k in keys for _, b in study.arms[k]))
        colors = colormaps['Blues'](np.linspace(0.45, 0.95, len(keys)))
        for label, runs, color in [('none', base, 'k')] + [(folders.arm_label(dict(k[1])), [c for c, _ in
                                                                                         study.arms[k]], colors[i])
                                                           for i, k in enumerate(keys)]:
            for ax, metric in ((axes[0], key), (axes[1], 'entropy')):
                its, v = stack(runs, metric)
                ax.plot(its, np.nanmean(v, (0, 2)), color=color, label=f'{label} ({len(runs)})')
        for x, k in enumerate(keys):
            d = [c.final('entropy') - b.final('entropy') for c, b in study.arms[k]]
            m, lo, hi, _ = stats.t_interval(d)
            axes[2].scatter([x] * len(d), d, color=colors[x], s=16)
            if np.isfinite(lo):
                axes[2].errorbar([x + 0.2], [m], yerr=[[m - lo], [hi - m]], fmt='D', color='k', capsize=4)
        axes[2].set_xticks(range(len(keys)), [folders.arm_label(dict(k[1])) for k in keys], fontsize=7, rotation=15)
        axes[2].axhline(0, color='k', lw=0.8)
        axes[2].set(ylabel='final entropy, controlled - baseline', title='per seed pair; mean and t interval')
        for ax, name in ((axes[0], key), (axes[1], 'entropy (layer mean)')):
            iteration_axis(ax)
            ax.set(ylabel=name, title=study.label[setting] if ax is axes[0] else name)
            ax.legend(fontsize=7)
    return fig


def folders_of_arms(study, control=None):
    """{(setting, arm without the dose): [arm keys]}, optionally of one control kind."""
    out = {}
    for key in study.arms:
        if control in (None, dict(key[1])['control']):
            out.setdefault((key[0], tuple(x for x in key[1] if x[0] != 'shrink_to')), []).append(key)
    return out


def scale_shape(study, t):
    pts = []
    for r in (r for g in settings_of(study).values() for r in g):
        if {'qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads'} <= set(r.m):
            keep = r.iters >= r.cfg['warmup_iters']
            s, h, k = (r.m[key][keep].ravel() for key in ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads'))
            pts.append((np.log10(s[s > 0]), h[s > 0], k[s > 0]))
    if not pts or not sum(len(p[0]) for p in pts):
        raise Skip('no per-head entropy, PR_K and qk_spec_norm from the end of warm-up on')
    scale, ent, pr_k = (np.concatenate(v) for v in zip(*pts))
    fig = Figure(layout='constrained', figsize=(13, 4.6))
    ax, ax_bins = fig.subplots(1, 2)
    order = np.argsort(pr_k)[::-1]
    sc = ax.scatter(scale[order], ent[order], c=pr_k[order], s=5, cmap='viridis', alpha=0.7, lw=0)
    fig.colorbar(sc, ax=ax, label='PR_K of the head')
    ax.set(xlabel='log10 ||W_QK^h||_2 (logit scale)', ylabel='entropy of the head (nats)',
           title='(run, layer, head, record) from the end of warm-up on')
    bins = np.clip(np.searchsorted(np.quantile(scale, np.linspace(0, 1, 9)), scale, side='right') - 1, 0, 7)
    for high, style in ((False, 'o-'), (True, 's--')):
        cells = [(scale[bins == b].mean(), pr_k[bins == b][(ent[bins == b] >= np.median(ent[bins == b])) == high]
                  .mean()) for b in range(8) if (bins == b).sum() >= 4]
        ax_bins.plot(*zip(*cells), style, label=('higher' if high else 'lower') + '-entropy half of the bin')
    ax_bins.set(xlabel='log10 ||W_QK^h||_2 (8 bins of equal count)', ylabel='mean PR_K',
                title='at one logit scale, does the higher-entropy half have the larger PR_K?')
    ax_bins.legend(fontsize=8)
    return fig


def regime(study, t):
    trends = [r for r in (t['regime'] or {}).get('trends', []) if r['position'] == 'all']
    names = list(dict.fromkeys(r['statistic'] for r in trends if not r['statistic'].startswith(('d_', 'ratio'))))
    if not names:
        raise Skip('no numeric setting with two points on a line')
    axes_ = list(dict.fromkeys(r['axis'] for r in trends))
    coords = {study.label[r.setting]: r.settings for r in study.runs}
    rows = {(r['point'], r['statistic'], r['position']): r for r in t['regime']['rows']}
    figs = []
    for i in range(0, len(names), 4):
        fig = Figure(layout='constrained', figsize=(4.6 * len(axes_), 3.0 * len(names[i:i + 4])))
        for row, name in zip(fig.subplots(len(names[i:i + 4]), len(axes_), squeeze=False), names[i:i + 4]):
            for ax, axis in zip(row, axes_):
                lines = [r for r in trends if r['statistic'] == name and r['axis'] == axis]
                for j, line in enumerate(lines):
                    pts = [rows[(p, name, 'all')] for p in line['members'].split(' | ')]
                    x = [coords[p['point']][axis] for p in pts]
                    m, lo, hi = (np.array([p[k] for p in pts], dtype=float) for k in ('est', 'lo', 'hi'))
                    ax.errorbar(x, m, yerr=np.nan_to_num([m - lo, hi - m]), marker='o', ms=4, capsize=2,
                                ls=('-', '--', ':', '-.')[j % 4], label=line['line'])
                ax.set_xscale('log', base=2)
                ax.set(xlabel=axis, title=name)
                if lines:
                    ax.legend(fontsize=6)
        fig.suptitle(f'each statistic per regime point (all layers): estimate and {stats.LEVEL:.0%} interval')
        figs.append(fig)
    return figs


def dose_response(study, t):
    families = {k: v for k, v in folders_of_arms(study, 'shrink').items() if dict(k[1])['control_target'] == 'k'}
    if not families:
        raise Skip('no shrink arms of W_K paired with a baseline')
    fig, axes = grid(len(families), 5.5, 4.4)
    fits = {(r['setting'], r['arm']): r for r in t['control_dose_fit']}
    for ax, ((setting, rest), keys) in zip(axes, families.items()):
        colors = colormaps['Blues'](np.linspace(0.45, 0.95, len(keys)))
        xs, ys = [], []
        for color, k in zip(colors, keys):
            x = [c.final('pr_k_head') - b.final('pr_k_head') for c, b in study.arms[k]]
            y = [c.final('entropy') - b.final('entropy') for c, b in study.arms[k]]
            ax.scatter(x, y, color=color, s=16, label=folders.arm_label(dict(k[1])))
            xs, ys = xs + x, ys + y
        fit = fits.get((study.label[setting], folders.arm_label(dict(rest + (('shrink_to', 0),)))))
        if fit and np.isfinite(fit['slope']):
            grid_x = np.linspace(min(xs + [0]), max(xs + [0]), 20)
            ax.plot(grid_x, np.nanmean(ys) + fit['slope'] * (grid_x - np.nanmean(xs)), 'k-', lw=1,
                    label=f"slope {fit['slope']:+.3g} [{fit['slope_lo']:+.3g}, {fit['slope_hi']:+.3g}]")
        ax.axhline(0, color='k', lw=0.6)
        ax.set(xlabel='per-head PR_K change', ylabel='final entropy change', title=study.label[setting])
        ax.legend(fontsize=7)
    return fig


def imbalance(study, t):
    groups = {n: g for n, g in settings_of(study, control=True).items() if any('qk_imbalance' in r.m for r in g)}
    if not groups:
        raise Skip('qk_imbalance not logged')
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_i, ax_d, ax_s = fig.subplots(1, 3)
    for i, (name, runs) in enumerate(groups.items()):
        color = colormaps['tab20'](i % 20)
        for ax, key in ((ax_i, 'qk_imbalance'), (ax_d, 'qk_drift')):
            its, v = stack(runs, key)
            ax.plot(its, np.nanmean(v, (0, 2)), color=color, label=name)
        for r in (r for r in runs if {'pr_q_heads', 'pr_k_heads', 'qk_imbalance_heads'} <= set(r.m)):
            gap = r.m['pr_q_heads'][-1] - r.m['pr_k_heads'][-1]
            ax_s.scatter(r.m['qk_imbalance_heads'][-1].ravel(), gap.ravel(), color=color, s=10)
    for ax, key in ((ax_i, 'qk_imbalance'), (ax_d, 'qk_drift')):
        iteration_axis(ax)
        ax.set(ylabel=key, title=f'{key} (seed and layer mean)')
    ax_i.legend(fontsize=6)
    ax_s.set(xlabel='qk_imbalance per head (last record)', ylabel='PR_Q^h - PR_K^h (last record)',
             title='per-head PR gap against the imbalance')
    return fig


FIGURES = [('fig1_pr_over_training', pr_over_training), ('fig2_pr_gap', pr_gap),
           ('fig3_entropy_and_pr', entropy_and_pr), ('fig4_spectra', spectra), ('fig5_control', control),
           ('fig8_scale_shape', scale_shape), ('fig9_regime', regime), ('fig10_dose_response', dose_response),
           ('fig11_imbalance', imbalance)]
