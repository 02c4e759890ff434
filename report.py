"""
The claims report: each claim of the study, the statistic it is judged on, the rule that turns that statistic
into a verdict (holds, does not hold, mixed, not measured; the rule's text is printed into REPORT.md beside
it), and REPORT.md itself. analyze.py computes the tables and hands their rows here; nothing here reads a run.
"""
import math
import os
import re
import time

import numpy as np

import regime
from folders import markdown_table
from stats import BOOT_SEED, LEVEL, N_BOOT, N_PERM, mean_ci

HOLDS, FAILS, MIXED, NOT_MEASURED = 'holds', 'does not hold', 'mixed', 'not measured'
ALPHA = 0.05               # sign-test and permutation-test threshold
SHARE_HOLDS = 0.90         # share-of-trajectories claims hold at or above this share ...
SHARE_FAILS = 0.50         # ... and do not hold at or below this one
LINK_MODELS = 2            # "visible in several models": at least this many (and at least half of them)
LINK_MARGIN = 0.1          # (c), (c2): a correlation below this is a negligible link
NEAR_UNIFORM = 0.98        # a record whose layer-mean entropy_norm is at least this has near-uniform attention
WELL_BELOW = 0.20          # (d): a dose moves per-head PR_K well below the baseline when it takes off more than this
MIN_SEEDS = 3              # (a)-(c2) from fewer seeds than this in every configuration: a small sample, marked so
# token level (claims f1, f2): where each source's tables live in the analysis folder
TOKEN_SOURCES = {'tokens': 'our checkpoints', 'pretrained': 'pretrained models'}
# the ways a claim is measured (analyze.py computes a view for each): windows of records, scopes of scale/shape
ALL, FROM_WARMUP = 'all records', 'from warm-up'
ACROSS, OVER_TIME = 'across heads, per checkpoint', 'within runs, over time, per layer'
CHANGES = 'changes across heads, per step'    # (c): changes between consecutive records, across (layer, head) pairs
# the robustness map: its columns, and the claims' own lens (the claims table's), which the later columns vary
LENS_COLUMNS = {'whole-matrix weight PR': 'whole', 'per-head weight PR': 'head', 'token-level PR': 'tok',
                'learned part W - W(0)': 'learned'}
WARMUP_COLUMN, SPEC_COLUMN = 'from warm-up on', 'control_keep=spec (top singular value kept at each step)'
DECAY_COLUMNS = {'no decay on W_Q, W_K': False, 'decay on W_Q, W_K': True}
MAIN_LENS = {'a': 'whole', 'b': 'whole', 'c': 'head', 'c2': 'head'}
MAIN_WINDOW = {'a': ALL, 'b': ALL, 'c': FROM_WARMUP, 'c2': FROM_WARMUP}   # the claims table's window


# ----------------------------------------------------------------------------- verdict rules
# (each printed into the report beside the claims it decides)

SHARE_RULE = (f'holds if >= {SHARE_HOLDS:.0%} of trajectories do; does not hold if <= {SHARE_FAILS:.0%} do; '
              f'else mixed')
EFFECT_RULE = (f'holds if the mean paired difference has the predicted sign, its {LEVEL:.0%} bootstrap interval '
               f'excludes 0 and the sign-test p < {ALPHA}; does not hold if the interval excludes 0 with the '
               f'opposite sign; else mixed')
WINDOW_NOTE = ('from the end of warm-up on (warmup_iters, or --from_iter): before it the weights are still near '
               'their random draw and attention is near uniform, so entropy differs across heads by round-off and '
               'those records would carry the mean; the robustness map keeps all records (the lens columns)')
C_LINKS = ('pr_k~pr_qk', 'pr_k~entropy')    # the two links claim (c) states
LINK_RULE = (f'per head, Spearman of PR_K with PR_QK and of PR_K with entropy (the claim\'s two links; PR_QK with '
             f'entropy is shown beside them) across the (layer, head) pairs of a run, in two scopes that two series '
             f'trending over training cannot fake: levels at each checkpoint (every head has trained as long) and '
             f'changes between consecutive records (a trend every head shares shifts every change alike); per run '
             f'the mean over its checkpoints (steps), {WINDOW_NOTE}. Each of the four tests (two links x two scopes) '
             f'holds if the mean over runs has its {LEVEL:.0%} bootstrap interval (over runs) above +{LINK_MARGIN} '
             f'and more runs are positive than a one-sided sign test allows by chance (p < {ALPHA}), does not hold '
             f'if the interval lies below +{LINK_MARGIN} (at most a negligible link), else mixed; the claim holds if '
             f'all four hold, does not hold if all four do not, else mixed. The within-run correlations over time, '
             f'of levels and of changes (per layer), are descriptive only: series that trend, or slow down, together '
             f'correlate there whatever links them')
C2_RULE = (f'per checkpoint, across its (layer, head) pairs, the partial correlation of entropy with PR_K (per head) '
           f'given log ||W_QK^h||_2 (what is left of each once a linear fit on the log logit scale is taken out), '
           f'set beside the raw correlation of the same family: Pearson for both, since a partial of ranks removes '
           f'only the part of a pure-scale link that is linear in the ranks and leaves the rest in as an upward bias '
           f'that would read as shape beyond scale; per run the mean over its checkpoints, {WINDOW_NOTE}; holds if '
           f'the mean over runs has its {LEVEL:.0%} bootstrap interval (over runs) above +{LINK_MARGIN}, does not '
           f'hold if the interval lies below +{LINK_MARGIN} (at most a negligible link, or a negative one, once the '
           f'scale is held fixed), else mixed')
