"""
The study's exploratory sections: what sets a head's sharpness, where a key control in one layer
acts, and whether the claims keep their verdicts on a second text. Outside the claims and Holm.

    a new section:  def my_section(study): return {'my_table': rows}, then its name in EXPLORATORY;
                    each table is written as .csv and .md and listed in REPORT.md

A run's per-head value is the mean of its last FINAL_LOGS records, as the claims table reads a
control arm, so an arm's effect is one number in every table. Layer is a factor throughout: the
layers of a model differ in entropy and logit spread more than the heads of one layer do, so a
link pooled across layers can be a difference between layers. A study's README says which of
these statistics it fixed before its runs and what would read which way.
"""
import json
import math

import numpy as np

import control
from plumbing import engine, stats
from plumbing.engine import group
from plumbing.folders import FINAL_LOGS

NO_EFFECT = 0.02      # nats: an arm's dH inside +/- this is no effect (the control claims' margin)
LINK_BAND = 0.1       # a partial link inside +/- this goes no further than the spread (claim (c)'s)
ONLY_SPREAD_R2 = 0.8  # model 1's uncentred R^2 that "only through the spread" asks for
MEDIATORS = ('log logit_std', 'log qk_fro_norm', 'log qk_spec_norm', 'logit_margin',
             'logit_kurtosis')
CANDIDATES = MEDIATORS + ('log pr_k', 'log pr_qk', 'qk_eig_mean')
ROUTES = {'spread': ('log logit_std',), 'shape': ('logit_margin', 'logit_kurtosis')}
SPREAD_AND_SHAPE = ROUTES['spread'] + ROUTES['shape']
CARRIES = 0.2         # a route carries an effect when its share's interval lies above this


def late_heads(run, key):
    """(layers, heads) of key's per-head values, the mean of the last FINAL_LOGS records (of its
    log for a 'log ' key); None where the run does not log it."""
    values = run.m.get(f"{key.removeprefix('log ')}_heads")
    if values is None:
        return None
    late = values[-FINAL_LOGS:].mean(0)
    return np.log(late) if key.startswith('log ') else late


def spread_runs(study):
    """The runs that log logit_std per head, with at least one record."""
    return [run for run in study.runs if 'logit_std_heads' in run.m and len(run.iters)]


def logged_by_all(runs, keys):
    return [key for key in keys if all(late_heads(run, key) is not None for run in runs)]


# ---------------------------------------------------------------------------- what sets entropy
def what_sets_entropy(study):
    """Across heads within layers, the predictors with layer intercepts, and the key control's
    mediation with one unit per (seed pair, layer), over the runs that log logit_std."""
    runs = spread_runs(study)
    if not runs:
        return {}
    tables = {'entropy_heads': across_heads(runs)}
    if len({run.seed for run in runs}) >= 2:
        tables['entropy_predictors'] = predictor_rows(runs)
    units = layer_units(study, [(arm, pairs) for (setting, arm), pairs in study.arms.items()
                                if dict(arm)['control_target'] == 'k'])
    if units:
        fits, slopes, shares = mediation_rows(units)
        fits[0]['only through the spread'] = only_through_spread(fits[0], shares)
        tables.update(entropy_mediation=fits, entropy_slopes=slopes, entropy_share=shares,
                      entropy_pairs=unit_rows(units))
    return tables


def layer_ranks(run, key):
    """key's ranks among the heads of each layer, centred in their layer, over the run's heads."""
    ranked = stats.ranks(late_heads(run, key))
    return (ranked - ranked.mean(1, keepdims=True)).ravel()


def across_heads(runs):
    """Per run over its heads, ranked within their layer: the Spearman of entropy with log
    logit_std, and the partial Spearman of each other candidate with entropy given log logit_std;
    each where some run defines it."""
    rows = [{**link_row(runs, layer_ranks, 'entropy', 'log logit_std'), 'reading': ''}]
    beyond = 'beyond the spread (a correlation)'
    for key in logged_by_all(runs, CANDIDATES[1:]):
        row = link_row(runs, layer_ranks, key)
        row['reading'] = against_band(row['lo'], row['hi'], LINK_BAND,
                                      'no further than the spread', beyond, beyond)
        rows.append(row)
    return [row for row in rows if row['runs']]


