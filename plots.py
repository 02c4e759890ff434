"""
The figures: FIGURES, a list of Figure(file stem, fn(study, tables), the REPORT.md section it is
shown in, title); fn returns a Figure or a list of them, or raises folders.Skip with its reason.
Settings come in the study's order (of their values), each in a colour of its own, named as plain
text (a '$' in a value is not mathtext); legends sit outside the data.
"""
import io
import textwrap
from collections import namedtuple
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as Canvas

from plumbing import stats
from plumbing.folders import Skip, families, group, stack

matplotlib.rcParams['axes.formatter.useoffset'] = False
Figure = namedtuple('Figure', 'stem fn section title')
PR = 'participation ratio'
WRAP = 40           # characters a line of a title or a legend entry
LONG_NAME = 90      # a setting name longer: drawn as S1, S2, ..., listed under the figure


@dataclass(frozen=True)
class Transform:
    """A transformed axis: fn (a numpy function) of shift + the quantity, and its label, made from
    fn's own name: the label cannot say log10 while the axis draws np.log."""
    fn: object          # np.log10, np.log, ...: its __name__ starts the label
    what: str           # the quantity, as the label names it
    shift: int = 0      # added before fn: log10(1 + iteration)

    @property
    def label(self):
        name = self.fn.__name__
        return f'{name}({self.shift:g} + {self.what})' if self.shift else f'{name} {self.what}'

    def __call__(self, x):
        return self.fn(self.shift + x) if self.shift else self.fn(x)


# every transformed axis of the figures, its label and its function in one place
TRANSFORMS = {'iteration': Transform(np.log10, 'iteration', shift=1),
              'logit scale': Transform(np.log10, '||W_QK^h||_2 (logit scale)')}


def draw(study, tables, log=print):
    """{'files': {name: bytes}, 'notes': [why a figure was skipped]} of every figure in FIGURES."""
    files, notes, key = {}, [], setting_names(study)[1]
    for f in FIGURES:
        try:
            made = f.fn(study, tables)
        except Skip as e:
            notes.append(f'{f.stem}: {e}')
            log(f'note: {f.stem} skipped: {e}')
            continue
        for i, fig in enumerate(made if isinstance(made, list) else [made]):
            title = f.title + (f' ({i + 1})' if i else '')
            fig.suptitle(textwrap.fill(title, int(7 * fig.get_figwidth())))   # clear of a legend
            if key:   # below the axes, outside the layout: a long list never squeezes them
                fig.text(0, 0, key, va='top', fontsize=7)
            buf = io.BytesIO()
            fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
            files[f.stem + (f'_{i + 1}.png' if i else '.png')] = buf.getvalue()
    return {'files': files, 'notes': notes}


def plain(text, width=WRAP):
    """text wrapped to width, '$' drawn as itself: a setting's value is never parsed as mathtext."""
    return textwrap.fill(str(text), width).replace('$', r'\$')


def setting_names(study):
    """({setting: its name in figures} in the study's order, the key under a figure): key is ''
    unless a name is too long to draw; then the names are S1, S2, ... and the key lists them."""
    order = list(study.label)
    if all(len(study.label[s]) <= LONG_NAME for s in order):
        return {s: plain(study.label[s]) for s in order}, ''
    names = {s: f'S{i + 1}' for i, s in enumerate(order)}
    return names, '\n'.join(plain(f'{names[s]}: {study.label[s]}', 160) for s in order)


def colours(n):
    """n distinct colours: tab10's, then tab20's light shades, then a sample of turbo."""
    if n > 20:
        return list(colormaps['turbo'](np.linspace(0.05, 0.95, n)))
    return [colormaps['tab20'](i) for i in [*range(0, 20, 2), *range(1, 20, 2)][:n]]


def legend_outside(fig, ax, **kw):
    """ax's labelled lines as one legend to the right of the figure's panels."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc='outside right upper', fontsize=7, title_fontsize=7, **kw)


def iteration_axis(ax, ylabel=None, title=None):
    """Iterations on a symlog axis that starts at 0."""
    ax.set_xscale('symlog', linthresh=1)
    ax.set_xlim(left=0)
    ax.set(xlabel='iteration', ylabel=ylabel or ax.get_ylabel(), title=title or ax.get_title())


def settings_of(study):
    """{setting name: its uncontrolled runs with geometry records}, in setting_names' order."""
    groups = group([r for r in study.runs if r.control == 'none' and len(r.iters)],
                   lambda r: r.setting)
    if not groups:
        raise Skip('no uncontrolled runs with geometry records')
    return {name: groups[s] for s, name in setting_names(study)[0].items() if s in groups}


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
    low, high = np.nanmin(v[:, ok], 0), np.nanmax(v[:, ok], 0)
    ax.fill_between(its[ok], low, high, color=kw['color'], alpha=0.15)


