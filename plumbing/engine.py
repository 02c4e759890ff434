"""
The analysis engine: the study read once (load), each statistic judged over its units (judge), the
control's seed pairs (arms), the robustness map, the claims table, the regime and its trends, the
control tables, and analyze, which computes every table. It reads the registries from the Study
(analyze.py holds them and passes them in), never from analyze.py, so a research change does not
open this file.
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
from plumbing.folders import FINAL_LOGS, Skip, group
from plumbing.stats import nanmean

WELL_BELOW = -0.20
NOT_MEASURED = {   # why a statistic has no unit with a value, by its unit
    'seed': 'not logged, or no run with a value in this view',
    'pair': 'no seed pair with a value (not logged)',
    'model': 'no model with a value: a Spearman needs 3 or more checkpoints (heads) that differ',
    'trajectory': (f'no trajectory has a reference record before its last {FINAL_LOGS} records '
                   '(runs too short for this window)')}

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
        m = {k: v[keep] for k, v in run.m.items()}
        run.memo['grid'] = dataclasses.replace(run, iters=run.iters[keep], m=m, memo={})
        run.memo['grid'].use(run.settings)   # as the study read them (folders.load_runs)
    return run.memo['grid']


def seed_mean(runs):
    """One run: the per-layer mean over runs (a setting's seeds) at the grid records they share."""
    grids = [on_grid(r) for r in runs]
    its = reduce(np.intersect1d, [g.iters for g in grids])
    keys = {k for g in grids for k, v in g.m.items() if v.ndim == 2}
    m = {k: nanmean(stack(grids, k, its)[1], axis=0) for k in sorted(keys)}
    mean = dataclasses.replace(grids[0], iters=its, m=m, memo={})
    mean.use(runs[0].settings)
    return mean


def checkpoints(run):
    """The indices of the records measured on a model checkpoint (all of a pretrained series')."""
    if run.pretrained:
        return np.arange(len(run.iters))
    return np.flatnonzero(np.isin(run.iters, sorted(geometry.model_ckpt_iters(run.cfg))))


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
    limits: tuple = (-math.inf, math.inf)   # intervals are clipped to these ((-1, 1): a correlation)


@dataclass(frozen=True, kw_only=True)
class Claim(Stat):
    text: str                   # what the paper says
    sign: int = +1              # the predicted sign of (statistic - ref)
    ref: float = 0.0            # in the units of the value shown (a log claim: a ratio)
    margin: float = 0.0         # no effect: the interval inside ref -/+ margin
    beside: tuple = ()          # 'key' or 'key@window' shown beside (a pair claim: the fro arm's)
    tables: tuple = ('map', 'regime')


def judge(stat, units, view=View()):
    """A statistic over units by its interval rule, judged if a Claim: {n, est, lo, hi, p, verdict,
    why, values}; a trajectory claim adds hits, mirror, seeds, per_ref, per_part."""
    found = [stat.fn(u, view) for u in units]
    res = shares(found) if stat.unit == 'trajectory' else interval(stat, found)
    res.update({'verdict': '', 'why': '', 'p': math.nan})
    if isinstance(stat, Claim):
        res.update(decide(stat, res))
    if not res['n']:
        res['verdict'], res['why'] = 'not measured', NOT_MEASURED[stat.unit]
    if stat.log:
        res.update(zip(('est', 'lo', 'hi'), np.exp([res['est'], res['lo'], res['hi']])))
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in res.items()}


def interval(stat, values):
    """The Student-t interval of the finite values, clipped to the statistic's limits."""
    v = np.array(values, dtype=float)
    v = v[np.isfinite(v)]
    est, lo, hi, n = stats.t_interval(v)
    return {'values': list(v), 'n': n, 'est': est, 'lo': max(lo, stat.limits[0]),
            'hi': min(hi, stat.limits[1]), 'df': n - 1,
            'se': float(v.std(ddof=1)) / math.sqrt(n) if n > 1 else 0}