def link_row(runs, ranked, key, other=None):
    """The Spearman of key with other, or without other the partial Spearman of key with entropy
    given log logit_std, over the heads ranked(run, key) ranks: its mean over runs, t interval
    clipped to a correlation's [-1, 1]."""
    if other:
        statistic = f'Spearman of {key} with {other}'
        values = [stats.pearson_rows(ranked(run, key), ranked(run, other)) for run in runs]
    else:
        statistic = f'partial Spearman of {key} with entropy | log logit_std'
        values = [stats.partial_rows(ranked(run, key), ranked(run, 'entropy'),
                                     ranked(run, 'log logit_std')) for run in runs]
    mean, low, high, count = stats.t_interval([value for value in values if np.isfinite(value)])
    return {'statistic': statistic, 'mean': mean, 'lo': max(low, -1.0), 'hi': min(high, 1.0),
            'runs': count}


def against_band(low, high, band, inside, above, below):
    """An interval read against +/- band: inside it, wholly above it, wholly below it, else
    undecided (as is an interval that is not finite)."""
    if -band <= low and high <= band:
        return inside
    return engine.side(low - band, high + band, above, below, 'undecided')


def predictor_rows(runs):
    """Per candidate, and the spread with the row shape together: R^2 of entropy across heads on
    it beside one intercept per layer, fitted on all seeds but one and read on that seed's heads;
    'layer alone' is the intercepts' own."""
    candidates = {'layer alone': ()}
    candidates.update({key: (key,) for key in logged_by_all(runs, CANDIDATES)})
    if logged_by_all(runs, SPREAD_AND_SHAPE) == list(SPREAD_AND_SHAPE):
        candidates[', '.join(SPREAD_AND_SHAPE)] = SPREAD_AND_SHAPE
    return [{'predictor': name, **held_out_r2(*head_design(runs, keys))}
            for name, keys in candidates.items()]


def head_design(runs, keys):
    """Across the heads of runs: entropy; one intercept per layer (a layer of a depth) beside the
    columns of keys; each head's seed."""
    layers = sorted({(run.n_layer, layer) for run in runs for layer in range(run.n_layer)})
    entropy, columns, seeds = [], [], []
    for run in runs:
        found = [late_heads(run, key) for key in ('entropy', *keys)]
        own = [layers.index((run.n_layer, layer)) for layer in range(run.n_layer)]
        intercepts = np.repeat(np.eye(len(layers))[own], found[0].shape[1], axis=0)   # per head
        entropy.append(found[0].ravel())
        columns.append(np.column_stack([intercepts, *(value.ravel() for value in found[1:])]))
        seeds += [run.seed] * len(intercepts)
    return np.concatenate(entropy), np.concatenate(columns), np.array(seeds)


def held_out_r2(entropy, design, seeds):
    """R^2 on each seed's heads of the fit on the other seeds: mean, lowest and highest."""
    scores = []
    for held in np.unique(seeds):
        fit = stats.solve(design[seeds != held], entropy[seeds != held])
        error = entropy[seeds == held] - design[seeds == held] @ fit
        spread = entropy[seeds == held] - entropy[seeds == held].mean()
        with np.errstate(divide='ignore', invalid='ignore'):   # heads all alike: not measured
            scores.append(1 - (error @ error) / (spread @ spread))
    return {'heads': len(entropy), 'R2_held_out': float(np.mean(scores)),
            'lowest': float(np.min(scores)), 'highest': float(np.max(scores))}