DOSE_RULE = (f'the dose that decides is the strongest shrink (smallest shrink_to) whose achieved change moves per-head '
             f'PR_K well below the baseline: the paired change of the final pr_k_head, relative to the same-seed '
             f'baseline\'s, has its {LEVEL:.0%} bootstrap interval below -{WELL_BELOW:.0%}; not measured when no '
             f'dose does (a null result from a weak manipulation says little). On that dose: ' + EFFECT_RULE)
FIT_RULE = (f'across the shrink doses x seeds of one keep, least-squares fits of the paired entropy change on the '
            f'change in per-head PR_K (the slope), and on it together with the change in log qk_spec_norm; '
            f'{LEVEL:.0%} intervals from a jackknife that leaves out one seed at a time (the arms of a seed share its '
            f'baseline), with Student\'s t on seeds - 1 degrees of freedom. The entropy effect follows the PR_K '
            f'change once the logit scale is accounted for when the '
            f'joint fit\'s PR_K coefficient has its interval above 0 (less PR_K, lower entropy), goes against it when '
            f'the interval is below 0, else undecided')
LESS_TRAINED_RULE = (f'a softer-attention verdict (e) also says whether the model is less trained: it is when the '
                     f'paired final val_loss difference (controlled - none) has its {LEVEL:.0%} bootstrap interval '
                     f'above 0')
TREND_RULE = (f'per (model, layer) checkpoint series, Spearman of tok_pr_q - tok_pr_k with log(1 + step) over the '
              f'early checkpoints (log step at or below the median of the series) and over the late ones (at or '
              f'above it); the rise holds if the early mean over series is > 0 with a {LEVEL:.0%} bootstrap '
              f'interval (over series) above 0, does not hold if the interval is below 0, else mixed; the decay '
              f'the same with signs reversed on the late mean; the claim holds if both hold, does not hold if both '
              f'do not, else mixed')
TOKEN_LINK_RULE = (f'per model at its last checkpoint, Spearman of tok_pr_qk with entropy across its (layer, head) '
                   f'pairs; the link is visible if the correlation is > 0 with a one-sided permutation p < {ALPHA} '
                   f'({N_PERM} shuffles); holds if visible in at least {LINK_MODELS} models and in at least half of '
                   f'them, does not hold if visible in none, else mixed')


def share_verdict(count, total):
    if not total:
        return NOT_MEASURED
    share = count / total
    return HOLDS if share >= SHARE_HOLDS else FAILS if share <= SHARE_FAILS else MIXED


def interval_verdict(mean, lo, hi, sign, p=None):
    """Rule for an effect with a predicted sign; p (sign test) is required only when given."""
    if not np.isfinite(mean):
        return NOT_MEASURED
    if sign * mean > 0 and min(sign * lo, sign * hi) > 0 and (p is None or p < ALPHA):
        return HOLDS
    if max(sign * lo, sign * hi) < 0:
        return FAILS
    return MIXED


def link_verdict(row):
    """One test of (c), a link_tests row (analyze.link_test_rows), by LINK_RULE."""
    if not np.isfinite(row['mean']):
        return NOT_MEASURED
    if row['ci_lo'] > LINK_MARGIN and row['sign_p'] < ALPHA:
        return HOLDS
    return FAILS if row['ci_hi'] < LINK_MARGIN else MIXED


def well_below(effect):
    """Whether an arm's pr_ctl_head_rel effect (the relative change of the controlled per-head PR) is well below
    the baseline (DOSE_RULE); False without one."""
    return effect is not None and bool(effect['ci_hi'] < -WELL_BELOW)


def effect_verdict(effect, control):
    """EFFECT_RULE on an arm's entropy effect, with the sign its control predicts."""
    return interval_verdict(effect['mean'], effect['ci_lo'], effect['ci_hi'], -1 if control == 'shrink' else +1,
                            effect['sign_p'])


def follows(fit):
    """FIT_RULE on a control_dose_fit row: follows, goes against, undecided or not measured."""
    lo, hi = fit['pr_coef_lo'], fit['pr_coef_hi']
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return NOT_MEASURED
    return 'follows' if lo > 0 else 'goes against' if hi < 0 else 'undecided'


def combine_verdicts(verdicts):
    if all(v == HOLDS for v in verdicts):
        return HOLDS
    if all(v == FAILS for v in verdicts):
        return FAILS
    if all(v == NOT_MEASURED for v in verdicts):
        return NOT_MEASURED
    return MIXED


def models_verdict(count, total):
    if not total:
        return NOT_MEASURED
    if count >= max(LINK_MODELS, total / 2):
        return HOLDS
    return FAILS if count == 0 else MIXED


# ----------------------------------------------------------------------------- claims