def outcomes(signs):
    """Per trajectory: +1 if every sign it has (over references or records, and parts) is +1, -1
    if every one is -1, else 0; NaN with none."""
    fin = np.isfinite(signs)
    def every(x):
        return (np.where(fin, signs, x) == x).all((1, 2))
    found = np.where(every(1), 1.0, np.where(every(-1), -1.0, 0.0))
    return np.where(fin.any((1, 2)), found, np.nan)


def shares(signs):
    """The per-seed shares of a trajectory claim and its mirror; counts per reference and part."""
    signs = [s for s in signs if np.size(s)]
    found = [outcomes(s) for s in signs]
    count = [int(np.isfinite(o).sum()) for o in found]
    hold = [int((o == 1).sum()) for o in found]
    mirror = [int((o == -1).sum()) for o in found]
    names = ('est', 'lo', 'hi', 'se_lo', 'se_hi', 'df')
    res = dict(zip(names, stats.share(hold, count)))
    res.update({f'mirror_{k}': v for k, v in zip(names, stats.share(mirror, count))})
    res.update({'values': [h / c for h, c in zip(hold, count) if c], 'n': sum(count),
                'hits': sum(hold), 'mirror': sum(mirror), 'seeds': sum(c > 0 for c in count)})
    if signs and len({s.shape[1:] for s in signs}) == 1 and signs[0].shape[2] > 1:
        cat = np.concatenate(signs)   # trajectories x references x parts
        refs, parts = range(cat.shape[1]), range(cat.shape[2])
        held = [int((cat[:, r] == 1).all(1).sum()) for r in refs]
        res['per_ref'] = [(k, int(np.isfinite(cat[:, r]).all(1).sum())) for k, r in zip(held, refs)]
        res['per_part'] = [int((outcomes(cat[..., p:p + 1]) == 1).sum()) for p in parts]
    return res


def decide(claim, res):
    """The verdict, why it could not decide, and the two-sided p of the interval's test."""
    if claim.unit == 'trajectory':   # holds, reversed (the mirror holds), fails (neither can)
        word, why = stats.verdict(res['lo'], res['hi'], claim.sign, claim.ref, 0,
                                  f"{res['seeds']} seeds", (res['mirror_lo'], res['mirror_hi']))
        def p(x, side):
            return stats.p_value(res[f'{x}est'], claim.ref, res[f'{x}se_{side}'], res['df'])
        found = {'holds': p('', 'lo'), 'reversed': p('mirror_', 'lo'),
                 'fails': max(p('', 'hi'), p('mirror_', 'hi'))}
        return {'verdict': word, 'why': why, 'p': found.get(word, 1.0)}
    to_value = np.exp if claim.log else float
    word, why = stats.verdict(to_value(res['lo']), to_value(res['hi']), claim.sign, claim.ref,
                              claim.margin, res['n'])
    ref, low, high = claim.ref, claim.ref - claim.margin, claim.ref + claim.margin
    if claim.log:   # ref and margin are in the units shown: the statistic is their log
        ref, low, high = (math.log(x) if x > 0 else -math.inf for x in (ref, low, high))
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
def uncontrolled(runs):
    return [r for r in runs if r.control == 'none' and not r.pretrained]


def arms(runs, rank):
    """{(the baseline's setting, arm): [(controlled, baseline run)] by seed}: settings in rank's
    order, then other control keys, shrink from the weakest dose."""
    base, found = {(r.base, r.seed): r for r in uncontrolled(runs)}, {}
    for r in sorted((r for r in runs if r.control != 'none'), key=lambda r: r.seed):
        b = base.get((r.base, r.seed))
        if b is not None:
            found.setdefault((b.setting, r.arm), []).append((r, b))

    def order(key):
        setting, arm = key
        rest = [sort_key(v) for n, v in arm if n not in control.DOSES]
        doses = [-dict(arm).get(key, 0) for key in control.DOSES]   # the weakest dose first
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
        doses = ', '.join(f"shrink_to {dict(k[1])['shrink_to']:g}: {shown(rel, found[k])}"
                          for k in keys)
        why = f'no dose moves per-head PR_K well below the baseline ({doses})'
        out.append((setting, keys[0][1], None, why))
    return out


