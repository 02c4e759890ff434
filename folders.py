"""
Run folders in, tables out: the I/O every analysis shares (analyze.py, tokens.py, plots.py).

- Finding runs: a run folder is any folder holding a config.json (hidden, or inside another run's folder, too);
  sweep.sh's runs.txt (the planned runs) is found beside them. Odd folders (metrics.jsonl without config.json,
  symbolic links) are named, not followed.
- Loading a run: config.json, done.json (a run without it is unfinished and skipped) and metrics.jsonl through
  runfolder.read_metrics, the one tolerant reader. A record with a value that is not a finite number is left out
  with a note naming its iteration and key; a run keeps the rest.
- Grouping: runs share a training setup (SETTING_KEYS: A = that of most uncontrolled runs, then B, C, ...);
  within one, a run is (depth, qk_init, control label, seed), the control label being control.control_label.
- Tables: every table is written as .csv and .md; an analysis is written into a staging folder and moved into
  its output folder at the end, so a REPORT.md never sits beside the tables of another analysis. The output
  folder's MANIFEST lists what each analysis wrote there: only those files are replaced or removed, and a
  folder holding files of the same names that analyze.py did not write is refused (check_out).
"""
import contextlib
import csv
import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import reduce

import numpy as np

import control
import runfolder

CONTROL_KINDS = control.KINDS
FINAL_LOGS = 3             # a run's "final" entropy or PR: mean over its last FINAL_LOGS logged iterations
# config keys that make two runs comparable (same training setup); the grid axes, the control settings and
# bookkeeping are left out. The data is compared by content (data_sha256, and the data cache key without the
# text's file name: digest, min_char_count, encoder version), never by how data_file's path is spelled
SETTING_KEYS = ('n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'batch_size', 'grad_accum', 'max_iters',
                'lr', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'weight_decay', 'decay_qk', 'beta1', 'beta2',
                'grad_clip', 'data_sha256', 'data_cache', 'min_char_count', 'eval_windows')


class Skip(Exception):
    """A run, table or figure left out, with the reason (printed and reported, never fatal)."""


# ----------------------------------------------------------------------------- finding and loading runs

@dataclass
class Run:
    path: str
    cfg: dict
    done: dict
    iters: np.ndarray        # every logged iteration, sorted
    train_loss: np.ndarray
    val_loss: np.ndarray
    geom_iters: np.ndarray   # the logged iterations that carry geometry ("layers")
    layers: dict             # per-layer scalar metric -> (len(geom_iters), n_layer) float64
    notes: list = field(default_factory=list)
    heads: dict = field(default_factory=dict)   # per-head metric -> (len(geom_iters), n_layer, n_head)
    setting: str = 'A'       # which training setup (SETTING_KEYS) it shares with others; set by load_runs

    n_layer = property(lambda self: int(self.cfg['n_layer']))
    qk_init = property(lambda self: self.cfg['qk_init'])
    seed = property(lambda self: int(self.cfg['seed']))
    control = property(lambda self: self.cfg.get('control', 'none'))
    target = property(lambda self: target_of(self.cfg))
    label = property(lambda self: control.control_label(self.cfg))   # '' for none, e.g. 'shrink-k', 'freeze-k-spec'
    has_geometry = property(lambda self: len(self.geom_iters) > 0)

    def metric(self, key):
        """(len(geom_iters), n_layer) values of a per-layer metric; NaN where it was not logged."""
        return self.layers.get(key, np.full((len(self.geom_iters), self.n_layer), np.nan))

    @property
    def too_short(self):
        """Fewer than FINAL_LOGS records after the end of warm-up: its final values still average over warm-up."""
        its = self.geom_iters if self.has_geometry else self.iters
        return int((its > self.cfg.get('warmup_iters', 0)).sum()) < FINAL_LOGS

    def final(self, key):
        """Mean over the last FINAL_LOGS logged iterations and over layers (NaN if not logged)."""
        v = self.metric(key)[-FINAL_LOGS:]
        return float(np.nanmean(v)) if np.isfinite(v).any() else float('nan')


RUN_PARTS = ('snapshots', 'models')   # what train.py writes inside a run folder: never a run of its own


