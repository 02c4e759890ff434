"""
REPORT.md and the formatting of results: a value with its interval and n (shown), a verdict with why it could not
decide (verdict_text), the rule of each claim generated from its CLAIMS row (rule), and the robustness map and
descriptive tables pivoted from their cells (map_tables). Nothing here computes a statistic.
"""
import math
import os
import re
import time
from collections import Counter, defaultdict

import numpy as np

import folders
import stats

UNITS = {'trajectory': 'trajectories (the seed mean of one layer of one setting)', 'seed': 'seeds (runs)',
         'pair': 'seed pairs (controlled - baseline)', 'model': 'models (a run or a pretrained model)'}
NEAR_UNIFORM = 0.98        # a record whose layer-mean entropy_norm is at least this has near-uniform attention


def signed(v):
    """v with its sign, 4 significant digits (scientific where that would show only zeros)."""
    if not np.isfinite(v) or v == 0:
        return f'{v:g}'
    return f'{v:+.3e}' if abs(v) < 1e-4 else f'{v:+.4g}'


def shown(claim, res):
    """'+0.55 [+0.52, +0.58], n = 37'; a share '12/54 = 22% [13%, 35%]', with (a)'s count per reference."""
    if not res.get('n'):
        return 'not logged'
    if claim.unit == 'trajectory':
        text = f"{res['hits']}/{res['n']} = {res['est']:.0%} [{res['lo']:.0%}, {res['hi']:.0%}]"
        return text + (' (from each reference: ' + ', '.join(map(str, res['counts'])) + ')' if res['counts'] else '')
    f = (lambda v: f'{v:.4g}') if claim.log or claim.key.endswith('loss') else signed
    interval = f" [{f(res['lo'])}, {f(res['hi'])}]" if np.isfinite(res['lo']) else ''
    return f"{f(res['est'])}{interval}, n = {res['n']}"


def verdict_text(res):
    return res['verdict'] + (f" ({res['why']})" if res.get('why') else '')


def rule(claim):
    """The verdict rule of a claim, from its row."""
    interval = 'Wilson' if claim.unit == 'trajectory' else 'Student-t'
    side = ('above', 'below') if claim.sign > 0 else ('below', 'above')
    ref = f'{claim.ref:g}'
    text = (f'`{claim.key}`: per {UNITS[claim.unit].split(" (")[0][:-1]}, {claim.stat}; {interval} '
            f'{stats.LEVEL:.0%} interval over {UNITS[claim.unit]}; holds if it lies {side[0]} {ref}, reversed if '
            f'{side[1]}')
    if claim.margin:
        text += f', no effect if inside [{claim.ref - claim.margin:g}, {claim.ref + claim.margin:g}]'
    return text + ', else undecided'


# ----------------------------------------------------------------------------- the map

def cell_text(claim, c):
    if not c.get('n'):
        return c.get('why') or 'not logged'
    return f"{c['verdict']} ({shown(claim, c)})" if claim.sign else shown(claim, c)


def map_tables(cells, claims):
    """robustness_map (the claims) and descriptive (statistics without a prediction): every cell in .csv, pivoted
    in .md (a row per statistic, a column per lens and window; decay and keep columns for the claims)."""
    out = {}
    columns = [f'{lens}, {w}' for lens in ('whole', 'head', 'tok', 'learned') for w in ('all', 'warmup')]
    for stem, pick in (('robustness_map', lambda c: c.sign), ('descriptive', lambda c: not c.sign)):
        mine = [c for c in cells if pick(claims[c['key']])]
        long = [{k: c.get(k) for k in ('key', 'lens', 'window', 'decay', 'keep', 'setting', 'n', 'est', 'lo', 'hi',
                                       'verdict', 'why')} for c in mine]
        pivot = {}
        for c in mine:
            claim = claims[c['key']]
            row = pivot.setdefault(c['key'], {'statistic': claim.text or f"{c['key']}: {claim.stat}"})
            if c['keep']:
                col = f"keep={c['keep']}"
                row[col] = (row.get(col, '') + '; ' if col in row else '') + f"{c['setting']}: {cell_text(claim, c)}"
            elif c['decay'] == 'pooled':
                row[f"{c['lens']}, {c['window']}"] = cell_text(claim, c)
            else:
                row['decay on W_Q, W_K' if c['decay'] else 'no decay on W_Q, W_K'] = cell_text(claim, c)
        rows = list(pivot.values())
        extra = [k for k in ('decay on W_Q, W_K', 'no decay on W_Q, W_K', 'keep=fro', 'keep=spec')
                 if any(k in r for r in rows)]
        used = [c for c in columns if any(c in r for r in rows)]
        if long:
            out[f'{stem}.csv'] = folders.table(stem, long)[f'{stem}.csv']
            out[f'{stem}.md'] = folders.markdown([{k: r.get(k, '-') for k in ['statistic'] + used + extra}
                                                  for r in rows], ['statistic'] + used + extra)
    return out


# ----------------------------------------------------------------------------- REPORT.md