def claims(res):
    """The claims of the study as report rows (key, claim, statistic, value, verdict, rule; qualifier and
    plumbing where they apply), from the analysis result res (analyze.analyze): its views for (a)-(c2), the
    control effects of the main setting A for (d), (e), and its 'token' tables found for (f1), (f2)."""
    views, rows = res['views'], []
    for key in ('a', 'b'):
        rows.append(share_claim(key, views[('whole', ALL, None)]))
        rows.append(share_claim(key, views[('whole', FROM_WARMUP, None)], res['from_iter']))
    rows.append(link_claim(views[(MAIN_LENS['c'], MAIN_WINDOW['c'], None)]))
    rows.append(shape_claim(views[(MAIN_LENS['c2'], MAIN_WINDOW['c2'], None)]))
    main = setting_effects(res, 'A')
    for key in ('d', 'e'):
        rows += [effect_claim(key, main, keep, res['final_logs']) for keep in ('fro', 'spec')]
    for row in rows if res['short'] else ():   # the weight study's claims, all from these runs
        row['plumbing'] = row['verdict'] != NOT_MEASURED
    for row in rows if res['few_seeds'] and not res['short'] else ():   # those of the uncontrolled runs
        row['small'] = row['verdict'] != NOT_MEASURED and row['key'].split('-')[0] in ('a', 'b', 'c', 'c2')
    for prefix in TOKEN_SOURCES:
        rows += token_claims(prefix, *res['token'].get(prefix, ([], []))[:2])
    return rows


def setting_effects(res, setting):
    """The control effects of one training setup (analyze's control_effects rows)."""
    return [e for e in res['effects'] if e['setting'] == setting]


def not_logged(view):
    if view['missing']:
        return f'{", ".join(view["missing"])} not logged in these runs'
    start = ', '.join(map(str, view['start']))
    return f'no trajectories (fewer than 2 records from iteration {start} on)' if view['start'] else 'no trajectories'


def share_claim(key, view, from_iter=0):
    """(a) or (b) in one view: the share of its trajectories with Q up and K down, or the gap > 0 throughout."""
    summary, window = view['summary'], view['summary']['window']
    start = f'from iteration {", ".join(map(str, view["start"]))} on' + \
        (' (--from_iter)' if from_iter is not None else ' (warmup_iters)')
    claim, stat = {'a': ('(a) PR_Q grows and PR_K falls over training', 'q_up_k_down'),
                   'b': ('(b) PR_Q - PR_K > 0 along every trajectory', 'gap_positive_throughout')}[key]
    n, c = summary['trajectories'], summary[stat]
    what = {'a': 'PR_Q(end) > PR_Q(start) and PR_K(end) < PR_K(start)',
            'b': 'PR_Q - PR_K > 0 at every logged iteration after 0'}[key]
    return {'key': key if window == ALL else f'{key}-warmup',
            'claim': claim + ('' if window == ALL else ' [from warm-up on]'),
            'statistic': f'share of (depth, init, layer) trajectories (seed means) with {what}; '
                         f'{summary["measure"]}, ' + ('all records' if window == ALL else f'the records {start}'),
            'value': f'{c}/{n} = {c / n:.0%}' if n else not_logged(view),
            'short': f'{c}/{n}' if n else not_logged(view),
            'verdict': share_verdict(c, n), 'rule': SHARE_RULE}


def window_text(view):
    """Which records a view of (c), (c2) uses, and how many of them have near-uniform attention."""
    near, total = view['near_uniform']
    where = 'all records' if view['window'] == ALL else f'records from iteration {", ".join(map(str, view["start"]))}'
    return f'{where} ({total} in all, {near} with near-uniform attention: layer-mean entropy_norm >= {NEAR_UNIFORM})'


def link_claim(view):
    """(c) in one view: the four tests of its two links (C_LINKS) across heads (link_tests rows, each with its
    verdict), and the descriptive within-run links over time beside them."""
    claim = '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy'
    row = {'key': 'c', 'claim': claim, 'rule': LINK_RULE,
           'statistic': 'per head, Spearman of PR_K with PR_QK and with entropy across the (layer, head) pairs of '
                        'each uncontrolled run, levels at each checkpoint and changes between consecutive records; '
                        f'mean over checkpoints (steps), then over runs; {window_text(view)}'}
    tests = [t for t in view['tests'] if t['link'] in C_LINKS]
    if not tests or all(t['verdict'] == NOT_MEASURED for t in tests):
        reason = not_logged(view) if view['missing'] else 'no run with per-head values that vary'
        return {**row, 'value': reason, 'short': reason, 'verdict': NOT_MEASURED}
    scope = {ACROSS: 'levels', CHANGES: 'changes'}
    values = [f'{scope[t["scope"]]} {t["link"]}: {num(t["mean"])} [{num(t["ci_lo"])}, {num(t["ci_hi"])}], '
              f'{t["runs_positive"]}/{t["n_runs"]} runs > 0 ({t["verdict"]})' for t in tests]
    pooled = view['link_rows'][-1] if view['link_rows'] else {}
    described = [f'{what} {num(pooled[name])}' for what, name in (('levels', 'pr_k~entropy'),
                                                                   ('changes', 'dpr_k~dentropy')) if name in pooled]
    if described:
        values.append('descriptive, within runs over time: pr_k~entropy ' + ', '.join(described))
    return {**row, 'value': '; '.join(values), 'verdict': combine_verdicts([t['verdict'] for t in tests]),
            'short': ', '.join(f'{name} ' + '/'.join(num(t['mean']) for t in tests if t['link'] == name)
                               for name in C_LINKS) + ' (levels/changes)'}