def layer_units(study, chosen):
    """One unit per (seed pair, layer) of the chosen (arm, pairs): the change, controlled -
    baseline, of the layer's mean over heads of entropy, log PR_K and each mediator every run
    logs; with the unit's arm, pair, seed and layer ('0 of 4'). {} where no pair logs logit_std."""
    pairs = [(arm, pair) for arm, arm_pairs in chosen for pair in arm_pairs
             if all(late_heads(run, 'logit_std') is not None for run in pair)]
    mediators = logged_by_all([run for arm, pair in pairs for run in pair], MEDIATORS)
    found = []
    for number, (arm, (controlled, baseline)) in enumerate(pairs):
        for layer in range(controlled.n_layer):
            unit = {'arm': study.arm_name(arm), 'pair': number, 'seed': controlled.seed,
                    'layer': f'{layer} of {controlled.n_layer}'}
            for key in ('entropy', 'log pr_k', *mediators):
                unit[key] = (late_heads(controlled, key)[layer].mean()
                             - late_heads(baseline, key)[layer].mean())
            found.append(unit)
    return {key: np.array([unit[key] for unit in found]) for key in found[0]} if found else {}


def mediation_rows(units):
    """Per mediator m over the units: dH = b_l dm (model 1) and dH = b_l dm + c dK (model 2), a
    slope b_l per layer, dK the change of log PR_K, no intercept (a pair of equal runs changes
    nothing), jackknife-t over seeds, uncentred R^2. Then per arm the share of its dH that goes
    through m: the mean over its units of model 1's b_l dm over the mean of dH."""
    fits, slopes, shares = [], [], []
    entropy, seeds, arms = units['entropy'], units['seed'], units['arm']
    layers = list(dict.fromkeys(units['layer']))
    in_layer = (units['layer'][:, None] == np.array(layers)).astype(float)
    for mediator in [key for key in MEDIATORS if key in units]:
        slope_only = in_layer * units[mediator][:, None]
        with_key = np.column_stack([slope_only, units['log pr_k']])
        first = stats.jackknife(lambda keep: stats.solve(slope_only[keep], entropy[keep]), seeds)
        second = stats.jackknife(lambda keep: stats.solve(with_key[keep], entropy[keep]), seeds)
        fits.append({'mediator': mediator, 'units': len(entropy),
                     'R2_1': uncentred_r2(entropy, slope_only), 'c_dlogPR_K': second[0][-1],
                     'c_lo': second[1][-1], 'c_hi': second[2][-1],
                     'R2_2': uncentred_r2(entropy, with_key), 'only through the spread': ''})
        for index, layer in enumerate(layers):
            slopes.append({'mediator': mediator, 'layer': layer, 'b1': first[0][index],
                           'b1_lo': first[1][index], 'b1_hi': first[2][index],
                           'b2': second[0][index]})
        for arm in dict.fromkeys(arms):
            shares.append({'mediator': mediator, 'arm': arm,
                           **arm_share(units, slope_only, arms == arm)})
    return fits, slopes, shares


def uncentred_r2(target, design):
    """1 - sum e^2 / sum target^2 of target's least-squares fit on design, no intercept."""
    residual = target - design @ stats.solve(design, target)
    return 1 - float(residual @ residual) / float(target @ target)


def arm_share(units, design, in_arm):
    """An arm's dH (per pair the mean over its layers, t interval over pairs), the mean change of
    the mediator, and the share of dH through it, jackknife-t over seeds."""
    entropy, seeds = units['entropy'], units['seed']
    def share(keep):
        slopes = stats.solve(design[keep], entropy[keep])
        with np.errstate(divide='ignore', invalid='ignore'):   # no change: no share (not measured)
            return (design[keep & in_arm] @ slopes).mean() / entropy[keep & in_arm].mean()
    per_pair = [entropy[units['pair'] == pair].mean() for pair in np.unique(units['pair'][in_arm])]
    mean, low, high, count = stats.t_interval(per_pair)
    through, through_low, through_high = stats.jackknife(share, seeds)
    return {'pairs': count, 'dH': mean, 'dH_lo': low, 'dH_hi': high,
            'effect': bool(low > NO_EFFECT or high < -NO_EFFECT),
            'd_mediator': float(design[in_arm].sum(1).mean()), 'share': float(through),
            'share_lo': float(through_low), 'share_hi': float(through_high)}


