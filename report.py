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

from folders import markdown_table
from stats import BOOT_SEED, LEVEL, N_BOOT, N_PERM, mean_ci

HOLDS, FAILS, MIXED, NOT_MEASURED = 'holds', 'does not hold', 'mixed', 'not measured'
ALPHA = 0.05               # sign-test and permutation-test threshold
SHARE_HOLDS = 0.90         # share-of-trajectories claims hold at or above this share ...
SHARE_FAILS = 0.50         # ... and do not hold at or below this one
LINK_MODELS = 2            # "visible in several models": at least this many (and at least half of them)
# token level (claims f1, f2): where each source's tables live in the analysis folder
TOKEN_SOURCES = {'tokens': 'our checkpoints', 'pretrained': 'pretrained models'}


# ----------------------------------------------------------------------------- verdict rules
# (each printed into the report beside the claims it decides)

SHARE_RULE = (f'holds if >= {SHARE_HOLDS:.0%} of trajectories do; does not hold if <= {SHARE_FAILS:.0%} do; '
              f'else mixed')
EFFECT_RULE = (f'holds if the mean paired difference has the predicted sign, its {LEVEL:.0%} bootstrap interval '
               f'excludes 0 and the sign-test p < {ALPHA}; does not hold if the interval excludes 0 with the '
               f'opposite sign; else mixed')
LINK_RULE = (f'each correlation holds if its mean over runs is > 0 with a {LEVEL:.0%} bootstrap interval (over '
             f'runs) above 0, does not hold if the interval is below 0, else mixed; the claim holds if both '
             f'hold, does not hold if both do not, else mixed')
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
    """The claims of the study as report rows: claim, statistic, value, verdict, rule; from the analysis result
    res (analyze.analyze), whose 'token' holds the token-level tables found, for the rows (f1) and (f2)."""
    rows = share_claims(res['summary'])
    rows.append(link_claim(res['link_rows'][-1] if res['link_rows'] else None))
    rows += effect_claims(res['effects'], res['final_logs'])
    for row in rows if res['short'] else ():   # the weight study's claims, all from these runs
        row['plumbing'] = row['verdict'] != NOT_MEASURED
    for prefix in TOKEN_SOURCES:
        rows += token_claims(prefix, *res['token'].get(prefix, ([], []))[:2])
    return rows


def share_claims(summary):
    """(a) and (b): shares of the trajectories of a trajectory_summary row."""
    n = summary['trajectories'] if summary else 0
    rows = []
    for claim, key, stat in (
            ('(a) PR_Q grows and PR_K falls over training', 'q_up_k_down',
             'share of (depth, init, layer) trajectories (seed means) with PR_Q(end) > PR_Q(0) and PR_K(end) < PR_K(0)'),
            ('(b) PR_Q - PR_K > 0 along every trajectory', 'gap_positive_throughout',
             'share of trajectories with PR_Q - PR_K > 0 at every logged iteration after 0')):
        c = summary[key] if summary else 0
        rows.append({'claim': claim, 'statistic': stat, 'value': f'{c}/{n} = {c / n:.0%}' if n else 'no trajectories',
                     'verdict': share_verdict(c, n), 'rule': SHARE_RULE})
    return rows


def link_claim(pooled):
    """(c): the pooled row of the attention_link table."""
    claim = '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy'
    if not pooled:
        return {'claim': claim, 'statistic': 'within-run Spearman PR_K~PR_QK and PR_K~entropy', 'value': 'no runs',
                'verdict': NOT_MEASURED, 'rule': LINK_RULE}
    parts, values = [], []
    for name in ('pr_k~pr_qk', 'pr_k~entropy'):
        m, lo, hi = pooled[name], pooled[f'{name}_lo'], pooled[f'{name}_hi']
        parts.append(interval_verdict(m, lo, hi, +1))
        values.append(f'{name}: {m:.2f} [{lo:.2f}, {hi:.2f}] ({parts[-1]})')
    return {'claim': claim, 'statistic': f'within-run Spearman over logged iterations (per layer, mean over layers), '
                                         f'mean over {pooled["n_runs"]} uncontrolled runs',
            'value': '; '.join(values), 'verdict': combine_verdicts(parts), 'rule': LINK_RULE}