def pr_over_training(study, tables):
    groups = settings_of(study)
    fig, axes = panels(len(groups))
    layers = max(r.n_layer for runs in groups.values() for r in runs)
    shade = colormaps['viridis'](np.linspace(0, 0.9, layers))
    for ax, (name, runs) in zip(axes, groups.items()):
        for key, style in (('pr_q', '-'), ('pr_k', '--')):
            its, v = stack(runs, key)
            for i in range(v.shape[2]):
                label = f'layer {i}' if style == '-' else None
                band(ax, its, v[:, :, i], ls=style, color=shade[i], label=label)
        iteration_axis(ax, f'whole-matrix {PR}', plain(f'{name} ({len(runs)} seeds)'))
    legend_outside(fig, axes[0], title='solid PR_Q,\ndashed PR_K')
    return fig


def pr_gap(study, tables):
    fig, (ax,) = panels(1, 8, 4.5)
    groups = settings_of(study)
    for colour, (name, runs) in zip(colours(len(groups)), groups.items()):
        its, q = stack(runs, 'pr_q')
        gap = stats.nanmean(q, 0) - stats.nanmean(stack(runs, 'pr_k', its)[1], 0)
        for i, layer in enumerate(gap.T):   # one legend entry per setting
            ax.plot(its, layer, color=colour, lw=0.9, label=None if i else name)
    ax.axhline(0, color='k', lw=1)
    iteration_axis(ax, 'PR_Q - PR_K (whole matrix, seed mean)',
                   'a line per layer, a colour per setting')
    legend_outside(fig, ax)
    return fig


def flat(runs, key, from_warmup=False):
    """key of every run, record (all or from the end of warm-up on) and layer (and head), flat."""
    parts = [r.m[key][r.iters >= (r.cfg['warmup_iters'] if from_warmup else 0)].ravel()
             for r in runs]
    return np.concatenate(parts or [np.zeros(0)])


def entropy_and_pr(study, tables):
    groups = settings_of(study)
    fig, (ax_h, *scatter, ax_s) = panels(4, 5, 4.3)
    for colour, (name, runs) in zip(colours(len(groups)), groups.items()):
        ax_h.plot(*mean_line(runs, 'entropy'), color=colour, label=name)
    iteration_axis(ax_h, 'attention entropy (nats)', 'seed and layer mean')
    runs = [r for g in groups.values() for r in g if 'entropy' in r.m]
    when = TRANSFORMS['iteration'](np.concatenate([np.repeat(r.iters, r.n_layer) for r in runs]))
    axes_x = (('pr_k', 'PR_K (whole matrix)'), ('pr_qk', 'PR_QK (mean over heads)'))
    for ax, (key, what) in zip(scatter, axes_x):
        x = np.concatenate([r.m.get(key, r.m['entropy'] * np.nan).ravel() for r in runs])
        dots = ax.scatter(x, flat(runs, 'entropy'), c=when, s=4, alpha=0.6, lw=0)
        ax.set(xlabel=what, ylabel='attention entropy (nats)', title='each run, layer and record')
    fig.colorbar(dots, ax=scatter, label=TRANSFORMS['iteration'].label)
    # shape beyond scale, from warm-up on (before it, the weights are still their random draw)
    keys = ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads')
    logged = [r for r in runs if set(keys) <= set(r.m)]
    scale, entropy, pr_k = (flat(logged, key, True) for key in keys)
    order = np.argsort(pr_k)[::-1]
    log_scale = TRANSFORMS['logit scale']
    dots = ax_s.scatter(log_scale(scale[order]), entropy[order], c=pr_k[order], s=5, alpha=0.7,
                        lw=0)
    fig.colorbar(dots, ax=ax_s, label='PR_K of the head')
    ax_s.set(xlabel=log_scale.label, ylabel='entropy of the head (nats)',
             title='per head and record from the end of warm-up on')
    legend_outside(fig, ax_h)
    return fig