def twins(arm):
    """What a spec arm and its fro arm share: the arm without its keep and its dose."""
    return tuple(x for x in undosed(arm) if x[0] != 'control_keep')


def robustness_cells(study):
    """The map: each map statistic in every lens x window over the uncontrolled runs; claims in
    their own view per weight decay on W_Q, W_K; (d), (e) per deciding arm and keep."""
    pool, cells = uncontrolled(study.runs), []
    split = group(pool, lambda r: bool(r.cfg['decay_qk'] and r.cfg['weight_decay'] > 0))
    mapped = [s for s in study.stats.values() if s.unit in ('trajectory', 'seed') and 'map' in s.tables]
    for s in mapped:
        lenses = s.lenses or (NO_LENS,)
        views = [(lens, window, 'pooled', pool) for lens, window in product(lenses, study.windows)]
        if isinstance(s, Claim) and len(split) > 1:
            views += [(lenses[0], s.window, d, runs) for d, runs in split.items()]
        for lens, window, d, runs in views:
            res = judge(s, runs, view_of(lens, window, study.from_iter))
            cells.append({'key': s.key, 'lens': lens, 'window': window, 'decay': d, 'keep': '',
                          **res})
    for c in (c for c in study.claims if c.unit == 'pair'):
        for keep in ('spec', 'fro'):
            for setting, arm, pairs, why in deciding(c, study, keep):
                res = judge(c, pairs) if pairs else {'n': 0, 'verdict': 'not measured', 'why': why}
                cells.append({'key': c.key, 'lens': '', 'window': '', 'decay': '', 'keep': keep,
                              'pairs': pairs, 'setting': study.label[setting], 'twins': twins(arm),
                              'arm': study.arm_name(arm), **res})
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
        settings = group(pool, lambda r: r.setting).values()
        res = shares([claim.fn(seed_mean(rs), view) for rs in settings])
        hits, mirror, n = res['hits'], res['mirror'], res['n']
        out.append(f'seed-averaged layers: {hits}/{n}, mirror {mirror}/{n}')
    if cell.get('per_ref'):
        names = [name.split(' (')[0] for name in study.references[claim.window]]
        counts = ', '.join(f'{name} {k}/{n}' for name, (k, n) in zip(names, cell['per_ref']))
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
    series = [r for r in study.series if r.cfg.get('rope') in (None, 'none', 'after')]
    return {name: rs for name, rs in (('our checkpoints', ours), ('pretrained models', series))
            if rs}


def claims_table(study, cells):
    """Each claim in its own view, (d), (e) per setting, (f1), (f2) per source; Holm over them."""
    pool, rows = uncontrolled(study.runs), []
    where = f'{len(pool)} uncontrolled runs in {len(group(pool, lambda r: r.setting))} settings'
    for c in (c for c in study.claims if study.runs or c.unit == 'model'):   # a series: model claims
        if c.unit == 'pair':
            fro = {(x['setting'], x['twins']): x for x in cells
                   if x['key'] == c.key and x['keep'] == 'fro'}
            spec = [x for x in cells if x['key'] == c.key and x['keep'] == 'spec']
            spec = spec or [dict(x, n=0, verdict='not measured', why='no control_keep=spec arm')
                            for x in fro.values()]
            found = [(x, f"{x['setting']}, {x['arm']}",
                      beside(c, study, pool, fro.get((x['setting'], x['twins']), {})))
                     for x in spec]
        elif c.unit == 'model':
            found = [(judge(c, rs), f'{source}: {len(rs)} series', '')
                     for source, rs in models(study).items()]
        else:
            own = (c.key, own_lens(c), c.window, 'pooled')
            x = next(x for x in cells if (x['key'], x['lens'], x['window'], x['decay']) == own)
            lens = f'{study.lenses[c.lenses[0]].what}, ' if c.lenses else ''
            scope = f'{where}; {lens}{study.windows[c.window]}'
            found = [(x, scope, beside(c, study, pool, x))]
        for x, scope, also in found:
            rows.append({'key': c.key, 'claim': c.text, 'scope': scope, 'n': x['n'],
                         'est': x.get('est'), 'lo': x.get('lo'), 'hi': x.get('hi'),
                         'p': x.get('p', math.nan), 'value': shown(c, x) if x['n'] else x['why'],
                         'beside': also, 'verdict': verdict_text(x) if x['n'] else x['verdict']})
    judged = [r for r in rows if np.isfinite(r['p']) and r['key'] in study.family]
    for r, p in zip(judged, stats.holm([r['p'] for r in judged])):
        r.update(p_holm=p, holm=r['verdict'].split(' (')[0] if p < stats.ALPHA else 'undecided')
    return rows


