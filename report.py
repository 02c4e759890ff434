"""
What the analysis writes (publish): the figures, every table as .csv and .md, and REPORT.md: each
claim's rule from its row (rule), the map pivoted from its cells (map_tables), then SECTIONS in
order, placed by a statistic's `tables` and a figure's section (plots.FIGURES). Nothing here names
a statistic.
"""
import time
from collections import Counter

import numpy as np

import exploratory
import plots
from plumbing import folders, stats
from plumbing.engine import by_setting, group, interval_text, shown
from plumbing.folders import FINAL_LOGS

UNITS = {'seed': 'seeds (runs)', 'pair': 'seed pairs (controlled - baseline)', 'model': 'models'}
NEAR_UNIFORM = 0.98     # a layer-mean entropy_norm this high or more: near-uniform attention
FEW_SEEDS = 3           # below this in every setting, an interval over seeds is absent or too wide
FEW_RECORDS = 5         # below this from warm-up on in every run (the smoke preset): no trajectory
MAP_COLUMNS = ['key', 'lens', 'window', 'decay', 'keep', 'setting', 'n', 'est', 'lo', 'hi',
               'verdict', 'why']
TREND_COLUMNS = ('axis', 'line', 'statistic', 'points', 'n', 'reading', 'verdicts')
KEEP_ARMS = ('; on the control_keep=spec arm '
             '(the top singular value kept: the shape changes, the logits are not pushed up), '
             'the fro arm beside with its qk_spec_norm change')
SETTINGS_TEXT = ('Seeds of one setting share every config.json key but '
                 f'{", ".join(folders.BOOKKEEPING)} '
                 '(and the control keys their control kind ignores).')
SECTIONS = {   # title: (what it says, why it can be empty); its tables follow, then its figures
    'Robustness map': (
        'Each claim in every lens and window; '
        'in its own view with and without weight decay on W_Q, W_K; (d), (e) per control_keep. '
        '-: the claim is not measured in that view.',
        'no claim could be measured in any view'),
    'Descriptive statistics': (
        'Links across heads beside (c) (|scale: given log ||W_QK^h||_2); '
        'within runs over time, where two trends correlate, linked or not.',
        'no descriptive statistic could be measured'),
    'Trajectories': ('', ''),
    'Control experiment': (
        'Final values, controlled - baseline (the none run of its other settings, seed).',
        'no controlled run has a control=none run with the same other settings and seed'),
    'Regime': (
        'Each statistic per point (uncontrolled setting), all layers; '
        'trends along a setting, the rest fixed: slope per doubling (per unit if a value is 0), '
        "lack of fit (p < 0.05: not a line), Spearman's rho. Nothing is extrapolated.",
        'the regime compares two or more uncontrolled settings'),
    'Queries, keys and the optimizer': (
        'D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T is conserved under gradient flow (geometry.py); '
        'imbalance_conserved: what the law leaves of it.',
        'these statistics are read per point of the regime, '
        'which needs two or more uncontrolled settings'),
    'Token level': ('', 'no uncontrolled run and no pretrained series'),
}


def rule(claim, references):
    """A claim's rule from its row, in its value's units (references: each window's)."""
    level = f'{stats.LEVEL:.0%}'
    if claim.unit == 'trajectory':
        return (f"`{claim.key}`: per trajectory (one layer of one run), {claim.stat}; "
                f"references: {', '.join(references[claim.window])}. "
                f"The share of each seed's trajectories, its {level} interval over seeds "
                f"(stats.share): holds if it lies above {claim.ref:g}, "
                "reversed if the mirror's does, fails if both lie below, else undecided")
    # ref and margin are in the units of the value shown (a log claim: a ratio)
    low, high = claim.ref - claim.margin, claim.ref + claim.margin
    side = ('above', 'below')[::claim.sign]
    where = f' (from {references[claim.window][0]} on)' if claim.unit == 'seed' else ''
    return (f"`{claim.key}`: per {claim.unit.replace('pair', 'seed pair')}, {claim.stat}{where}; "
            f'the {level} Student-t interval over {UNITS[claim.unit]}: '
            f'no effect if inside [{low:g}, {high:g}], holds if it lies {side[0]} {claim.ref:g}, '
            f'reversed if {side[1]}, else undecided' + (KEEP_ARMS if claim.unit == 'pair' else ''))


