"""
What the analysis writes (publish): the figures, every table as .csv and .md, and REPORT.md: each
claim's rule from its row (rule), the map pivoted from its cells (map_tables), then SECTIONS in
order, placed by a statistic's `tables` and a figure's section (plots.FIGURES). Nothing here names a
statistic.
"""
import time
from collections import Counter

import numpy as np

import plots
from plumbing import folders, stats
from plumbing.engine import group, interval_text, shown

UNITS = {'seed': 'seeds (runs)', 'pair': 'seed pairs (controlled - baseline)', 'model': 'models'}
NEAR_UNIFORM = 0.98     # a layer-mean entropy_norm this high or more: near-uniform attention
FEW_SEEDS = 3           # below this in every setting, an interval over seeds is absent or too wide
FEW_RECORDS = 5         # below this from warm-up on in every run (the smoke preset): no trajectory
SECTIONS = {   # title: (what it says, why it can be empty); its tables follow, then its figures
    'Robustness map': (
        'Each claim in every lens and window; in its own view with and without weight decay on '
        'W_Q, W_K; (d), (e) per control_keep. -: the claim is not measured in that view.',
        'no claim could be measured in any view'),
    'Descriptive statistics': (
        'Links across heads beside (c) (|scale: given log ||W_QK^h||_2); within runs over time, '
        'where two trends correlate, linked or not.',
        'no descriptive statistic could be measured'),
    'Trajectories': ('', ''),
    'Control experiment': (
        'Final values, controlled - baseline (the none run of its other settings, seed).',
        'no controlled run has a control=none run with the same other settings and seed'),
    'Regime': (
        'Each statistic per point (uncontrolled setting), all layers; trends along a setting, the '
        'rest fixed: slope per doubling (per unit if a value is 0), lack of fit (p < 0.05: not a '
        "line), Spearman's rho. Nothing is extrapolated.",
        'the regime compares two or more uncontrolled settings'),
    'Queries, keys and the optimizer': (
        'D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T is conserved under gradient flow (geometry.py); '
        'imbalance_conserved: what the law leaves of it.',
        'these statistics are read per point of the regime, '
        'which needs two or more uncontrolled settings'),
    'Token level': ('', 'no uncontrolled run and no pretrained series'),
}


def rule(claim, refs):
    """A claim's rule from its row, in its value's units (refs: each window's references)."""
    level, side = f'{stats.LEVEL:.0%}', ('above', 'below')[::claim.sign]
    if claim.unit == 'trajectory':
        return (f"`{claim.key}`: per trajectory (one layer of one run), {claim.stat}; references: "
                f"{', '.join(refs[claim.window])}. The share of each seed's trajectories, its "
                f'{level} interval over seeds (stats.share): holds if it lies above {claim.ref:g}, '
                "reversed if the mirror's does, fails if both lie below, else undecided")
    # ref and margin are in the units of the value shown (a log claim: a ratio)
    ref, low, high = claim.ref, claim.ref - claim.margin, claim.ref + claim.margin
    where = f' (from {refs[claim.window][0]} on)' if claim.unit == 'seed' else ''
    arm = ''
    if claim.unit == 'pair':
        arm = ('; on the control_keep=spec arm (the top singular value kept: the shape changes, '
               'the logits are not pushed up), the fro arm beside with its qk_spec_norm change')
    return (f"`{claim.key}`: per {claim.unit.replace('pair', 'seed pair')}, {claim.stat}{where}; "
            f'the {level} Student-t interval over {UNITS[claim.unit]}: no effect if inside '
            f'[{low:g}, {high:g}], holds if it lies {side[0]} {ref:g}, reversed if {side[1]}, '
            f'else undecided{arm}')


def map_column(cell):
    """The view of a map cell: lens and window, weight decay on W_Q, W_K, or the control's keep."""
    if cell['keep']:
        return f"keep={cell['keep']}"
    if cell['decay'] == 'pooled':
        return f"{cell['lens']}, {cell['window']}"
    return ('no ' if cell['decay'] is False else '') + 'decay on W_Q, W_K'


def map_text(stat, cell):
    """A map cell: its verdict with its value, or why it has none; a keep cell names its setting."""
    text = cell.get('why') or 'not logged'
    if cell['n']:
        text = f"{cell['verdict']} ({shown(stat, cell)})" if cell['verdict'] else shown(stat, cell)
    return f"{cell['setting']}: {text}" if cell['keep'] else text


