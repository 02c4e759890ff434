"""
The figures: FIGURES, a list of Figure(file stem, fn(study, tables), the REPORT.md section it is
shown in, title); fn returns a Figure or a list of them, or raises folders.Skip with its reason.
Settings come in the study's order (of their values), each in a style of its own, named as plain
text (a '$' in a value is not mathtext); legends sit under the panels, inside the figure, and name
every series drawn; a colour map has a colour bar beside each panel that uses it.
"""
import io
import textwrap
from collections import namedtuple
from itertools import chain

import matplotlib
import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure as Canvas
from matplotlib.lines import Line2D

import control
import exploratory
from plumbing import stats
from plumbing.engine import families, group, stack, varying
from plumbing.folders import Skip

matplotlib.rcParams['axes.formatter.useoffset'] = False
Figure = namedtuple('Figure', 'stem fn section title')
Style = namedtuple('Style', 'color ls marker')
PALETTE = [colormaps['tab10'](index) for index in (0, 1, 2, 3, 4, 5, 6, 8, 9)]   # but 7, its grey
WRAP = 40           # characters a line of a title or a legend entry
LONG_NAME = 90      # a setting name longer: drawn as S1, S2, ..., listed under the figure
ENTROPY_AGAINST = {'pr_k': 'PR_K (whole matrix)', 'pr_qk': 'PR_QK (mean over heads)'}


def transform(function, quantity, shift=0):
    """An axis that draws function(shift + quantity), labelled by the function's own name: the
    label cannot say log10 while the axis draws np.log."""
    def drawn(values):
        return function(shift + values)
    name = function.__name__
    drawn.label = f'{name}({shift:g} + {quantity})' if shift else f'{name} {quantity}'
    return drawn


TRANSFORMS = {'iteration': transform(np.log10, 'iteration', shift=1),
              'logit scale': transform(np.log10, '||W_QK^h||_2 (logit scale)'),
              'logit spread': transform(np.log10, 'logit_std of the head')}


def draw(study, tables, log=print):
    """{'files': {name: bytes}, 'notes': [why a figure was skipped]} of every figure in FIGURES."""
    files, notes = {}, []
    names_key = setting_names(study)[1]
    for plot in FIGURES:
        try:
            made = plot.fn(study, tables)
        except Skip as reason:
            notes.append(f'{plot.stem}: {reason}')
            log(f'note: {plot.stem} skipped: {reason}')
            continue
        for index, figure in enumerate(made if isinstance(made, list) else [made]):
            title = plot.title + (f' ({index + 1})' if index else '')
            figure.suptitle(textwrap.fill(title, int(7 * figure.get_figwidth())))
            if names_key:   # in the layout, so that a legend under the panels stays clear of it
                figure.supxlabel(names_key, x=0, ha='left', fontsize=7)
            image = io.BytesIO()
            figure.savefig(image, format='png', dpi=110, bbox_inches='tight')
            files[plot.stem + (f'_{index + 1}.png' if index else '.png')] = image.getvalue()
    return {'files': files, 'notes': notes}


def plain(text, width=WRAP):
    """text wrapped to width, '$' drawn as itself: a setting's value is never parsed as mathtext."""
    return textwrap.fill(str(text), width).replace('$', r'\$')


def setting_names(study):
    """({setting: its name in figures} in the study's order, the key under a figure): 'base' is
    named by its values of the settings that vary; key is '' unless a name is too long to draw,
    then the names are S1, S2, ... and the key lists them."""
    settings = {run.setting: run.settings for run in study.runs}
    varied = [key for key in varying(list(settings.values())) if key not in control.KEYS]
    labels = dict(study.label)
    for setting in (setting for setting, label in study.label.items() if label == 'base'):
        values = ', '.join(f'{key}={settings[setting].get(key)}' for key in varied)
        labels[setting] = f'base: {values}' if varied else 'base'
    if all(len(label) <= LONG_NAME for label in study.label.values()):
        return {setting: plain(label) for setting, label in labels.items()}, ''
    short = {setting: f'S{number}' for number, setting in enumerate(labels, 1)}
    listed = [plain(f'{short[setting]}: {label}', 160) for setting, label in labels.items()]
    return short, '\n'.join(listed)