def write(study, t, claims, figure_notes, files):
    """REPORT.md as text: the claims and their rules, then the tables behind them, notes and warnings."""
    by_key = {c.key: c for c in claims}
    L = header(study, t) + claim_lines(t, by_key)
    L += section('Robustness map', 'Each claim measured every other way: every lens (whole-matrix and per-head weight '
                 'PR, token-level PR, the learned part W - W(0)) and window (all records, from warm-up on) over every '
                 'uncontrolled run; in its own lens and window with and without weight decay on W_Q, W_K; (d), (e) '
                 'per (setting, arm) by control_keep. "-": the lens does not apply (no per-head values).',
                 files, 'robustness_map.md')
    L += section('Descriptive statistics', 'Statistics without a predicted sign, in every lens and window: links '
                 'across heads beside those of (c), the logit scale against the shape (|scale: the partial '
                 'correlation given log ||W_QK^h||_2), and correlations within runs over time, which two trending '
                 'series show whatever links them: no verdict is taken from them.', files, 'descriptive.md')
    L += figure_lines(files, 'fig8_')
    L += ['## Trajectory summary', '', folders.markdown(t['trajectory_summary']) if t['trajectory_summary'] else
          'No trajectories (fewer than 2 records per window).\n']
    L += sum((figure_lines(files, f'fig{i}_') for i in (1, 2, 3, 4)), [])
    L += control_lines(t, files) + regime_lines(t, files) + imbalance_lines(t, files)
    L += token_lines(study)
    L += ['## Settings', '', 'Runs are seeds of one setting only when every config.json key but the bookkeeping '
          f'({", ".join(folders.BOOKKEEPING)}) is equal; the table names the keys in which settings differ.', '',
          folders.markdown(t['settings'])]
    L += ['## Notes: known confounds', ''] + [f'- {n}' for n in confounds(study)] + ['']
    L += ['## Missing from the planned runs', ''] + ([f'- {m}' for m in t['missing']] or
                                                    ['- nothing (or no runs.txt beside the runs)']) + ['']
    L += ['## Skipped runs and warnings', ''] + ([f'- {w}' for w in study.warnings] or ['- none']) + ['']
    L += ['## Files', ''] + [f'- [{n}]({n})' for n in files if n.endswith('.md')]
    L += [f'- figure skipped: {n}' for n in figure_notes] + ['']
    return '\n'.join(L) + '\n'


def header(study, t):
    keys = [k for k in t['settings'][0] if k not in ('setting', 'runs', 'seeds')] if t['settings'] else []
    return ['# qkgeom: claims report', '',
            f'Generated by `python analyze.py {" ".join(study.paths)}` on {time.strftime("%Y-%m-%d %H:%M")}. Every '
            f'value and verdict is computed from the run folders by the rules printed here.', '',
            f'Runs: {len(study.runs)} used, {len(study.skipped)} skipped, in {len(study.label)} settings' +
            (f' that differ in {", ".join(keys)}' if keys else '') + '.', '']


def claim_lines(t, claims):
    rows = [{'claim': r['claim'], 'in': r['scope'], 'value': r['value'] + (f"; {r['also']}" if r.get('also') else ''),
             'verdict': r['verdict']} for r in t['claims']]
    L = ['## Claims', '', folders.markdown(rows, ['claim', 'in', 'value', 'verdict']), '### Rules', '']
    L += [f'- {rule(claims[k])}.' for k in dict.fromkeys(r['key'] for r in t['claims'])]
    L += ['', f'Each interval is over independent units: Student-t for means (seeds, seed pairs, models), Wilson for '
              f'shares (trajectories); the sign tests in control_effects are printed and gate nothing. (a) counts a '
              f'trajectory only when it holds from every reference record; its count from each one is shown. (d) is '
              f'judged at the strongest shrink dose whose per-head PR_K change has its interval below -20% of the '
              f'baseline\'s (control_dose). Trajectories are seed means over the iterations every seed logged.', '']
    return L


def section(title, text, files, name):
    return [f'## {title}', '', text, '', f'[{name}]({name})' if name in files else 'Nothing to show.', '']


def figure_lines(files, prefix):
    found = sorted((n for n in files if n.startswith(prefix) and n.endswith('.png')), key=lambda n: (len(n), n))
    return [f'![{n}]({n})' for n in found] + ([''] if found else [])


def control_lines(t, files):
    L = ['## Control experiment', '']
    if not t['control_dose']:
        return L + ['No controlled run paired with a baseline.', '']
    L += ['Final values, controlled - baseline (the control=none run with the same other settings and seed), mean '
          'over seed pairs. pr_head: the per-head PR of the controlled projection; k_spec_norm: the top singular '
          'value of W_K^h, mean over heads, as logged (not logged by older runs). control_keep=spec keeps the top '
          'singular value each optimizer step sets; it does not fix the logit scale over training, and the '
          'qk_spec_norm column says by how much it moved.', '', folders.markdown(t['control_dose'])]
    if t['control_dose_fit']:
        L += ['Dose response: across the shrink doses x seeds of one arm, least squares of the entropy change on '
              'the per-head PR change (slope), and on it with the change in log qk_spec_norm (pr_coef, scale_coef); '
              'jackknife-t intervals over seeds.', '', folders.markdown(t['control_dose_fit'])]
    return L + figure_lines(files, 'fig5_') + figure_lines(files, 'fig10_')