def walk_folders(paths, warn=None):
    """(run folders, plans) under paths: every folder that holds a config.json (a run nested inside another run's
    folder too; one reached twice counts once) and every runs.txt outside them (sweep.sh's plan). Hidden folders
    are searched only when they are run folders themselves (a run named .seed2), not .git or a staging folder.
    With warn, a folder with metrics.jsonl but no config.json and a symbolic link to a folder (not followed) are
    named."""
    warn = warn or (lambda msg: None)
    found, plans = [], []
    for top in paths:
        for root, dirs, files in os.walk(top):
            run = 'config.json' in files
            if run:
                found.append(os.path.normpath(root))
            elif 'metrics.jsonl' in files:
                warn(f'skipped {root}: it holds metrics.jsonl but no config.json (a run folder train.py did not '
                     f'finish setting up, or a copy missing it)')
            for d in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                warn(f'skipped {os.path.join(root, d)}: a symbolic link to {os.path.realpath(os.path.join(root, d))},'
                     f' not followed; pass that folder itself')
            dirs[:] = sorted(d for d in dirs if searched(os.path.join(root, d), run))
            if 'runs.txt' in files and not run:
                plans.append(os.path.normpath(os.path.join(root, 'runs.txt')))
    unique = {}
    for path in found:
        unique.setdefault(os.path.realpath(path), path)
    return sorted(unique.values()), list(dict.fromkeys(plans))


def searched(path, in_run):
    """Whether walk_folders looks inside a folder: not a symbolic link, not a run's snapshots/ or models/, not
    hidden unless it is a run folder."""
    name = os.path.basename(path)
    if os.path.islink(path) or (in_run and name in RUN_PARTS):
        return False
    return not name.startswith('.') or os.path.isfile(os.path.join(path, 'config.json'))


def find_run_dirs(paths):
    return walk_folders(paths)[0]


def discover(paths, warn=None):
    """walk_folders, or Skip naming the folders when they hold no run folder (every subcommand starts here)."""
    run_dirs, plans = walk_folders(paths, warn)
    if not run_dirs:
        raise Skip(f'no run folder (a folder with config.json) found under {", ".join(paths)}')
    return run_dirs, plans


def collector(log):
    """(warnings, warn): warn(msg) logs 'warning: msg' and keeps msg in the list, for the report."""
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')
    return warnings, warn


def read_json(path):
    """runfolder.read_json, with what is wrong as a Skip (the run is left out with that reason)."""
    try:
        return runfolder.read_json(path)
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__}: {str(e)[:80]})') from None


def load_run(path):
    """A finished run folder as a Run; Skip (with the reason) for an unfinished or corrupt one. Records with a
    value that is not a finite number are left out, each with a note naming its iteration and key."""
    cfg = read_json(os.path.join(path, 'config.json'))
    lacking = [k for k in ('n_layer', 'qk_init', 'seed') if k not in cfg]
    if lacking:
        raise Skip(f"config.json lacks {', '.join(lacking)}")
    if not (type(cfg['n_layer']) is int and type(cfg['seed']) is int and isinstance(cfg['qk_init'], str)):
        raise Skip('config.json: n_layer and seed must be integers and qk_init a string')
    if not os.path.exists(os.path.join(path, 'done.json')):
        raise Skip('unfinished (no done.json)')
    done = read_json(os.path.join(path, 'done.json'))
    if not os.path.isfile(os.path.join(path, 'metrics.jsonl')):
        raise Skip('no metrics.jsonl')
    notes = []  # a line that is not a record is left out, with a note naming it (a cut last line: silently)
    recs = usable_records(runfolder.read_metrics(os.path.join(path, 'metrics.jsonl'), notes.append), cfg['n_layer'],
                          notes.append)
    if not recs:
        raise Skip('metrics.jsonl holds no usable records')
    geo = [r for r in recs if r.get('layers')]
    scalars = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items() if not isinstance(v, list)})
    lists = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items() if isinstance(v, list)})
    run = Run(path, cfg, done, np.array([r['iter'] for r in recs], dtype=np.int64),
              np.array([r.get('train_loss') for r in recs], dtype=float),
              np.array([r.get('val_loss') for r in recs], dtype=float),
              np.array([r['iter'] for r in geo], dtype=np.int64),
              {k: np.array([[layer.get(k) for layer in r['layers']] for r in geo], dtype=float) for k in scalars},
              notes, per_head(geo, lists, notes.append))
    if not run.has_geometry:
        run.notes.append('no geometry logged (geom_interval=0): losses only')
    return run


