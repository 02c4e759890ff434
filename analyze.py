"""
Turn run folders written by train.py into the study's evidence: tables, figures and a claims report in which
every verdict is computed by a rule printed in the report. The command line of every analysis, and the
weight-study tables; the rest is split by job:

    folders.py   finding and loading run folders, writing tables      plots.py    the figures fig1-fig5
    stats.py     the statistics (numpy only)                          report.py   claims, verdict rules, REPORT.md
    tokens.py    the token-level analysis of checkpoints (ours and pretrained), fig6 and fig7

    python analyze.py out/                           # every run folder under out/ -> out/analysis/
    python analyze.py out/ more_runs/ --out=results --pdf
    python analyze.py out/ --no_figures              # tables and REPORT.md only
    python analyze.py tokens out/                    # token-level analysis of checkpoints (tokens.py)
    python analyze.py pretrained --model=gpt2        # the same for a pretrained model (tokens.py; transformers)

A run folder is any folder holding a config.json (folders.py says how runs are read, checked and grouped);
unfinished or corrupt runs are skipped and bad records left out, each with a warning naming it. The runs a
sweep planned are read from the runs.txt that sweep.sh writes into its output folder; those without done.json
are listed as missing. Written to --out (default <first dir>/analysis/), each table as .csv and .md:

    REPORT.md                      one row per claim of the study: statistic, value, verdict, rule
    runs                           final losses and wall time, one row per run
    trajectories[_head|_tok]       PR_Q, PR_K per (depth, init, layer), seed means; full-matrix, per-head, token-level
    trajectory_summary             per variant: how many trajectories keep PR_Q - PR_K > 0, have PR_Q up and PR_K down
    attention_link[_runs]          within-run Spearman of PR_K, PR_QK and entropy over training
    control, control_effects       the control experiment: per seed, and paired differences against none
    timeline                       PRs and entropy over training, mean over the runs of each group (which moves when)
    fig1..fig5 *.png (--pdf: also .pdf)

`tokens` and `pretrained` (tokens.py, whose docstring has the details) write tokens* / pretrained* tables and
fig6 / fig7 into their --out folder; `runs` (the default subcommand: `python analyze.py out/` is
`python analyze.py runs out/`) reads those tables from its --out folder into REPORT.md (claims f1, f2), so run
it after them.
"""
import argparse
import os
import re
import shlex
import sys
import time
from collections import Counter, defaultdict

import numpy as np

import control
import plots
import report
import stats
import tokens
from folders import (CONTROL_KINDS, FINAL_LOGS, SETTING_KEYS, Skip, collector, discover, find_run_dirs, init_order,
                     load_runs, moved, publish, read_table, seed_stack, staging, study_cells, write_table)

# -----------------------------------------------------------------------------
# what the tables measure (the verdict rules are report.py's; the study's grid is sweep.sh's, read from runs.txt)
# predicted sign of (controlled - none) per (metric, control): shrink sharpens attention, freeze softens it;
# shrink lowering the controlled PR (pr_k; pr_q in the mirror, control_target=q) is the manipulation check
PREDICTED = {('entropy', 'shrink'): -1, ('entropy', 'freeze'): +1,
             ('entropy_norm', 'shrink'): -1, ('entropy_norm', 'freeze'): +1, ('pr_controlled', 'shrink'): -1}
CONTROL_METRICS = ('entropy', 'entropy_norm', 'pr_k', 'pr_q', 'pr_qk', 'val_loss')
# trajectory variants: table suffix -> (query key, key key, what it is)
VARIANTS = {'': ('pr_q', 'pr_k', 'full-matrix weight PR'),
            '_head': ('pr_q_head', 'pr_k_head', 'per-head weight PR (mean over heads)'),
            '_tok': ('tok_pr_q', 'tok_pr_k', 'token-level PR of the query/key vectors')}