# ------------------------------------------------------------------------------------- the regime
def regime(study):
    """(a row per statistic and point (uncontrolled setting), all layers; their trends); none below
    2 points."""
    points = group(uncontrolled(study.runs), lambda r: r.setting)
    if len(points) < 2:
        return [], []
    shown_here = [s for s in study.stats.values()
                  if s.unit in ('trajectory', 'seed') and {'regime', 'optimizer'} & set(s.tables)]
    rows, found = [], {}
    for setting, runs in points.items():
        for s in shown_here:
            res = judge(s, runs, view_of(own_lens(s), s.window, study.from_iter))
            found[(setting, s.key)] = res
            rows.append({'point': study.label[setting], 'statistic': s.key, 'seeds': len(runs),
                         'n': res['n'], 'est': res['est'], 'lo': res['lo'], 'hi': res['hi'],
                         'value': shown(s, res), 'verdict': res['verdict']})
    return rows, trends(study, points, found)


def axes(points):
    """The settings varying between points but a constant multiple of an earlier one (lr / 10)."""
    cfgs = [runs[0].settings for runs in points.values()]
    def numeric(k):
        return all(type(c.get(k)) in folders.NUMBER and c.get(k) for c in cfgs)
    out = []
    for k in (k for k in varying(cfgs) if k not in control.KEYS):
        def ratio(a):
            return {round(c[k] / c[a], 12) for c in cfgs}
        multiple = any(numeric(a) and numeric(k) and len(ratio(a)) == 1 for a in out)
        if not multiple:
            out.append(k)
    return out


def trends(study, points, found):
    """Per numeric axis, each line of points equal in every other axis: its line_trends."""
    ax, cfg, out = axes(points), {s: runs[0].settings for s, runs in points.items()}, []
    for axis in (a for a in ax if all(type(c.get(a)) in folders.NUMBER for c in cfg.values())):
        def others(s):
            return tuple((a, cfg[s].get(a)) for a in ax if a != axis)
        for fixed, line in group(points, others).items():
            head = {'axis': axis, 'line': ', '.join(f'{a}={v}' for a, v in fixed) or 'all points'}
            at = {s: cfg[s][axis] for s in sorted(line, key=lambda s: cfg[s][axis])}
            out += line_trends(study, found, head, at)
    return out


def line_trends(study, found, head, at):
    """Each statistic's stats.trend over a line's points (at: setting -> its value on the axis; x
    is its log2 where every value is positive), the trend's reading and the point verdicts."""
    log2, out = all(v > 0 for v in at.values()), []
    for key in dict.fromkeys(k for _, k in found):
        have = [s for s in at if found[(s, key)]['values']]
        if len(have) < 2:
            continue
        units = [found[(s, key)]['values'] for s in have]
        fit = stats.trend([math.log2(at[s]) if log2 else at[s] for s in have], units)
        means = [np.mean(u) for u in units]
        out.append({**head, 'members': ' | '.join(study.label[s] for s in have),
                    'statistic': key, **fit,
                    'reading': reading(fit, np.exp(means) if study.stats[key].log else means),
                    'verdicts': ', '.join(found[(s, key)]['verdict'] or '-' for s in have)})
    return out