def only_through_spread(fit, shares):
    """The reading of model 2's c, the arms' shares and model 1's R^2 with m = log logit_std:
    'yes', 'refuted' (and why) or 'undecided'."""
    arms = [row for row in shares if row['mediator'] == fit['mediator'] and row['effect']]
    refuted = []
    if fit['c_lo'] > 0 or fit['c_hi'] < 0:
        refuted.append("PR_K's change acts beyond the spread (c's interval excludes 0)")
    refuted += [f"the share of {row['arm']} lies below 1" for row in arms if row['share_hi'] < 1]
    if refuted:
        return 'refuted: ' + '; '.join(refuted)
    holds = (fit['c_lo'] <= 0 <= fit['c_hi'] and fit['R2_1'] >= ONLY_SPREAD_R2
             and all(row['share_lo'] <= 1 <= row['share_hi'] for row in arms))
    return 'yes' if holds else 'undecided'


def unit_rows(units):
    """The units the mediation reads, a row each."""
    names = {'arm': 'arm', 'seed': 'seed', 'layer': 'layer', 'entropy': 'dH',
             'log pr_k': 'd log PR_K'}
    names.update({key: f'd {key}' for key in MEDIATORS if key in units})
    columns = [units[key].tolist() for key in names]
    return [dict(zip(names.values(), values)) for values in zip(*columns)]


# ------------------------------------------------------------------ the key control in one layer
def layer_effects(study):
    """Per arm with control_layers set and per layer: dH (the layer's mean entropy over the last
    FINAL_LOGS records, controlled - baseline) over the arm's seed pairs, read against NO_EFFECT."""
    rows = []
    for (setting, arm), pairs in study.arms.items():
        chosen = dict(arm).get('control_layers', '')
        if not chosen:
            continue
        controlled = control.parse_layers(chosen, pairs[0][0].n_layer)
        for layer in range(pairs[0][0].n_layer):
            changes = [run.final('entropy', [layer]) - base.final('entropy', [layer])
                       for run, base in pairs]
            mean, low, high, count = stats.t_interval(changes)
            reading = against_band(low, high, NO_EFFECT, 'stays', 'moves up', 'moves down')
            rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                         'layer': layer, 'controlled': layer in controlled, 'pairs': count,
                         'dH': mean, 'lo': low, 'hi': high, 'reading': reading})
    return {'entropy_layers': rows}


def layer_targeted(study):
    """{baseline setting: [(arm, pairs)]}: the arms with control_layers whose runs log the
    logit rows' shape (margin, kurtosis)."""
    found = {}
    for (setting, arm), pairs in study.arms.items():
        logged = all(late_heads(run, 'logit_margin') is not None for pair in pairs for run in pair)
        if dict(arm).get('control_layers', '') and logged:
            found.setdefault(setting, []).append((arm, pairs))
    return found


def none_runs(study, settings):
    return [run for run in engine.uncontrolled(study.runs) if run.setting in settings]


def route_rows(study):
    """Entropy across the none runs' heads on log logit_std (spread), and on it with the row's
    margin and kurtosis (shape), one intercept a layer, R^2 on held-out seeds; then each
    layer-targeted arm's controlled layer: the share of its dH that each route's coefficients (of
    the shape fit) times the pair's changes predict, jackknife-t over seeds. Each setting with
    such arms is fitted on its own none runs."""
    keys, fits, shares = SPREAD_AND_SHAPE, [], []
    for setting, arms in layer_targeted(study).items():
        base = none_runs(study, [setting])
        if len({run.seed for run in base}) < 2:
            continue
        for route, chosen in (('spread', ROUTES['spread']), ('shape', keys)):
            fits.append({'setting': study.label[setting], 'route': route,
                         **held_out_r2(*head_design(base, chosen))})
        entropy, design, seeds = head_design(base, keys)
        coefficients = dict(zip(keys, stats.solve(design, entropy)[-len(keys):]))
        for arm, pairs in arms:
            shares += arm_routes(study, setting, arm, pairs, coefficients)
    return {'entropy_routes_fit': fits, 'entropy_routes': shares}


