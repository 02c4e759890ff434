"""
The analysis engine: the study read once (load), each statistic judged over its units (judge), the
control's seed pairs (arms), the robustness map, the claims table, the regime and its trends, the
control tables; analyze computes them all. It reads the registries (claims, statistics, views,
exploratory sections) from the Study that analyze.py fills, never from analyze.py: a research
change does not open this file.
"""
import dataclasses
import json
import math
import os
from collections import Counter, namedtuple
from dataclasses import dataclass
from functools import reduce
from itertools import product

import numpy as np

import control
import geometry
from plumbing import folders, stats
from plumbing.folders import FINAL_LOGS, Skip
from plumbing.stats import nanmean

WELL_BELOW = -0.20
NOT_MEASURED = {   # why a statistic has no unit with a value, by its unit
    'seed': 'not logged, or no run with a value in this view',
    'pair': 'no seed pair with a value (not logged)',
    'model': 'no model with a value: a Spearman needs 3 or more checkpoints (heads) that differ',
    'trajectory': (f'no trajectory has a reference record before its last {FINAL_LOGS} records '
                   '(runs too short for this window)')}


# ------------------------------------------------------------------- statistics and their views
@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class Claim(Stat):
    text: str                   # what the paper says
    sign: int = +1              # the predicted sign of (statistic - ref)
    ref: float = 0.0            # in the units of the value shown (a log claim: a ratio)
    margin: float = 0.0         # no effect: the interval inside ref -/+ margin
    beside: tuple = ()          # 'key' or 'key@window' shown beside (a pair claim: the fro arm's)
    tables: tuple = ('map', 'regime')


View = namedtuple('View', 'lens window from_iter', defaults=('whole', 'all', None))
NO_LENS = 'no lens'   # the map's column of a statistic that reads no lens


def view_of(lens, window, from_iter=None):
    """The View of a map cell's lens and window (a statistic with no lens is read as 'whole')."""
    return View('whole' if lens == NO_LENS else lens, window, from_iter)


def own_lens(stat):
    return stat.lenses[0] if stat.lenses else NO_LENS


def on_grid(run):
    """The run on its regular grid: its records at multiples of geom_interval and at max_iters."""
    if 'grid' not in run.memo:
        every, last = run.cfg.get('geom_interval'), run.cfg.get('max_iters')
        keep = np.ones(len(run.iters), bool)
        if type(every) is int and every > 0:
            keep = (run.iters % every == 0) | (run.iters == last)
        metrics = {key: values[keep] for key, values in run.m.items()}
        run.memo['grid'] = dataclasses.replace(run, iters=run.iters[keep], m=metrics, memo={})
        run.memo['grid'].use(run.settings)   # as the study read them (folders.load_runs)
    return run.memo['grid']


def seed_mean(runs):
    """One run: the per-layer mean over runs (a setting's seeds) at the grid records they share."""
    grids = [on_grid(run) for run in runs]
    shared = reduce(np.intersect1d, [grid.iters for grid in grids])
    keys = {key for grid in grids for key, values in grid.m.items() if values.ndim == 2}
    metrics = {key: nanmean(stack(grids, key, shared)[1], axis=0) for key in sorted(keys)}
    mean = dataclasses.replace(grids[0], iters=shared, m=metrics, memo={})
    mean.use(runs[0].settings)
    return mean


def checkpoints(run):
    """The indices of the records measured on a model checkpoint (all of a pretrained series')."""
    if run.pretrained:
        return np.arange(len(run.iters))
    return np.flatnonzero(np.isin(run.iters, sorted(geometry.model_ckpt_iters(run.cfg))))


# ------------------------------------------------------------------------ a statistic over units
def judge(stat, units, view=View()):
    """A statistic over units by its interval rule, judged if a Claim: {n, est, lo, hi, p, verdict,
    why, values}; a trajectory claim adds hits, mirror, seeds, per_ref, per_part."""
    found = [stat.fn(unit, view) for unit in units]
    res = shares(found) if stat.unit == 'trajectory' else interval(stat, found)
    res.update({'verdict': '', 'why': '', 'p': math.nan})
    if isinstance(stat, Claim):
        res.update(decide(stat, res))
    if not res['n']:
        res['verdict'], res['why'] = 'not measured', NOT_MEASURED[stat.unit]
    if stat.log:
        res.update(zip(('est', 'lo', 'hi'), np.exp([res['est'], res['lo'], res['hi']])))
    return {key: float(v) if isinstance(v, np.floating) else v for key, v in res.items()}