def regime_lines(t, files):
    reg = t['regime']
    L = ['## Regime', '']
    if not reg:
        return L + ['One setting of uncontrolled runs (or none): nothing to compare across settings.', '']
    rows = [r for r in reg['rows'] if r['position'] == 'all']
    points = list(dict.fromkeys(r['point'] for r in rows))
    pivot = {}
    for r in rows:
        pivot.setdefault(r['statistic'], {'statistic': r['statistic']})[r['point']] = \
            r['value'] + (f" {r['verdict']}" if r['verdict'] and r['n'] else '')
    L += [f'{len(points)} regime points (uncontrolled settings, named by how they differ). Each claim per point over '
          'its own units, all layers (regime.md: each layer position too).', '',
          folders.markdown(list(pivot.values()), ['statistic'] + points)]
    L += ['### Trends', '', 'A line holds every other setting fixed (a setting that is a constant multiple of the axis '
          'moves with it); the slope per doubling is fitted to the units\' values, its t interval from the '
          'residuals; a lack-of-fit F test with p < 0.05 reads "no linear trend" and lists the point means. Nothing '
          'is projected beyond the points measured.', '']
    shown_rows = [{k: r[k] for k in ('axis', 'line', 'statistic', 'position', 'points', 'n', 'reading', 'verdicts')} |
                  {'slope [interval]': f"{signed(r['slope'])} [{signed(r['lo'])}, {signed(r['hi'])}]"}
                  for r in reg['trends'] if r['position'] == 'all']
    L += [folders.markdown(shown_rows) if shown_rows else 'No numeric setting with two points on a line.\n']
    return L + figure_lines(files, 'fig9_')


def imbalance_lines(t, files):
    if not t['imbalance']:
        return []
    return ['## Q/K imbalance', '', 'Under gradient flow D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T is conserved: '
            'imbalance_conserved is what qk_imbalance would be at the end had D_h kept its initial norm, drift_end how '
            'far D_h moved (relative to the Grams); ratio_end_head is PR_Q / PR_K per head.', '',
            folders.markdown(t['imbalance'])] + figure_lines(files, 'fig11_')


def token_lines(study):
    L = ['## Token-level analysis', '']
    if not study.tokens:
        return L + ['No token tables in this folder: `python analyze.py tokens RUN_FOLDERS --out=THIS_FOLDER` and '
                    '`python analyze.py pretrained --model=NAME --out=THIS_FOLDER` write them.', '']
    names = os.listdir(study.out) if os.path.isdir(study.out) else []
    for source, rows in study.tokens.items():
        L += [f'### {source}', '', folders.markdown(rows)]
        L += figure_lines(names, 'fig6_' if source == 'our checkpoints' else 'fig7_')
    return L


def confounds(study):
    """Weight decay on W_Q, W_K; the random init's PR near C/2; learning rate and length, as in these runs."""
    runs = study.runs
    wd = Counter((r.cfg['weight_decay'], r.cfg['decay_qk']) for r in runs)
    notes = [f'weight decay {w} {"on" if d and w else "not on"} W_Q, W_K in {n} run(s): decay shrinks both spectra.'
             for (w, d), n in sorted(wd.items(), key=str)]
    by_init = defaultdict(list)
    for r in (r for r in runs if r.control == 'none' and len(r.iters) and r.iters[0] == 0 and 'pr_q' in r.m):
        by_init[r.cfg['qk_init']].append(float(np.nanmean(r.m['pr_q'][0])) / r.C)
    if by_init:
        notes.append('a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), so early training lowers '
                     'every PR; at iteration 0, ' + '; '.join(f'{i}: PR_Q/C = {np.mean(v):.2f}'
                                                             for i, v in by_init.items()) + '.')
    schedules = Counter((r.cfg.get('lr'), r.cfg['warmup_iters'], r.cfg['max_iters']) for r in runs)
    notes.append('learning rate, warm-up and length set how fast both PRs move: ' + '; '.join(
        f'lr {a}, warmup_iters {b}, max_iters {c} in {n} run(s)' for (a, b, c), n in sorted(schedules.items(),
                                                                                            key=str)) + '.')
    near = [r.m['entropy_norm'][r.iters >= r.cfg['warmup_iters']].mean(1) for r in runs
            if r.control == 'none' and 'entropy_norm' in r.m]
    total = sum(len(v) for v in near)
    if total:
        notes.append(f'{sum(int((v >= NEAR_UNIFORM).sum()) for v in near)} of the {total} records from warm-up on '
                     f'have near-uniform attention (layer-mean entropy_norm >= {NEAR_UNIFORM}), where entropy '
                     f'differs across heads by round-off.')
    return notes