def shape_claim(view):
    """(c2) in one view: its pooled partial correlation across heads, per checkpoint."""
    row = {'key': 'c2', 'claim': '(c2) the key spectrum\'s shape tracks entropy beyond the logit scale',
           'statistic': 'per checkpoint across (layer, head) pairs: Pearson partial correlation of entropy with PR_K '
                        'given log ||W_QK^h||_2, mean over checkpoints, then over runs; ' + window_text(view),
           'rule': C2_RULE}
    s = view['shape']
    m = s['pr_k~entropy|scale'] if s else float('nan')
    if not np.isfinite(m):
        reason = not_logged(view) if view['missing'] else 'no checkpoint with 4 or more heads that vary'
        return {**row, 'value': reason, 'short': reason, 'verdict': NOT_MEASURED}
    lo, hi = s['pr_k~entropy|scale_lo'], s['pr_k~entropy|scale_hi']
    verdict = HOLDS if lo > LINK_MARGIN else FAILS if hi < LINK_MARGIN else MIXED
    if not np.isfinite(lo):   # one run: no interval
        verdict = MIXED
    return {**row, 'verdict': verdict, 'short': f'{m:+.2f} [{num(lo)}, {num(hi)}]',
            'value': f'partial {m:+.2f} [{num(lo)}, {num(hi)}] over {s["n_runs"]} runs; without holding the scale '
                     f'{num(s["pr_k~entropy"])} [{num(s["pr_k~entropy_lo"])}, {num(s["pr_k~entropy_hi"])}]; entropy '
                     f'~ log scale {num(s["scale~entropy"])}; PR_QK partial {num(s["pr_qk~entropy|scale"])} (all '
                     f'Pearson)'}


def arms(effects, control, keep):
    """The arms of control_target k with this control and keep, each {metric: effect row}, in the effects' order
    (shrink from the weakest dose to the strongest)."""
    found = {}
    for e in effects:
        if (e['target'], e['control'], e['keep']) == ('k', control, keep):
            found.setdefault((e['n_layer'], e['qk_init'], e['arm']), {})[e['metric']] = e
    return list(found.values())


def deciding_arm(key, effects, keep):
    """(the arm that decides (d) or (e) for a keep, why there is none): (e) freeze; (d) the strongest shrink dose
    whose per-head PR_K is well below the baseline (DOSE_RULE)."""
    kind = 'shrink' if key == 'd' else 'freeze'
    found = [a for a in arms(effects, kind, keep) if 'entropy' in a]
    if key == 'e' or not found:
        return (found[0], '') if found else (None, f'no {kind}/none pairs')
    strong = [a for a in found if well_below(a.get('pr_ctl_head_rel'))]
    if strong:
        return min(strong, key=lambda a: a['entropy']['dose']), ''
    achieved = ', '.join(f'{a["entropy"]["dose"]:g}: {percent(a.get("pr_ctl_head_rel"))}' for a in found)
    return None, f'no shrink dose moves per-head PR_K well below the baseline (shrink_to: achieved change {achieved})'


def percent(effect):
    """A relative change with its interval, '-45% [-48%, -41%]'; 'n/a' without one."""
    if effect is None:
        return 'n/a'
    return f'{effect["mean"]:+.0%} [{effect["ci_lo"]:+.0%}, {effect["ci_hi"]:+.0%}]'


def interval(effect):
    return f'{signed(effect["mean"])} [{signed(effect["ci_lo"])}, {signed(effect["ci_hi"])}]'


def effect_claim(key, effects, keep, final_logs):
    """(d) or (e) for one control_keep: the paired entropy effect of the deciding arm (deciding_arm), with its
    achieved change in per-head PR_K and the paired changes of the logit scale, of W_K's top singular value and of
    val_loss; (e), softer attention, also says whether the model is less trained."""
    kind, word = {'d': ('shrink', 'lower'), 'e': ('freeze', 'higher')}[key]
    claim = {'d': '(d) shrinking the key spectrum sharpens attention',
             'e': '(e) freezing the key spectrum softens attention'}[key]
    dose = ' at the strongest dose that moves per-head PR_K well below the baseline' if key == 'd' else ''
    row = {'key': key if keep == 'fro' else f'{key}-{keep}',
           'claim': claim + ('' if keep == 'fro' else ' [control_keep=spec]'),
           'statistic': f'final attention entropy (mean of the last {final_logs} logs and of layers), {kind} - none '
                        f'paired by seed{dose}; predicted {word}', 'rule': DOSE_RULE if key == 'd' else EFFECT_RULE}
    arm, why = deciding_arm(key, effects, keep)
    if arm is None:
        return {**row, 'value': why, 'short': f'{why} with control_keep={keep}', 'verdict': NOT_MEASURED}
    e, loss = arm['entropy'], arm.get('val_loss')
    row['short'] = f'{e["arm"]}: {interval(e)}, {e["n_predicted"]}/{e["n"]}'
    row['value'] = (f'{e["arm"]}: mean {interval(e)}, {e["n_predicted"]}/{e["n"]} {word}, sign test p = '
                    f'{e["sign_p"]:.3g}, directional confidence {e["confidence"]:.2f}; per-head PR_K '
                    f'{percent(arm.get("pr_ctl_head_rel"))}' + ''.join(
                        f'; {name} {interval(arm[name])}' for name in ('qk_spec_norm', 'k_spec_norm', 'val_loss')
                        if name in arm))
    row['verdict'] = effect_verdict(e, kind)
    if key == 'e' and loss:
        trained = 'the model is also less trained' if loss['ci_lo'] > 0 else 'the model is not less trained'
        row['qualifier'] = f'{trained} (val_loss {interval(loss)})'
        row['also'] = LESS_TRAINED_RULE
    return row


