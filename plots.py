"""
The figures: FIGURES, a list of Figure(file stem, fn(study, tables), the REPORT.md section it is
shown in, title); fn returns a Figure or a list of them, or raises folders.Skip with its reason.
Settings come in the study's order (of their values), each in a style of its own, named as plain
text (a '$' in a value is not mathtext); legends sit under the panels, inside the figure, and name
every series drawn; a colour map has a colour bar beside each panel that uses it.
"""
import io
import json
import textwrap
from collections import namedtuple
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as Canvas
from matplotlib.lines import Line2D

import control
from plumbing import stats
from plumbing.engine import families, group, stack, varying
from plumbing.folders import Skip

matplotlib.rcParams['axes.formatter.useoffset'] = False
Figure = namedtuple('Figure', 'stem fn section title')
Style = namedtuple('Style', 'color ls marker')
PALETTE = [colormaps['tab10'](i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]   # tab10 without its grey
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
              'logit scale': Transform(np.log10, '||W_QK^h||_2 (logit scale)'),
              'logit spread': Transform(np.log10, 'logit_std of the head')}


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
            if key:   # in the layout, so that a legend under the panels stays clear of it
                fig.supxlabel(key, x=0, ha='left', fontsize=7)
            buf = io.BytesIO()
            fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
            files[f.stem + (f'_{i + 1}.png' if i else '.png')] = buf.getvalue()
    return {'files': files, 'notes': notes}


def plain(text, width=WRAP):
    """text wrapped to width, '$' drawn as itself: a setting's value is never parsed as mathtext."""
    return textwrap.fill(str(text), width).replace('$', r'\$')


def setting_names(study):
    """({setting: its name in figures} in the study's order, the key under a figure): 'base' is
    named by its values of the settings that vary; key is '' unless a name is too long to draw,
    then the names are S1, S2, ... and the key lists them."""
    settings = {r.setting: r.settings for r in study.runs}
    axes = [k for k in varying(list(settings.values())) if k not in control.KEYS]
    label = dict(study.label)
    for s in (s for s in label if label[s] == 'base'):
        values = ', '.join(f'{k}={settings[s].get(k)}' for k in axes)
        label[s] = f'base: {values}' if axes else 'base'
    if all(len(text) <= LONG_NAME for text in study.label.values()):
        return {s: plain(text) for s, text in label.items()}, ''
    names = {s: f'S{i + 1}' for i, s in enumerate(label)}
    return names, '\n'.join(plain(f'{names[s]}: {label[s]}', 160) for s in label)