# the within-run correlations of table 2: name -> (x, y)
LINKS = {'pr_k~entropy': ('pr_k', 'entropy'), 'pr_k~pr_qk': ('pr_k', 'pr_qk'), 'pr_qk~entropy': ('pr_qk', 'entropy')}
# the files `runs` writes into its --out folder (stale ones from an earlier analysis are removed)
RUNS_OUTPUTS = re.compile(r'(runs|trajectories\w*|trajectory_summary|attention_link\w*|control|control_effects|timeline'
                          r'|scale_shape\w*|robustness\w*)\.(csv|md)|fig[1-58]_\w+\.(png|pdf)')


# ----------------------------------------------------------------------------- tables


def runs_table(runs, skipped):
    rows = []
    for r in sorted(runs, key=lambda r: (r.control != 'none', r.n_layer, init_order(r.qk_init), r.control,
                                         r.target, r.seed)):
        rows.append({'run': os.path.basename(r.path), 'path': r.path, 'n_layer': r.n_layer, 'qk_init': r.qk_init,
                     'control': r.control, 'control_target': r.target, 'seed': r.seed, 'setting': r.setting,
                     'iters': int(r.iters[-1]), 'train_loss': r.done.get('train_loss', float(r.train_loss[-1])),
                     'val_loss': r.done.get('val_loss', float(r.val_loss[-1])), 'wall_time': r.done.get('wall_time'),
                     'geometry_share': r.done.get('geometry_share'), 'note': '; '.join(r.notes)})
    for path, reason in skipped:
        rows.append({'run': os.path.basename(path), 'path': path, 'note': f'skipped: {reason}'})
    return rows


def trajectory_rows(cells, q_key, k_key, warn):
    """One row per (depth, init, layer): the seed-mean PR_Q and PR_K trajectories, summarised."""
    rows = []
    for (depth, init), runs in cells.items():
        try:
            iters, Q = seed_stack(runs, q_key)
            K = seed_stack(runs, k_key)[1]
        except Skip as e:
            warn(f'trajectories L{depth} {init}: {e}')
            continue
        Q, K = Q.mean(0), K.mean(0)   # (T, n_layer) seed means
        after = iters > 0
        for layer in range(depth):
            q, k = Q[:, layer], K[:, layer]
            if not (np.isfinite(q).all() and np.isfinite(k).all()):
                continue  # not logged (an older run, or token-level metrics off)
            gap = q - k
            rows.append({'n_layer': depth, 'qk_init': init, 'layer': layer, 'n_seeds': len(runs),
                         'iter_start': int(iters[0]), 'iter_end': int(iters[-1]),
                         'pr_q_start': q[0], 'pr_q_end': q[-1], 'pr_q_change': q[-1] - q[0],
                         'pr_k_start': k[0], 'pr_k_end': k[-1], 'pr_k_change': k[-1] - k[0],
                         'gap_end': gap[-1],
                         'gap_min_after_0': float(gap[after].min()) if after.any() else float('nan'),
                         'gap_positive_share': float((gap[after] > 0).mean()) if after.any() else float('nan'),
                         'gap_positive_throughout': bool(after.any() and (gap[after] > 0).all()),
                         'q_up_k_down': bool(q[-1] > q[0] and k[-1] < k[0])})
    return rows


def trajectory_summary(rows, variant, what):
    n = len(rows)
    count = lambda pred: sum(1 for r in rows if pred(r))
    return {'variant': variant or 'full', 'measure': what, 'trajectories': n,
            'gap_positive_throughout': count(lambda r: r['gap_positive_throughout']),
            'q_up_k_down': count(lambda r: r['q_up_k_down']),
            'q_up': count(lambda r: r['pr_q_change'] > 0), 'k_down': count(lambda r: r['pr_k_change'] < 0),
            'both_down': count(lambda r: r['pr_q_change'] < 0 and r['pr_k_change'] < 0),
            'gap_end_positive': count(lambda r: r['gap_end'] > 0)}


def link_of_run(run):
    """Per link: the Spearman correlation over logged iterations, per layer, then the mean over layers."""
    out = {}
    for name, (x, y) in LINKS.items():
        X, Y = run.metric(x), run.metric(y)
        rhos = [stats.spearman(X[:, layer], Y[:, layer]) for layer in range(run.n_layer)]
        out[name] = float(np.nanmean(rhos)) if np.isfinite(rhos).any() else float('nan')
    return out