def arm_routes(study, setting, arm, pairs, coefficients):
    """Per controlled layer of an arm: its dH and each route's share, jackknife-t over seeds."""
    rows, seeds = [], np.array([run.seed for run, baseline in pairs])
    for layer in control.parse_layers(dict(arm)['control_layers'], pairs[0][0].n_layer):
        def change(key):
            means = [late_heads(run, key)[layer].mean() for pair in pairs for run in pair]
            return np.array(means[0::2]) - np.array(means[1::2])
        entropy = change('entropy')
        low, high = stats.t_interval(entropy)[1:3]
        moves = low > NO_EFFECT or high < -NO_EFFECT   # a route is read only where the layer moves
        for route, keys in ROUTES.items():
            predicted = sum(coefficients[key] * change(key) for key in keys)
            def share(keep):
                with np.errstate(divide='ignore', invalid='ignore'):   # no change: no share
                    return predicted[keep].mean() / entropy[keep].mean()
            through, low, high = stats.jackknife(share, seeds)
            reading = against_band(low, high, CARRIES, 'carries none', 'carries', 'undecided')
            if not moves:
                reading = 'not read: the layer does not move'
            rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                         'layer': layer, 'pairs': len(pairs), 'dH': float(entropy.mean()),
                         'route': route, 'share': float(through), 'lo': float(low),
                         'hi': float(high), 'reading': reading})
    return rows


def layer_mediation(study):
    """Per layer-targeted arm and mediator m, over its (seed pair, layer) units: model 2 of
    mediation_rows, dH = b_l dm + c dK; c with its interval: the key spectrum acts beyond m where
    it excludes 0."""
    rows = []
    for setting, arms in layer_targeted(study).items():
        for arm, pairs in arms:
            for fit in mediation_rows(layer_units(study, [(arm, pairs)]))[0]:
                low, high = fit['c_lo'], fit['c_hi']
                reading = engine.side(low, high, 'beyond m', 'beyond m', 'not beyond m')
                if not np.isfinite([low, high]).all():
                    reading = 'undecided (no interval)'
                rows.append({'setting': study.label[setting], 'arm': study.arm_name(arm),
                             'mediator': fit['mediator'], 'units': fit['units'],
                             'c_dlogPR_K': float(fit['c_dlogPR_K']), 'lo': float(low),
                             'hi': float(high), 'reading': reading})
    return {'entropy_layer_mediation': rows}


def self_match(study):
    """Across the none runs' heads within each layer (descriptive): the partial Spearman of
    qk_eig_mean with entropy given log logit_std, and its Spearman with self_top."""
    rows = []
    for setting in layer_targeted(study):
        runs = none_runs(study, [setting])   # an arm's setting is its baseline's: never empty
        for layer in range(runs[0].n_layer):
            def ranked(run, key):
                return stats.ranks(late_heads(run, key)[layer])
            for other in (None, 'self_top'):
                rows.append({'setting': study.label[setting], 'layer': layer,
                             **link_row(runs, ranked, 'qk_eig_mean', other)})
    return {'entropy_self_match': rows}


# --------------------------------------------------------------------------------- a second text
SAME_SIZE = {'b': 0.25, 'd': 0.03, 'e': 0.03}   # results/sotu-wide/README.md fixed these