def styles(n):
    """n styles told apart: tab10's colours (not its grey) drawn solid, then dashed, then dotted
    (in a scatter: circles, squares, triangles)."""
    return [Style(PALETTE[i % 9], ('-', '--', ':')[i // 9 % 3], 'os^'[i // 9 % 3])
            for i in range(n)]


def legend(fig, handles, labels, title=None):
    """One legend under the panels, in as many columns as the figure's width holds."""
    if not handles:
        return
    longest = max(len(line) for text in labels for line in text.split('\n'))
    cols = max(1, min(len(labels), int(fig.get_figwidth() * 72 // (3.6 * longest + 36))))
    fig.legend(handles, labels, loc='outside lower center', ncols=cols, fontsize=7, title=title,
               title_fontsize=7)


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
    ax.fill_between(its[ok], low, high, color=kw['color'], alpha=0.15, lw=0)


def pr_over_training(study, tables):
    groups = settings_of(study)
    fig, axes = panels(len(groups))
    layers = max(r.n_layer for runs in groups.values() for r in runs)
    shade = colormaps['viridis'](np.linspace(0, 0.9, layers))
    for ax, (name, runs) in zip(axes, groups.items()):
        for key, ls in (('pr_q', '-'), ('pr_k', '--')):
            its, v = stack(runs, key)
            for i in range(v.shape[2]):
                band(ax, its, v[:, :, i], ls=ls, color=shade[i])
        iteration_axis(ax, f'whole-matrix {PR}', plain(f'{name} ({len(runs)} seeds)'))
    handles = [Line2D([], [], color='k', ls=ls) for ls in ('-', '--')]
    handles += [Line2D([], [], color=colour) for colour in shade]
    legend(fig, handles, ['PR_Q', 'PR_K'] + [f'layer {i}' for i in range(layers)])
    return fig


def pr_gap(study, tables):
    fig, (ax,) = panels(1, 8, 4.5)
    groups = settings_of(study)
    for style, (name, runs) in zip(styles(len(groups)), groups.items()):
        its, q = stack(runs, 'pr_q')
        gap = stats.nanmean(q, 0) - stats.nanmean(stack(runs, 'pr_k', its)[1], 0)
        ok = np.isfinite(gap).any(1)
        its, gap = its[ok], gap[ok]
        ax.plot(its, np.nanmedian(gap, 1), color=style.color, ls=style.ls, lw=1.2,
                label=f'{name} ({gap.shape[1]} layers)')
        ax.fill_between(its, np.nanmin(gap, 1), np.nanmax(gap, 1), color=style.color, alpha=0.12,
                        lw=0)
    ax.axhline(0, color='k', lw=0.8)
    iteration_axis(ax, 'PR_Q - PR_K (whole matrix, seed mean)')
    legend(fig, *ax.get_legend_handles_labels())
    return fig


def flat(runs, key, from_warmup=False):
    """key of every run, record (all or from the end of warm-up on) and layer (and head), flat."""
    parts = [r.m[key][r.iters >= (r.cfg['warmup_iters'] if from_warmup else 0)].ravel()
             for r in runs]
    return np.concatenate(parts or [np.zeros(0)])


def entropy_and_pr(study, tables):
    """Entropy over training; entropy against PR_K and PR_QK, and against the logit scale coloured
    by PR_K: a panel for each of these that the runs log."""
    groups = settings_of(study)
    runs = [r for g in groups.values() for r in g if 'entropy' in r.m]
    keys = ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads')
    logged = [r for r in runs if set(keys) <= set(r.m)]
    against = [(key, what) for key, what in (('pr_k', 'PR_K (whole matrix)'),
                                             ('pr_qk', 'PR_QK (mean over heads)'))
               if any(key in r.m for r in runs)]
    fig, (ax_h, *scatter) = panels(1 + len(against) + bool(logged), 5, 4.3)
    for style, (name, runs_of) in zip(styles(len(groups)), groups.items()):
        ax_h.plot(*mean_line(runs_of, 'entropy'), color=style.color, ls=style.ls, label=name)
    iteration_axis(ax_h, 'attention entropy (nats)', 'entropy: seed and layer mean')
    for ax, (key, what) in zip(scatter, against):
        have = [r for r in runs if key in r.m]
        when = np.concatenate([np.repeat(r.iters, r.n_layer) for r in have])
        dots = ax.scatter(flat(have, key), flat(have, 'entropy'),
                          c=TRANSFORMS['iteration'](when), s=4, alpha=0.6, lw=0)
        fig.colorbar(dots, ax=ax, label=TRANSFORMS['iteration'].label)
        ax.set(xlabel=what, ylabel='attention entropy (nats)',
               title=f'{what.split()[0]}: each run, layer and record')
    if logged:   # shape beyond scale, from warm-up on (before, the weights are their random draw)
        ax_s = scatter[-1]
        scale, entropy, pr_k = (flat(logged, key, True) for key in keys)
        order = np.argsort(pr_k)[::-1]
        log_scale = TRANSFORMS['logit scale']
        dots = ax_s.scatter(log_scale(scale[order]), entropy[order], c=pr_k[order], s=5,
                            alpha=0.7, lw=0)
        fig.colorbar(dots, ax=ax_s, label='PR_K of the head')
        ax_s.set(xlabel=log_scale.label, ylabel='entropy of the head (nats)',
                 title='logit scale: per head and record\nfrom the end of warm-up on')
    legend(fig, *ax_h.get_legend_handles_labels())
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


def control_arms(study, tables):
    """A row per arm family (setting, control kind): its controlled PR and entropy over training
    beside the baseline's, and the dose response."""
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
        family = study.arm_name(rest) + ('' if study.label[setting] == 'base' else
                                         f', {names[setting]}')
        axes[2].set(xlabel=f'change in {key}', ylabel='change in final entropy (nats)',
                    title=plain(f'{family}: dose response', 48))
        iteration_axis(axes[0], f'{key} (layer mean)', plain(f'{family}: {key}', 48))
        iteration_axis(axes[1], 'attention entropy (nats, layer mean)',
                       plain(f'{family}: entropy', 48))
        axes[2].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc='upper left',
                       bbox_to_anchor=(1.02, 1))
    return fig


def trended(stat):
    """Whether REPORT.md and fig9 show a statistic's trends: claims and those tagged 'trend'."""
    return hasattr(stat, 'sign') or 'trend' in stat.tables


def by_axis(study, points):
    """The regime points (labels) grouped by the settings in which they differ from base (or the
    first point), base first, then one setting, then two, ...; in the study's order inside a group:
    {group name: [points]}."""
    settings = {study.label[r.setting]: r.settings for r in study.runs}
    keys = varying([settings[p] for p in points])
    ref = settings['base' if 'base' in points else points[0]]
    def differs(p):
        return tuple(k for k in keys if json.dumps(settings[p].get(k)) != json.dumps(ref.get(k)))
    groups = group(points, differs)
    order = sorted(groups, key=lambda ks: (len(ks), [keys.index(k) for k in ks]))
    return {', '.join(ks) or 'base': groups[ks] for ks in order}


def regime_points(study, tables):
    """Each trended statistic at every regime point, grouped by the settings a point varies."""
    keys = [k for k, s in study.stats.items() if trended(s)]
    rows = group([r for r in tables['regime'] if r['statistic'] in keys and r['n']],
                 lambda r: r['statistic'])
    if not rows:
        raise Skip('the regime compares two or more uncontrolled settings')
    names = {study.label[s]: name for s, name in setting_names(study)[0].items()}
    points = by_axis(study, list(dict.fromkeys(r['point'] for rs in rows.values() for r in rs)))
    colour = {p: s.color for s, ps in zip(styles(len(points)), points.values()) for p in ps}
    order = [p for ps in points.values() for p in ps]
    figs, keys = [], list(rows)
    for chunk in (keys[i:i + 4] for i in range(0, len(keys), 4)):
        fig, axes = panels(len(chunk), 6, 1.2 + 0.3 * len(order), 2)
        for ax, key in zip(axes, chunk):
            at = {r['point']: r for r in rows[key]}
            for y, p in ((y, p) for y, p in enumerate(order) if p in at):
                est, lo, hi = (at[p][k] for k in ('est', 'lo', 'hi'))
                ax.errorbar([est], [y], xerr=np.nan_to_num([[est - lo], [hi - est]]), fmt='o',
                            capsize=3, color=colour[p])
            for edge in np.cumsum([len(ps) for ps in points.values()])[:-1]:
                ax.axhline(edge - 0.5, color='0.8', lw=0.6)
            ax.set_yticks(range(len(order)), [names[p] for p in order], fontsize=7)
            ax.set_ylim(len(order) - 0.5, -0.5)   # the first point on top
            s = study.stats[key]
            if hasattr(s, 'sign'):
                ax.axvline(s.ref, color='k', lw=0.8)
            share = ': share of trajectories' if s.unit == 'trajectory' else ''
            ax.set_xlabel(key + share)
            ax.set_title(textwrap.fill(getattr(s, 'text', '') or s.stat, 48), fontsize=9)
        legend(fig, [Line2D([], [], color=colour[ps[0]], marker='o') for ps in points.values()],
               list(points), title='points that differ from base in')
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
    for style, (name, runs) in zip(styles(len(groups)), groups.items()):
        ax_i.plot(*mean_line(runs, 'qk_imbalance'), color=style.color, ls=style.ls, label=name)
        ax_d.plot(*mean_line(runs, 'qk_drift'), color=style.color, ls=style.ls)
        gap = [(r.m['pr_q_heads'][-1] - r.m['pr_k_heads'][-1]).ravel() / r.d for r in runs]
        x = [r.m['qk_imbalance_heads'][-1].ravel() for r in runs]
        ax_s.scatter(np.concatenate(x), np.concatenate(gap), s=10, color=style.color,
                     marker=style.marker, alpha=0.7, lw=0)
    iteration_axis(ax_i, '||D_h||_F / Gram norm', 'qk_imbalance: layer, seed mean')
    iteration_axis(ax_d, 'qk_drift', 'qk_drift: layer, seed mean')
    ax_s.axhline(0, color='k', lw=0.8)
    ax_s.set(xlabel='final qk_imbalance of the head', ylabel='final (PR_Q^h - PR_K^h) / d',
             title='PR gap against qk_imbalance: run x layer x head')
    legend(fig, *ax_i.get_legend_handles_labels())
    return fig


def spread_runs(study):
    return [r for r in study.runs if 'logit_std_heads' in r.m and len(r.iters)]


def entropy_spread(study, tables):
    """Across heads, each run's final entropy against its logit spread, coloured by PR_K. Nothing
    where no run logs logit_std."""
    runs = spread_runs(study)
    if not runs:
        return []
    fig, (ax,) = panels(1, 6, 4.5)
    spread, entropy, pr_k = (np.concatenate([r.m[f'{k}_heads'][-1].ravel() for r in runs])
                             for k in ('logit_std', 'entropy', 'pr_k'))
    log_spread = TRANSFORMS['logit spread']
    dots = ax.scatter(log_spread(spread), entropy, c=pr_k, s=8, alpha=0.7, lw=0)
    fig.colorbar(dots, ax=ax, label='PR_K of the head')
    ax.set(xlabel=log_spread.label, ylabel='entropy of the head (nats)',
           title=plain(f'final record, run x layer x head ({len(runs)} runs)', 48))
    return fig


def spread_pairs(study, tables):
    """The key control's seed pairs, dH against d log logit_std, by arm."""
    if not spread_runs(study):
        return []
    arms = group(tables.get('entropy_pairs', []), lambda row: row['arm'])
    if not arms:
        raise Skip('no controlled run that logs logit_std has a baseline of the same seed')
    fig, (ax,) = panels(1, 6, 4.5)
    for style, (arm, rows) in zip(styles(len(arms)), arms.items()):
        ax.scatter([r['d log logit_std'] for r in rows], [r['dH'] for r in rows], s=16,
                   color=style.color, marker=style.marker, label=plain(f'{arm} ({len(rows)})', 30))
    ax.axhline(0, color='k', lw=0.8)
    ax.axvline(0, color='k', lw=0.8)
    ax.set(xlabel='change in log logit_std (head mean)', ylabel='change in entropy (head mean)',
           title='key control, a dot per seed pair')
    legend(fig, *ax.get_legend_handles_labels())
    return fig


FIGURES = [
    Figure('fig1_pr_over_training', pr_over_training, 'Trajectories',
           'PR_Q and PR_K over training per setting (seed mean, min-max band)'),
    Figure('fig2_pr_gap', pr_gap, 'Trajectories',
           'PR_Q - PR_K per setting: the median over layers, the band from the lowest to the '
           'highest layer (each layer a seed mean)'),
    Figure('fig3_entropy_and_pr', entropy_and_pr, 'Descriptive statistics',
           'Attention entropy over training; PR_K and PR_QK against entropy; entropy against the '
           'logit scale, coloured by PR_K'),
    Figure('fig5_control', control_arms, 'Control experiment',
           'The controlled PR and the entropy over training per arm family (its baseline: none); '
           'the dose response: controlled - baseline per seed pair, each arm\'s mean with its t '
           'interval'),
    Figure('fig9_regime', regime_points, 'Regime',
           'Each statistic per regime point (all layers): estimate and 95% interval'),
    Figure('fig10_imbalance', imbalance, 'Queries, keys and the optimizer',
           'The Q/K imbalance and its drift from the init over training (equal where D_h starts at '
           '0); the per-head PR gap against the imbalance'),
    Figure('fig11_entropy_spread', entropy_spread, 'What sets entropy',
           'Entropy against the logit spread across heads, coloured by PR_K'),
    Figure('fig12_spread_pairs', spread_pairs, 'What sets entropy',
           'The key control\'s entropy change against its logit_std change per seed pair'),
]
