"""
The analysis engine: the study read once (load), each statistic judged over its units (judge), the
control's seed pairs (arms), the robustness map, the claims table, the regime and its trends, and
the control tables; analyze computes them all. It reads the registries (claims, statistics, views,
exploratory sections) from the Study that analyze.py fills, never from analyze.py itself, so that a
research change does not open this file.
"""
import dataclasses
import json
import math
import os
from collections import Counter, namedtuple
from functools import reduce
from itertools import product

import numpy as np

import control
import geometry
from plumbing import folders, stats
from plumbing.folders import FINAL_LOGS, Skip
from plumbing.stats import nanmean

WELL_BELOW = -0.20
TOO_SHORT = f'no trajectory has a reference record before its last {FINAL_LOGS} records'
NOT_MEASURED = {   # why a statistic has no unit with a value, by its unit
    'seed': 'not logged, or no run with a value in this view',
    'pair': 'no seed pair with a value (not logged)',
    'model': 'no model with a value: a Spearman needs 3 or more checkpoints (heads) that differ',
    'trajectory': f'{TOO_SHORT} (runs too short for this window)'}
SHARE = ('est', 'lo', 'hi', 'se_lo', 'se_hi', 'df')   # what stats.share returns, by name
ESTIMATE = ('n', 'est', 'lo', 'hi')                   # a result's columns in a table


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stat:
    key: str
    stat: str                   # the statistic of one unit, in words
    fn: object                  # fn(unit, view): a number (a trajectory claim: signs, see moves)
    unit: str = 'seed'          # seed | pair | model | trajectory
    lenses: tuple = ()          # its own first; the map measures it in each (none: reads no lens)
    window: str = 'all'         # its own
    tables: tuple = ()          # map, regime, trend (REPORT.md, fig9), optimizer, control
    control: str = ''           # a pair's control kind ('': any)
    log: bool = False           # fn gives logs; intervals, ref and margin are shown as their exp
    limits: tuple = (-math.inf, math.inf)   # intervals are clipped to these (-1, 1: a correlation)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claim(Stat):
    text: str                   # what the paper says
    sign: int = +1              # the predicted sign of (statistic - ref)
    ref: float = 0.0            # in the units of the value shown (a log claim: a ratio)
    margin: float = 0.0         # no effect: the interval inside ref -/+ margin
    beside: tuple = ()          # 'key' or 'key@window' shown beside (a pair claim: the fro arm's)
    tables: tuple = ('map', 'regime')


View = namedtuple('View', 'lens window from_iter', defaults=('whole', 'all', None))
NO_LENS = 'no lens'   # the map's column of a statistic that reads no lens


@dataclasses.dataclass
class Study:
    """The loaded runs and what is computed from them (the figures and the report read it)."""
    paths: list
    out: str
    runs: list                  # runs of train.py
    skipped: list
    warnings: list
    series: list = ()           # pretrained series: read by the model claims only
    from_iter: int = None
    label: dict = None          # setting -> its name: the values where it differs from the others
    arms: dict = None
    tables: dict = None
    files: list = None
    arm_keys: tuple = ()        # control keys that vary between arms beyond those arm_label names
    # the registries, as analyze.registries() passes them
    claims: list = ()           # the paper's claims, in the claims table's order
    stats: dict = None          # every Stat and Claim by key
    family: tuple = ()          # the claims Holm adjusts over
    lenses: dict = None
    windows: dict = None
    references: dict = None
    exploratory: tuple = ()     # the exploratory sections: fn(study) -> {table stem: rows}

    def arm_name(self, arm):
        return control.label(dict(arm), self.arm_keys)


def analyze(paths, registries, out=None, from_iter=None, log=print):
    """The Study with every table. Skip (no usable run) or OutError (out refused) first."""
    study = load(paths, registries, out, from_iter, log)
    folders.check_out(study.out)
    if not study.runs and not study.series:
        raise Skip(f'no usable run folder under {", ".join(paths)} ({len(study.skipped)} skipped)')
    cells, (points, lines) = robustness_cells(study) if study.runs else [], regime(study)
    study.tables = dict(claims=claims_table(study, cells), cells=cells, regime=points,
                        regime_trend=lines, control_dose=control_dose(study),
                        control_dose_fit=dose_fits(study), runs=runs_rows(study),
                        settings=setting_rows(study), token_series=token_rows(study))
    for section in study.exploratory:
        study.tables.update(section(study))
    return study