def side(lo, hi, up, down, neither):
    """The word for an interval: up above 0, down below 0, else neither."""
    return up if lo > 0 else down if hi < 0 else neither


def reading(fit, means):
    """The line (up, down, no clear slope, or not a line by lack of fit) and the monotone trend."""
    line = side(fit['lo'], fit['hi'], 'up', 'down', 'no clear slope')
    if fit['lof_p'] < stats.ALPHA:
        line = 'not a line: point means ' + ', '.join(f'{m:.3g}' for m in means)
    elif fit['points'] == 2:
        line += ' (2 points: no lack-of-fit test)'
    mono = side(fit['rho_lo'], fit['rho_hi'], 'rises monotonically', 'falls monotonically',
                'no monotone trend')
    return f'{line}; {mono}' if np.isfinite(fit['rho_lo']) else line


# ------------------------------------------------------------------------------- the other tables
def control_dose(study):
    """Each paired statistic over an arm's seed pairs, with (d) or (e)'s verdict."""
    dose, paired = [], [s for s in study.stats.values() if 'control' in s.tables]
    for (setting, arm), pairs in study.arms.items():
        kind, target = dict(arm)['control'], dict(arm)['control_target']
        claim = next((c for c in study.claims if c.control == kind), None)
        res = {s.key: judge(s, pairs) for s in paired}
        row = {'setting': study.label[setting], 'arm': study.arm_name(arm), 'n': len(pairs),
               'baseline PR/head': nanmean([b.final(f'pr_{target}_head') for _, b in pairs])}
        row.update({s.key[2:]: shown(s, res[s.key]) for s in paired})
        row['well below'] = bool(res['d_pr_head_rel']['hi'] < WELL_BELOW)
        row.update(predicted(claim, pairs, target))
        dose.append(row)
    return dose


def predicted(claim, pairs, target):
    """The predicted sign's count and the verdict of a kind's claim on an arm's pairs; a kind with
    no claim (a fork's new one) and the mirror get no verdict."""
    if claim is None:
        return {'predicted sign': '-', 'verdict': 'no claim on this kind: no verdict'}
    eff = judge(claim, pairs)
    k = sum(v * claim.sign > 0 for v in eff['values'])
    return {'predicted sign': f"{k}/{eff['n']}",
            'verdict': verdict_text(eff) if target == 'k' else 'mirror: no verdict'}


def dose_fits(study):
    """Per family of 2+ shrink doses: the entropy change on the per-head PR change, alone and with
    the change in log qk_spec_norm; jackknife-t over seeds (a seed's arms share its baseline)."""
    out = []
    for (setting, rest), keys in families(study.arms, 'shrink').items():
        if len(keys) < 2:
            continue
        pairs = [p for k in keys for p in study.arms[k]]
        def over_pairs(key):
            return [study.stats[key].fn(p, View()) for p in pairs]
        y, seeds = over_pairs('d_entropy'), [c.seed for c, _ in pairs]
        pr_k, scale = over_pairs('d_pr_head'), over_pairs('d_log_qk_spec_norm')
        one = stats.fit_groups(y, pr_k, seeds)
        two = stats.fit_groups(y, np.column_stack([pr_k, scale]), seeds)
        doses = ' '.join(f"{dict(k[1])['shrink_to']:g}" for k in keys)
        row = {'setting': study.label[setting], 'arm': study.arm_name(rest), 'doses': doses,
               'pairs': len(pairs)}
        for name, fit, i in (('slope', one, 1), ('pr_coef', two, 1), ('scale_coef', two, 2)):
            row.update({name: fit['coef'][i], f'{name}_lo': fit['lo'][i],
                        f'{name}_hi': fit['hi'][i]})
        row['entropy follows PR_K'] = side(row['pr_coef_lo'], row['pr_coef_hi'], 'follows',
                                           'goes against', 'undecided')
        out.append(row)
    return out