def attention_link_tables(cells):
    """(per-run rows, per-configuration rows with a pooled row last)."""
    run_rows, config_rows, pooled = [], [], defaultdict(list)
    for (depth, init), runs in cells.items():
        per = defaultdict(list)
        for r in runs:
            link = link_of_run(r)
            run_rows.append({'n_layer': depth, 'qk_init': init, 'seed': r.seed, 'run': r.path, **link})
            for name, v in link.items():
                per[name].append(v)
                pooled[name].append(v)
        config_rows.append(link_row({'n_layer': depth, 'qk_init': init}, per))
    if run_rows:
        config_rows.append(link_row({'n_layer': 'pooled', 'qk_init': 'all'}, pooled))
    return run_rows, config_rows


def link_row(head, values):
    row = dict(head)
    for name in LINKS:
        s = stats.mean_ci(values[name])
        row['n_runs'] = s['n']
        row.update({f'{name}': s['mean'], f'{name}_lo': s['lo'], f'{name}_hi': s['hi']})
    return row


def control_rows(runs, target):
    """Per (setting, depth, init, seed) of the control experiment with control_target = target: final
    entropy, PRs and validation loss of none, shrink and freeze, and the differences against none."""
    labels = {kind: control.control_label({'control': kind, 'control_target': target}) for kind in CONTROL_KINDS}
    controlled = [r for r in runs if r.control != 'none' and r.label in labels.values()]
    cells = sorted({(r.setting, r.n_layer, r.qk_init) for r in controlled},
                   key=lambda c: (c[0], c[1], init_order(c[2])))
    index = {(r.setting, r.n_layer, r.qk_init, r.label, r.seed): r for r in runs}
    rows = []
    for setting, depth, init in cells:
        seeds = sorted({r.seed for r in runs if (r.setting, r.n_layer, r.qk_init) == (setting, depth, init)
                        and r.label in labels.values()})
        for seed in seeds:
            row = {'target': target, 'setting': setting, 'n_layer': depth, 'qk_init': init, 'seed': seed}
            for kind in CONTROL_KINDS:
                r = index.get((setting, depth, init, labels[kind], seed))
                row.update({f'{metric}_{kind}': final_value(r, metric) for metric in CONTROL_METRICS})
            row.update({f'd_{metric}_{kind}': difference(row[f'{metric}_{kind}'], row[f'{metric}_none'])
                        for kind in ('shrink', 'freeze') for metric in CONTROL_METRICS})
            rows.append(row)
    return rows


def difference(a, b):
    return a - b if a is not None and b is not None else None


def final_value(run, metric):
    """A run's final value of a metric (Run.final; val_loss: the last logged), None without the run or geometry."""
    if run is None or (metric != 'val_loss' and not run.has_geometry):
        return None
    return float(run.val_loss[-1]) if metric == 'val_loss' else run.final(metric)


def control_effect_rows(rows, target):
    """Per (control, metric): the paired differences against none, summarised (stats.paired_effect)."""
    out = []
    for kind in ('shrink', 'freeze'):
        for metric in CONTROL_METRICS:
            d = [r[f'd_{metric}_{kind}'] for r in rows if r[f'd_{metric}_{kind}'] is not None]
            if not d:
                continue
            role = 'pr_controlled' if metric == f'pr_{target}' else metric
            out.append({'target': target, 'contrast': f'{kind} - none', 'metric': metric,
                        **stats.paired_effect(d, PREDICTED.get((role, kind)))})
    return out


TIMELINE_KEYS = ('pr_q', 'pr_k', 'pr_q_head', 'pr_k_head', 'pr_qk', 'entropy', 'entropy_norm')