def load(paths, registries, out=None, from_iter=None, log=print):
    """The Study of the run folders under paths, before any table; notes go to log."""
    warnings = []
    def warn(message):
        warnings.append(message)
        log(f'warning: {message}')
    loaded, skipped = folders.load_runs(paths, warn)
    series = [run for run in loaded if run.pretrained]
    runs, rank = by_value([run for run in loaded if not run.pretrained])
    study = Study(list(paths), out or os.path.join(paths[0], 'analysis'), runs, skipped, warnings,
                  series, from_iter, **registries)
    settings = {setting: members[0].settings for setting, members in by_setting(runs).items()}
    study.label = labels(settings, [run.settings for run in uncontrolled(runs)])
    study.arms = arms(runs, rank)
    controlled = [dict(run.arm) for run in runs if run.control != 'none']
    named = ('control', 'control_target', 'control_keep', *control.DOSES)   # in the label
    study.arm_keys = [name for name in varying(controlled) if name not in named]
    paired = {pair[0] for pairs in study.arms.values() for pair in pairs}
    for run in (run for run in runs if run.control != 'none' and run not in paired):
        warn(f'{run.path}: no control=none run with the same other settings and seed: '
             'left out of the control tables')
    return study


def by_value(runs):
    """The runs, settings in the order of their values (keys in config order), then seed; ranks."""
    settings = {run.setting: run.settings for run in runs}
    differing = varying(list(settings.values()))
    def values(setting):
        return tuple(sort_key(settings[setting].get(name)) for name in differing)
    rank = {setting: index for index, setting in enumerate(sorted(settings, key=values))}
    return sorted(runs, key=lambda run: (rank[run.setting], run.seed)), rank


def sort_key(value):
    """Orders a setting's values: numbers by size, the rest by their JSON text, absent last."""
    if type(value) in folders.NUMBER:
        return (0, value, '')
    return (1, 0, json.dumps(value)) if value is not None else (2, 0, '')


def robustness_cells(study):
    """The map: each map statistic in every lens x window over the uncontrolled runs; claims in
    their own view per weight decay on W_Q, W_K; (d), (e) per deciding arm and keep."""
    pool, cells = uncontrolled(study.runs), []
    split = group(pool, lambda run: bool(run.cfg['decay_qk'] and run.cfg['weight_decay'] > 0))
    mapped = [stat for stat in study.stats.values()
              if stat.unit in ('trajectory', 'seed') and 'map' in stat.tables]
    for stat in mapped:
        lenses = stat.lenses or (NO_LENS,)
        views = [(lens, window, 'pooled', pool) for lens, window in product(lenses, study.windows)]
        if isinstance(stat, Claim) and len(split) > 1:
            views += [(lenses[0], stat.window, decay, runs) for decay, runs in split.items()]
        for lens, window, decay, runs in views:
            result = judge(stat, runs, view_of(lens, window, study.from_iter))
            cells.append({'key': stat.key, 'lens': lens, 'window': window, 'decay': decay,
                          'keep': '', **result})
    for claim in (claim for claim in study.claims if claim.unit == 'pair'):
        for keep in ('spec', 'fro'):
            for setting, arm, pairs, why in deciding(claim, study, keep):
                result = judge(claim, pairs) if pairs else {'n': 0, 'verdict': 'not measured',
                                                            'why': why}
                # twins: what a spec arm and its fro arm share (the arm without keep and dose)
                twins = tuple(pair for pair in undosed(arm) if pair[0] != 'control_keep')
                cells.append({'key': claim.key, 'lens': '', 'window': '', 'decay': '',
                              'keep': keep, 'pairs': pairs, 'setting': study.label[setting],
                              'twins': twins, 'arm': study.arm_name(arm), **result})
    return cells