def map_entry(stat, cell):
    """A map cell's column (its view: lens and window, weight decay on W_Q, W_K, or the control's
    keep) and its text: its verdict with its value, or why it has none."""
    text = cell.get('why') or 'not logged'
    if cell['n']:
        text = f"{cell['verdict']} ({shown(stat, cell)})" if cell['verdict'] else shown(stat, cell)
    if cell['keep']:   # a keep cell names its setting
        return f"keep={cell['keep']}", f"{cell['setting']}: {text}"
    if cell['decay'] == 'pooled':
        return f"{cell['lens']}, {cell['window']}", text
    return ('no ' if cell['decay'] is False else '') + 'decay on W_Q, W_K', text


def map_tables(cells, registry):
    """robustness_map (claims), descriptive: .csv a row per cell; .md a statistic by view."""
    pooled = [cell for cell in cells if cell['decay'] == 'pooled']
    views = list(dict.fromkeys(f"{cell['lens']}, {cell['window']}" for cell in pooled))
    views += ['decay on W_Q, W_K', 'no decay on W_Q, W_K', 'keep=spec', 'keep=fro']
    written = {}
    for stem, claims in (('robustness_map', True), ('descriptive', False)):
        selected = [cell for cell in cells if hasattr(registry[cell['key']], 'sign') == claims]
        if not selected:
            continue
        pivot = {}
        for cell in selected:
            stat = registry[cell['key']]
            name = getattr(stat, 'text', '') or f"{cell['key']}: {stat.stat}"
            row = pivot.setdefault(cell['key'], {'statistic': name})
            column, text = map_entry(stat, cell)
            row[column] = f'{row[column]}; {text}' if column in row else text
        pivoted = list(pivot.values())
        used = [view for view in views if any(view in row for row in pivoted)]
        written.update(folders.table(stem, selected, MAP_COLUMNS))   # its .md, then the pivot
        written[f'{stem}.md'] = folders.markdown(pivoted, ['statistic', *used], missing='-')
    return written


def caveat(study):
    """A line for the top of the report when its verdicts rest on too little to mean much."""
    if not study.runs:   # a pretrained series alone: its claims say their n
        return []
    seeds = max(len({run.seed for run in runs}) for runs in by_setting(study.runs).values())
    records = max(int((run.iters >= run.cfg['warmup_iters']).sum()) for run in study.runs)
    causes = []
    if seeds < FEW_SEEDS:
        causes.append(f"n = {seeds} seed{'s' if seeds > 1 else ''} per setting")
    if records < FEW_RECORDS:
        causes.append(f'at most {records} geometry records a run from the end of warm-up on')
    if not causes:
        return []
    return [f"**These verdicts rest on {' and '.join(causes)}: they mean little.**", '']


def publish(study, figures, log):
    """Draw the figures (if figures) and write them, every table and REPORT.md into study.out."""
    drawn = plots.draw(study, study.tables, log) if figures else {'files': {}, 'notes': []}
    files = {**drawn['files'], **map_tables(study.tables['cells'], study.stats)}
    for stem in sorted(set(study.tables) - {'cells'}):
        files.update(folders.table(stem, study.tables[stem]))
    files['REPORT.md'] = write(study, drawn['notes'], dict(sorted(files.items())))
    study.files = folders.write_files(study.out, files)