def run_identity(path):
    """What tells one run from another whatever its folder is called or where it lies: its name and the SHA-256
    of its config.json and done.json ('' while unfinished). A run trained again has another done.json."""
    return {'run': os.path.basename(os.path.normpath(path)),
            'config_sha256': file_sha256(os.path.join(path, 'config.json')),
            'done_sha256': file_sha256(os.path.join(path, 'done.json'))}


def file_sha256(path):
    if not os.path.isfile(path):
        return ''
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def finite(v):
    return type(v) in (int, float) and math.isfinite(v)


def bad_value(rec, n_layer):
    """What makes a record unusable ('iteration 50: layer 0 pr_k = nan ...'), or None when every value is a
    finite number (lists: of finite numbers) and it has n_layer layers."""
    for key in ('train_loss', 'val_loss', 'lr'):
        if key in rec and rec[key] is not None and not finite(rec[key]):
            return f'{key} = {str(rec[key])[:40]} is not a finite number'
    layers = rec.get('layers') or []
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        return 'layers is not a list of objects'
    if layers and len(layers) != n_layer:
        return f'{len(layers)} layers logged, config.json says n_layer={n_layer}'
    for i, layer in enumerate(layers):
        for key, v in layer.items():
            if not (finite(v) or isinstance(v, list) and v and all(finite(x) for x in v)):
                return f'layer {i} {key} = {str(v)[:40]} is not a finite number'
    return None


def usable_records(rows, n_layer, note):
    """The records by iteration, without those bad_value rejects; a repeated iteration keeps its last record.
    Each record left out, and each repeat, gets a note naming the iteration."""
    counts = Counter(r['iter'] for r in rows)
    by_iter = {}
    for rec in rows:
        problem = bad_value(rec, n_layer)
        if problem:
            note(f"metrics.jsonl iteration {rec['iter']}: {problem}; that record is left out")
        else:
            by_iter[rec['iter']] = rec
    for it, n in sorted(counts.items()):
        if n > 1:
            note(f'metrics.jsonl has {n} records at iteration {it}: the last one is used')
    return [by_iter[it] for it in sorted(by_iter)]


def per_head(geo, keys, note):
    """{key: (records, n_layer, n_head)} of the per-head lists; a key whose lists differ in length is left out."""
    out = {}
    for key in keys:
        try:
            out[key] = np.array([[layer.get(key, []) for layer in r['layers']] for r in geo], dtype=float)
        except ValueError:
            note(f'metrics.jsonl: the lists of {key} differ in length between layers or records; left out')
    return {k: v for k, v in out.items() if v.ndim == 3}


def setting_of(cfg):
    """The training setup of a run: its SETTING_KEYS values, data_cache without the text's name (the cache key
    is NAME-DIGEST-minN-encV, NAME the file name of data_file)."""
    values = dict(cfg)
    if isinstance(cfg.get('data_cache'), str):
        values['data_cache'] = '-'.join(cfg['data_cache'].rsplit('-', 3)[1:])
    return tuple((k, json.dumps(values.get(k))) for k in SETTING_KEYS)


def load_runs(run_dirs, warn):
    """Load every folder; returns (runs used, skipped [(path, reason)], settings {letter: setting}).

    Runs are labelled by training setup (SETTING_KEYS): A = the setup of most uncontrolled runs, then B, C, ...
    Two runs with the same setup, depth, init, control, target and seed are one cell of the grid twice:
    the first (in path order) is used, the other reported."""
    runs, skipped = [], []
    for path in run_dirs:
        try:
            runs.append(load_run(path))
        except Skip as e:
            skipped.append((path, str(e)))
            warn(f'skipped {path}: {e}')
    # A = the setup of most uncontrolled runs (the study grid), then of most runs
    uncontrolled = Counter(setting_of(r.cfg) for r in runs if r.control == 'none')
    counts = Counter(setting_of(r.cfg) for r in runs)
    ranked = sorted(counts, key=lambda s: (-uncontrolled[s], -counts[s]))
    letters = {s: chr(ord('A') + i) if i < 26 else f'S{i}' for i, s in enumerate(ranked)}
    seen, used = {}, []
    for run in runs:
        run.setting = letters[setting_of(run.cfg)]
        key = (run.setting, run.n_layer, run.qk_init, run.label, run.seed)
        if key in seen:
            skipped.append((run.path, f'duplicate of {seen[key].path} (same settings, depth, init, control, seed)'))
            warn(f'skipped {run.path}: duplicate of {seen[key].path}')
            continue
        seen[key] = run
        used.append(run)
        for note in run.notes:
            warn(f'{run.path}: {note}')
    return used, skipped, {v: dict(k) for k, v in letters.items()}