def styled(groups):
    """(style, name, members) of each group, a style each: tab10's colours (not its grey) drawn
    solid, then dashed, then dotted (in a scatter: circles, squares, triangles)."""
    for index, (name, members) in enumerate(groups.items()):
        cycle = index // len(PALETTE) % 3
        style = Style(PALETTE[index % len(PALETTE)], ('-', '--', ':')[cycle], 'os^'[cycle])
        yield style, name, members


def legend(figure, handles, labels, title=None):
    """One legend under the panels, in as many columns as the figure's width holds."""
    if not handles:
        return
    longest = max(len(line) for line in '\n'.join(labels).split('\n'))
    fitting = int(figure.get_figwidth() * 72 // (3.6 * longest + 36))
    figure.legend(handles, labels, loc='outside lower center', fontsize=7, title=title,
                  title_fontsize=7, ncols=max(1, min(len(labels), fitting)))


def iteration_axis(axis, ylabel, title=''):
    """Iterations on a symlog axis that starts at 0."""
    axis.set_xscale('symlog', linthresh=1)
    axis.set_xlim(left=0)
    axis.set(xlabel='iteration', ylabel=ylabel, title=title)


def settings_of(study):
    """{setting name: its uncontrolled runs with geometry records}, in the study's order."""
    names = setting_names(study)[0]
    uncontrolled = [run for run in study.runs if run.control == 'none' and len(run.iters)]
    if not uncontrolled:
        raise Skip('no uncontrolled runs with geometry records')
    return group(uncontrolled, lambda run: names[run.setting])


def panels(count, width=4.2, height=3.2, per_row=4):
    """A figure of count panels, up to per_row a row, without empty ones."""
    columns, rows = min(count, per_row), -(-count // per_row)
    figure = Canvas(layout='constrained', figsize=(width * columns, height * rows))
    axes = figure.subplots(rows, columns, squeeze=False).flat
    for unused in axes[count:]:
        unused.remove()
    return figure, axes[:count]


def mean_line(runs, key):
    """(iterations, the mean over seeds and layers of key)."""
    iterations, values = stack(runs, key)
    return iterations, stats.nanmean(stats.nanmean(values, 0), 1)


def band(axis, iterations, values, centre=stats.nanmean, alpha=0.15, **line):
    """The centre of values (members, iterations) over its members, with their min-max band."""
    logged = np.isfinite(values).any(0)
    iterations, values = iterations[logged], values[:, logged]
    axis.plot(iterations, centre(values, 0), **line)
    low, high = np.nanmin(values, 0), np.nanmax(values, 0)
    axis.fill_between(iterations, low, high, color=line['color'], alpha=alpha, lw=0)


def flat(runs, key, from_warmup=False):
    """key of every run, record (all or from the end of warm-up on) and layer (and head), flat."""
    parts = [run.m[key][run.iters >= (run.cfg['warmup_iters'] if from_warmup else 0)].ravel()
             for run in runs]
    return np.concatenate(parts or [np.zeros(0)])


def finals(runs, key):
    """key at every run's final record, flat over layers (and heads)."""
    return np.concatenate([run.m[key][-1].ravel() for run in runs])


def pr_over_training(study, tables):
    groups = settings_of(study)
    figure, axes = panels(len(groups))
    layers = max(run.n_layer for run in chain(*groups.values()))
    shades = colormaps['viridis'](np.linspace(0, 0.9, layers))
    for axis, (name, runs) in zip(axes, groups.items()):
        for key, dashes in (('pr_q', '-'), ('pr_k', '--')):
            iterations, values = stack(runs, key)
            for layer in range(values.shape[2]):
                band(axis, iterations, values[:, :, layer], lw=1.1, ls=dashes, color=shades[layer])
        title = plain(f'{name} ({len(runs)} seeds)')
        iteration_axis(axis, 'whole-matrix participation ratio', title)
    handles = [Line2D([], [], color='k', ls=dashes) for dashes in ('-', '--')]
    handles += [Line2D([], [], color=shade) for shade in shades]
    legend(figure, handles, ['PR_Q', 'PR_K'] + [f'layer {layer}' for layer in range(layers)])
    return figure


def pr_gap(study, tables):
    figure, (axis,) = panels(1, 8, 4.5)
    for style, name, runs in styled(settings_of(study)):
        iterations, pr_q = stack(runs, 'pr_q')
        gap = stats.nanmean(pr_q, 0) - stats.nanmean(stack(runs, 'pr_k', iterations)[1], 0)
        band(axis, iterations, gap.T, np.nanmedian, 0.12, color=style.color, ls=style.ls, lw=1.2,
             label=f'{name} ({gap.shape[1]} layers)')
    axis.axhline(0, color='k', lw=0.8)
    iteration_axis(axis, 'PR_Q - PR_K (whole matrix, seed mean)')
    legend(figure, *axis.get_legend_handles_labels())
    return figure


def entropy_and_pr(study, tables):
    """Entropy over training; a panel each for PR_K, PR_QK and the logit scale, where logged."""
    groups = settings_of(study)
    runs = [run for run in chain(*groups.values()) if 'entropy' in run.m]
    head_keys = ('qk_spec_norm_heads', 'entropy_heads', 'pr_k_heads')
    logged = [run for run in runs if set(head_keys) <= set(run.m)]
    against = [key for key in ENTROPY_AGAINST if any(key in run.m for run in runs)]
    figure, (over_time, *scatters) = panels(1 + len(against) + bool(logged), 5, 4.3)
    for style, name, members in styled(groups):
        over_time.plot(*mean_line(members, 'entropy'), color=style.color, ls=style.ls, label=name)
    iteration_axis(over_time, 'attention entropy (nats)', 'entropy: seed and layer mean')
    log_iteration = TRANSFORMS['iteration']
    for axis, key in zip(scatters, against):
        have = [run for run in runs if key in run.m]
        iterations = np.concatenate([np.repeat(run.iters, run.n_layer) for run in have])
        dots = axis.scatter(flat(have, key), flat(have, 'entropy'), c=log_iteration(iterations),
                            lw=0, s=4, alpha=0.6)
        figure.colorbar(dots, ax=axis, label=log_iteration.label)
        axis.set(xlabel=ENTROPY_AGAINST[key], ylabel='attention entropy (nats)',
                 title=f'{key.upper()}: each run, layer and record')
    if logged:   # shape beyond scale, from warm-up on (before, the weights are their random draw)
        scale, entropy, pr_k = (flat(logged, key, from_warmup=True) for key in head_keys)
        order = np.argsort(pr_k)[::-1]   # the lowest PR_K drawn last, on top
        log_scale = TRANSFORMS['logit scale']
        dots = scatters[-1].scatter(log_scale(scale[order]), entropy[order], c=pr_k[order], lw=0,
                                    s=5, alpha=0.7)
        figure.colorbar(dots, ax=scatters[-1], label='PR_K of the head')
        scatters[-1].set(xlabel=log_scale.label, ylabel='entropy of the head (nats)',
                         title='logit scale: per head and record\nfrom the end of warm-up on')
    legend(figure, *over_time.get_legend_handles_labels())
    return figure


def control_arms(study, tables):
    """A row per arm family (setting, control kind): its PR, its entropy, its dose response."""
    names, arm_families = setting_names(study)[0], families(study.arms)
    if not arm_families:
        raise Skip('no controlled runs paired with a baseline')
    figure, grid = panels(3 * len(arm_families), 5, 4.2, 3)
    for row, ((setting, arm), keys) in zip(grid.reshape(-1, 3), arm_families.items()):
        pr_axis, entropy_axis, dose_axis = row
        target = f"pr_{dict(arm)['control_target']}_head"
        shades = colormaps['Blues'](np.linspace(0.45, 0.95, len(keys)))   # darker: a stronger dose
        every_pair = chain(*(study.arms[key] for key in keys))
        lines = [('none', list(dict.fromkeys(base for treated, base in every_pair)), 'k')]
        for colour, key in zip(shades, keys):
            pairs = study.arms[key]
            lines.append((study.arm_name(key[1]), [run for run, base in pairs], colour))
            doses = [treated.final(target) - base.final(target) for treated, base in pairs]
            changes = [treated.final('entropy') - base.final('entropy') for treated, base in pairs]
            dose_axis.scatter(doses, changes, color=colour, s=16)
            mean_change, low, high = stats.t_interval(changes)[:3]
            error = np.nan_to_num([[mean_change - low], [high - mean_change]])
            dose_axis.errorbar([stats.nanmean(doses)], [mean_change], yerr=error, fmt='D',
                               color=colour, mec='k', capsize=4)
        for label, runs, colour in lines:
            pr_axis.plot(*mean_line(runs, target), color=colour,
                         label=plain(f'{label} ({len(runs)})', 30))
            entropy_axis.plot(*mean_line(runs, 'entropy'), color=colour)
        dose_axis.axhline(0, color='k', lw=0.8)
        family = study.arm_name(arm)
        if study.label[setting] != 'base':
            family += f', {names[setting]}'
        dose_axis.set(xlabel=f'change in {target}', ylabel='change in final entropy (nats)',
                      title=plain(f'{family}: dose response', 48))
        iteration_axis(pr_axis, f'{target} (layer mean)', plain(f'{family}: {target}', 48))
        iteration_axis(entropy_axis, 'attention entropy (nats, layer mean)',
                       plain(f'{family}: entropy', 48))
        handles, labels = pr_axis.get_legend_handles_labels()
        dose_axis.legend(handles, labels, fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1))
    return figure


def trended(stat):
    """Whether REPORT.md and fig9 show a statistic's trends: claims and those tagged 'trend'."""
    return hasattr(stat, 'sign') or 'trend' in stat.tables


def by_axis(study, points):
    """{settings: [regime points (labels) that differ from base (or the first point) in them]}: base
    first, then one setting, then two, ...; in the study's order inside a group."""
    settings = {study.label[run.setting]: run.settings for run in study.runs}
    keys = varying([settings[point] for point in points])
    reference = settings['base' if 'base' in points else points[0]]

    def differs(point):
        return tuple(key for key in keys if key in varying([settings[point], reference]))
    groups = group(points, differs)
    order = sorted(groups, key=lambda varied: (len(varied), [keys.index(key) for key in varied]))
    return {', '.join(varied) or 'base': groups[varied] for varied in order}


def regime_points(study, tables):
    """Each trended statistic per regime point, the points grouped by_axis; four to a figure."""
    keys = [key for key, stat in study.stats.items() if trended(stat)]
    measured = [row for row in tables['regime'] if row['statistic'] in keys and row['n']]
    rows = group(measured, lambda row: row['statistic'])
    if not rows:
        raise Skip('the regime compares two or more uncontrolled settings')
    names = {study.label[setting]: name for setting, name in setting_names(study)[0].items()}
    blocks = by_axis(study, list(dict.fromkeys(row['point'] for row in measured)))
    colour = {point: style.color for style, varied, block in styled(blocks) for point in block}
    order = list(chain(*blocks.values()))
    statistics, figures = list(rows), []
    for start in range(0, len(statistics), 4):
        chunk = statistics[start:start + 4]
        figure, axes = panels(len(chunk), 6, 1.2 + 0.3 * len(order), 2)
        for axis, key in zip(axes, chunk):
            for row in rows[key]:
                estimate, low, high, point = row['est'], row['lo'], row['hi'], row['point']
                axis.errorbar([estimate], [order.index(point)], color=colour[point], fmt='o',
                              capsize=3, xerr=np.nan_to_num([[estimate - low], [high - estimate]]))
            for edge in np.cumsum([len(block) for block in blocks.values()])[:-1]:
                axis.axhline(edge - 0.5, color='0.8', lw=0.6)
            axis.set_yticks(range(len(order)), [names[point] for point in order], fontsize=7)
            axis.set_ylim(len(order) - 0.5, -0.5)   # the first point on top
            stat = study.stats[key]
            if hasattr(stat, 'sign'):
                axis.axvline(stat.ref, color='k', lw=0.8)
            axis.set_xlabel(key + (': share of trajectories' if stat.unit == 'trajectory' else ''))
            axis.set_title(textwrap.fill(getattr(stat, 'text', '') or stat.stat, 48), fontsize=9)
        handles = [Line2D([], [], color=colour[block[0]], marker='o') for block in blocks.values()]
        legend(figure, handles, list(blocks), title='points that differ from base in')
        figures.append(figure)
    return figures


def imbalance(study, tables):
    """Imbalance and drift in panels of their own: they coincide where D_h starts at 0."""
    logged = {name: [run for run in runs if 'qk_imbalance_heads' in run.m]
              for name, runs in settings_of(study).items()}
    groups = {name: runs for name, runs in logged.items() if runs}
    if not groups:
        raise Skip('qk_imbalance is not logged (runs trained before train.py logged it)')
    figure, (over_time, drift, heads) = panels(3, 5, 4.4, 3)
    for style, name, runs in styled(groups):
        over_time.plot(*mean_line(runs, 'qk_imbalance'), color=style.color, ls=style.ls, label=name)
        drift.plot(*mean_line(runs, 'qk_drift'), color=style.color, ls=style.ls)
        gaps = [(run.m['pr_q_heads'][-1] - run.m['pr_k_heads'][-1]).ravel() / run.d for run in runs]
        heads.scatter(finals(runs, 'qk_imbalance_heads'), np.concatenate(gaps), s=10,
                      color=style.color, marker=style.marker, alpha=0.7, lw=0)
    iteration_axis(over_time, '||D_h||_F / Gram norm', 'qk_imbalance: layer, seed mean')
    iteration_axis(drift, 'qk_drift', 'qk_drift: layer, seed mean')
    heads.axhline(0, color='k', lw=0.8)
    heads.set(xlabel='final qk_imbalance of the head', ylabel='final (PR_Q^h - PR_K^h) / d',
              title='PR gap against qk_imbalance: run x layer x head')
    legend(figure, *over_time.get_legend_handles_labels())
    return figure


def entropy_spread(study, tables):
    """Each head's final entropy against its logit spread; nothing where no run logs logit_std."""
    runs = exploratory.spread_runs(study)
    if not runs:
        return []
    figure, (axis,) = panels(1, 6, 4.5)
    log_spread = TRANSFORMS['logit spread']
    dots = axis.scatter(log_spread(finals(runs, 'logit_std_heads')), finals(runs, 'entropy_heads'),
                        c=finals(runs, 'pr_k_heads'), lw=0, s=8, alpha=0.7)
    figure.colorbar(dots, ax=axis, label='PR_K of the head')
    axis.set(xlabel=log_spread.label, ylabel='entropy of the head (nats)',
             title=plain(f'final record, run x layer x head ({len(runs)} runs)', 48))
    return figure


def spread_pairs(study, tables):
    """A panel a layer, a colour an arm (the same in every panel)."""
    if not exploratory.spread_runs(study):
        return []
    units = tables.get('entropy_pairs', [])
    if not units:
        raise Skip('no controlled run that logs logit_std has a baseline of the same seed')
    arm_styles = {arm: style for style, arm, _ in styled(group(units, lambda row: row['arm']))}
    layers = group(units, lambda row: row['layer'])
    figure, axes = panels(len(layers), 3.6, 3.2)
    for axis, (layer, rows) in zip(axes, layers.items()):
        for arm, arm_rows in group(rows, lambda row: row['arm']).items():
            changes = np.transpose([(row['d log logit_std'], row['dH']) for row in arm_rows])
            axis.scatter(*changes, s=16, color=arm_styles[arm].color, marker=arm_styles[arm].marker)
        axis.axhline(0, color='k', lw=0.8)
        axis.axvline(0, color='k', lw=0.8)
        axis.set(xlabel='change in log logit_std', ylabel='change in entropy',
                 title=f'layer {layer}, a dot per seed pair')
    handles = [Line2D([], [], ls='', color=style.color, marker=style.marker)
               for style in arm_styles.values()]
    legend(figure, handles, [plain(arm, 30) for arm in arm_styles])
    return figure


def layer_control(study, tables):
    """The arms side by side in each layer; nothing (and no note) where no arm targets layers."""
    rows = tables.get('entropy_layers', [])
    if not rows:
        return []
    arms = group(rows, lambda row: f"{row['setting']}: {row['arm']}")
    figure, (axis,) = panels(1, 6.5, 4)
    for index, (style, arm, arm_rows) in enumerate(styled(arms)):
        offset = (index - (len(arms) - 1) / 2) * (0.7 / len(arms))   # the arms side by side
        for row in arm_rows:
            error = [[row['dH'] - row['lo']], [row['hi'] - row['dH']]]
            axis.errorbar(row['layer'] + offset, row['dH'], color=style.color, marker=style.marker,
                          yerr=error if np.isfinite(error).all() else None, lw=1,
                          markerfacecolor=style.color if row['controlled'] else 'white')
    axis.axhspan(-exploratory.NO_EFFECT, exploratory.NO_EFFECT, color='0.9', zorder=0)
    axis.axhline(0, color='k', lw=0.8)
    axis.set_xticks(sorted({row['layer'] for row in rows}))
    axis.set(xlabel='layer', ylabel='change in entropy, controlled - none (nats)',
             title='each point the mean over its seed pairs')
    handles = [Line2D([], [], color=style.color, marker=style.marker, markerfacecolor=style.color)
               for style, _, _ in styled(arms)]
    legend(figure, handles, [plain(arm, 44) for arm in arms])
    return figure


FIGURES = [
    Figure('fig1_pr_over_training', pr_over_training, 'Trajectories',
           'PR_Q and PR_K over training per setting (seed mean, min-max band)'),
    Figure('fig2_pr_gap', pr_gap, 'Trajectories',
           'PR_Q - PR_K per setting: the median over layers, '
           'the band from the lowest to the highest layer (each layer a seed mean)'),
    Figure('fig3_entropy_and_pr', entropy_and_pr, 'Descriptive statistics',
           'Attention entropy over training; PR_K and PR_QK against entropy; '
           'entropy against the logit scale, coloured by PR_K'),
    Figure('fig5_control', control_arms, 'Control experiment',
           'The controlled PR and the entropy over training per arm family (its baseline: none); '
           'the dose response: controlled - baseline per seed pair, '
           "each arm's mean with its t interval"),
    Figure('fig9_regime', regime_points, 'Regime',
           'Each statistic per regime point (all layers): estimate and 95% interval'),
    Figure('fig10_imbalance', imbalance, 'Queries, keys and the optimizer',
           'The Q/K imbalance and its drift from the init over training '
           '(equal where D_h starts at 0); the per-head PR gap against the imbalance'),
    Figure('fig11_entropy_spread', entropy_spread, 'What sets entropy',
           'Entropy against the logit spread across heads, coloured by PR_K'),
    Figure('fig12_spread_pairs', spread_pairs, 'What sets entropy',
           "The key control's entropy change against its logit_std change, "
           'per seed pair in each layer'),
    Figure('fig13_layer_control', layer_control, 'What sets entropy',
           "The key control in one layer: each layer's change in entropy with its 95% interval "
           '(filled: the controlled layer; grey: the no-effect band)'),
]