# ----------------------------------------------------------------------------- the robustness map

def robustness_map(res):
    """One row per claim (a)-(e) and (c2), one column per way of measuring it (LENS_COLUMNS over all records, then
    the claim's own lens from warm-up on, without and with weight decay on W_Q, W_K, and with control_keep=spec);
    each cell 'verdict (statistic)', or '-' with the reason where the column does not apply."""
    columns = [*LENS_COLUMNS, WARMUP_COLUMN, *DECAY_COLUMNS, SPEC_COLUMN]
    rows = []
    for key in ('a', 'b', 'c', 'c2', 'd', 'e'):
        cells = {column: map_cell(res, key, column) for column in columns}
        name = next(c['claim'] for c in res['claims'] if c['key'] == key)
        rows.append({'key': key, 'claim': name, **cells})
    return rows


def map_cell(res, key, column):
    if column in DECAY_COLUMNS and not res['decays']:
        return '- (needs runs with and without decay)'
    if key in ('d', 'e'):
        if column == SPEC_COLUMN:
            return cell(effect_claim(key, setting_effects(res, 'A'), 'spec', res['final_logs']))
        if column in DECAY_COLUMNS:
            effects = setting_effects(res, res['decays'][DECAY_COLUMNS[column]])
            return cell(effect_claim(key, effects, 'fro', res['final_logs']))
        return '- (final entropy: no PR lens)'
    if column == SPEC_COLUMN:
        return '- (uncontrolled runs)'
    if key in ('c', 'c2') and LENS_COLUMNS.get(column) == 'whole':
        return '- (no per-head PR)'
    lens = LENS_COLUMNS.get(column, MAIN_LENS[key])
    window = FROM_WARMUP if column == WARMUP_COLUMN else ALL if column in LENS_COLUMNS else MAIN_WINDOW[key]
    view = res['views'][(lens, window, DECAY_COLUMNS.get(column))]
    claim = {'a': share_claim, 'b': share_claim}.get(key)
    found = claim(key, view) if claim else link_claim(view) if key == 'c' else shape_claim(view)
    return cell(found)


def cell(claim):
    return f'{claim["verdict"]} ({claim["short"]})'


def claim_label(row):
    return row['claim'].split(' ', 1)[0]


def in_claims(row):
    """Token-level series that enter the claims: uncontrolled, and the q, k the attention uses (after rotary)."""
    return (row.get('control') or 'none') == 'none' and (row.get('rope') or 'none') in ('none', 'after')


def token_claims(prefix, trend, link):
    """Rows (f1) and (f2) for one source of token-level results (TOKEN_SOURCES), from its trend and link rows."""
    source, command = TOKEN_SOURCES[prefix], f'python analyze.py {prefix} ...'
    series = [r for r in trend if in_claims(r)]
    usable = [r for r in series if np.isfinite(r['rho_early']) and np.isfinite(r['rho_late'])]
    f1 = {'key': f'f1-{prefix}', 'claim': f'(f1) token-level PR_Q - PR_K rises early and decays later [{source}]',
          'statistic': 'per (model, layer) series of checkpoints: Spearman of tok_pr_q - tok_pr_k with log(1 + step) '
                       'over the early and the late checkpoints (split at the median log step), mean over series',
          'rule': TREND_RULE}
    if not usable:
        f1.update(value=f'no {prefix} tables (run {command})' if not trend else
                  f'no series with 3 or more early and late checkpoints ({len(series)} series)', verdict=NOT_MEASURED)
    else:
        e, late = mean_ci([r['rho_early'] for r in usable]), mean_ci([r['rho_late'] for r in usable])
        f1['verdict'] = combine_verdicts([interval_verdict(e['mean'], e['lo'], e['hi'], +1),
                                          interval_verdict(late['mean'], late['lo'], late['hi'], -1)])
        models = len({series_of(r) for r in usable})
        f1['value'] = (f"early {e['mean']:+.2f} [{e['lo']:+.2f}, {e['hi']:+.2f}], late {late['mean']:+.2f} "
                       f"[{late['lo']:+.2f}, {late['hi']:+.2f}] over {len(usable)} series of {models} model(s); "
                       f"rise then decay in {sum(bool(r['rise_then_decay']) for r in usable)}/{len(usable)}; median "
                       f"peak position {np.median([r['peak_position'] for r in usable]):.2f} (0 first, 1 last); "
                       f"contrast > 0 at the last checkpoint in {sum(r['contrast_last'] > 0 for r in usable)}/"
                       f"{len(usable)}")
    finals = [r for r in link if r['last'] and in_claims(r) and np.isfinite(r['rho'])]
    visible = [r for r in finals if r['rho'] > 0 and r['p'] < ALPHA]
    f2 = {'key': f'f2-{prefix}', 'claim': f'(f2) token-level interaction rank tracks attention entropy [{source}]',
          'statistic': 'per model at its last checkpoint: Spearman of tok_pr_qk with entropy across (layer, head) '
                       'pairs, one-sided permutation test', 'verdict': models_verdict(len(visible), len(finals)),
          'rule': TOKEN_LINK_RULE}
    if not finals:
        f2['value'] = f'no {prefix} tables (run {command})' if not link else 'no checkpoint with 3 or more heads'
    elif len(finals) <= 6:
        f2['value'] = f'visible in {len(visible)}/{len(finals)}: ' + '; '.join(
            f"{os.path.basename(os.path.normpath(r['model']))} {r['rho']:+.2f} (p {r['p']:.3g})" for r in finals)
    else:
        f2['value'] = (f"visible in {len(visible)}/{len(finals)}; median Spearman "
                       f"{np.median([r['rho'] for r in finals]):+.2f}")
    return [f1, f2]