def claims_table(study, cells):
    """Each claim in its own view, (d), (e) per setting, (f1), (f2) per source; Holm over them."""
    rows = []
    for claim in study.claims:
        if not study.runs and claim.unit != 'model':   # a series alone: the model claims
            continue
        for result, scope, also in claim_results(claim, study, cells):
            measured = bool(result['n'])
            estimate = {column: result.get(column) for column in ESTIMATE}
            rows.append({'key': claim.key, 'claim': claim.text, 'scope': scope, **estimate,
                         'p': result.get('p', math.nan),
                         'value': shown(claim, result) if measured else result['why'],
                         'beside': also,
                         'verdict': verdict_text(result) if measured else result['verdict']})
    judged = [row for row in rows if np.isfinite(row['p']) and row['key'] in study.family]
    for row, p_holm in zip(judged, stats.holm([row['p'] for row in judged])):
        holds = row['verdict'].split(' (')[0] if p_holm < stats.ALPHA else 'undecided'
        row.update(p_holm=p_holm, holm=holds)
    return rows


def claim_results(claim, study, cells):
    """[(result, scope, what is shown beside)] of a claim: a row of the claims table each."""
    pool = uncontrolled(study.runs)
    if claim.unit == 'model':
        return [(judge(claim, runs), f'{source}: {len(runs)} series', '')
                for source, runs in models(study).items()]
    mine = [cell for cell in cells if cell['key'] == claim.key]
    if claim.unit == 'pair':
        fro = {(cell['setting'], cell['twins']): cell for cell in mine if cell['keep'] == 'fro'}
        spec = [cell for cell in mine if cell['keep'] == 'spec']
        spec = spec or [dict(cell, n=0, verdict='not measured', why='no control_keep=spec arm')
                        for cell in fro.values()]
        return [(cell, f"{cell['setting']}, {cell['arm']}",
                 beside(claim, study, pool, fro.get((cell['setting'], cell['twins']), {})))
                for cell in spec]
    own = (own_lens(claim), claim.window, 'pooled')
    cell = next(cell for cell in mine if (cell['lens'], cell['window'], cell['decay']) == own)
    lens = f'{study.lenses[claim.lenses[0]].what}, ' if claim.lenses else ''
    where = f'{len(pool)} uncontrolled runs in {len(by_setting(pool))} settings'
    scope = f'{where}; {lens}{study.windows[claim.window]}'
    return [(cell, scope, beside(claim, study, pool, cell))]


def beside(claim, study, pool, cell):
    """Shown beside a claim's verdict: Claim.beside (a pair claim: the fro arm's); a trajectory
    claim's count over seed-averaged trajectories; (a)'s counts per reference and part."""
    if claim.unit == 'pair':
        if not cell.get('pairs'):
            return ''
        beside_stats = {stat_key: study.stats[stat_key] for stat_key in claim.beside}
        more = [f"{stat_key} {shown(stat, judge(stat, cell['pairs']))}"
                for stat_key, stat in beside_stats.items()]
        return '; '.join([f"keep=fro ({cell['arm']}): {shown(claim, cell)}"] + more)
    shown_beside = []
    if claim.unit == 'trajectory':   # the paper's unit: a setting's layer averaged over its seeds
        settings = by_setting(pool).values()
        result = shares([claim.fn(seed_mean(runs), own_view(claim, study)) for runs in settings])
        hits, mirror, count = result['hits'], result['mirror'], result['n']
        shown_beside.append(f'seed-averaged layers: {hits}/{count}, mirror {mirror}/{count}')
    if cell.get('per_ref'):
        names = [name.split(' (')[0] for name in study.references[claim.window]]
        counts = ', '.join(f'{name} {hits}/{count}'
                           for name, (hits, count) in zip(names, cell['per_ref']))
        parts = 'PR_Q rises in {}, PR_K falls in {}'.format(*cell['per_part'])
        shown_beside.append(f'from each reference: {counts}; {parts}')
    for stat_key, _, window in (entry.partition('@') for entry in claim.beside):
        stat = study.stats[stat_key]
        result = judge(stat, pool, own_view(stat, study, window))
        where = f' ({study.windows[window]})' if window else ''
        shown_beside.append(f'{stat_key}{where}: {shown(stat, result)}')
    return '; '.join(shown_beside)


