"""
REPORT.md: a value with its interval (shown), a verdict and why (verdict_text), each claim's rule from its row
(rule), the map pivoted from its cells (map_tables), then SECTIONS in order, placed by a statistic's `tables`
and a figure's section (plots.FIGURES). Nothing here names a statistic.
"""
import os
import time
from collections import Counter

import numpy as np

import folders
import plots
import stats

UNITS = {'seed': 'seeds (runs)', 'pair': 'seed pairs (controlled - baseline)', 'model': 'models'}
NEAR_UNIFORM = 0.98     # a record whose layer-mean entropy_norm is this or more has near-uniform attention
SECTIONS = {   # title: what it says; its tables follow, then its figures
    'Robustness map': 'Each claim in every lens and window; in its own view with and without weight decay on '
                      'W_Q, W_K; (d), (e) per control_keep.',
    'Descriptive statistics': 'Links across heads beside (c) (|scale: given log ||W_QK^h||_2); within runs '
                              'over time, where two trends correlate, linked or not.',
    'Trajectories': '',
    'Control experiment': 'Final values, controlled - baseline (the none run of its other settings, seed).',
    'Regime': "Each statistic per point (uncontrolled setting), all layers (regime.md: per position); trends "
              "along a setting, the rest fixed: slope per doubling (per unit if a value is 0), lack of fit "
              "(p < 0.05: not a line), Spearman's rho. Nothing is extrapolated.",
    'Queries, keys and the optimizer': 'D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T is conserved under gradient '
                                       'flow (geometry.py); imbalance_conserved: what the law leaves of it.',
    'Token level': '',
}


def signed(v):
    """v with its sign, 4 significant digits (scientific where that would show only zeros)."""
    return f'{v:g}' if not np.isfinite(v) or v == 0 else f'{v:+.3e}' if abs(v) < 1e-4 else f'{v:+.4g}'


def shown(stat, res):
    """'+0.55 [+0.52, +0.58], n = 37'; a share '12/54 = 22% [13%, 35%], 3 seeds; mirror 0/54'."""
    if not res.get('n'):
        return 'not logged'
    if stat.unit == 'trajectory':
        return '{hits}/{n} = {est:.0%} [{lo:.0%}, {hi:.0%}], {seeds} seeds; mirror {mirror}/{n}'.format(**res)
    f = (lambda v: f'{v:.4g}') if stat.log or stat.key.endswith('loss') else signed
    interval = f" [{f(res['lo'])}, {f(res['hi'])}]" if np.isfinite(res['lo']) else ''
    return f"{f(res['est'])}{interval}, n = {res['n']}"


def verdict_text(res):
    return res['verdict'] + (f" ({res['why']})" if res.get('why') else '')


def rule(claim, refs):
    """A claim's rule, from its row (refs: each window's reference records)."""
    level, side = f'{stats.LEVEL:.0%}', ('above', 'below')[::claim.sign]
    if claim.unit == 'trajectory':
        return (f"`{claim.key}`: per trajectory (one layer of one run), {claim.stat}; references: "
                f"{', '.join(refs[claim.window])}. The share of each seed's trajectories, its {level} "
                f'interval over seeds (stats.share): holds if it lies above {claim.ref:g}, reversed if the '
                "mirror's does, fails if both lie below, else undecided")
    where = f' (from {refs[claim.window][0]} on)' if claim.unit == 'seed' else ''
    arm = '; on the control_keep=spec arm (the top singular value kept: the shape changes, the logits are ' \
          'not pushed up), the fro arm beside with its qk_spec_norm change' if claim.unit == 'pair' else ''
    return (f"`{claim.key}`: per {claim.unit.replace('pair', 'seed pair')}, {claim.stat}{where}; the {level} "
            f'Student-t interval over {UNITS[claim.unit]}: no effect if inside '
            f'[{claim.ref - claim.margin:g}, {claim.ref + claim.margin:g}], holds if it lies {side[0]} '
            f'{claim.ref:g}, reversed if {side[1]}, else undecided{arm}')