def series_of(row):
    """The series of a token-level table row (tokens.py): one model's checkpoints, one rope variant."""
    return row['model'], row.get('rope') or 'none'



# ----------------------------------------------------------------------------- REPORT.md

def num(v):
    """A correlation for the report: +0.42, or n/a where it is undefined (a constant series)."""
    return f'{v:+.2f}' if np.isfinite(v) else 'n/a'


def signed(v, decimals=4):
    """v with its sign to `decimals` places, or in scientific notation where that would show only zeros: an
    effect of 2e-8 reads +2.00e-08, never +0.0000."""
    if v == 0 or not math.isfinite(v):
        return f'{v:g}'
    return f'{v:+.2e}' if abs(v) < 0.5 * 10 ** -decimals else f'{v:+.{decimals}f}'


def clip(text, width):
    """text cut to width characters for the console, with '...' where it was cut (REPORT.md has it whole)."""
    return text if len(text) <= width else text[:width - 3] + '...'


def write_report(path, ctx):
    """REPORT.md from the analysis result ctx (analyze.analyze): claims and rules first, the robustness map, then
    the tables behind them, the notes, what is missing and every warning."""
    L = header(ctx) + claims_section(ctx) + map_section(ctx) + link_section(ctx) + shape_section(ctx)
    L += ['## Trajectory summary', '',
          markdown_table(ctx['summaries'], list(ctx['summaries'][0]) if ctx['summaries'] else ['variant'])]
    L += control_section(ctx) + regime.report_lines(ctx['regime'], ctx['figures'])
    L += token_report(ctx['out'], ctx['token'])
    L += ['## Notes: known confounds', ''] + [f'- {n}' for n in ctx['confounds']] + ['']
    if ctx['setting_notes']:
        L += ['## Notes: training setups', ''] + [f'- {n}' for n in ctx['setting_notes']] + ['']
    L += ['## Missing from the planned runs', '']
    if ctx['missing'] is None:
        L += ['No runs.txt found (sweep.sh writes the runs it plans into its output folder): not checked.']
    else:
        L += [f'- {m}' for m in ctx['missing']] or ['- nothing: every run listed in runs.txt has done.json']
    L += ['', '## Skipped runs and warnings', '']
    L += [f'- {w}' for w in ctx['warnings']] or ['- none']
    L += ['', '## Files', '']
    L += [f'- [{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['tables'] if p.endswith('.md')]
    L += [f'- figure skipped: {n}' for n in ctx['figure_notes']]
    L += [''] + [f'![{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['figures'] if p.endswith('.png')]
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


def map_section(ctx):
    columns = [c for c in ctx['map'][0] if c not in ('key', 'claim')] if ctx['map'] else []
    return ['## Robustness map', '',
            'Which conclusion survives which way of measuring. Each cell is the claim\'s verdict by its rule above, '
            'with its statistic, measured one other way: the four PR columns over all records; then the claim\'s '
            'own lens (whole-matrix for (a), (b), per-head for (c), (c2)) from the end of warm-up on, on the runs '
            'without and with weight decay on W_Q, W_K (the main setting of each; (c), (c2) from warm-up on), and '
            '(d), (e) with control_keep=spec. For (c) and (c2), whose claims-table window is from warm-up on, the PR '
            'columns are the other window. The learned part starts after iteration 0, where W - W(0) = 0. "-": the '
            'column does not apply, and why.', '', markdown_table(ctx['map'], ['claim'] + columns)]


def link_section(ctx):
    """The tests of (c) in every lens and window, and the descriptive within-run links beside them."""
    rows = [{**r, 'mean [interval]': f'{num(r["mean"])} [{num(r["ci_lo"])}, {num(r["ci_hi"])}]',
             'runs > 0': f'{r["runs_positive"]}/{r["n_runs"]}'} for r in ctx['link_tests']]
    L = ['## Tests of (c): across heads', '',
         'Per head, the Spearman correlation of entropy with PR_K and PR_QK across the (layer, head) pairs of each '
         'uncontrolled run: of the levels at each checkpoint, and of the changes between consecutive records. '
         'Per run the mean over its checkpoints (steps), then the mean over runs with its interval; share_positive: '
         'the share of positive correlations over every checkpoint (step) of every run. Rule: (c) above.', '',
         markdown_table(rows, ['lens', 'window', 'scope', 'link', 'n_runs', 'mean [interval]', 'runs > 0', 'sign_p',
                               'share_positive', 'verdict']) if rows else 'No per-head values logged: not measured.\n',
         '### Within runs over time (descriptive)', '',
         'Within-run Spearman correlations over the logged iterations, per layer, mean over layers (whole-matrix '
         'PRs, all records), of the levels and of the changes between consecutive records (dpr_k~dentropy). Two '
         'series that both trend over training correlate in levels whatever links them, and two that slow down '
         'together still correlate in their changes: no verdict is taken from these.', '',
         markdown_table(ctx['link_rows'], list(ctx['link_rows'][0]) if ctx['link_rows'] else ['n_layer'])]
    return L


def shape_section(ctx):
    rows = ctx['scale_shape']
    L = ['## Scale against shape', '',
         'Attention entropy falls as the logits grow whatever the spectrum\'s shape, so each link between a PR and '
         'entropy is also given with the logit scale held fixed: |scale is the partial correlation given log '
         '||W_QK^h||_2, scale~entropy the correlation of the log scale with entropy. One family throughout: Pearson '
         'correlations of the values, raw and partial (see the (c2) rule for why not ranks). Across heads at one '
         'checkpoint every head has trained as long; within runs over time (per layer), entropy, PR_K and the '
         'scale all trend, and two trending series correlate whatever links them: those rows are for comparison '
         'only, and (c2) uses the across-head ones. Per-run values: scale_shape_runs.', '']
    names = [c for c in (rows[0] if rows else {}) if '~' in c and not c.endswith(('_lo', '_hi'))]
    shown = [{**{k: r[k] for k in ('lens', 'window', 'scope', 'n_runs')},
              **{n: f'{num(r[n])} [{num(r[n + "_lo"])}, {num(r[n + "_hi"])}]' for n in names}} for r in rows]
    return L + ([markdown_table(shown, ['lens', 'window', 'scope', 'n_runs'] + names)] if rows else
                ['No per-head values logged: not measured.', ''])


CONTROL_TEXT = (
    'What each control keeps. After every optimizer step the control reshapes the spectrum of each head\'s W_K^h '
    'towards its target PR, keeping its singular vectors. control_keep=fro keeps ||W_K^h||_F at that step, so a '
    'narrower spectrum has a larger top singular value and larger logits: shape and scale move together. '
    'control_keep=spec keeps the top singular value that the optimizer step just set (the reshaping leaves it '
    'unchanged), so the reshaping itself changes only the shape; it does not hold the logit scale over training: '
    'training moves ||W_K^h||_2 between steps, W_Q keeps learning, and the final qk_spec_norm and k_spec_norm differ '
    'from the baseline\'s by the amounts below. The dose-response fit accounts for the change in the logit scale '
    'instead of assuming it away. control_target=q (if shown) is the mirror experiment: listed, no verdict.')


def control_section(ctx):
    """The controls as they are, the dose table (every arm against its paired baseline), the dose-response fits and
    fig10; the per-seed and per-metric tables are linked."""
    L = ['## Control experiment', '']
    if not ctx['effects']:
        return L + ['No controlled runs.', '']
    iv = lambda r, name: (f'{signed(r[name])} [{signed(r[name + "_lo"])}, {signed(r[name + "_hi"])}]'
                          if r[name] is not None else 'n/a')
    pct = lambda r: (f'{r["d_pr_ctl_head_rel"]:+.0%} [{r["d_pr_ctl_head_rel_lo"]:+.0%}, '
                     f'{r["d_pr_ctl_head_rel_hi"]:+.0%}]' if r['d_pr_ctl_head_rel'] is not None else 'n/a')
    dose = [{'setting': r['setting'], 'L': r['n_layer'], 'target': r['target'], 'keep': r['keep'], 'arm': r['arm'],
             'n': r['n'], 'baseline PR/head': r['pr_head_none'], 'PR/head change': iv(r, 'd_pr_head'),
             'relative': pct(r), 'well below': r['well_below'], 'qk_spec_norm change': iv(r, 'd_qk_spec_norm'),
             'k_spec_norm change': iv(r, 'd_k_spec_norm'), 'entropy change': iv(r, 'd_entropy'),
             'predicted sign': f'{r["entropy_predicted"]}/{r["n"]}', 'verdict': r['verdict']} for r in ctx['dose']]
    L += [CONTROL_TEXT, '', '### Every arm against its paired baseline (control_dose)', '',
          'Final values (mean of the last logs and of layers), controlled - none paired by seed, mean over seeds '
          f'with its {LEVEL:.0%} bootstrap interval. PR/head: the per-head PR of the controlled projection (pr_k_head '
          'for target k); relative: its change over the baseline\'s; k_spec_norm: the top singular value of W_K^h, '
          'mean over heads, from the snapshots. The verdict is the entropy effect by the rule of (d) (shrink) or '
          f'(e) (freeze); well below: the relative change has its interval below -{WELL_BELOW:.0%} (the doses that '
          'can decide (d)).', '', markdown_table(dose, list(dose[0]) if dose else ['arm'])]
    fits = [{**{k: r[k] for k in ('setting', 'n_layer', 'target', 'keep', 'doses', 'n_points', 'n_seeds')},
             'slope (entropy per unit PR/head)': iv(r, 'slope'), 'PR/head coef (joint)': iv(r, 'pr_coef'),
             'log qk_spec_norm coef (joint)': iv(r, 'scale_coef'), 'entropy follows PR_K': r['follows']}
            for r in ctx['dose_fits']]
    L += ['### Dose response (control_dose_fit)', '', f'Rule: {FIT_RULE}.', '',
          markdown_table(fits, list(fits[0])) if fits else 'Fewer than 2 shrink doses: no fit.\n']
    L += [f'![{n}]({n})' for n in ('fig10_dose_response.png',) if any(p.endswith(n) for p in ctx['figures'])]
    L += ['', 'Per seed: [control.md](control.md); every metric per arm: [control_effects.md](control_effects.md).', '']
    return L


def header(ctx):
    L = ['# qkgeom: claims report', '',
         f'Generated by `python analyze.py {" ".join(ctx["paths"])}` on {time.strftime("%Y-%m-%d %H:%M")}. '
         f'Every value and verdict below is computed from the run folders by the rules stated here; '
         f'none is typed by hand.', '',
         f'Runs: {ctx["n_found"]} run folders found, {len(ctx["runs"])} used, {len(ctx["skipped"])} skipped; '
         f'{sum(len(v) for v in ctx["cells"].values())} uncontrolled runs in {len(ctx["cells"])} (depth, init) '
         f'configurations give {ctx["summary"]["trajectories"] if ctx["summary"] else 0} (depth, init, layer) '
         f'trajectories (seed means).', '']
    if ctx['short']:
        L += [f'**Plumbing check, not results: {short_note(ctx)}.** The verdicts marked (plumbing check) show that '
              f'the analysis runs end to end; they say nothing about the claims.', '']
    elif ctx['few_seeds']:
        L += [f'**Small sample, not results: {small_note(ctx)}.** The verdicts marked (small sample) apply the rules '
              f'to these runs; they say little about the claims.', '']
    return L


def small_note(ctx):
    """Why (a)-(c2) rest on too few runs, in a sentence (REPORT.md and the console)."""
    n = sum(len(v) for v in ctx['cells'].values())
    return (f'every (depth, init) configuration has fewer than {MIN_SEEDS} seeds ({n} uncontrolled run(s) in '
            f'{len(ctx["cells"])} configuration(s)): the trajectories of (a), (b) and the links of (c), (c2) rest on '
            f'one or two runs each')


def short_note(ctx):
    """Why the runs are too short for verdicts, in a sentence (REPORT.md and the console)."""
    return (f'{len(ctx["short"])} of {len(ctx["runs"])} runs are too short for verdicts (fewer than '
            f'{ctx["final_logs"]} records after the end of warm-up, warmup_iters: their final values still average '
            f'over warm-up), e.g. {ctx["short"][0]}')


def claims_section(ctx):
    """The claims table (a verdict on too-short runs marked as a plumbing check) and the rules behind it."""
    shown = [{**c, 'verdict': c['verdict'] + (f'; {c["qualifier"]}' if c.get('qualifier') else '')
              + (' (plumbing check)' if c.get('plumbing') else '') + (' (small sample)' if c.get('small') else '')}
             for c in ctx['claims']]
    L = ['## Claims', '', markdown_table(shown, ['claim', 'statistic', 'value', 'verdict']), '### Verdict rules', '']
    for rule in dict.fromkeys(c['rule'] for c in ctx['claims'] if c['rule'] != '-'):
        which = ', '.join(dict.fromkeys(claim_label(c) for c in ctx['claims'] if c['rule'] == rule))
        L.append(f'- {which}: {rule}.')
    L += [f'- {rule}.' for rule in dict.fromkeys(c['also'] for c in ctx['claims'] if c.get('also'))]
    L += ['', f'Intervals are {LEVEL:.0%} percentile bootstrap intervals of the mean ({N_BOOT} resamples, seed '
              f'{BOOT_SEED}); the sign test is exact and one-sided, exact zeros dropped; the directional '
              f'confidence is the share of bootstrap means with the predicted sign; Spearman uses average ranks '
              f'for ties. Trajectories are seed means over the iterations every seed logged.', '']
    return L


def token_report(out, token):
    """The report's token-level section: per source found in out, one row per series (its _summary table),
    its tables and its figure."""
    L = ['## Token-level analysis', '']
    if not token:
        return L + ['No token-level tables in this folder: `python analyze.py tokens DIR` (our checkpoints) and '
                    '`python analyze.py pretrained --model=NAME --out=THIS_FOLDER` write them here.', '']
    L += ['From the tables that `python analyze.py tokens` and `python analyze.py pretrained` wrote into this folder. '
          'A series is one model\'s checkpoints (ours: a run, step = iteration), the trend statistics are means over '
          'its layers (rho: Spearman with log(1 + step), early/late split at the median log step; rise_then_decay '
          'and contrast_last_positive count layers), link_rho and link_p are those of its last checkpoint. Claims '
          '(f1) and (f2) use the uncontrolled runs and, for rotary models, q and k after the rotary embedding.', '']
    figures = {'tokens': 'fig6_tokens', 'pretrained': 'fig7_pretrained'}
    for prefix, (_, _, rows) in token.items():
        L += [f'### {TOKEN_SOURCES[prefix]}', '']
        L.append(markdown_table(rows, list(rows[0]) if rows else ['model']))
        L += [', '.join(f'[{prefix}{kind}.md]({prefix}{kind}.md)' for kind in ('', '_heads', '_trend', '_link')
                        if os.path.isfile(os.path.join(out, f'{prefix}{kind}.md'))), '']
        for name in sorted((n for n in os.listdir(out) if re.fullmatch(figures[prefix] + r'(_\d+)?\.png', n)),
                           key=lambda n: (len(n), n)):   # fig6_tokens.png, fig6_tokens_2.png, ...
            L += [f'![{name}]({name})', '']
    return L