def across_texts(study):
    """Claims (b), (d), (e) on each text of runs that differ in their text alone, and how they
    compare: the verdicts kept or changed, and the difference of the two texts' mean units with a
    two-sample (Welch) interval read against SAME_SIZE."""
    texts = group_by_text(study)
    if len(texts) != 2:
        return {}
    rows = []
    for key, size in SAME_SIZE.items():
        first, second = (text_claim(study, key, settings) for settings in texts.values())
        if first is None or second is None:
            continue
        difference, low, high = welch(second['values'], first['values'])
        reading = against_band(low, high, size, 'the same', 'different', 'different')
        rows.append({'claim': key, 'text 1': first['text'], 'verdict 1': first['verdict'],
                     'text 2': second['text'], 'verdict 2': second['verdict'],
                     'verdicts': kept(first['verdict'], second['verdict']),
                     'difference (2 - 1)': difference, 'lo': low, 'hi': high, 'size': reading})
    return {'across_texts': rows}


def group_by_text(study):
    """{data_sha256: the settings of its runs} where the runs' settings but their control arm
    differ in the text alone; {} otherwise."""
    if set(engine.varying([json.loads(run.base) for run in study.runs])) - {'data_sha256'}:
        return {}
    texts = group(study.runs, lambda run: run.settings.get('data_sha256'))
    return {text: {run.setting for run in runs} for text, runs in texts.items()}


def text_claim(study, key, settings):
    """A claim judged on one text's runs: (b) over its uncontrolled runs, (d) and (e) on the spec
    arm the claims table reads; its verdict word and unit values."""
    claim = study.stats.get(key)
    if claim is None:
        return None
    plain = none_runs(study, settings)
    units, view = plain, engine.own_view(claim, study)
    if claim.unit == 'pair':
        found = [pairs for setting, arm, pairs, dose in engine.deciding(claim, study, 'spec')
                 if setting in settings and pairs]
        units, view = (found[0] if found else []), engine.View()
    judged = engine.judge(claim, units, view) if units else None
    if judged is None or not judged['n']:
        return None
    # a judged pair's baseline is a none run of these settings: plain is not empty
    return {'text': study.label[plain[0].setting], 'verdict': judged['verdict'],
            'values': np.array(judged['values'], float)}


def kept(first, second):
    if 'undecided' in (first, second):
        return 'undecided'
    return 'kept' if first == second else 'changed'


def welch(values, others):
    """The difference of two samples' means with its 95% Welch interval."""
    difference = float(values.mean() - others.mean())
    if min(len(values), len(others)) < 2:
        return difference, math.nan, math.nan
    variance, variance_other = values.var(ddof=1) / len(values), others.var(ddof=1) / len(others)
    spread = variance ** 2 / (len(values) - 1) + variance_other ** 2 / (len(others) - 1)
    half = 0.0   # two samples without spread: their difference is exact
    if spread > 0:
        freedom = (variance + variance_other) ** 2 / spread   # Welch-Satterthwaite
        half = stats.critical(freedom) * math.sqrt(variance + variance_other)
    return difference, difference - half, difference + half


def token_layers(study):
    """(f2) per layer of each pretrained series: Spearman of tok_pr_qk with entropy across the
    layer's heads at the last checkpoint (heads of one layer, one model)."""
    rows = []
    for series in study.series:
        if not {'tok_pr_qk_heads', 'entropy_heads'} <= set(series.m):
            continue
        rank, entropy = (series.m[key][-1] for key in ('tok_pr_qk_heads', 'entropy_heads'))
        for layer in range(series.n_layer):
            rows.append({'model': series.name, 'step': int(series.iters[-1]), 'layer': layer,
                         'heads': rank.shape[-1], 'f2 within the layer': stats.spearman(
                             rank[layer], entropy[layer])})
    return {'token_layers': rows}


# The sections in the order REPORT.md lists their tables: fn(study) -> {table stem: rows}
EXPLORATORY = (token_layers, what_sets_entropy, layer_effects, route_rows, layer_mediation,
               self_match, across_texts)