def map_tables(cells, registry):
    """robustness_map (claims), descriptive: .csv a row per cell; .md a row per statistic, a column a view."""
    out = {}
    views = list(dict.fromkeys(f"{c['lens']}, {c['window']}" for c in cells if c['decay'] == 'pooled'))
    views += ['decay on W_Q, W_K', 'no decay on W_Q, W_K', 'keep=spec', 'keep=fro']
    keys = ('key', 'lens', 'window', 'decay', 'keep', 'setting', 'n', 'est', 'lo', 'hi', 'verdict', 'why')
    for stem, claims in (('robustness_map', True), ('descriptive', False)):
        mine, pivot = [c for c in cells if hasattr(registry[c['key']], 'sign') == claims], {}
        for c in mine:
            s = registry[c['key']]
            text = (f"{c['verdict']} ({shown(s, c)})" if c['verdict'] else shown(s, c)) if c['n'] else \
                c.get('why') or 'not logged'
            row = pivot.setdefault(c['key'], {'statistic': getattr(s, 'text', '') or f"{c['key']}: {s.stat}"})
            col = f"keep={c['keep']}" if c['keep'] else f"{c['lens']}, {c['window']}" if \
                c['decay'] == 'pooled' else ('no ' if c['decay'] is False else '') + 'decay on W_Q, W_K'
            text = (f"{c['setting']}: " if c['keep'] else '') + text
            row[col] = row[col] + '; ' + text if col in row else text
        used = ['statistic'] + [c for c in views if any(c in r for r in pivot.values())]
        csv = folders.table(stem, [{k: c.get(k) for k in keys} for c in mine])
        md = folders.markdown([{k: r.get(k, '-') for k in used} for r in pivot.values()], used)
        out.update({f'{stem}.csv': csv[stem + '.csv'], f'{stem}.md': md} if mine else {})
    return out


def write(study, t, claims, registry, figure_notes, files, refs):
    """REPORT.md: the claims with their rules, then SECTIONS, settings, confounds and warnings."""
    files = {n: files[n] for n in sorted(files)}
    rows = [{'claim': r['claim'], 'in': r['scope'], 'value': r['value'], 'verdict': r['verdict'],
             'Holm': r.get('holm', '-'), 'beside': r['beside']} for r in t['claims']]
    keys = [k for k in t['settings'][0] if k not in ('setting', 'runs', 'seeds')] if t['settings'] else []
    differ = f' that differ in {", ".join(keys)}' if keys else ''
    L = ['# qkgeom: claims report', '', f'Generated by `python analyze.py {" ".join(study.paths)}` on '
         f'{time.strftime("%Y-%m-%d %H:%M")}: {len(study.runs)} runs used, {len(study.skipped)} skipped, '
         f'in {len(study.label)} settings{differ}. Every value and verdict is computed from the run folders '
         'by the rules printed here.', '', '## Claims', '', "The seed's claims, fixed before the runs, "
         "each a test at 95%. Holm: the verdict after Holm's step-down adjustment over the "
         f"{sum('holm' in r for r in t['claims'])} rows judged (family-wise 5%; a verdict it does not keep "
         'reads undecided). Every other table here is exploratory.', '',
         folders.markdown(rows, list(rows[0]) if rows else ['claim']), '### Rules', '']
    L += [f'- {rule(c, refs)}.' for c in claims if any(r['key'] == c.key for r in t['claims'])]
    L += ["- (d) is judged at the strongest shrink dose whose per-head PR_K change lies below -20% of the "
          "baseline's.", '']
    optimizer = [s.key for s in registry.values() if 'optimizer' in s.tables]
    tables = {'Robustness map': [files.get('robustness_map.md', '')],
              'Descriptive statistics': ['[descriptive.md](descriptive.md)'] * ('descriptive.md' in files),
              'Trajectories': [],
              'Control experiment': control_lines(t), 'Regime': regime_lines(t, registry),
              'Queries, keys and the optimizer': [by_point(t, optimizer)], 'Token level': token_lines(study)}
    names = list(files) + (sorted(os.listdir(study.out)) if os.path.isdir(study.out) else [])
    for title, text in SECTIONS.items():
        body = [x for x in tables[title] if x] + figures(title, names)
        L += [f'## {title} (exploratory)', ''] + [text, ''] * bool(text and body) + (body or ['-']) + ['']
    L += ['## Settings', '', 'Seeds of one setting share every config.json key but '
          f'{", ".join(folders.BOOKKEEPING)} (and the control keys their control kind ignores).', '',
          folders.markdown(t['settings']), '## Notes: known confounds', '']
    L += [f'- {n}' for n in confounds(study)] + ['', '## Skipped runs and warnings', '']
    L += [f'- {w}' for w in study.warnings] or ['- none']
    L += ['', '## Files', ''] + [f'- [{n}]({n})' for n in files if n.endswith('.md')]
    return '\n'.join(L + [f'- figure skipped: {n}' for n in figure_notes]) + '\n'