def write(study, figure_notes, files):
    """REPORT.md: the claims with their rules, then SECTIONS, settings, confounds and warnings."""
    lines = ['# qkgeom: claims report', '', generated(study), '', *caveat(study)]
    lines += claims_lines(study) + sections(study, files, figure_notes)
    lines += ['## Settings', '', SETTINGS_TEXT, '', folders.markdown(study.tables['settings'])]
    lines += ['## Notes: known confounds', ''] + [f'- {note}' for note in confounds(study)]
    lines += ['', '## Skipped runs and warnings', '']
    lines += [f'- {warning}' for warning in study.warnings] or ['- none']
    markdown_files = [name for name in files if name.endswith('.md')]
    lines += ['', '## Files', ''] + [f'- [{name}]({name})' for name in markdown_files]
    return '\n'.join(lines + [f'- figure skipped: {note}' for note in figure_notes]) + '\n'


# One paragraph, wrapped here for reading: spread_lines joins its words with single spaces.
SPREAD_TEXT = """Outside the claims and Holm, over the runs that log logit_std (the std of a query's
scaled logits over its keys). A run's per-head value is the mean of its last {logs} records, as the
claims table reads a control arm. Layer is a factor throughout. A correlation ranks heads within
their layer; it is undefined in a run whose spread orders every layer's heads as entropy does, and
`runs` counts the others. A predictor is fitted beside one intercept per layer, on all seeds but
one, and scored by R^2 on the held-out seed's heads. The control's mediation takes one unit per
(seed pair, layer): dH = b_l dm (model 1) and dH = b_l dm + c d log PR_K (model 2), with a slope
b_l per layer and no intercept, jackknife-t over seeds, uncentred R^2. An arm's share through m is
the mean of b_l dm over its units over the mean of its dH; it has an effect where its dH interval
lies outside +/-{margin} nats. The key spectrum acts only through the spread where c's interval
holds 0, each arm with an effect has a share interval holding 1, and model 1 has R^2 >= {r2}; it is
refuted where c's interval excludes 0 or an arm's share lies below 1."""
SPREAD_TABLES = ('entropy_heads', 'entropy_predictors', 'entropy_mediation', 'entropy_slopes',
                 'entropy_share', 'entropy_layers', 'entropy_routes_fit', 'entropy_routes',
                 'entropy_layer_mediation', 'entropy_self_match')
CAPTIONS = {   # a table shown under a caption
    'control_dose_fit': 'Dose response over the doses x seeds of an arm family: '
                        'the entropy change on the per-head PR change (slope), '
                        'and on it with the change in log qk_spec_norm; jackknife-t over seeds.',
    'token_layers': '(f2) within each layer of a pretrained series, '
                    'across its heads at the last checkpoint:',
    'entropy_layers': 'A key control in some layers: dH of each layer over its seed pairs.',
    'entropy_routes_fit': "The routes, fitted across the none runs' heads with layer intercepts.",
    'entropy_routes': "The share of a controlled layer's dH that each route predicts.",
    'entropy_layer_mediation': "Model 2's c for each layer-targeted arm alone.",
    'entropy_self_match': "The mean eigenvalue of W_QK within each layer's heads.",
}


def spread_lines(tables, files):
    """The section 'What sets entropy', or nothing where no run logs logit_std."""
    if 'entropy_heads.md' not in files:
        return []
    text = ' '.join(SPREAD_TEXT.split()).format(logs=FINAL_LOGS, margin=exploratory.NO_EFFECT,
                                                r2=exploratory.ONLY_SPREAD_R2)
    lines = ['## What sets entropy (exploratory, outside Holm)', '', text, '']
    fits = [fit for fit in tables.get('entropy_mediation', ()) if fit['only through the spread']]
    if fits:
        lines += ["The key spectrum acts only through the logits' spread: "
                  f"{fits[0]['only through the spread']}.", '']
    predictors = tables.get('entropy_predictors', ())
    scored = [row for row in predictors if np.isfinite(row['R2_held_out'])]
    if scored:
        best = max(scored, key=lambda row: row['R2_held_out'])
        held_out = f"{best['R2_held_out']:.3g} ({best['lowest']:.3g} to {best['highest']:.3g})"
        lines += [f"Best predictor of entropy across heads (held-out seeds): {best['predictor']}, "
                  f'R^2 {held_out}.', '']
    for stem in SPREAD_TABLES:
        lines += table_lines(files, stem)
    return lines + figures('What sets entropy', files)