def runs_rows(study):
    rows = [{'run': r.name, 'setting': study.label[r.setting], 'seed': r.seed,
             'arm': study.arm_name(r.arm), 'records': len(r.iters),
             'last_iter': int(r.iters[-1]) if len(r.iters) else None,
             'train_loss': r.final_loss('train_loss'), 'val_loss': r.final_loss('val_loss'),
             'wall_time': r.done.get('wall_time'), 'notes': len(r.notes), 'path': r.path}
            for r in study.runs]
    return rows + [{'run': os.path.basename(p), 'path': p, 'notes': f'skipped: {why}'}
                   for p, why in study.skipped]


def setting_rows(study):
    groups, rows = group(study.runs, lambda r: r.setting), []
    keys = varying([rs[0].settings for rs in groups.values()])
    for s, rs in groups.items():
        seeds = ' '.join(str(r.seed) for r in rs)
        row = {'setting': study.label[s], 'runs': len(rs), 'seeds': seeds}
        rows.append({**row, **{k: rs[0].settings.get(k) for k in keys}})
    return rows


def token_rows(study):
    """A row per model of each source: its checkpoints and the statistics of (f1), (f2)."""
    rows = []
    for source, runs in models(study).items():
        for r in runs:
            steps = r.iters[checkpoints(r)]
            row = {'source': source, 'model': r.name, 'setting': study.label.get(r.setting, r.name),
                   'seed': r.seed, 'checkpoints': len(steps),
                   'first_step': int(steps[0]) if len(steps) else None,
                   'last_step': int(steps[-1]) if len(steps) else None}
            rows.append({**row, **{c.key: c.fn(r, View()) for c in study.claims if c.unit == 'model'}})
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
    # the registries, as analyze.py passes them (analyze.registries)
    claims: list = ()           # the paper's claims, in the claims table's order
    stats: dict = None          # every Stat and Claim by key
    family: tuple = ()          # the claims Holm adjusts over
    lenses: dict = None
    windows: dict = None
    references: dict = None
    sections: tuple = ()        # the exploratory sections: fn(study) -> {table stem: rows}

    def arm_name(self, arm):
        return control.label(dict(arm), self.arm_keys)


def sort_key(value):
    """Orders a setting's values: numbers by size, the rest by their JSON text, absent last."""
    if type(value) in folders.NUMBER:
        return (0, value, '')
    return (1, 0, json.dumps(value)) if value is not None else (2, 0, '')


def by_value(runs):
    """The runs, settings in the order of their values (keys in config order), then seed; ranks."""
    settings = {r.setting: r.settings for r in runs}
    keys = varying(list(settings.values()))
    def key(s):
        return tuple(sort_key(settings[s].get(k)) for k in keys)
    rank = {s: i for i, s in enumerate(sorted(settings, key=key))}
    return sorted(runs, key=lambda r: (rank[r.setting], r.seed)), rank