def interval(stat, values):
    """The Student-t interval of the finite values, clipped to the statistic's limits."""
    finite = np.array(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    est, lo, hi, n = stats.t_interval(finite)
    return {'values': list(finite), 'n': n, 'est': est, 'lo': max(lo, stat.limits[0]),
            'hi': min(hi, stat.limits[1]), 'df': n - 1,
            'se': float(finite.std(ddof=1)) / math.sqrt(n) if n > 1 else 0}


def outcomes(signs):
    """Per trajectory: +1 if every sign it has (over references or records, and parts) is +1, -1
    if every one is -1, else 0; NaN with none."""
    finite = np.isfinite(signs)
    def every(sign):
        return (np.where(finite, signs, sign) == sign).all((1, 2))
    found = np.where(every(1), 1.0, np.where(every(-1), -1.0, 0.0))
    return np.where(finite.any((1, 2)), found, np.nan)


def shares(signs):
    """The per-seed shares of a trajectory claim and its mirror; counts per reference and part."""
    signs = [run_signs for run_signs in signs if np.size(run_signs)]
    found = [outcomes(run_signs) for run_signs in signs]
    count = [int(np.isfinite(outcome).sum()) for outcome in found]
    hold = [int((outcome == 1).sum()) for outcome in found]
    mirror = [int((outcome == -1).sum()) for outcome in found]
    names = ('est', 'lo', 'hi', 'se_lo', 'se_hi', 'df')
    res = dict(zip(names, stats.share(hold, count)))
    res.update({f'mirror_{name}': v for name, v in zip(names, stats.share(mirror, count))})
    res.update({'values': [held / n for held, n in zip(hold, count) if n], 'n': sum(count),
                'hits': sum(hold), 'mirror': sum(mirror), 'seeds': sum(n > 0 for n in count)})
    if signs and len({run_signs.shape[1:] for run_signs in signs}) == 1 and signs[0].shape[2] > 1:
        every = np.concatenate(signs)   # trajectories x references x parts
        refs, parts = range(every.shape[1]), range(every.shape[2])
        held = [int((every[:, ref] == 1).all(1).sum()) for ref in refs]
        res['per_ref'] = [(hits, int(np.isfinite(every[:, ref]).all(1).sum()))
                          for hits, ref in zip(held, refs)]
        res['per_part'] = [int((outcomes(every[..., part:part + 1]) == 1).sum()) for part in parts]
    return res


def decide(claim, res):
    """The verdict, why it could not decide, and the two-sided p of the interval's test."""
    if claim.unit == 'trajectory':   # holds, reversed (the mirror holds), fails (neither can)
        word, why = stats.verdict(res['lo'], res['hi'], claim.sign, claim.ref, 0,
                                  f"{res['seeds']} seeds", (res['mirror_lo'], res['mirror_hi']))
        def p_of(prefix, side):
            return stats.p_value(res[f'{prefix}est'], claim.ref, res[f'{prefix}se_{side}'],
                                 res['df'])
        found = {'holds': p_of('', 'lo'), 'reversed': p_of('mirror_', 'lo'),
                 'fails': max(p_of('', 'hi'), p_of('mirror_', 'hi'))}
        return {'verdict': word, 'why': why, 'p': found.get(word, 1.0)}
    to_value = np.exp if claim.log else float
    word, why = stats.verdict(to_value(res['lo']), to_value(res['hi']), claim.sign, claim.ref,
                              claim.margin, res['n'])
    ref, low, high = claim.ref, claim.ref - claim.margin, claim.ref + claim.margin
    if claim.log:   # ref and margin are in the units shown: the statistic is their log
        ref, low, high = (math.log(bound) if bound > 0 else -math.inf for bound in (ref, low, high))
    if word == 'no effect':   # two one-sided tests, doubled to match the two-sided interval
        tails = [stats.t_sf((res['est'] - low) / res['se'], res['df']),
                 stats.t_sf((high - res['est']) / res['se'], res['df'])] if res['se'] else [0.0]
        p = 2 * max(tails)
    elif word == 'undecided':
        p = 1.0
    else:
        p = stats.p_value(res['est'], ref, res['se'], res['df'])
    return {'verdict': word, 'why': why, 'p': min(p, 1.0)}


# -------------------------------------------------------------------------------------- groupings
def group(items, key):
    """{key(item): [item, ...]} in the order first seen."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def uncontrolled(runs):
    return [run for run in runs if run.control == 'none' and not run.pretrained]


def arms(runs, rank):
    """{(the baseline's setting, arm): [(controlled, baseline run)] by seed}: settings in rank's
    order, then other control keys, shrink from the weakest dose."""
    base, found = {(run.base, run.seed): run for run in uncontrolled(runs)}, {}
    for run in sorted((run for run in runs if run.control != 'none'), key=lambda run: run.seed):
        baseline = base.get((run.base, run.seed))
        if baseline is not None:
            found.setdefault((baseline.setting, run.arm), []).append((run, baseline))

    def order(setting_arm):
        setting, arm = setting_arm
        rest = [sort_key(value) for name, value in arm if name not in control.DOSES]
        doses = [-dict(arm).get(name, 0) for name in control.DOSES]   # the weakest dose first
        return (rank[setting], *rest, *doses)
    return {key: found[key] for key in sorted(found, key=order)}


def deciding(claim, study, keep):
    """[(setting, arm, pairs or None, why)] deciding a control claim on W_K per family of one keep:
    every freeze arm; the strongest shrink dose moving PR_K well below the baseline."""
    out, rel = [], study.stats['d_pr_head_rel']
    for (setting, rest), keys in families(study.arms, claim.control).items():
        if (dict(rest).get('control_target'), dict(rest).get('control_keep')) != ('k', keep):
            continue
        if claim.control == 'freeze':
            out += [(setting, key[1], study.arms[key], '') for key in keys]
            continue
        found = {key: judge(rel, study.arms[key]) for key in keys}
        strong = [key for key in keys if found[key]['hi'] < WELL_BELOW]
        if strong:
            out.append((setting, strong[-1][1], study.arms[strong[-1]], ''))
            continue
        doses = ', '.join(f"shrink_to {dict(key[1])['shrink_to']:g}: {shown(rel, found[key])}"
                          for key in keys)
        why = f'no dose moves per-head PR_K well below the baseline ({doses})'
        out.append((setting, keys[0][1], None, why))
    return out


def twins(arm):
    """What a spec arm and its fro arm share: the arm without its keep and its dose."""
    return tuple(pair for pair in undosed(arm) if pair[0] != 'control_keep')


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
            res = judge(stat, runs, view_of(lens, window, study.from_iter))
            cells.append({'key': stat.key, 'lens': lens, 'window': window, 'decay': decay,
                          'keep': '', **res})
    for claim in (claim for claim in study.claims if claim.unit == 'pair'):
        for keep in ('spec', 'fro'):
            for setting, arm, pairs, why in deciding(claim, study, keep):
                res = judge(claim, pairs) if pairs else {'n': 0, 'verdict': 'not measured',
                                                         'why': why}
                cells.append({'key': claim.key, 'lens': '', 'window': '', 'decay': '',
                              'keep': keep, 'pairs': pairs, 'setting': study.label[setting],
                              'twins': twins(arm), 'arm': study.arm_name(arm), **res})
    return cells


def beside(claim, study, pool, cell):
    """Shown beside a claim's verdict: Claim.beside (a pair claim: the fro arm's); a trajectory
    claim's count over seed-averaged trajectories; (a)'s counts per reference and part."""
    if claim.unit == 'pair':
        if not cell.get('pairs'):
            return ''
        judged = {key: judge(study.stats[key], cell['pairs']) for key in claim.beside}
        more = [f'{key} {shown(study.stats[key], res)}' for key, res in judged.items()]
        return '; '.join([f"keep=fro ({cell['arm']}): {shown(claim, cell)}"] + more)
    out, view = [], view_of(own_lens(claim), claim.window, study.from_iter)
    if claim.unit == 'trajectory':   # the paper's unit: a setting's layer averaged over its seeds
        settings = group(pool, lambda run: run.setting).values()
        res = shares([claim.fn(seed_mean(runs), view) for runs in settings])
        hits, mirror, n = res['hits'], res['mirror'], res['n']
        out.append(f'seed-averaged layers: {hits}/{n}, mirror {mirror}/{n}')
    if cell.get('per_ref'):
        names = [name.split(' (')[0] for name in study.references[claim.window]]
        counts = ', '.join(f'{name} {hits}/{n}' for name, (hits, n) in zip(names, cell['per_ref']))
        rises, falls = cell['per_part']
        out.append(f'from each reference: {counts}; PR_Q rises in {rises}, PR_K falls in {falls}')
    for key, _, window in (entry.partition('@') for entry in claim.beside):
        stat = study.stats[key]
        res = judge(stat, pool, view_of(own_lens(stat), window or stat.window, study.from_iter))
        where = f' ({study.windows[window]})' if window else ''
        out.append(f'{key}{where}: {shown(stat, res)}')
    return '; '.join(out)


def models(study):
    """{source: the units of a model claim}: uncontrolled runs, pretrained series (q, k as used)."""
    ours = uncontrolled(study.runs)
    series = [run for run in study.series if run.cfg.get('rope') in (None, 'none', 'after')]
    return {name: runs for name, runs in (('our checkpoints', ours), ('pretrained models', series))
            if runs}


def claims_table(study, cells):
    """Each claim in its own view, (d), (e) per setting, (f1), (f2) per source; Holm over them."""
    pool, rows = uncontrolled(study.runs), []
    where = f'{len(pool)} uncontrolled runs in {len(group(pool, lambda run: run.setting))} settings'
    for claim in study.claims:
        if not study.runs and claim.unit != 'model':   # a series alone: the model claims
            continue
        if claim.unit == 'pair':
            fro = {(cell['setting'], cell['twins']): cell for cell in cells
                   if cell['key'] == claim.key and cell['keep'] == 'fro'}
            spec = [cell for cell in cells if cell['key'] == claim.key and cell['keep'] == 'spec']
            spec = spec or [dict(cell, n=0, verdict='not measured', why='no control_keep=spec arm')
                            for cell in fro.values()]
            found = [(cell, f"{cell['setting']}, {cell['arm']}",
                      beside(claim, study, pool, fro.get((cell['setting'], cell['twins']), {})))
                     for cell in spec]
        elif claim.unit == 'model':
            found = [(judge(claim, runs), f'{source}: {len(runs)} series', '')
                     for source, runs in models(study).items()]
        else:
            own = (claim.key, own_lens(claim), claim.window, 'pooled')
            cell = next(cell for cell in cells
                        if (cell['key'], cell['lens'], cell['window'], cell['decay']) == own)
            lens = f'{study.lenses[claim.lenses[0]].what}, ' if claim.lenses else ''
            found = [(cell, f'{where}; {lens}{study.windows[claim.window]}',
                      beside(claim, study, pool, cell))]
        for res, scope, also in found:
            rows.append({'key': claim.key, 'claim': claim.text, 'scope': scope, 'n': res['n'],
                         'est': res.get('est'), 'lo': res.get('lo'), 'hi': res.get('hi'),
                         'p': res.get('p', math.nan),
                         'value': shown(claim, res) if res['n'] else res['why'], 'beside': also,
                         'verdict': verdict_text(res) if res['n'] else res['verdict']})
    judged = [row for row in rows if np.isfinite(row['p']) and row['key'] in study.family]
    for row, p in zip(judged, stats.holm([row['p'] for row in judged])):
        row.update(p_holm=p, holm=row['verdict'].split(' (')[0] if p < stats.ALPHA else 'undecided')
    return rows


# ------------------------------------------------------------------------------------- the regime
def regime(study):
    """(a row per statistic and point (uncontrolled setting), all layers; their trends); none below
    2 points."""
    points = group(uncontrolled(study.runs), lambda run: run.setting)
    if len(points) < 2:
        return [], []
    shown_here = [stat for stat in study.stats.values() if stat.unit in ('trajectory', 'seed')
                  and {'regime', 'optimizer'} & set(stat.tables)]
    rows, found = [], {}
    for setting, runs in points.items():
        for stat in shown_here:
            res = judge(stat, runs, view_of(own_lens(stat), stat.window, study.from_iter))
            found[(setting, stat.key)] = res
            rows.append({'point': study.label[setting], 'statistic': stat.key, 'seeds': len(runs),
                         'n': res['n'], 'est': res['est'], 'lo': res['lo'], 'hi': res['hi'],
                         'value': shown(stat, res), 'verdict': res['verdict']})
    return rows, trends(study, points, found)


def axes(points):
    """The settings varying between points but a constant multiple of an earlier one (lr / 10)."""
    settings = [runs[0].settings for runs in points.values()]
    def numeric(key):
        return all(type(cfg.get(key)) in folders.NUMBER and cfg.get(key) for cfg in settings)
    out = []
    for key in (key for key in varying(settings) if key not in control.KEYS):
        def ratios(axis):
            return {round(cfg[key] / cfg[axis], 12) for cfg in settings}
        multiple = any(numeric(axis) and numeric(key) and len(ratios(axis)) == 1 for axis in out)
        if not multiple:
            out.append(key)
    return out


def trends(study, points, found):
    """Per numeric axis, each line of points equal in every other axis: its line_trends."""
    all_axes, out = axes(points), []
    settings = {setting: runs[0].settings for setting, runs in points.items()}
    numeric = [axis for axis in all_axes
               if all(type(cfg.get(axis)) in folders.NUMBER for cfg in settings.values())]
    for axis in numeric:
        def others(setting):
            return tuple((other, settings[setting].get(other)) for other in all_axes
                         if other != axis)
        for fixed, line in group(points, others).items():
            named = ', '.join(f'{other}={value}' for other, value in fixed)
            head = {'axis': axis, 'line': named or 'all points'}
            at = {setting: settings[setting][axis]
                  for setting in sorted(line, key=lambda setting: settings[setting][axis])}
            out += line_trends(study, found, head, at)
    return out


def line_trends(study, found, head, at):
    """Each statistic's stats.trend over a line's points (at: setting -> its value on the axis; x
    is its log2 where every value is positive), the trend's reading and the point verdicts."""
    log2, out = all(value > 0 for value in at.values()), []
    for key in dict.fromkeys(key for _, key in found):
        have = [setting for setting in at if found[(setting, key)]['values']]
        if len(have) < 2:
            continue
        units = [found[(setting, key)]['values'] for setting in have]
        xs = [math.log2(at[setting]) if log2 else at[setting] for setting in have]
        fit, means = stats.trend(xs, units), [np.mean(values) for values in units]
        out.append({**head, 'members': ' | '.join(study.label[setting] for setting in have),
                    'statistic': key, **fit,
                    'reading': reading(fit, np.exp(means) if study.stats[key].log else means),
                    'verdicts': ', '.join(found[(setting, key)]['verdict'] or '-'
                                          for setting in have)})
    return out


def side(lo, hi, up, down, neither):
    """The word for an interval: up above 0, down below 0, else neither."""
    return up if lo > 0 else down if hi < 0 else neither


def reading(fit, means):
    """The line (up, down, no clear slope, or not a line by lack of fit) and the monotone trend."""
    line = side(fit['lo'], fit['hi'], 'up', 'down', 'no clear slope')
    if fit['lof_p'] < stats.ALPHA:
        line = 'not a line: point means ' + ', '.join(f'{mean:.3g}' for mean in means)
    elif fit['points'] == 2:
        line += ' (2 points: no lack-of-fit test)'
    mono = side(fit['rho_lo'], fit['rho_hi'], 'rises monotonically', 'falls monotonically',
                'no monotone trend')
    return f'{line}; {mono}' if np.isfinite(fit['rho_lo']) else line


# ------------------------------------------------------------------------------- the other tables
def control_dose(study):
    """Each paired statistic over an arm's seed pairs, with (d) or (e)'s verdict."""
    dose, paired = [], [stat for stat in study.stats.values() if 'control' in stat.tables]
    for (setting, arm), pairs in study.arms.items():
        kind, target = dict(arm)['control'], dict(arm)['control_target']
        claim = next((claim for claim in study.claims if claim.control == kind), None)
        found = {stat.key: judge(stat, pairs) for stat in paired}
        baseline_pr = nanmean([baseline.final(f'pr_{target}_head') for _, baseline in pairs])
        row = {'setting': study.label[setting], 'arm': study.arm_name(arm), 'n': len(pairs),
               'baseline PR/head': baseline_pr}
        row.update({stat.key[2:]: shown(stat, found[stat.key]) for stat in paired})
        row['well below'] = bool(found['d_pr_head_rel']['hi'] < WELL_BELOW)
        row.update(predicted(claim, pairs, target))
        dose.append(row)
    return dose


def predicted(claim, pairs, target):
    """The predicted sign's count and the verdict of a kind's claim on an arm's pairs; a kind with
    no claim (a fork's new one) and the mirror get no verdict."""
    if claim is None:
        return {'predicted sign': '-', 'verdict': 'no claim on this kind: no verdict'}
    effect = judge(claim, pairs)
    agree = sum(value * claim.sign > 0 for value in effect['values'])
    return {'predicted sign': f"{agree}/{effect['n']}",
            'verdict': verdict_text(effect) if target == 'k' else 'mirror: no verdict'}


def dose_fits(study):
    """Per family of 2+ shrink doses: the entropy change on the per-head PR change, alone and with
    the change in log qk_spec_norm; jackknife-t over seeds (a seed's arms share its baseline)."""
    out = []
    for (setting, rest), keys in families(study.arms, 'shrink').items():
        if len(keys) < 2:
            continue
        pairs = [pair for key in keys for pair in study.arms[key]]
        def over_pairs(key):
            return [study.stats[key].fn(pair, View()) for pair in pairs]
        entropy, seeds = over_pairs('d_entropy'), [controlled.seed for controlled, _ in pairs]
        pr_k, scale = over_pairs('d_pr_head'), over_pairs('d_log_qk_spec_norm')
        alone = stats.fit_groups(entropy, pr_k, seeds)
        both = stats.fit_groups(entropy, np.column_stack([pr_k, scale]), seeds)
        doses = ' '.join(f"{dict(key[1])['shrink_to']:g}" for key in keys)
        row = {'setting': study.label[setting], 'arm': study.arm_name(rest), 'doses': doses,
               'pairs': len(pairs)}
        for name, (coef, lo, hi), i in (('slope', alone, 1), ('pr_coef', both, 1),
                                        ('scale_coef', both, 2)):
            row.update({name: coef[i], f'{name}_lo': lo[i], f'{name}_hi': hi[i]})
        row['entropy follows PR_K'] = side(row['pr_coef_lo'], row['pr_coef_hi'], 'follows',
                                           'goes against', 'undecided')
        out.append(row)
    return out


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
    groups, rows = group(study.runs, lambda run: run.setting), []
    keys = varying([runs[0].settings for runs in groups.values()])
    for setting, runs in groups.items():
        seeds = ' '.join(str(run.seed) for run in runs)
        row = {'setting': study.label[setting], 'runs': len(runs), 'seeds': seeds}
        rows.append({**row, **{key: runs[0].settings.get(key) for key in keys}})
    return rows


def token_rows(study):
    """A row per model of each source: its checkpoints and the statistics of (f1), (f2)."""
    rows, model_claims = [], [claim for claim in study.claims if claim.unit == 'model']
    for source, runs in models(study).items():
        for run in runs:
            steps = run.iters[checkpoints(run)]
            row = {'source': source, 'model': run.name,
                   'setting': study.label.get(run.setting, run.name), 'seed': run.seed,
                   'checkpoints': len(steps),
                   'first_step': int(steps[0]) if len(steps) else None,
                   'last_step': int(steps[-1]) if len(steps) else None}
            rows.append({**row, **{claim.key: claim.fn(run, View()) for claim in model_claims}})
    return rows


# ----------------------------------------------------------------------------------- the analysis
@dataclass
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


def sort_key(value):
    """Orders a setting's values: numbers by size, the rest by their JSON text, absent last."""
    if type(value) in folders.NUMBER:
        return (0, value, '')
    return (1, 0, json.dumps(value)) if value is not None else (2, 0, '')


def by_value(runs):
    """The runs, settings in the order of their values (keys in config order), then seed; ranks."""
    settings = {run.setting: run.settings for run in runs}
    keys = varying(list(settings.values()))
    def values(setting):
        return tuple(sort_key(settings[setting].get(key)) for key in keys)
    rank = {setting: i for i, setting in enumerate(sorted(settings, key=values))}
    return sorted(runs, key=lambda run: (rank[run.setting], run.seed)), rank


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
    groups = group(runs, lambda run: run.setting)
    settings = [members[0].settings for members in groups.values()]
    names = labels(settings, varying(settings), [run.settings for run in uncontrolled(runs)])
    study.label, study.arms = dict(zip(groups, names)), arms(runs, rank)
    controlled = [dict(run.arm) for run in runs if run.control != 'none']
    named = ('control', 'control_target', 'control_keep', *control.DOSES)   # in the label
    study.arm_keys = [key for key in varying(controlled) if key not in named]
    paired = {pair[0] for pairs in study.arms.values() for pair in pairs}
    for run in (run for run in runs if run.control != 'none' and run not in paired):
        warn(f'{run.path}: no control=none run with the same other settings and seed: left out of '
             'the control tables')
    return study


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


# ----------------------------------------------------------------------------------- sets of runs
def stack(runs, key, iters=None):
    """(iters, default all runs'; (runs, iters, layers[, heads]) of key, NaN where not logged)."""
    if iters is None:
        iters = reduce(np.union1d, [run.iters for run in runs], np.zeros(0, int))
    iters = np.asarray(iters)
    shape = next((run.m[key].shape[2:] for run in runs if key in run.m), ())
    out = np.full((len(runs), len(iters), runs[0].n_layer if runs else 0) + shape, np.nan)
    for values, run in zip(out, runs):
        if key in run.m:
            have = np.isin(iters, run.iters)
            values[have] = run.m[key][np.searchsorted(run.iters, iters[have])]
    return iters, out


def undosed(arm):
    """An arm's (key, value) pairs without its dose: what the arms of one family share."""
    return tuple(pair for pair in arm if pair[0] not in control.DOSES)


def families(arms, kind=None):
    """{(setting, arm without its dose): [arm keys]} of arms, of one control kind or all."""
    return group([key for key in arms if kind in (None, dict(key[1])['control'])],
                 lambda key: (key[0], undosed(key[1])))


def varying(dicts):
    """The keys whose values differ between the dicts (absent differs)."""
    keys = dict.fromkeys(key for each in dicts for key in each)
    return [key for key in keys if len({json.dumps(each.get(key)) for each in dicts}) > 1]


def labels(dicts, keys, reference=None):
    """Per dict, its values of keys unlike the most common in reference (or dicts), or 'base'."""
    common = {}
    for key in keys:
        counts = Counter(json.dumps(each.get(key)) for each in reference or dicts)
        (top, n), *rest = counts.most_common(2) + [('', 0)]
        common[key] = top if n > rest[0][1] else None
    def unlike(each):
        return [f'{key}={each.get(key)}' for key in keys
                if json.dumps(each.get(key)) != common[key]]
    return [', '.join(unlike(each)) or 'base' for each in dicts]


# ------------------------------------------------------------------------------ a result as text
def signed(value):
    """value with its sign, 4 significant digits (scientific where that would show only zeros)."""
    if not np.isfinite(value) or value == 0:
        return f'{value:g}'
    return f'{value:+.3e}' if abs(value) < 1e-4 else f'{value:+.4g}'


def shown(stat, res):
    """'+0.55 [+0.52, +0.58], n = 37'; a share '12/54 = 22% [13%, 35%], 3 seeds; mirror 0/54'."""
    if not res.get('n'):
        return 'not logged'
    if stat.unit == 'trajectory':
        share = interval_text(res['est'], res['lo'], res['hi'], lambda share: f'{share:.0%}')
        mirror = f"mirror {res['mirror']}/{res['n']}"
        return f"{res['hits']}/{res['n']} = {share}, {res['seeds']} seeds; {mirror}"
    number = (lambda value: f'{value:.4g}') if stat.log or stat.key.endswith('loss') else signed
    return f"{interval_text(res['est'], res['lo'], res['hi'], number)}, n = {res['n']}"


def interval_text(est, lo, hi, number=signed):
    """'est [lo, hi]' in number's format; words where a value cannot be computed."""
    if not np.isfinite(est):
        return 'not measured'
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f'{number(est)} (no interval)'
    return f'{number(est)} [{number(lo)}, {number(hi)}]'


def verdict_text(res):
    return res['verdict'] + (f" ({res['why']})" if res.get('why') else '')