def table_lines(files, stem):
    """A table under its caption (CAPTIONS), each with a blank line after; nothing without rows."""
    if f'{stem}.md' not in files:
        return []
    return ([CAPTIONS[stem], ''] if stem in CAPTIONS else []) + [files[f'{stem}.md'], '']


def generated(study):
    """The line under the title: the command, its date and what it read."""
    first = study.tables['settings'][0] if study.tables['settings'] else {}
    varied = [key for key in first if key not in ('setting', 'runs', 'seeds')]
    differ = f' that differ in {", ".join(varied)}' if varied else ''
    return (f'Generated by `python analyze.py {" ".join(study.paths)}` '
            f'on {time.strftime("%Y-%m-%d %H:%M")}: {len(study.runs)} runs used, '
            f'{len(study.skipped)} skipped, in {len(study.label)} settings{differ}. '
            'Every value and verdict is computed from the run folders by the rules printed here.')


def claims_lines(study):
    """The claims table, what its verdicts mean, those outside the family, and each claim's rule."""
    claims = study.tables['claims']
    judged = sum('holm' in row for row in claims)
    lines = ['## Claims', '',
             "The paper's claims, fixed before the runs, each a test at 95%. "
             f"Holm: the verdict after Holm's step-down adjustment over the {judged} rows judged "
             '(family-wise 5%; a verdict it does not keep reads undecided). '
             'Every other table here is exploratory.']
    outside = list(dict.fromkeys(row['key'] for row in claims if row['key'] not in study.family))
    if outside:
        lines += ['', "Outside the pre-registered family, so not in Holm (Holm reads '-'): "
                      f"{', '.join(outside)}. They are reported as judged alone."]
    rows = [{'claim': row['claim'], 'in': row['scope'], 'value': row['value'],
             'verdict': row['verdict'], 'Holm': row.get('holm', '-'), 'beside': row['beside']}
            for row in claims]
    lines += ['', folders.markdown(rows, list(rows[0]) if rows else ['claim']), '### Rules', '']
    in_table = {row['key'] for row in claims}
    lines += [f'- {rule(claim, study.references)}.' for claim in study.claims
              if claim.key in in_table]
    return lines + ['']


def sections(study, files, figure_notes):
    """SECTIONS in order: each one's text, tables and figures, or why it has none."""
    tables = study.tables
    optimizer = [stat.key for stat in study.stats.values() if 'optimizer' in stat.tables]
    described = '[descriptive.md](descriptive.md)' if 'descriptive.md' in files else ''
    dose = table_lines(files, 'control_dose') + table_lines(files, 'control_dose_fit')
    bodies = {'Robustness map': table_lines(files, 'robustness_map'),
              'Descriptive statistics': [described], 'Trajectories': [],
              'Control experiment': dose, 'Regime': regime_lines(tables, study.stats),
              'Queries, keys and the optimizer': [by_point(tables, optimizer)],
              'Token level': token_lines(tables, files)}
    drawn = bool(figure_notes) or any(name.endswith('.png') for name in files)
    lines = []
    for title, (text, empty) in SECTIONS.items():
        body = [part for part in bodies[title] if part] + figures(title, files)
        if not body:   # its own reason, else its figures': not drawn, or skipped and why
            stems = [plot.stem for plot in plots.FIGURES if plot.section == title]
            reasons = [note for note in figure_notes if note.split(':')[0] in stems]
            if stems and not drawn:
                reasons = ['figures not drawn (--no_figures)']
            body = [f"Nothing to show: {empty or '; '.join(reasons) or 'nothing was measured'}."]
        elif text:
            body = [text, ''] + body
        lines += [f'## {title} (exploratory)', ''] + body + ['']
    return lines + spread_lines(tables, files)