def deciding(claim, study, keep):
    """[(setting, arm, pairs or None, why)] deciding a control claim on W_K per family of one keep:
    every freeze arm; the strongest shrink dose moving PR_K well below the baseline."""
    decided, relative = [], study.stats['d_pr_head_rel']
    for (setting, rest), members in families(study.arms, claim.control).items():
        if (dict(rest).get('control_target'), dict(rest).get('control_keep')) != ('k', keep):
            continue
        if claim.control == 'freeze':
            decided += [(setting, member[1], study.arms[member], '') for member in members]
            continue
        found = {member: judge(relative, study.arms[member]) for member in members}
        strong = [member for member in members if found[member]['hi'] < WELL_BELOW]
        if strong:
            decided.append((setting, strong[-1][1], study.arms[strong[-1]], ''))
            continue
        doses = ', '.join(f"shrink_to {dict(member[1])['shrink_to']:g}: "
                          f'{shown(relative, found[member])}' for member in members)
        why = f'no dose moves per-head PR_K well below the baseline ({doses})'
        decided.append((setting, members[0][1], None, why))
    return decided


def models(study):
    """{source: the units of a model claim}: uncontrolled runs, pretrained series (q, k as used)."""
    series = [run for run in study.series if run.cfg.get('rope') in (None, 'none', 'after')]
    sources = {'our checkpoints': uncontrolled(study.runs), 'pretrained models': series}
    return {source: runs for source, runs in sources.items() if runs}


def regime(study):
    """(a row per statistic and point, an uncontrolled setting; trends); none below 2 points."""
    points = by_setting(uncontrolled(study.runs))
    if len(points) < 2:
        return [], []
    read_here = [stat for stat in study.stats.values() if stat.unit in ('trajectory', 'seed')
                 and {'regime', 'optimizer'} & set(stat.tables)]
    rows, found = [], {}
    for setting, runs in points.items():
        for stat in read_here:
            result = judge(stat, runs, own_view(stat, study))
            found[(setting, stat.key)] = result
            rows.append({'point': study.label[setting], 'statistic': stat.key, 'seeds': len(runs),
                         **{column: result[column] for column in ESTIMATE},
                         'value': shown(stat, result), 'verdict': result['verdict']})
    return rows, trends(study, points, found)


def axes(points):
    """The settings varying between points but a constant multiple of an earlier one (lr / 10)."""
    settings, found = [runs[0].settings for runs in points.values()], []
    def nonzero_numbers(name):
        return all(type(point.get(name)) in folders.NUMBER and point.get(name)
                   for point in settings)
    for candidate in (name for name in varying(settings) if name not in control.KEYS):
        def ratios(axis):
            return {round(point[candidate] / point[axis], 12) for point in settings}
        if not any(nonzero_numbers(axis) and nonzero_numbers(candidate) and len(ratios(axis)) == 1
                   for axis in found):
            found.append(candidate)
    return found


def trends(study, points, found):
    """Per numeric axis, point line of points equal in every other axis: its line_trends."""
    all_axes, rows = axes(points), []
    settings = {setting: runs[0].settings for setting, runs in points.items()}
    numeric = [axis for axis in all_axes
               if all(type(point.get(axis)) in folders.NUMBER for point in settings.values())]
    for axis in numeric:
        def others(setting):
            return tuple((other, settings[setting].get(other)) for other in all_axes
                         if other != axis)
        for fixed, line in group(points, others).items():
            named = ', '.join(f'{other}={value}' for other, value in fixed)
            line.sort(key=lambda setting: settings[setting][axis])
            axis_values = {setting: settings[setting][axis] for setting in line}
            head = {'axis': axis, 'line': named or 'all points'}
            rows += line_trends(study, found, head, axis_values)
    return rows


def line_trends(study, found, head, axis_values):
    """Each statistic's stats.trend over a line (axis_values: setting -> its value; x is its log2
    where every value is positive), the trend's reading and the point verdicts."""
    log2, rows = all(value > 0 for value in axis_values.values()), []
    for stat_key in dict.fromkeys(stat_key for _, stat_key in found):
        measured = [setting for setting in axis_values if found[(setting, stat_key)]['values']]
        if len(measured) < 2:
            continue
        units = [found[(setting, stat_key)]['values'] for setting in measured]
        positions = [math.log2(axis_values[setting]) if log2 else axis_values[setting]
                     for setting in measured]
        line_fit, means = stats.trend(positions, units), [np.mean(values) for values in units]
        means = np.exp(means) if study.stats[stat_key].log else means
        verdicts = ', '.join(found[(setting, stat_key)]['verdict'] or '-' for setting in measured)
        rows.append({**head, 'members': ' | '.join(study.label[setting] for setting in measured),
                     'statistic': stat_key, **line_fit, 'reading': reading(line_fit, means),
                     'verdicts': verdicts})
    return rows