def study_cells(runs, setting='A'):
    """{(depth, init): [runs by seed]} of the uncontrolled runs with geometry in a setting (the main one, A)."""
    cells = defaultdict(list)
    for r in runs:
        if r.control == 'none' and r.setting == setting and r.has_geometry:
            cells[(r.n_layer, r.qk_init)].append(r)
    order = sorted(cells, key=lambda cell: (cell[0], init_order(cell[1])))
    return {cell: sorted(cells[cell], key=lambda r: r.seed) for cell in order}


def init_order(name):
    """qk_init names sort alphabetically: normal, orthogonal, tied."""
    return name


def target_of(cfg):
    """The controlled projection ('k' or 'q') of a controlled run, '' for an uncontrolled one."""
    return cfg.get('control_target', 'k') if cfg.get('control', 'none') != 'none' else ''


def group_label(cfg):
    """How figures name a configuration: 'L4 normal', 'L4 normal shrink-k', 'L4 normal freeze-k-spec'."""
    label = control.control_label(cfg)
    return f"L{cfg.get('n_layer')} {cfg.get('qk_init')}" + (f' {label}' if label else '')


def seed_stack(runs, key, layer_mean=False):
    """The iterations logged by every run and a metric over them: (iters (T,), values (S, T, n_layer)), or
    with layer_mean each run's mean over its layers, (S, T), which also stacks runs of different depths."""
    common = reduce(np.intersect1d, [r.geom_iters for r in runs])
    if len(common) == 0:
        raise Skip(f'runs {", ".join(r.path for r in runs)} share no logged iteration')
    values = [r.metric(key)[np.searchsorted(r.geom_iters, common)] for r in runs]
    return common, np.stack([v.mean(axis=1) for v in values] if layer_mean else values)


# ----------------------------------------------------------------------------- tables

def fmt(v):
    """A cell for Markdown: 4 significant digits for floats, blank for None, '|' escaped (||W_QK||_2, x|scale)."""
    if v is None:
        return ''
    if isinstance(v, float):
        return 'nan' if v != v else f'{v:.4g}'
    return str(v).replace('|', '\\|')


def markdown_table(rows, columns):
    lines = ['| ' + ' | '.join(fmt(c) for c in columns) + ' |', '|' + ' --- |' * len(columns)]
    lines += ['| ' + ' | '.join(fmt(row.get(c)) for c in columns) + ' |' for row in rows]
    return '\n'.join(lines) + '\n'