def timeline_rows(runs):
    """Which quantity moves when: means over runs (of layer means) at every iteration that all runs of a
    group logged. Groups are (setting, depth, init, control, target), plus every uncontrolled run of a
    setting pooled (n_layer and qk_init 'all'); the numbers behind fig3 (left) and fig5."""
    groups = defaultdict(list)
    for r in runs:
        if r.has_geometry:
            groups[(r.setting, r.n_layer, r.qk_init, r.control, r.target)].append(r)
            if r.control == 'none':
                groups[(r.setting, 'all', 'all', 'none', '')].append(r)
    order = lambda g: (g[0], g[1] != 'all', str(g[1]), init_order(g[2]), CONTROL_KINDS.index(g[3]), g[4])
    rows = []
    for (setting, depth, init, control, target) in sorted(groups, key=order):
        group = groups[(setting, depth, init, control, target)]
        keys = [k for k in TIMELINE_KEYS if all(k in r.layers for r in group)]
        try:  # (runs, iterations) per key: each run's mean over its layers, so every run weighs the same
            stacks = {k: seed_stack(group, k, layer_mean=True) for k in keys}
        except Skip:
            continue  # no iteration logged by every run of the group: nothing to average
        for i, it in enumerate(stacks[keys[0]][0] if keys else []):
            rows.append({'setting': setting, 'n_layer': depth, 'qk_init': init, 'control': control,
                         'control_target': target, 'n_runs': len(group), 'iter': int(it),
                         **{k: float(v[:, i].mean()) for k, (_, v) in stacks.items()}})
    return rows


def missing_runs(plans):
    """Lines naming the planned runs without done.json, one per runs.txt (sweep.sh writes the runs it plans,
    `NAME --key=value ...` per line, into its output folder); None when no runs.txt was found."""
    if not plans:
        return None
    lines = []
    for plan in plans:
        with open(plan, errors='replace') as f:
            names = [line.split()[0] for line in f if line.strip() and not line.startswith('#')]
        folder = os.path.dirname(plan)
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n, 'done.json'))]
        if missing:
            lines.append(f'{plan}: {len(missing)} of {len(names)} planned runs have no done.json: {", ".join(missing)}')
    return lines


# ---- the token-level tables (tokens.py writes them; the report reads them back)


def token_results(out):
    """{prefix: (trend rows, link rows, summary rows)} of the token-level tables found in out (written by
    `tokens` and `pretrained`), for the report."""
    found = {}
    for prefix in report.TOKEN_SOURCES:
        paths = [os.path.join(out, f'{prefix}_{kind}.csv') for kind in ('trend', 'link', 'summary')]
        if all(os.path.isfile(p) for p in paths):
            found[prefix] = tuple(read_table(p) for p in paths)
    return found


# ----------------------------------------------------------------------------- notes for the report

def confound_notes(runs, cells, traj_rows):
    """The known confounds (DESIGN.md), as measured in these runs."""
    notes = []
    wd = Counter((r.cfg.get('weight_decay'), r.cfg.get('decay_qk')) for r in runs)
    for (w, d), n in sorted(wd.items(), key=str):
        on = 'applied to W_Q and W_K' if d and w else 'not applied to W_Q and W_K'
        notes.append(f'weight decay {w} {on} (decay_qk={d}) in {n} run(s): decay shrinks both spectra, '
                     f'so it can move PR_Q and PR_K together.')
    study = [r for rs in cells.values() for r in rs]
    if study:
        by_init = defaultdict(list)
        for r in study:
            C = r.cfg.get('n_embd')
            if C and r.geom_iters[0] == 0:
                by_init[r.qk_init].append((np.nanmean(r.metric('pr_q')[0]) / C, np.nanmean(r.metric('pr_k')[0]) / C))
        parts = [f'{init}: PR_Q/C = {np.mean([a for a, _ in v]):.2f}, PR_K/C = {np.mean([b for _, b in v]):.2f}'
                 for init, v in sorted(by_init.items(), key=lambda kv: init_order(kv[0]))]
        if parts:
            notes.append('a random (C, C) matrix starts near PR = C/2 (an orthogonal one at C), so early training '
                         'tends to lower every PR; at step 0, ' + '; '.join(parts) + '.')
    if traj_rows:
        both = sum(1 for r in traj_rows if r['pr_q_change'] < 0 and r['pr_k_change'] < 0)
        notes.append(f'{both}/{len(traj_rows)} trajectories end with both PR_Q and PR_K below their start.')
    lrs = Counter((r.cfg.get('lr'), r.cfg.get('warmup_iters'), r.cfg.get('max_iters')) for r in runs)
    notes.append('learning rate, warm-up and length change how fast both PRs move: '
                 + '; '.join(f'lr {a}, warmup_iters {b}, max_iters {c} in {n} run(s)' for (a, b, c), n in
                             sorted(lrs.items(), key=str)) + '.')
    return notes