def side(low, high, up, down, neither):
    """The word for an interval: up above 0, down below 0, else neither."""
    return up if low > 0 else down if high < 0 else neither


def reading(fit, means):
    """The line (up, down, no clear slope, or not a line by lack of fit) and the monotone trend."""
    line = side(fit['lo'], fit['hi'], 'up', 'down', 'no clear slope')
    if fit['lof_p'] < stats.ALPHA:
        line = 'not a line: point means ' + ', '.join(f'{mean:.3g}' for mean in means)
    elif fit['points'] == 2:
        line += ' (2 points: no lack-of-fit test)'
    monotone = side(fit['rho_lo'], fit['rho_hi'], 'rises monotonically', 'falls monotonically',
                    'no monotone trend')
    return f'{line}; {monotone}' if np.isfinite(fit['rho_lo']) else line


def control_dose(study):
    """Each paired statistic over an arm's seed pairs, with (d) or (e)'s verdict (on W_K alone: the
    mirror and a kind with no claim, a fork's new one, get none)."""
    rows, paired = [], [stat for stat in study.stats.values() if 'control' in stat.tables]
    for (setting, arm), pairs in study.arms.items():
        kind, target = dict(arm)['control'], dict(arm)['control_target']
        claim = next((claim for claim in study.claims if claim.control == kind), None)
        found = {stat.key: judge(stat, pairs) for stat in paired}
        baseline_pr = nanmean([baseline.final(f'pr_{target}_head') for _, baseline in pairs])
        row = {'setting': study.label[setting], 'arm': study.arm_name(arm), 'n': len(pairs),
               'baseline PR/head': baseline_pr}
        row.update({stat.key[2:]: shown(stat, found[stat.key]) for stat in paired})
        row['well below'] = bool(found['d_pr_head_rel']['hi'] < WELL_BELOW)
        row.update({'predicted sign': '-', 'verdict': 'no claim on this kind: no verdict'})
        if claim is not None:
            effect = judge(claim, pairs)
            agree = sum(value * claim.sign > 0 for value in effect['values'])
            row['predicted sign'] = f"{agree}/{effect['n']}"
            row['verdict'] = verdict_text(effect) if target == 'k' else 'mirror: no verdict'
        rows.append(row)
    return rows


def dose_fits(study):
    """Per family of 2+ shrink doses: the entropy change on the per-head PR change, alone and with
    the change in log qk_spec_norm; jackknife-t over seeds (a seed's arms share its baseline)."""
    rows = []
    for (setting, rest), members in families(study.arms, 'shrink').items():
        if len(members) < 2:
            continue
        pairs = [pair for member in members for pair in study.arms[member]]
        entropy, pr_k, scale = ([study.stats[stat_key].fn(pair, View()) for pair in pairs]
                                for stat_key in ('d_entropy', 'd_pr_head', 'd_log_qk_spec_norm'))
        seeds = [controlled.seed for controlled, _ in pairs]
        alone = stats.fit_groups(entropy, pr_k, seeds)
        both = stats.fit_groups(entropy, np.column_stack([pr_k, scale]), seeds)
        doses = ' '.join(f"{dict(arm)['shrink_to']:g}" for _, arm in members)
        row = {'setting': study.label[setting], 'arm': study.arm_name(rest), 'doses': doses,
               'pairs': len(pairs)}
        for name, fit, index in ('slope', alone, 1), ('pr_coef', both, 1), ('scale_coef', both, 2):
            row.update(zip((name, f'{name}_lo', f'{name}_hi'), (part[index] for part in fit)))
        row['entropy follows PR_K'] = side(row['pr_coef_lo'], row['pr_coef_hi'], 'follows',
                                           'goes against', 'undecided')
        rows.append(row)
    return rows


def runs_rows(study):
    rows = [{'run': run.name, 'setting': study.label[run.setting], 'seed': run.seed,
             'arm': study.arm_name(run.arm), 'records': len(run.iters),
             'last_iter': int(run.iters[-1]) if len(run.iters) else None,
             'train_loss': run.final_loss('train_loss'), 'val_loss': run.final_loss('val_loss'),
             'wall_time': run.done.get('wall_time'), 'notes': len(run.notes), 'path': run.path}
            for run in study.runs]
    return rows + [{'run': os.path.basename(path), 'path': path, 'notes': f'skipped: {why}'}
                   for path, why in study.skipped]