def write_table(rows, out, stem, columns=None):
    """rows (list of dicts) as stem.csv and stem.md; returns the paths written."""
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    csv_path, md_path = os.path.join(out, stem + '.csv'), os.path.join(out, stem + '.md')
    with open(csv_path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows([['' if row.get(c) is None else row.get(c) for c in columns] for row in rows])
    with open(md_path, 'w') as f:
        f.write(markdown_table(rows, columns))
    return [csv_path, md_path]


TEXT_COLUMNS = {'model', 'family', 'rope', 'revision', 'qk_init', 'control', 'target', 'run', 'config_sha256',
                'done_sha256'}


def parse_cell(key, text):
    """A CSV cell written by write_table back to a value: '' -> None, True/False, int, float, else the text."""
    if key in TEXT_COLUMNS:
        return text
    if text == '':
        return None
    if text in ('True', 'False'):
        return text == 'True'
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_table(path):
    with open(path, newline='') as f:
        return [{k: parse_cell(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------- output folders
# An output folder may hold files of its user's beside an analysis: analyze.py records the files each analysis
# (kind: runs, tokens, pretrained) wrote in MANIFEST and replaces or removes only those.

MANIFEST = '.analyze.json'


class OutError(Exception):
    """An output folder that cannot or must not be written, as one line for the user."""


def read_manifest(out):
    """{kind: [file names]} of what analyses wrote into out; {} when none did."""
    path = os.path.join(out, MANIFEST)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not (isinstance(manifest, dict) and all(isinstance(v, list) for v in manifest.values())):
            raise ValueError('not a JSON object of lists')
    except (OSError, ValueError):
        raise OutError(f'{path} (the list of files analyze.py wrote there) is unreadable; remove it and the files '
                       f'of the earlier analysis, or pass another --out') from None
    return manifest


def write_manifest(out, manifest):
    path = os.path.join(out, MANIFEST)
    with open(path + '.tmp', 'w') as f:
        json.dump({kind: sorted(names) for kind, names in manifest.items() if names}, f, indent=1)
    os.replace(path + '.tmp', path)


def foreign_files(out, names):
    shown = ', '.join(names[:4]) + (f' and {len(names) - 4} more' if len(names) > 4 else '')
    return (f'{out} holds {shown}, not written by analyze.py: an analysis would overwrite them; move them away or '
            f'pass another --out')


def check_out(out, names):
    """OutError when out must not receive an analysis: a file, the root of the file system, a run folder, or a
    folder holding files named as the analysis names its own (names, a regex) that analyze.py did not write."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutError(f'--out={out} is a file, not a folder; pass a folder for the analysis')
    real = os.path.realpath(out)
    if os.path.dirname(real) == real:
        raise OutError(f'--out={out} is the root of the file system; pass a folder of its own, e.g. --out=analysis')
    if os.path.exists(os.path.join(out, 'config.json')):
        raise OutError(f'the output folder {out} is a run folder (it holds config.json); pass another --out')
    if os.path.isdir(out):
        ours = {n for kind in read_manifest(out).values() for n in kind}
        foreign = sorted(n for n in os.listdir(out) if names.fullmatch(n) and n not in ours)
        if foreign:
            raise OutError(foreign_files(out, foreign))


def write_error(out, e):
    """The one line for an OSError while writing into out."""
    fix = {errno.ENOSPC: 'free some disk space', errno.EDQUOT: 'free some disk space (quota)',
           errno.EROFS: 'the file system is read-only', errno.EACCES: 'make it writable',
           errno.EPERM: 'make it writable'}.get(e.errno)
    return f'cannot write into {out} ({e.strerror or e}): {fix + " or " if fix else ""}pass another --out'


@contextmanager
def staging(out):
    """A fresh hidden folder inside out to write an analysis into (publish moves it into out); removed on the
    way out, so a crash halfway leaves out as it was. An OSError while writing becomes an OutError."""
    try:
        os.makedirs(out, exist_ok=True)
        staged = tempfile.mkdtemp(prefix='.staging-', dir=out)
    except OSError as e:
        raise OutError(write_error(out, e)) from None
    try:
        yield staged
    except OSError as e:
        raise OutError(write_error(out, e)) from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish(staged, out, kind):
    """Move the files written into staged into out and record them in its manifest under kind. Only files the
    manifest lists go: those of the same kind of analysis from an earlier one that were not written again, and
    an earlier REPORT.md (a report never sits beside tables of another analysis; a new REPORT.md comes last).
    A file of the same name as a new one that analyze.py did not write stops it (OutError) before anything
    moves. Returns whether an old REPORT.md was removed."""
    manifest = read_manifest(out)
    ours = {n for names in manifest.values() for n in names}
    new = sorted(os.listdir(staged), key=lambda name: name == 'REPORT.md')
    foreign = [n for n in new if os.path.lexists(os.path.join(out, n)) and n not in ours]
    if foreign:
        raise OutError(foreign_files(out, foreign))
    stale = {n for n in manifest.get(kind, []) if n not in new} | ({'REPORT.md'} & ours)
    write_manifest(out, {**manifest, kind: set(manifest.get(kind, [])) | set(new)})   # lists all until moved
    old_report = os.path.isfile(os.path.join(out, 'REPORT.md')) and 'REPORT.md' in ours
    for name in stale - set(new):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))
    for name in new:
        os.replace(os.path.join(staged, name), os.path.join(out, name))
    kept = {k: [n for n in names if n not in stale or n in new] for k, names in manifest.items() if k != kind}
    write_manifest(out, {**kept, kind: new})
    return old_report and 'REPORT.md' not in new


def moved(paths, out):
    return [os.path.join(out, os.path.basename(p)) for p in paths]