def setting_notes(runs, settings):
    """What the training setups B, C, ... change against A, and what they are used for."""
    notes = []
    base = settings.get('A', {})
    for letter, s in sorted(settings.items()):
        if letter == 'A':
            continue
        diff = ', '.join(f'{k}={s[k]} (A: {base.get(k)})' for k in SETTING_KEYS if s[k] != base.get(k))
        n = sum(1 for r in runs if r.setting == letter)
        notes.append(f'setting {letter} ({n} run(s)) differs from A in {diff}: its uncontrolled runs are left out of '
                     f'the trajectory and attention tables and serve only as control baselines in setting {letter}.')
    return notes


# ----------------------------------------------------------------------------- the analysis

def analyze(paths, out=None, pdf=False, figures=True, log=print):
    """Everything: load the runs under paths, write tables, figures and REPORT.md to out. Returns a dict
    with the claims, the files written, the warnings and what is missing. Raises Skip when no run
    folder is found. Everything is written into a staging folder first and moved into out at the end."""
    warnings, warn = collector(log)
    run_dirs, plans = discover(paths, warn)
    runs, skipped, settings = load_runs(run_dirs, warn)
    out = out or os.path.join(paths[0], 'analysis')
    res = study_tables(runs, warn)
    # the report, with the token-level results written earlier into out by `tokens` and `pretrained`
    res.update(paths=list(paths), out=out, n_found=len(run_dirs), runs=runs, skipped=skipped,
               token=token_results(out), final_logs=FINAL_LOGS, short=[r.path for r in runs if r.too_short])
    res.update(claims=report.claims(res), confounds=confound_notes(runs, res['cells'], res['traj']['']),
               setting_notes=setting_notes(runs, settings), missing=missing_runs(plans), warnings=warnings)
    with staging(out) as staged:
        tables = write_tables(res, runs, skipped, staged)
        written, figure_notes = plots.draw_figures(res, runs, staged, pdf, log, warn) if figures else ([], [])
        res.update(tables=moved(tables, out), figures=moved(written, out), figure_notes=figure_notes)
        report.write_report(os.path.join(staged, 'REPORT.md'), res)
        publish(staged, out, RUNS_OUTPUTS)
    res['files'] = res['tables'] + res['figures'] + [os.path.join(out, 'REPORT.md')]
    return res


def study_tables(runs, warn):
    """The rows of every table of the weight study, computed from the loaded runs."""
    cells = study_cells(runs)
    traj = {suffix: trajectory_rows(cells, q_key, k_key, warn) for suffix, (q_key, k_key, _) in VARIANTS.items()}
    summaries = [trajectory_summary(traj[suffix], suffix.strip('_'), what)
                 for suffix, (_, _, what) in VARIANTS.items() if traj[suffix]]
    link_runs, link_rows = attention_link_tables(cells)
    ctl_rows = {target: control_rows(runs, target) for target in ('k', 'q')}
    effects = [e for target in ('k', 'q') for e in control_effect_rows(ctl_rows[target], target)]
    return {'cells': cells, 'traj': traj, 'summaries': summaries,
            'summary': summaries[0] if summaries and summaries[0]['variant'] == 'full' else None,
            'link_runs': link_runs, 'link_rows': link_rows, 'ctl_rows': ctl_rows, 'effects': effects,
            'timeline': timeline_rows(runs)}