def figures(section, names):
    """The figures of a section (plots.FIGURES), in their order, with their titles."""
    shown_here = []
    for plot in (plot for plot in plots.FIGURES if plot.section == section):
        images = [name for name in names if name.startswith(plot.stem) and name.endswith('.png')]
        for image in sorted(images, key=lambda name: (len(name), name)):   # fig9 before fig9_2
            shown_here.append(f'![{plot.title}]({image})')
    return shown_here + [''] if shown_here else []


def by_point(tables, keep=None):
    """The regime rows: a row per statistic (those in keep), in the registry's order as the regime
    reads them, a column per point."""
    rows = [row for row in tables['regime'] if keep is None or row['statistic'] in keep]
    points = list(dict.fromkeys(row['point'] for row in rows))
    measured = {row['statistic'] for row in rows if row['n']}
    pivot = {}
    for row in (row for row in rows if row['statistic'] in measured):
        cell = f"{row['value']} {row['verdict']}" if row['verdict'] and row['n'] else row['value']
        pivot.setdefault(row['statistic'], {'statistic': row['statistic']})[row['point']] = cell
    return folders.markdown(list(pivot.values()), ['statistic'] + points) if pivot else ''


def regime_lines(tables, registry):
    if not tables['regime']:
        return []
    trends = []
    for row in tables['regime_trend']:
        if plots.trended(registry[row['statistic']]):
            trends.append({**{key: row[key] for key in TREND_COLUMNS},
                           'slope': interval_text(row['slope'], row['lo'], row['hi']),
                           'Spearman': interval_text(row['rho'], row['rho_lo'], row['rho_hi'])})
    table = folders.markdown(trends) if trends else 'No numeric setting with two points on a line.'
    return [by_point(tables), '### Trends', table]


def token_lines(tables, files):
    lines = []
    for source, rows in group(tables['token_series'], lambda row: row['source']).items():
        columns = [key for key in rows[0] if key != 'source']
        lines += [f'### {source}', folders.markdown(rows, columns)]
    return lines + table_lines(files, 'token_layers')


def confounds(study):
    """Weight decay on W_Q, W_K; the init's PR near C/2; lr and length; near-uniform records."""
    notes = []
    decay = Counter((run.cfg['weight_decay'], run.cfg['decay_qk']) for run in study.runs)
    for (weight, on_qk), count in sorted(decay.items()):
        where = f'on W_Q, W_K in {count} run(s)'
        notes.append(f'weight decay {weight} {where}: it shrinks both spectra.' if on_qk and weight
                     else f'no weight decay {where}.')
    base = [run for run in study.runs if run.control == 'none']
    ratios = {}   # PR_Q / C at iteration 0, per init
    for run in base:
        if len(run.iters) and run.iters[0] == 0:
            ratios.setdefault(run.cfg['qk_init'], []).append(run.m['pr_q'][0].mean() / run.C)
    if ratios:
        means = [f'{init}: PR_Q/C = {np.mean(values):.2f}' for init, values in ratios.items()]
        notes.append('a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), '
                     f"so early training lowers every PR; at iteration 0 {'; '.join(means)}.")
    notes.append('learning rate, warm-up and length set how fast both PRs move '
                 '(their values: Settings).')
    logged = [run for run in base if 'entropy_norm' in run.m]
    near = [run.m['entropy_norm'][run.iters >= run.cfg['warmup_iters']].mean(1) for run in logged]
    if near:
        uniform = sum(int((means >= NEAR_UNIFORM).sum()) for means in near)
        notes.append(f'{uniform} of the {sum(map(len, near))} records from warm-up on have '
                     f'near-uniform attention (layer-mean entropy_norm >= {NEAR_UNIFORM}): '
                     'entropy differs across heads there by round-off.')
    return notes