def effect_claims(effects, final_logs):
    """(d) and (e): the paired entropy effects of the control experiment (control_effects rows, target k)."""
    rows = []
    for claim, kind, sign, word in (('(d) shrinking the key spectrum sharpens attention', 'shrink', -1, 'lower'),
                                    ('(e) freezing the key spectrum softens attention', 'freeze', +1, 'higher')):
        e = next((e for e in effects if e['target'] == 'k' and e['contrast'] == f'{kind} - none'
                  and e['metric'] == 'entropy'), None)
        row = {'claim': claim, 'statistic': f'final attention entropy (mean of the last {final_logs} logs and of '
                                            f'layers), {kind} - none paired by seed; predicted {word}',
               'value': f'no {kind}/none pairs', 'verdict': NOT_MEASURED, 'rule': EFFECT_RULE}
        if e is not None:
            row['value'] = (f'mean {signed(e["mean"])} [{signed(e["ci_lo"])}, {signed(e["ci_hi"])}], '
                            f'{e["n_predicted"]}/{e["n"]} {word}, sign test p = {e["sign_p"]:.3g}, directional '
                            f'confidence {e["confidence"]:.2f}')
            row['verdict'] = interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], sign, e['sign_p'])
        rows.append(row)
    return rows


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
    f1 = {'claim': f'(f1) token-level PR_Q - PR_K rises early and decays later [{source}]',
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
    f2 = {'claim': f'(f2) token-level interaction rank tracks attention entropy [{source}]',
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
    """REPORT.md from the analysis result ctx (analyze.analyze): claims and rules first, then the tables behind
    them, the notes, what is missing and every warning."""
    L = header(ctx) + claims_section(ctx)
    L += ['## Trajectory summary', '',
          markdown_table(ctx['summaries'], list(ctx['summaries'][0]) if ctx['summaries'] else ['variant']),
          '## Attention link', '',
          markdown_table(ctx['link_rows'], list(ctx['link_rows'][0]) if ctx['link_rows'] else ['n_layer']),
          '## Control experiment', '']
    if ctx['effects']:
        L.append('control_target=q (if shown) is the mirror experiment: listed for comparison, no verdict.\n')
        L.append(markdown_table(ctx['effects'], list(ctx['effects'][0])))
    else:
        L += ['No controlled runs.', '']
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


def header(ctx):
    L = ['# qkgeom: claims report', '',
         f'Generated by `python analyze.py {" ".join(ctx["paths"])}` on {time.strftime("%Y-%m-%d %H:%M")}. '
         f'Every value and verdict below is computed from the run folders by the rules stated here; '
         f'none is typed by hand.', '',
         f'Runs: {ctx["n_found"]} run folders found, {len(ctx["runs"])} used, {len(ctx["skipped"])} skipped; '
         f'{sum(len(v) for v in ctx["cells"].values())} uncontrolled runs in {len(ctx["cells"])} (depth, init) '
         f'configurations give {ctx["summary"]["trajectories"] if ctx["summary"] else 0} layer trajectories.', '']
    if ctx['short']:
        L += [f'**Plumbing check, not results: {short_note(ctx)}.** The verdicts marked (plumbing check) show that '
              f'the analysis runs end to end; they say nothing about the claims.', '']
    return L


def short_note(ctx):
    """Why the runs are too short for verdicts, in a sentence (REPORT.md and the console)."""
    return (f'{len(ctx["short"])} of {len(ctx["runs"])} runs are too short for verdicts (fewer than '
            f'{ctx["final_logs"]} records after the end of warm-up, warmup_iters: their final values still average '
            f'over warm-up), e.g. {ctx["short"][0]}')


def claims_section(ctx):
    """The claims table (a verdict on too-short runs marked as a plumbing check) and the rules behind it."""
    shown = [{**c, 'verdict': c['verdict'] + (' (plumbing check)' if c.get('plumbing') else '')}
             for c in ctx['claims']]
    L = ['## Claims', '', markdown_table(shown, ['claim', 'statistic', 'value', 'verdict']), '### Verdict rules', '']
    for rule in dict.fromkeys(c['rule'] for c in ctx['claims'] if c['rule'] != '-'):
        which = ', '.join(dict.fromkeys(claim_label(c) for c in ctx['claims'] if c['rule'] == rule))
        L.append(f'- {which}: {rule}.')
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