def dose_response(ax, study, keys, colours_of, key):
    """Each seed pair at the change in key it achieved; each arm's mean, t interval."""
    for colour, k in zip(colours_of, keys):
        x = [c.final(key) - b.final(key) for c, b in study.arms[k]]
        y = [c.final('entropy') - b.final('entropy') for c, b in study.arms[k]]
        ax.scatter(x, y, color=colour, s=16)
        (mean_x, *_), (mean_y, lo, hi, _) = stats.t_interval(x), stats.t_interval(y)
        ax.errorbar([mean_x], [mean_y], yerr=np.nan_to_num([[mean_y - lo], [hi - mean_y]]), fmt='D',
                    color=colour, mec='k', capsize=4)


def control(study, tables):
    names = setting_names(study)[0]
    fams = sorted(families(study.arms).items(), key=lambda item: list(names).index(item[0][0]))
    if not fams:
        raise Skip('no controlled runs paired with a baseline')
    fig, grid = panels(3 * len(fams), 5, 4.2, 3)
    for axes, ((setting, rest), keys) in zip(grid.reshape(-1, 3), fams):
        key = f"pr_{dict(rest)['control_target']}_head"
        doses = colormaps['Blues'](np.linspace(0.45, 0.95, len(keys)))   # darker: a stronger dose
        baseline = list(dict.fromkeys(b for k in keys for _, b in study.arms[k]))
        lines = [('none', baseline, 'k')]
        for colour, k in zip(doses, keys):
            lines.append((study.arm_name(k[1]), [c for c, _ in study.arms[k]], colour))
        for label, runs, colour in lines:
            text = plain(f'{label} ({len(runs)})', 30)
            for ax, metric in zip(axes, (key, 'entropy')):
                ax.plot(*mean_line(runs, metric), color=colour, label=text)
        dose_response(axes[2], study, keys, doses, key)
        axes[2].axhline(0, color='k', lw=0.8)
        axes[2].set(xlabel=f'change in {key}', ylabel='change in final entropy (nats)',
                    title='controlled - baseline per seed pair;\narm mean, t interval')
        iteration_axis(axes[0], f'{key} (layer mean)', names[setting])
        iteration_axis(axes[1], 'attention entropy (nats, layer mean)')
        axes[2].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc='upper left',
                       bbox_to_anchor=(1.02, 1))
    return fig


def trended(stat):
    """Whether REPORT.md and fig9 show a statistic's trends: claims and those tagged 'trend'."""
    return hasattr(stat, 'sign') or 'trend' in stat.tables


def regime_points(study, tables):
    """Each trended statistic at every regime point, in the study's order."""
    keys = [k for k, s in study.stats.items() if trended(s)]
    rows = group([r for r in tables['regime'] if r['statistic'] in keys and r['n']],
                 lambda r: r['statistic'])
    if not rows:
        raise Skip('the regime compares two or more uncontrolled settings')
    names = {study.label[s]: name for s, name in setting_names(study)[0].items()}
    figs, keys = [], list(rows)
    for chunk in (keys[i:i + 4] for i in range(0, len(keys), 4)):
        points = max(len(rows[key]) for key in chunk)
        fig, axes = panels(len(chunk), 6, 1.2 + 0.3 * points, 2)
        for ax, key in zip(axes, chunk):
            est, lo, hi = (np.array([r[k] for r in rows[key]]) for k in ('est', 'lo', 'hi'))
            y = np.arange(len(est))
            ax.errorbar(est, y, xerr=np.nan_to_num([est - lo, hi - est]), fmt='o', capsize=3)
            ax.set_yticks(y, [names[r['point']] for r in rows[key]], fontsize=7)
            ax.invert_yaxis()   # the first point on top
            s = study.stats[key]
            if hasattr(s, 'sign'):
                ax.axvline(s.ref, color='k', lw=0.8)
            share = ': share of trajectories' if s.unit == 'trajectory' else ''
            ax.set_xlabel(key + share)
            ax.set_title(textwrap.fill(getattr(s, 'text', '') or s.stat, 48), fontsize=9)
        figs.append(fig)
    return figs