def map_tables(cells, registry):
    """robustness_map (claims), descriptive: .csv a row per cell; .md a statistic by view."""
    out = {}
    pooled = [c for c in cells if c['decay'] == 'pooled']
    views = list(dict.fromkeys(f"{c['lens']}, {c['window']}" for c in pooled))
    views += ['decay on W_Q, W_K', 'no decay on W_Q, W_K', 'keep=spec', 'keep=fro']
    keys = ['key', 'lens', 'window', 'decay', 'keep', 'setting', 'n', 'est', 'lo', 'hi', 'verdict',
            'why']
    for stem, claims in (('robustness_map', True), ('descriptive', False)):
        mine, pivot = [c for c in cells if hasattr(registry[c['key']], 'sign') == claims], {}
        if not mine:
            continue
        for c in mine:
            s = registry[c['key']]
            name = getattr(s, 'text', '') or f"{c['key']}: {s.stat}"
            row = pivot.setdefault(c['key'], {'statistic': name})
            column, text = map_column(c), map_text(s, c)
            row[column] = f'{row[column]}; {text}' if column in row else text
        used = ['statistic'] + [v for v in views if any(v in row for row in pivot.values())]
        out[f'{stem}.csv'] = folders.table(stem, mine, keys)[f'{stem}.csv']
        out[f'{stem}.md'] = folders.markdown(list(pivot.values()), used, missing='-')
    return out


def caveat(study):
    """A line for the top of the report when its verdicts rest on too little to mean much."""
    if not study.runs:   # a pretrained series alone: its claims say their n
        return []
    seeds = group(study.runs, lambda r: r.setting).values()
    most_seeds = max(len({r.seed for r in runs}) for runs in seeds)
    most_records = max(int((r.iters >= r.cfg['warmup_iters']).sum()) for r in study.runs)
    why = []
    if most_seeds < FEW_SEEDS:
        why.append(f"n = {most_seeds} seed{'s' if most_seeds > 1 else ''} per setting")
    if most_records < FEW_RECORDS:
        why.append(f'at most {most_records} geometry records a run from the end of warm-up on')
    return [f"**These verdicts rest on {' and '.join(why)}: they mean little.**", ''] if why else []


def outside_family(rows, family):
    """The line naming the claims judged outside the pre-registered family, if any."""
    keys = list(dict.fromkeys(r['key'] for r in rows if r['key'] not in family))
    if not keys:
        return []
    return ['', f"Outside the pre-registered family, so not in Holm (Holm reads '-'): "
                f"{', '.join(keys)}. They are reported as judged alone."]


def publish(study, figures, log):
    """Draw the figures (unless not figures) and write them, every table and REPORT.md into
    study.out."""
    drawn = plots.draw(study, study.tables, log) if figures else {'files': {}, 'notes': []}
    files = {**drawn['files'], **map_tables(study.tables['cells'], study.stats)}
    for stem in sorted(set(study.tables) - {'cells'}):
        files.update(folders.table(stem, study.tables[stem]))
    files['REPORT.md'] = write(study, study.tables, drawn['notes'], files)
    study.files = folders.write_files(study.out, files)


def write(study, tables, figure_notes, files):
    """REPORT.md: the claims with their rules, then SECTIONS, settings, confounds and warnings."""
    files = {n: files[n] for n in sorted(files)}
    rows = [{'claim': r['claim'], 'in': r['scope'], 'value': r['value'], 'verdict': r['verdict'],
             'Holm': r.get('holm', '-'), 'beside': r['beside']} for r in tables['claims']]
    first = tables['settings'][0] if tables['settings'] else {}
    keys = [k for k in first if k not in ('setting', 'runs', 'seeds')]
    differ = f' that differ in {", ".join(keys)}' if keys else ''
    judged = sum('holm' in r for r in tables['claims'])
    lines = ['# qkgeom: claims report', '',
             f'Generated by `python analyze.py {" ".join(study.paths)}` on '
             f'{time.strftime("%Y-%m-%d %H:%M")}: {len(study.runs)} runs used, '
             f'{len(study.skipped)} skipped, in {len(study.label)} settings{differ}. Every value '
             'and verdict is computed from the run folders by the rules printed here.', '']
    lines += caveat(study)
    lines += ['## Claims', '',
              "The paper's claims, fixed before the runs, each a test at 95%. Holm: the verdict "
              f"after Holm's step-down adjustment over the {judged} rows judged (family-wise 5%; a "
              'verdict it does not keep reads undecided). Every other table here is exploratory.',
              *outside_family(tables['claims'], study.family), '',
              folders.markdown(rows, list(rows[0]) if rows else ['claim']), '### Rules', '']
    in_table = {r['key'] for r in tables['claims']}
    lines += [f'- {rule(c, study.references)}.' for c in study.claims if c.key in in_table]
    lines += ['']
    lines += sections(study, tables, study.stats, files, figure_notes)
    lines += ['## Settings', '', 'Seeds of one setting share every config.json key but '
              f'{", ".join(folders.BOOKKEEPING)} (and the control keys their control kind '
              'ignores).', '',
              folders.markdown(tables['settings']), '## Notes: known confounds', '']
    lines += [f'- {n}' for n in confounds(study)] + ['', '## Skipped runs and warnings', '']
    lines += [f'- {w}' for w in study.warnings] or ['- none']
    lines += ['', '## Files', ''] + [f'- [{n}]({n})' for n in files if n.endswith('.md')]
    return '\n'.join(lines + [f'- figure skipped: {n}' for n in figure_notes]) + '\n'