def write_tables(res, runs, skipped, out):
    """Every table that has rows, as .csv and .md in out; returns the paths written."""
    tables = [('runs', runs_table(runs, skipped))]
    tables += [('trajectories' + suffix, rows) for suffix, rows in res['traj'].items()]
    tables += [('trajectory_summary', res['summaries'])]
    if res['link_rows']:
        tables += [('attention_link_runs', res['link_runs']), ('attention_link', res['link_rows'])]
    tables += [('control', res['ctl_rows']['k'] + res['ctl_rows']['q']), ('control_effects', res['effects']),
               ('timeline', res['timeline'])]
    return [path for stem, rows in tables if rows for path in write_table(rows, out, stem)]


def folders_parser(prog, description):
    """The arguments every folder-reading subcommand shares."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument('dirs', nargs='+', help='folders searched recursively for run folders (folders with config.json)')
    p.add_argument('--out', default=None, help='where to write; default <first dir>/analysis/')
    p.add_argument('--pdf', action='store_true', help='write every figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables (and REPORT.md) only: faster')
    return p


def folders_exist(dirs):
    absent = [d for d in dirs if not os.path.isdir(d)]
    if absent:
        print(f'error: {", ".join(absent)}: no such folder', file=sys.stderr)
    return not absent


def runs_command(argv):
    """python analyze.py [runs] DIR [DIR ...] [--out OUT] [--pdf] [--no_figures]"""
    p = folders_parser('analyze.py', 'Tables, figures and the claims report (REPORT.md) from run folders '
                       'written by train.py.')
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
        return 2
    t0 = time.time()
    try:
        res = analyze(args.dirs, args.out, args.pdf, not args.no_figures)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    print(f'{res["n_found"]} run folders found: {len(res["runs"])} used, {len(res["skipped"])} skipped')
    for path, reason in res['skipped']:
        print(f'  skipped {path}: {reason}')
    if not res['runs']:
        print(f'error: none of the {res["n_found"]} run folders is usable (reasons above; '
              f'{os.path.join(res["out"], "REPORT.md")} lists them too)', file=sys.stderr)
        return 1
    print_missing(res['missing'])
    if res['short']:
        print(f'note: {report.short_note(res)}; the verdicts below are plumbing checks')
    for c in res['claims']:
        print(f'{report.claim_label(c):<4} {c["verdict"]:<14} {report.clip(c["value"], 100)}')
    print(f'wrote {len(res["files"])} files to {res["out"]} in {time.time() - t0:.1f}s: '
          f'{len(res["tables"]) // 2} tables (csv, md), {len(res["figures"])} figure files, REPORT.md')
    return 0


def print_missing(missing):
    if missing is None:
        print('missing from the planned runs: not checked (no runs.txt, which sweep.sh writes, found)')
        return
    print('missing from the planned runs:' + ('' if missing else ' nothing'))
    for line in missing:
        print(f'  {line}')


def print_token_result(res, dirs=None):
    """The token-level claims, the files, and the exact command that puts the claims into a REPORT.md: the runs
    analysed (dirs), else the run folders above an --out named analysis/ (pretrained models)."""
    for c in res['claims']:
        print(f'{report.claim_label(c):<4} {c["verdict"]:<14} {report.clip(c["value"], 110)}')
    out = res['out']
    if dirs is None and os.path.basename(os.path.normpath(out)) == 'analysis':
        parent = os.path.dirname(os.path.normpath(out)) or '.'
        dirs = [parent] if find_run_dirs([parent]) else None
    if dirs is None:
        hint = f'`python analyze.py RUN_FOLDERS --out={shlex.quote(out)}` (RUN_FOLDERS: the out_dir of your runs)'
    else:
        default = os.path.normpath(os.path.join(dirs[0], 'analysis')) == os.path.normpath(out)
        hint = '`python analyze.py ' + ' '.join(map(shlex.quote, [*dirs] + ([] if default else [f'--out={out}']))) + '`'
    print(f'wrote {len(res["files"])} files to {out}; {hint} puts claims (f1), (f2) into its REPORT.md')
    if res.get('report_removed'):
        print(f'(the REPORT.md there reported the earlier token tables: removed until that command writes it again)')


def tokens_command(argv):
    """python analyze.py tokens DIR [DIR ...] [--out OUT] [--data_file F] [--data_dir D] [--cache_dir C] ..."""
    p = folders_parser('analyze.py tokens', 'Token-level query/key geometry and attention entropy of every saved '
                       'model checkpoint (models/*.pt) of the runs, on the fixed evaluation batch of each run, '
                       'rebuilt from its config.json.')
    p.add_argument('--data_file', default='', help="the runs' training text, where config.json's data_file moved")
    p.add_argument('--data_dir', default='', help="the folder holding wiki.{train,valid}.raw (dataset runs), if moved")
    p.add_argument('--cache_dir', default='', help="where encoded data is cached; default: each run's config")
    p.add_argument('--device', default=tokens.default_device(), help='cuda if available, else cpu')
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
        return 2
    t0 = time.time()
    try:
        res = tokens.analyze_tokens(args.dirs, args.out, args.data_file, args.data_dir, args.cache_dir, args.device,
                             args.pdf, not args.no_figures)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    if not res['measured']:
        print(f'error: none of the {res["n_found"]} run folders could be measured (reasons above)', file=sys.stderr)
        return 1
    print(f'{len(res["measured"])} of {res["n_found"]} runs measured in {time.time() - t0:.1f}s')
    print_token_result(res, args.dirs)
    return 0


def pretrained_command(argv):
    """python analyze.py pretrained --model=NAME_OR_PATH [--revisions=...] [--text=FILE] [--rope=after] ..."""
    p = argparse.ArgumentParser(prog='analyze.py pretrained', description='Token-level query/key geometry and '
                                'attention entropy of a pretrained model (each revision: a checkpoint series) on a '
                                'fixed text sample. Needs transformers. Families: ' + ', '.join(
                                    t for fam in tokens.FAMILIES.values() for t in fam.model_types) + '.')
    p.add_argument('--model', required=True, help='a local folder or a HF name (from the cache, else the hub)')
    p.add_argument('--revisions', default='', help='comma-separated revisions (a local folder MODEL/REVISION is '
                   'used if there), or a preset: ' + ', '.join(tokens.REVISION_PRESETS) + '; default: the default revision')
    p.add_argument('--text', default='', help=f'UTF-8 text to sample (first {tokens.SAMPLE_CHARS} characters); '
                   f'default {os.path.normpath(tokens.SAMPLE_FILE)}')
    p.add_argument('--rope', default='after', choices=('after', 'before', 'both'),
                   help='rotary families: q and k after the rotary embedding (as attention uses them), before it '
                        '(as projected), or both')
    p.add_argument('--n_seqs', type=int, default=8, help='windows of the text')
    p.add_argument('--seq_len', type=int, default=256, help='tokens per window, special tokens included')
    p.add_argument('--out', default=os.path.join('out', 'analysis'), help='where to write (default out/analysis, '
                   'where `python analyze.py out/` reads it)')
    p.add_argument('--device', default=tokens.default_device(), help='cuda if available, else cpu')
    p.add_argument('--pdf', action='store_true', help='write the figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    args = p.parse_args(argv)
    revisions = tokens.REVISION_PRESETS.get(args.revisions) or [r for r in args.revisions.split(',') if r] or [None]
    t0 = time.time()
    try:
        res = tokens.analyze_pretrained(args.model, list(revisions), args.text, args.out, args.rope, args.n_seqs,
                                 args.seq_len, args.device, args.pdf, not args.no_figures)
    except (ImportError, ValueError, OSError) as e:  # OSError: a checkpoint neither local nor downloadable
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{args.model}: {len(revisions)} checkpoint(s) in {time.time() - t0:.1f}s')
    print_token_result(res)
    return 0


SUBCOMMANDS = {'runs': runs_command, 'tokens': tokens_command, 'pretrained': pretrained_command}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return runs_command(argv)


if __name__ == '__main__':
    sys.exit(main())