def imbalance(study, tables):
    """qk_imbalance and qk_drift over training per uncontrolled setting, each in its panel (they
    coincide where D_h starts at 0: tied inits); per head, the final PR gap against imbalance."""
    logged = {name: [r for r in runs if 'qk_imbalance_heads' in r.m]
              for name, runs in settings_of(study).items()}
    groups = {name: runs for name, runs in logged.items() if runs}
    if not groups:
        raise Skip('qk_imbalance is not logged (runs trained before train.py logged it)')
    fig, (ax_i, ax_d, ax_s) = panels(3, 5, 4.4, 3)
    for colour, (name, runs) in zip(colours(len(groups)), groups.items()):
        ax_i.plot(*mean_line(runs, 'qk_imbalance'), color=colour, label=name)
        ax_d.plot(*mean_line(runs, 'qk_drift'), color=colour)
        gap = [(r.m['pr_q_heads'][-1] - r.m['pr_k_heads'][-1]).ravel() / r.d for r in runs]
        x = [r.m['qk_imbalance_heads'][-1].ravel() for r in runs]
        ax_s.scatter(np.concatenate(x), np.concatenate(gap), s=12, color=colour)
    iteration_axis(ax_i, '||D_h||_F / Gram norm', 'qk_imbalance: layer, seed mean')
    iteration_axis(ax_d, 'qk_drift', 'qk_drift: layer, seed mean')
    ax_s.axhline(0, color='k', lw=0.8)
    ax_s.set(xlabel='final qk_imbalance of the head', ylabel='final (PR_Q^h - PR_K^h) / d',
             title='run x layer x head')
    legend_outside(fig, ax_i)
    return fig


def entropy_spread(study, tables):
    """Across heads, each run's final entropy against its logit spread, coloured by PR_K; the key
    control's seed pairs, dH against d log logit_std, by arm. Nothing where no run logs
    logit_std."""
    runs = [r for r in study.runs if 'logit_std_heads' in r.m and len(r.iters)]
    if not runs:
        return []
    fig, (ax_h, ax_p) = panels(2, 5, 4.3)
    spread, entropy, pr_k = (np.concatenate([r.m[f'{k}_heads'][-1].ravel() for r in runs])
                             for k in ('logit_std', 'entropy', 'pr_k'))
    dots = ax_h.scatter(spread, entropy, c=pr_k, s=8, alpha=0.7, lw=0)
    fig.colorbar(dots, ax=ax_h, label='PR_K of the head')
    ax_h.set_xscale('log')
    ax_h.set(xlabel='logit_std of the head (log scale)', ylabel='entropy of the head (nats)',
             title=plain(f'final record, run x layer x head ({len(runs)} runs)', 48))
    arms = group(tables.get('entropy_pairs', []), lambda row: row['arm'])
    for colour, (arm, rows) in zip(colours(len(arms)), arms.items()):
        ax_p.scatter([r['d log logit_std'] for r in rows], [r['dH'] for r in rows], s=16,
                     color=colour, label=plain(f'{arm} ({len(rows)})', 30))
    ax_p.axhline(0, color='k', lw=0.8)
    ax_p.axvline(0, color='k', lw=0.8)
    ax_p.set(xlabel='change in log logit_std (head mean)', ylabel='change in entropy (head mean)',
             title='key control, a dot per seed pair')
    legend_outside(fig, ax_p)
    return fig


FIGURES = [
    Figure('fig1_pr_over_training', pr_over_training, 'Trajectories',
           'PR_Q and PR_K over training per setting (seed mean, min-max band)'),
    Figure('fig2_pr_gap', pr_gap, 'Trajectories', 'PR_Q - PR_K along every trajectory'),
    Figure('fig3_entropy_and_pr', entropy_and_pr, 'Descriptive statistics',
           'Attention entropy over training; PR_K and PR_QK against entropy; entropy against the '
           'logit scale, coloured by PR_K'),
    Figure('fig5_control', control, 'Control experiment',
           'The controlled PR and the entropy over training per arm family; the dose response'),
    Figure('fig9_regime', regime_points, 'Regime',
           'Each statistic per regime point (all layers): estimate and 95% interval'),
    Figure('fig10_imbalance', imbalance, 'Queries, keys and the optimizer',
           'The Q/K imbalance and its drift from the init over training (equal where D_h starts at '
           '0); the per-head PR gap against the imbalance'),
    Figure('fig11_entropy_spread', entropy_spread, 'What sets entropy',
           'Entropy against the logit spread across heads, coloured by PR_K; the key control\'s '
           'entropy change against its logit_std change per seed pair'),
]