def figures(section, names):
    """The figures of a section (plots.FIGURES), in their order, with their titles."""
    out = []
    for f in (f for f in plots.FIGURES if f.section == section):
        found = sorted({n for n in names if n.startswith(f.stem) and n.endswith('.png')},
                       key=lambda n: (len(n), n))
        out += [f'![{f.title}]({n})' for n in found]
    return out + [''] * bool(out)


def control_lines(t):
    if not t['control_dose']:
        return []
    return [folders.markdown(t['control_dose'])] + ([
        'Dose response over the doses x seeds of an arm family: the entropy change on the per-head PR change '
        '(slope), and on it with the change in log qk_spec_norm; jackknife-t over seeds.', '',
        folders.markdown(t['control_dose_fit'])] if t['control_dose_fit'] else [])


def by_point(t, keep=None):
    """The regime rows of all layers as a table: a row per statistic (those in keep), a column per point."""
    rows = [r for r in t['regime_rows'] if r['position'] == 'all'
            and (keep is None or r['statistic'] in keep)]
    points, measured = list(dict.fromkeys(r['point'] for r in rows)), {r['statistic'] for r in rows if r['n']}
    pivot = {}
    for r in (r for r in rows if r['statistic'] in measured):
        cell = f"{r['value']} {r['verdict']}" if r['verdict'] and r['n'] else r['value']
        pivot.setdefault(r['statistic'], {'statistic': r['statistic']})[r['point']] = cell
    return folders.markdown([pivot[k] for k in (keep or pivot) if k in pivot], ['statistic'] + points) \
        if pivot else ''


def regime_lines(t, registry):
    if not t['regime']:
        return []
    interval = lambda r, k='': f"{signed(r[k or 'slope'])} [{signed(r[k + '_lo' if k else 'lo'])}, " \
                               f"{signed(r[k + '_hi' if k else 'hi'])}]"
    trends = [{**{k: r[k] for k in ('axis', 'line', 'statistic', 'points', 'n', 'reading', 'verdicts')},
               'slope': interval(r), 'Spearman': interval(r, 'rho')} for r in t['regime_trend']
              if r['position'] == 'all' and plots.trended(registry.get(r['statistic'].split(' [')[0]))]
    return [by_point(t), '### Trends', '', folders.markdown(trends) if trends else
            'No numeric setting with two points on a line.']


def token_lines(study):
    if not study.tokens:
        return ['No token tables: `analyze.py tokens` or `pretrained` with --out=THIS_FOLDER write them.']
    return sum(([f'### {source}', '', folders.markdown(rows)] for source, rows in study.tokens.items()), [])


def confounds(study):
    """Weight decay on W_Q, W_K; the init's PR near C/2; learning rate and length; near-uniform records."""
    base = [r for r in study.runs if r.control == 'none']
    decay = sorted(Counter((r.cfg['weight_decay'], r.cfg['decay_qk']) for r in study.runs).items())
    notes = [f'weight decay {w} on W_Q, W_K in {n} run(s): it shrinks both spectra.' if d and w else
             f'no weight decay on W_Q, W_K in {n} run(s).' for (w, d), n in decay]
    start = folders.group([r for r in base if len(r.iters) and r.iters[0] == 0], lambda r: r.cfg['qk_init'])
    ratio = '; '.join(f"{i}: PR_Q/C = {np.mean([r.m['pr_q'][0].mean() / r.C for r in rs]):.2f}"
                      for i, rs in start.items())
    notes += ['a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), so early training '
              f'lowers every PR; at iteration 0 {ratio}.'] * bool(start)
    notes.append('learning rate, warm-up and length set how fast both PRs move (their values: Settings).')
    near = [r.m['entropy_norm'][r.iters >= r.cfg['warmup_iters']].mean(1) for r in base
            if 'entropy_norm' in r.m]
    return notes + [f'{sum(int((v >= NEAR_UNIFORM).sum()) for v in near)} of the {sum(map(len, near))} '
                    'records from warm-up on have near-uniform attention (layer-mean entropy_norm >= '
                    f'{NEAR_UNIFORM}): entropy differs across heads there by round-off.'] * bool(near)