def setting_rows(study):
    settings, rows = by_setting(study.runs), []
    differing = varying([runs[0].settings for runs in settings.values()])
    for setting, runs in settings.items():
        seeds = ' '.join(str(run.seed) for run in runs)
        row = {'setting': study.label[setting], 'runs': len(runs), 'seeds': seeds}
        rows.append({**row, **{name: runs[0].settings.get(name) for name in differing}})
    return rows


def token_rows(study):
    """A row per model of each source: its checkpoints and the statistics of (f1), (f2)."""
    rows, model_claims = [], [claim for claim in study.claims if claim.unit == 'model']
    for source, runs in models(study).items():
        for run in runs:
            steps = run.iters[checkpoints(run)]
            row = {'source': source, 'model': run.name,
                   'setting': study.label.get(run.setting, run.name), 'seed': run.seed,
                   'checkpoints': len(steps), 'first_step': int(steps[0]) if len(steps) else None,
                   'last_step': int(steps[-1]) if len(steps) else None}
            rows.append({**row, **{claim.key: claim.fn(run, View()) for claim in model_claims}})
    return rows


def judge(stat, units, view=View()):
    """A statistic over units by its interval rule, judged if a Claim: {n, est, lo, hi, p, verdict,
    why, values}; a trajectory claim adds hits, mirror, seeds, per_ref, per_part."""
    found = [stat.fn(unit, view) for unit in units]
    result = shares(found) if stat.unit == 'trajectory' else interval(stat, found)
    result.update({'verdict': '', 'why': '', 'p': math.nan})
    if isinstance(stat, Claim):
        result.update(decide(stat, result))
    if not result['n']:
        result['verdict'], result['why'] = 'not measured', NOT_MEASURED[stat.unit]
    if stat.log:
        result.update(zip(('est', 'lo', 'hi'), np.exp([result['est'], result['lo'], result['hi']])))
    return {column: float(value) if isinstance(value, np.floating) else value
            for column, value in result.items()}