def load(paths, registries, out=None, from_iter=None, log=print):
    """The Study of the run folders under paths, before any table; notes go to log."""
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')
    loaded, skipped = folders.load_runs(paths, warn)
    series = [r for r in loaded if r.pretrained]
    runs, rank = by_value([r for r in loaded if not r.pretrained])
    study = Study(list(paths), out or os.path.join(paths[0], 'analysis'), runs, skipped, warnings,
                  series, from_iter, **registries)
    groups = group(runs, lambda r: r.setting)
    cfgs = [rs[0].settings for rs in groups.values()]
    names = labels(cfgs, varying(cfgs), [r.settings for r in uncontrolled(runs)])
    study.label, study.arms = dict(zip(groups, names)), arms(runs, rank)
    controlled = [dict(r.arm) for r in runs if r.control != 'none']
    named = ('control', 'control_target', 'control_keep', *control.DOSES)   # in the label
    study.arm_keys = [k for k in varying(controlled) if k not in named]
    paired = {c for pairs in study.arms.values() for c, _ in pairs}
    for r in (r for r in runs if r.control != 'none' and r not in paired):
        warn(f'{r.path}: no control=none run with the same other settings and seed: left out of '
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
    for section in study.sections:
        study.tables.update(section(study))
    return study



# ----------------------------------------------------------------------------- sets of runs
def stack(runs, key, its=None):
    """(its, default all runs'; (runs, its, layers[, heads]) of key, NaN where not logged)."""
    if its is None:
        its = reduce(np.union1d, [r.iters for r in runs], np.zeros(0, int))
    its = np.asarray(its)
    shape = next((r.m[key].shape[2:] for r in runs if key in r.m), ())
    out = np.full((len(runs), len(its), runs[0].n_layer if runs else 0) + shape, np.nan)
    for a, r in (x for x in zip(out, runs) if key in x[1].m):
        have = np.isin(its, r.iters)
        a[have] = r.m[key][np.searchsorted(r.iters, its[have])]
    return its, out


def undosed(arm):
    """An arm's (key, value) pairs without its dose: what the arms of one family share."""
    return tuple(x for x in arm if x[0] not in control.DOSES)


def families(arms, kind=None):
    """{(setting, arm without its dose): [arm keys]} of arms, of one control kind or all."""
    return group([k for k in arms if kind in (None, dict(k[1])['control'])],
                 lambda k: (k[0], undosed(k[1])))


def varying(dicts):
    """The keys whose values differ between the dicts (absent differs)."""
    return [k for k in dict.fromkeys(k for d in dicts for k in d)
            if len({json.dumps(d.get(k)) for d in dicts}) > 1]


def labels(dicts, keys, reference=None):
    """Per dict, its values of keys unlike the most common in reference (or dicts), or 'base'."""
    common = {}
    for k in keys:
        counts = Counter(json.dumps(d.get(k)) for d in reference or dicts)
        (top, n), *rest = counts.most_common(2) + [('', 0)]
        common[k] = top if n > rest[0][1] else None
    def unlike(d):
        return [f'{k}={d.get(k)}' for k in keys if json.dumps(d.get(k)) != common[k]]
    return [', '.join(unlike(d)) or 'base' for d in dicts]




# ------------------------------------------------------------------------ a result as text
def signed(v):
    """v with its sign, 4 significant digits (scientific where that would show only zeros)."""
    if not np.isfinite(v) or v == 0:
        return f'{v:g}'
    return f'{v:+.3e}' if abs(v) < 1e-4 else f'{v:+.4g}'


def shown(stat, res):
    """'+0.55 [+0.52, +0.58], n = 37'; a share '12/54 = 22% [13%, 35%], 3 seeds; mirror 0/54'."""
    if not res.get('n'):
        return 'not logged'
    if stat.unit == 'trajectory':
        share = interval_text(res['est'], res['lo'], res['hi'], lambda v: f'{v:.0%}')
        mirror = f"mirror {res['mirror']}/{res['n']}"
        return f"{res['hits']}/{res['n']} = {share}, {res['seeds']} seeds; {mirror}"
    number = (lambda v: f'{v:.4g}') if stat.log or stat.key.endswith('loss') else signed
    return f"{interval_text(res['est'], res['lo'], res['hi'], number)}, n = {res['n']}"


def interval_text(est, lo, hi, number=None):
    """'est [lo, hi]' in number's format; words where a value cannot be computed."""
    number = number or signed
    if not np.isfinite(est):
        return 'not measured'
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return f'{number(est)} (no interval)'
    return f'{number(est)} [{number(lo)}, {number(hi)}]'


def verdict_text(res):
    return res['verdict'] + (f" ({res['why']})" if res.get('why') else '')