SPREAD_TEXT = (
    "Outside the claims and Holm, over every run that logs logit_std (the std of a query's scaled "
    'logits over its keys): at the final record across (layer, head) pairs; in the control per '
    'seed pair (controlled - the none run of its seed), dH = b dm (model 1) and dH = b dm + c d '
    'log PR_K (model 2) with no intercept, jackknife-t over seeds, uncentred R^2, and the share of '
    "an arm's mean dH through the mediator m, b mean(dm) / mean(dH); \"effect\": the arm's dH "
    'interval outside +/-0.02 nats. Only through the spread: c\'s interval holds 0, every arm with '
    "an effect has a share interval holding 1, and model 1 has R^2 >= 0.8; refuted where c's "
    "interval excludes 0 or an arm's share lies below 1.")


def spread_lines(tables, files):
    """The section 'What sets entropy', or nothing where no run logs logit_std."""
    if 'entropy_heads.md' not in files:
        return []
    lines = ['## What sets entropy (exploratory, outside Holm)', '', SPREAD_TEXT, '']
    fit = next((f for f in tables.get('entropy_mediation', ()) if f['only through the spread']),
               None)
    if fit:
        lines += [f"The key spectrum acts only through the logits' spread: "
                  f"{fit['only through the spread']}.", '']
    best = max(tables.get('entropy_predictors', ()), key=lambda r: r['R2_held_out'], default=None)
    if best:
        lines += [f"Best predictor of entropy across heads (held-out seeds): {best['predictor']}, "
                  f"R^2 {best['R2_held_out']:.3g} ({best['lowest']:.3g} to {best['highest']:.3g}).",
                  '']
    for stem in ('entropy_heads', 'entropy_predictors', 'entropy_mediation', 'entropy_share'):
        if f'{stem}.md' in files:
            lines += [files[f'{stem}.md'], '']
    return lines + figures('What sets entropy', files)


def sections(study, tables, registry, files, figure_notes):
    """SECTIONS in order: each one's text, tables and figures, or why it has none."""
    optimizer = [s.key for s in registry.values() if 'optimizer' in s.tables]
    described = '[descriptive.md](descriptive.md)' if 'descriptive.md' in files else ''
    bodies = {'Robustness map': [files.get('robustness_map.md', '')],
              'Descriptive statistics': [described], 'Trajectories': [],
              'Control experiment': control_lines(tables), 'Regime': regime_lines(tables, registry),
              'Queries, keys and the optimizer': [by_point(tables, optimizer)],
              'Token level': token_lines(tables)}
    drawn = bool(figure_notes) or any(n.endswith('.png') for n in files)
    lines = []
    for title, (text, empty) in SECTIONS.items():
        body = [x for x in bodies[title] if x] + figures(title, files)
        if not body:
            body = [nothing_shown(title, empty, drawn, figure_notes)]
        elif text:
            body = [text, ''] + body
        lines += [f'## {title} (exploratory)', ''] + body + ['']
    lines += spread_lines(tables, files)
    return lines


def nothing_shown(title, empty, drawn, figure_notes):
    """Why a section is empty: its own reason, else its figures' (not drawn, or skipped and why)."""
    stems = [f.stem for f in plots.FIGURES if f.section == title]
    why = [note for note in figure_notes if note.split(':')[0] in stems]
    if stems and not drawn:
        why = ['figures not drawn (--no_figures)']
    return f"Nothing to show: {empty or '; '.join(why) or 'nothing was measured'}."