def interval(stat, values):
    """The Student-t interval of the finite values, clipped to the statistic's limits."""
    finite = np.array(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    estimate, low, high, count = stats.t_interval(finite)
    std_error = float(finite.std(ddof=1)) / math.sqrt(count) if count > 1 else 0
    return {'values': list(finite), 'n': count, 'est': estimate, 'lo': max(low, stat.limits[0]),
            'hi': min(high, stat.limits[1]), 'df': count - 1, 'se': std_error}


def outcomes(signs):
    """Per trajectory: +1 if every sign it has (over references or records, and parts) is +1, -1
    if every one is -1, else 0; NaN with none."""
    finite = np.isfinite(signs)
    holds, reverses = [(np.where(finite, signs, sign) == sign).all((1, 2)) for sign in (1, -1)]
    found = np.where(holds, 1.0, np.where(reverses, -1.0, 0.0))
    return np.where(finite.any((1, 2)), found, np.nan)


def shares(signs):
    """The per-seed shares of a trajectory claim and its mirror; counts per reference and part."""
    signs = [run_signs for run_signs in signs if np.size(run_signs)]
    found = [outcomes(run_signs) for run_signs in signs]
    counts = [int(np.isfinite(outcome).sum()) for outcome in found]
    hits = [int((outcome == 1).sum()) for outcome in found]
    mirror = [int((outcome == -1).sum()) for outcome in found]
    result = dict(zip(SHARE, stats.share(hits, counts)))
    result.update(zip([f'mirror_{name}' for name in SHARE], stats.share(mirror, counts)))
    result.update({'values': [held / count for held, count in zip(hits, counts) if count],
                   'n': sum(counts), 'hits': sum(hits), 'mirror': sum(mirror),
                   'seeds': sum(count > 0 for count in counts)})
    if signs and len({run_signs.shape[1:] for run_signs in signs}) == 1 and signs[0].shape[2] > 1:
        every = np.concatenate(signs)   # trajectories x references x parts
        ref_hits, ref_counts = (every == 1).all(2).sum(0), np.isfinite(every).all(2).sum(0)
        result['per_ref'] = list(zip(ref_hits.tolist(), ref_counts.tolist()))
        result['per_part'] = [int((outcomes(every[..., part:part + 1]) == 1).sum())
                              for part in range(every.shape[2])]
    return result


def decide(claim, result):
    """The verdict, why it could not decide, and the two-sided p of the interval's test."""
    if claim.unit == 'trajectory':   # holds, reversed (the mirror holds), fails (neither can)
        mirror = (result['mirror_lo'], result['mirror_hi'])
        verdict, why = stats.verdict(result['lo'], result['hi'], claim.sign, claim.ref, 0,
                                     f"{result['seeds']} seeds", mirror)
        def p_of(prefix, side):
            return stats.p_value(result[f'{prefix}est'], claim.ref, result[f'{prefix}se_{side}'],
                                 result['df'])
        p_values = {'holds': p_of('', 'lo'), 'reversed': p_of('mirror_', 'lo'),
                    'fails': max(p_of('', 'hi'), p_of('mirror_', 'hi'))}
        return {'verdict': verdict, 'why': why, 'p': p_values.get(verdict, 1.0)}
    as_shown = np.exp if claim.log else float
    verdict, why = stats.verdict(as_shown(result['lo']), as_shown(result['hi']), claim.sign,
                                 claim.ref, claim.margin, result['n'])
    reference, low, high = claim.ref, claim.ref - claim.margin, claim.ref + claim.margin
    if claim.log:   # ref and margin are in the units shown: the statistic is their log
        reference, low, high = (math.log(bound) if bound > 0 else -math.inf
                                for bound in (reference, low, high))
    estimate, std_error, df = result['est'], result['se'], result['df']
    p_value = 1.0
    if verdict == 'no effect':   # two one-sided tests, doubled to match the two-sided interval
        p_value = 2 * max([stats.t_sf((estimate - low) / std_error, df),
                           stats.t_sf((high - estimate) / std_error, df)] if std_error else [0.0])
    elif verdict != 'undecided':
        p_value = stats.p_value(estimate, reference, std_error, df)
    return {'verdict': verdict, 'why': why, 'p': min(p_value, 1.0)}


def view_of(lens, window, from_iter=None):
    """The View of a map cell's lens and window (a statistic with no lens is read as 'whole')."""
    return View('whole' if lens == NO_LENS else lens, window, from_iter)


def own_lens(stat):
    return stat.lenses[0] if stat.lenses else NO_LENS


def own_view(stat, study, window=''):
    """The View a statistic is judged in: its own lens, and its own window unless given one."""
    return view_of(own_lens(stat), window or stat.window, study.from_iter)


def on_grid(run):
    """The run on its regular grid: its records at multiples of geom_interval and at max_iters."""
    if 'grid' not in run.memo:
        every, last = run.cfg.get('geom_interval'), run.cfg.get('max_iters')
        keep = np.ones(len(run.iters), bool)
        if type(every) is int and every > 0:
            keep = (run.iters % every == 0) | (run.iters == last)
        metrics = {metric: values[keep] for metric, values in run.m.items()}
        run.memo['grid'] = dataclasses.replace(run, iters=run.iters[keep], m=metrics, memo={})
        run.memo['grid'].use(run.settings)   # as the study read them (folders.load_runs)
    return run.memo['grid']


def seed_mean(runs):
    """One run: the per-layer mean over runs (a setting's seeds) at the grid records they share."""
    grids = [on_grid(run) for run in runs]
    shared = reduce(np.intersect1d, [grid.iters for grid in grids])
    layered = {metric for grid in grids for metric, values in grid.m.items() if values.ndim == 2}
    metrics = {metric: nanmean(stack(grids, metric, shared)[1], axis=0)
               for metric in sorted(layered)}
    mean = dataclasses.replace(grids[0], iters=shared, m=metrics, memo={})
    mean.use(runs[0].settings)
    return mean


def checkpoints(run):
    """The indices of the records measured on a model checkpoint (all of a pretrained series')."""
    if run.pretrained:
        return np.arange(len(run.iters))
    return np.flatnonzero(np.isin(run.iters, sorted(geometry.model_ckpt_iters(run.cfg))))


def stack(runs, metric, iters=None):
    """(iters, default all runs'; (runs, iters, layers[, heads]) of metric, NaN if not logged)."""
    if iters is None:
        iters = reduce(np.union1d, [run.iters for run in runs], np.zeros(0, int))
    iters = np.asarray(iters)
    shape = next((run.m[metric].shape[2:] for run in runs if metric in run.m), ())
    stacked = np.full((len(runs), len(iters), runs[0].n_layer if runs else 0) + shape, np.nan)
    for values, run in zip(stacked, runs):
        if metric in run.m:
            have = np.isin(iters, run.iters)
            values[have] = run.m[metric][np.searchsorted(run.iters, iters[have])]
    return iters, stacked


def group(items, key):
    """{key(item): [item, ...]} in the order first seen."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def by_setting(runs):
    return group(runs, lambda run: run.setting)


def uncontrolled(runs):
    return [run for run in runs if run.control == 'none' and not run.pretrained]


def arms(runs, rank):
    """{(the baseline's setting, arm): [(controlled, baseline run)] by seed}: settings in rank's
    order, then other control keys, shrink from the weakest dose."""
    baselines, found = {(run.base, run.seed): run for run in uncontrolled(runs)}, {}
    for run in sorted((run for run in runs if run.control != 'none'), key=lambda run: run.seed):
        baseline = baselines.get((run.base, run.seed))
        if baseline is not None:
            found.setdefault((baseline.setting, run.arm), []).append((run, baseline))
    def order(setting_arm):
        setting, arm = setting_arm
        rest = [sort_key(value) for name, value in arm if name not in control.DOSES]
        doses = [-dict(arm).get(name, 0) for name in control.DOSES]   # the weakest dose first
        return (rank[setting], *rest, *doses)
    return {setting_arm: found[setting_arm] for setting_arm in sorted(found, key=order)}


def undosed(arm):
    """An arm's (key, value) pairs without its dose: what the arms of one family share."""
    return tuple(pair for pair in arm if pair[0] not in control.DOSES)


def families(arms, kind=None):
    """{(setting, arm without its dose): [arm keys]} of arms, of one control kind or all."""
    of_kind = [member for member in arms if kind in (None, dict(member[1])['control'])]
    return group(of_kind, lambda member: (member[0], undosed(member[1])))


def varying(mappings):
    """The names whose values differ between the mappings (absent differs)."""
    names = dict.fromkeys(name for mapping in mappings for name in mapping)
    return [name for name in names
            if len({json.dumps(mapping.get(name)) for mapping in mappings}) > 1]


def labels(settings, reference):
    """{setting: its differing values unlike the most common in reference (or all), or 'base'}."""
    mappings = list(settings.values())
    names, common = varying(mappings), {}
    for name in names:
        counts = Counter(json.dumps(mapping.get(name)) for mapping in reference or mappings)
        ranked = counts.most_common(2) + [('', 0)]   # a tie has no most common value
        common[name] = ranked[0][0] if ranked[0][1] > ranked[1][1] else None
    def unlike(mapping):
        return [f'{name}={mapping.get(name)}' for name in names
                if json.dumps(mapping.get(name)) != common[name]]
    return {setting: ', '.join(unlike(mapping)) or 'base' for setting, mapping in settings.items()}


def signed(value):
    """value with its sign, 4 significant digits (scientific where that would show only zeros)."""
    if not np.isfinite(value) or value == 0:
        return f'{value:g}'
    return f'{value:+.3e}' if abs(value) < 1e-4 else f'{value:+.4g}'


def shown(stat, result):
    """'+0.55 [+0.52, +0.58], n = 37'; a share '12/54 = 22% [13%, 35%], 3 seeds; mirror 0/54'."""
    if not result.get('n'):
        return 'not logged'
    if stat.unit == 'trajectory':
        percent = interval_text(result['est'], result['lo'], result['hi'], '{:.0%}'.format)
        mirror = f"mirror {result['mirror']}/{result['n']}"
        return f"{result['hits']}/{result['n']} = {percent}, {result['seeds']} seeds; {mirror}"
    number = '{:.4g}'.format if stat.log or stat.key.endswith('loss') else signed
    return f"{interval_text(result['est'], result['lo'], result['hi'], number)}, n = {result['n']}"


def interval_text(estimate, low, high, number=signed):
    """'estimate [low, high]' in number's format; words where a value cannot be computed."""
    if not np.isfinite(estimate):
        return 'not measured'
    if not (np.isfinite(low) and np.isfinite(high)):
        return f'{number(estimate)} (no interval)'
    return f'{number(estimate)} [{number(low)}, {number(high)}]'


def verdict_text(result):
    return result['verdict'] + (f" ({result['why']})" if result.get('why') else '')