def figures(section, names):
    """The figures of a section (plots.FIGURES), in their order, with their titles."""
    out = []
    for f in (f for f in plots.FIGURES if f.section == section):
        found = {n for n in names if n.startswith(f.stem) and n.endswith('.png')}
        out += [f'![{f.title}]({n})' for n in sorted(found, key=lambda n: (len(n), n))]
    return out + [''] if out else []


def control_lines(tables):
    if not tables['control_dose']:
        return []
    lines = [folders.markdown(tables['control_dose'])]
    if tables['control_dose_fit']:
        lines += ['Dose response over the doses x seeds of an arm family: the entropy change on '
                  'the per-head PR change (slope), and on it with the change in log qk_spec_norm; '
                  'jackknife-t over seeds.', '', folders.markdown(tables['control_dose_fit'])]
    return lines


def by_point(tables, keep=None):
    """The regime rows: a row per statistic (those in keep), a column per point."""
    rows = [r for r in tables['regime'] if keep is None or r['statistic'] in keep]
    points = list(dict.fromkeys(r['point'] for r in rows))
    measured = {r['statistic'] for r in rows if r['n']}
    pivot = {}
    for r in (r for r in rows if r['statistic'] in measured):
        cell = f"{r['value']} {r['verdict']}" if r['verdict'] and r['n'] else r['value']
        pivot.setdefault(r['statistic'], {'statistic': r['statistic']})[r['point']] = cell
    if not pivot:
        return ''
    order = [pivot[k] for k in (keep or pivot) if k in pivot]
    return folders.markdown(order, ['statistic'] + points)


def regime_lines(tables, registry):
    if not tables['regime']:
        return []
    trends = []
    for r in (r for r in tables['regime_trend'] if plots.trended(registry[r['statistic']])):
        row = {k: r[k] for k in ('axis', 'line', 'statistic', 'points', 'n', 'reading', 'verdicts')}
        row['slope'] = interval_text(r['slope'], r['lo'], r['hi'])
        row['Spearman'] = interval_text(r['rho'], r['rho_lo'], r['rho_hi'])
        trends.append(row)
    table = folders.markdown(trends) if trends else 'No numeric setting with two points on a line.'
    return [by_point(tables), '### Trends', '', table]


def token_lines(tables):
    lines = []
    for source, rows in group(tables['token_series'], lambda r: r['source']).items():
        columns = [k for k in rows[0] if k != 'source']
        lines += [f'### {source}', '', folders.markdown(rows, columns)]
    if tables['token_layers']:
        lines += ['(f2) within each layer of a pretrained series, across its heads at the last '
                  'checkpoint:', '', folders.markdown(tables['token_layers'])]
    return lines


def confounds(study):
    """Weight decay on W_Q, W_K; the init's PR near C/2; lr and length; near-uniform records."""
    base = [r for r in study.runs if r.control == 'none']
    decay = sorted(Counter((r.cfg['weight_decay'], r.cfg['decay_qk']) for r in study.runs).items())
    notes = []
    for (weight, on_qk), n in decay:
        notes.append(f'weight decay {weight} on W_Q, W_K in {n} run(s): it shrinks both spectra.'
                     if on_qk and weight else f'no weight decay on W_Q, W_K in {n} run(s).')
    start = group([r for r in base if len(r.iters) and r.iters[0] == 0],
                          lambda r: r.cfg['qk_init'])
    ratio = '; '.join(f"{init}: PR_Q/C = {np.mean([r.m['pr_q'][0].mean() / r.C for r in runs]):.2f}"
                      for init, runs in start.items())
    if start:
        notes.append('a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), so '
                     f'early training lowers every PR; at iteration 0 {ratio}.')
    notes.append('learning rate, warm-up and length set how fast both PRs move (their values: '
                 'Settings).')
    near = [r.m['entropy_norm'][r.iters >= r.cfg['warmup_iters']].mean(1) for r in base
            if 'entropy_norm' in r.m]
    if near:
        count = sum(int((v >= NEAR_UNIFORM).sum()) for v in near)
        notes.append(f'{count} of the {sum(map(len, near))} records from warm-up on have '
                     f'near-uniform attention (layer-mean entropy_norm >= {NEAR_UNIFORM}): entropy '
                     'differs across heads there by round-off.')
    return notes
