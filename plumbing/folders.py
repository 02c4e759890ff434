"""
Run folders in, files out. A run folder's config.json, done.json and metrics.jsonl(.gz) are read
once, as arrays; its settings are the config.json keys but BOOKKEEPING. A pretrained series
(pretrained.py) reads alike: its config.json has pretrained=true, and a record is a checkpoint with
its step as iter. A fault in a run's files leaves that run (or that record) out with one line
saying why, and nothing else.
"""
import csv
import gzip
import io
import json
import math
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

import control
import geometry
from plumbing import stats

BOOKKEEPING = ('out_dir', 'run_name', 'overwrite', 'seed', 'device', 'threads', 'compile',
               'ckpt_interval', 'model_ckpts', 'save_snapshots', 'data_file', 'data_dir',
               'data_url', 'dataset', 'cache_dir', 'torch', 'git_commit', 'world_size', 'n_params',
               'vocab_size', 'n_chars', 'data_cache', 'transformers', 'wandb_log', 'wandb_project',
               'wandb_run_name')
NUMBER = (int, float)
SIZES = ('n_layer', 'n_head', 'n_embd', 'block_size')   # at least 1
REQUIRED = {(int,): SIZES + ('seed', 'max_iters', 'warmup_iters'),
            (str,): ('qk_init', 'control', 'control_target', 'control_keep', 'data_sha256'),
            NUMBER: ('shrink_to', 'weight_decay'), (bool,): ('decay_qk',)}
SERIES_REQUIRED = {(int,): SIZES, (str,): ('model', 'family', 'rope')}   # of a pretrained series
FINAL_LOGS = 3
LOSSES = ('train_loss', 'val_loss')
MANIFEST = '.analyze.json'
NOT_MEASURED = 'not measured'   # a table's cell for a number that could not be computed
NOTES_SHOWN = 6                 # a run's notes warned in full; the rest are counted


class Skip(Exception):
    """A run, table or figure left out; the reason in one line."""


class OutError(Exception):
    """An --out refused, as one line."""


def require(holds, why):
    if not holds:
        raise Skip(why)


@dataclass(eq=False)   # a run is itself: hashed and compared by identity
class Run:
    path: str
    cfg: dict
    done: dict
    iters: np.ndarray   # of the geometry records
    m: dict             # metric -> (records, layers[, heads])
    losses: dict        # LOSSES -> their values in the records that log val_loss
    notes: list
    memo: dict = field(default_factory=dict)

    def __post_init__(self):
        self.name, self.n_layer = os.path.basename(self.path), self.cfg['n_layer']
        self.C, self.d = self.cfg['n_embd'], self.cfg['n_embd'] / self.cfg['n_head']
        # a pretrained series has no seed and no control
        self.seed, self.control = self.cfg.get('seed'), self.cfg.get('control', 'none')
        self.pretrained = self.cfg.get('pretrained') is True
        self.use(config_settings([self.cfg])[0])

    def use(self, settings):
        """settings, and from them setting, base (without the control keys) and arm."""
        self.settings, self.setting = settings, json.dumps(settings, sort_keys=True)
        base = {name: value for name, value in settings.items() if name not in control.KEYS}
        self.base = json.dumps(base, sort_keys=True)
        self.arm = tuple((name, settings[name]) for name in control.KEYS if name in settings)

    def final(self, key, layers=None):
        """Mean of the last FINAL_LOGS records over layers (all, or these), or NaN."""
        if key not in self.m:
            return math.nan
        return stats.nanmean(self.m[key][-FINAL_LOGS:, slice(None) if layers is None else layers])

    def final_loss(self, key):
        """done.json's train_loss or val_loss, else the last one logged."""
        found = [number(self.done.get(key)), *self.losses[key][::-1]]
        return next((float(value) for value in found if value < math.inf), math.nan)


def config_settings(configs):
    """Each config's keys but BOOKKEEPING. A control key that a kind ignores takes, in every run of
    that kind, the value most of them have: it must not split their setting."""
    settings = [{name: value for name, value in config.items() if name not in BOOKKEEPING}
                for config in configs]
    for kind in control.KINDS:
        same_kind = [setting for setting in settings if setting.get('control') == kind]
        for name in control.ignored(kind):
            counts = Counter(json.dumps(setting[name]) for setting in same_kind if name in setting)
            for common, _ in counts.most_common(1):
                for setting in same_kind:
                    setting[name] = json.loads(common)
    return settings


# ---- reading
def read_json(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as error:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(error).__name__})') from None


def read_records(path, last):
    """The records (objects with an int iter) increasing up to last, and notes on the rest."""
    lines, records, notes = [], [], []
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as log:
        try:
            lines += log
        except (EOFError, OSError, zlib.error):
            pass   # a cut log: what it holds is checked against done.json
    numbered = [(line_no, line) for line_no, line in enumerate(lines, 1) if line.strip()]
    for line_no, line in numbered:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get('iter') if isinstance(record, dict) else None
        after = records[-1]['iter'] if records else -1
        if type(step) is int and after < step <= last:
            records.append(record)
            continue
        why = 'is not a record'
        if line_no == numbered[-1][0]:
            why = 'is cut short (a kill while it was written?)'
        if type(step) is int:   # train.py trims its log to the checkpoint it resumes from
            why = f"has iteration {step}, not after {after} and up to done.json's {last}"
        notes.append(f'metrics line {line_no} {why}: left out')
    return records, notes


def check_config(config):
    """Skip naming why a config.json cannot be read as a run (or a pretrained series)."""
    require(isinstance(config, dict), 'config.json is not a JSON object')
    series = config.get('pretrained') is True
    for types, names in (SERIES_REQUIRED if series else REQUIRED).items():
        for name in names:
            require(name in config, f'config.json lacks {name}')
            what = 'number' if types == NUMBER else types[0].__name__
            require(type(config[name]) in types, f'config.json has {name}={config[name]!r}, '
                    f'not a {what}')
    wrong = [(name, 'not a finite number') for name, value in config.items()
             if type(value) is float and not math.isfinite(value)]
    wrong += [(name, 'not a count of at least 1') for name in SIZES if config[name] < 1]
    wrong += [(name, 'negative') for name in ('max_iters', 'warmup_iters')
              if config.get(name, 0) < 0]
    if not series and config['control'] not in control.KINDS:
        wrong.append(('control', f"not one of {', '.join(control.KINDS)}"))
    if config['n_head'] >= 1 and config['n_embd'] % config['n_head']:
        wrong.append(('n_embd', f"not a multiple of n_head={config['n_head']}"))
    if wrong:   # the first is named
        name, why = wrong[0]
        raise Skip(f'config.json has {name}={config[name]!r}, {why}')


def record_fault(record, n_layer, n_head):
    """Why a record's losses or layers are not what train.py logs, or ''."""
    for loss in LOSSES:
        if loss in record and not (type(record[loss]) in NUMBER and 0 <= record[loss] < math.inf):
            return f'{loss} = {record[loss]!r} is not a loss'
    if 'layers' not in record:   # a record of the losses alone
        return ''
    layers = record['layers']
    if not isinstance(layers, list) or len(layers) != n_layer:
        return f'layers is not a list of n_layer = {n_layer} layers'
    for layer in layers:
        if not isinstance(layer, dict):
            return f'layers holds {layer!r}, not a layer'
        for metric, value in layer.items():   # a per-head list is named *_heads
            per_head = metric.endswith('_heads')
            if per_head and not (isinstance(value, list) and len(value) == n_head):
                return f'{metric} is not a list of n_head = {n_head} values'
            if isinstance(value, list) and not per_head:
                return f'{metric} is a list, not a number'
    return ''


def number(value):
    """A logged value as floats (a list, or a list of lists for a spectrum per head), +inf where
    it is not a finite number."""
    if isinstance(value, list):
        return [number(each) for each in value]
    return float(value) if type(value) in NUMBER and math.isfinite(value) else math.inf


def layer_arrays(records, n_layer):
    """{metric: (records, layers[, heads])}: NaN where absent, +inf where not a finite number."""
    arrays = {}
    for row, record in enumerate(records):
        for layer, logged in enumerate(record['layers']):
            for metric, value in logged.items():
                value = number(value)
                if metric not in arrays:
                    arrays[metric] = np.full((len(records), n_layer) + np.shape(value), np.nan)
                arrays[metric][row, layer] = value
    return arrays


def bounds(metric, metrics, iters, config):
    """(low, high, ' (from the logged metric high comes from)' or '') of a metric's values by
    geometry.BOUNDS; a metric not there may be any finite number."""
    base, per_head = metric.removesuffix('_heads'), metric.endswith('_heads')
    bound = geometry.BOUNDS.get(base + '_head' if per_head else base) or geometry.BOUNDS.get(base)
    low, high = bound or (-math.inf, math.inf)
    sizes = {'C': config['n_embd'], 'd': config['n_embd'] / config['n_head'],
             'log T': math.log(config['block_size'])}
    if not isinstance(high, str) or high in sizes:
        return low, sizes.get(high, high), ''
    if high == 'drift':   # 2 + 2 qk_gram(0) / qk_gram, head by head, from a first record at step 0
        if 'qk_gram_heads' not in metrics or iters[0] != 0:
            return low, math.inf, ''
        with np.errstate(divide='ignore', invalid='ignore'):
            ratio = metrics['qk_gram_heads'][:1] / metrics['qk_gram_heads']
        return low, 2 + 2 * (ratio if per_head else ratio.mean(-1)), ' (from qk_gram_heads)'
    source = high + '_heads' if per_head else high
    return (low, metrics[source], f' (from {source})') if source in metrics else (low, math.inf, '')


def bad_records(metrics, iters, config, notes):
    """The records to leave out, each noted with the metric and value that leave it out."""
    bad = np.zeros(len(iters), bool)
    for metric, values in metrics.items():
        low, high, source = bounds(metric, metrics, iters, config)
        # softmax rows in bf16 sum to 1 within ~4e-3: an entropy may pass its bound by that much
        slack = 1e-2 if metric.startswith('entropy') else 1e-6
        with np.errstate(invalid='ignore'):   # NaN (not logged) is in range: it bounds nothing
            outside = (values < low - slack * abs(low)) | (values > high + slack * abs(high))
        wrong = (np.isinf(values) | (values != 0) & outside).reshape(len(values), -1)
        highs = np.broadcast_to(high, values.shape)
        for row in np.flatnonzero(wrong.any(1) & ~bad):
            column = wrong[row].argmax()
            value, top = values[row].flat[column], highs[row].flat[column]
            reason = f'= {value:.4g} outside [{low:.4g}, {top:.4g}]{source}'
            if np.isinf(value):   # number() marks NaN and infinities alike
                reason = 'is not a finite number'
            notes.append(f'the record of iteration {iters[row]} is left out: {metric} {reason}')
        bad |= wrong.any(1)
    return bad


def load_run(path):
    """A finished run folder (or pretrained series) as a Run, or Skip naming why."""
    config = read_json(f'{path}/config.json')
    check_config(config)
    log_name = next((name for name in ('metrics.jsonl', 'metrics.jsonl.gz')
                     if os.path.isfile(f'{path}/{name}')), '')
    require(os.path.exists(f'{path}/done.json'), 'unfinished (no done.json)')
    require(log_name, 'no metrics.jsonl')
    done = read_json(f'{path}/done.json')   # its iteration is the last a finished run logged
    last = done.get('iter') if isinstance(done, dict) else None
    require(type(last) is int and last >= 0, f'done.json has iter={last!r}, not an iteration')
    require(last == config.get('max_iters', last), f'done.json is at iteration {last}, '
            f"config.json has max_iters={config.get('max_iters')}")
    records, notes = read_records(f'{path}/{log_name}', last)
    ended = records[-1]['iter'] if records else last   # final values read at a cut would mislead
    require(ended == last, f'{log_name} ends at iteration {ended}, done.json at {last}: cut short')
    faults = [record_fault(record, config['n_layer'], config['n_head']) for record in records]
    notes += [f"the record of iteration {record['iter']} is left out: {fault}"
              for record, fault in zip(records, faults) if fault]
    records = [record for record, fault in zip(records, faults) if not fault]
    with_layers = [record for record in records if 'layers' in record]
    require(with_layers, f'{log_name} holds no geometry record')
    metrics = layer_arrays(with_layers, config['n_layer'])
    iters = np.array([record['iter'] for record in with_layers], dtype=int)
    keep = ~bad_records(metrics, iters, config, notes)
    first = next((note for note in notes if note.startswith('the record')), '')
    require(keep.any(), f'none of its {len(with_layers)} geometry records is usable ({first})')
    final = next((record for record in records if record['iter'] == last), {})
    for loss in LOSSES:   # train.py copies the final record's losses into done.json
        if loss in final and done.get(loss) != final[loss]:
            notes.append(f'done.json has {loss} = {done.get(loss)!r}, not {final[loss]!r} as '
                         f'logged at its iteration {last}: the logged one is used')
            done[loss] = final[loss]
    with_losses = [record for record in records if 'val_loss' in record]
    losses = {loss: np.array([number(record.get(loss)) for record in with_losses])
              for loss in LOSSES}
    kept = {metric: values[keep] for metric, values in metrics.items()}
    return Run(path, config, done, iters[keep], kept, losses, notes)


def find_runs(paths, left_out):
    """Folders holding config.json under paths, each once, not in snapshots/ or models/. A link is
    followed where it stays under paths (one to an ancestor would pull sibling studies in); the
    others go to left_out as (link, why)."""
    tops = [os.path.realpath(path) for path in paths]
    found, seen = [], set()
    for top in paths:
        for root, children, files in os.walk(top, followlinks=True):
            real = os.path.realpath(root)
            children[:] = [] if real in seen else sorted(set(children) - {'snapshots', 'models'})
            if 'config.json' in files and real not in seen:
                found.append(os.path.normpath(root))
            seen.add(real)
            for name in list(children):
                target = os.path.realpath(os.path.join(root, name))
                if not any(os.path.commonpath([inside, target]) == inside for inside in tops):
                    children.remove(name)
                    why = f'a link to {target}, outside the folders given'
                    left_out.append((os.path.join(root, name), why))
    return sorted(found)


def load_runs(paths, warn):
    """(runs, [(path, why skipped)]) of the run folders under paths; notes go to warn."""
    loaded, skipped, first_runs = [], [], {}
    for path in find_runs(paths, skipped):
        try:
            loaded.append(load_run(path))
        except Skip as error:
            skipped.append((path, str(error)))
    for run, settings in zip(loaded, config_settings([run.cfg for run in loaded])):
        run.use(settings)
        first = first_runs.setdefault((run.setting, run.seed), run)
        if first is not run:
            skipped.append((run.path, f'duplicate of {first.path} (the same settings and seed)'))
    runs = list(first_runs.values())
    skipped.sort()
    for path, why in skipped:
        warn(f'skipped {path}: {why}')
    for run in runs:   # kept apart: it may differ in what it lacks
        fuller = [other.settings for other in runs if run.settings.items() < other.settings.items()]
        if fuller:
            missing = ', '.join(sorted(set().union(*fuller) - set(run.settings)))
            run.notes.insert(0, f'config.json lacks {missing}, which {len(fuller)} run(s) of '
                                'otherwise the same settings have: kept as a setting of its own')
        logged = set().union(*(other.m for other in runs if other.setting == run.setting))
        lost = ', '.join(sorted(logged - set(run.m)))
        if lost:
            run.notes.append(f'{lost} not logged, unlike other seeds of its setting')
        more = len(run.notes) - NOTES_SHOWN
        for note in run.notes[:NOTES_SHOWN] + ([f'and {more} more notes'] if more > 0 else []):
            warn(f'{run.path}: {note}')
    return runs, skipped


# ---- tables and the output folder
def markdown(rows, columns=None, missing=None):
    """A markdown table of rows (dicts); a cell a row lacks shows missing."""
    def cell_text(value):
        if isinstance(value, float):
            return f'{value:.4g}' if math.isfinite(value) else NOT_MEASURED
        return '' if value is None else str(value).replace('|', '\\|')

    def table_line(values):
        return '| ' + ' | '.join(map(cell_text, values)) + ' |'
    columns = columns or list(dict.fromkeys(column for row in rows for column in row))
    table_lines = [table_line(columns), '|' + ' --- |' * len(columns)]
    table_lines += [table_line(row.get(column, missing) for column in columns) for row in rows]
    return '\n'.join(table_lines) + '\n'


def table(stem, rows, columns=None):
    """{stem.csv: text, stem.md: text} of rows (dicts); {} without rows. A number that could not be
    computed is an empty csv cell."""
    if not rows:
        return {}
    columns = columns or list(dict.fromkeys(column for row in rows for column in row))
    text = io.StringIO()
    writer = csv.writer(text, lineterminator='\n')
    writer.writerow(columns)
    for row in rows:
        values = [row.get(column) for column in columns]
        writer.writerow(['' if isinstance(value, float) and not math.isfinite(value) else value
                         for value in values])
    return {f'{stem}.csv': text.getvalue(), f'{stem}.md': markdown(rows, columns)}


def check_out(out):
    """OutError when out is /, a file, a run folder or a folder inside one."""
    real = folder = os.path.realpath(out)
    if os.path.dirname(real) == real:
        raise OutError(f'--out={out} is the root folder; pass a folder of its own')
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutError(f'--out={out} is a file; pass a folder')
    while os.path.dirname(folder) != folder:
        if os.path.isfile(os.path.join(folder, 'config.json')):
            where = 'inside the run folder' if folder != real else 'the run folder'
            raise OutError(f'--out={out} is {where} {folder}; pass another --out')
        folder = os.path.dirname(folder)


def plain_name(name):
    return isinstance(name, str) and name not in ('', '.', '..') and os.path.basename(name) == name


def write_files(out, files):
    """Write {name: text or bytes} into out and remove the files MANIFEST lists but files does not;
    OutError first if a name is there but not in MANIFEST."""
    check_out(out)
    manifest = os.path.join(out, MANIFEST)
    try:   # the plain names the analysis wrote into out (an object: its keys)
        ours = json.load(open(manifest)) if os.path.exists(manifest) else []
    except (OSError, ValueError):
        ours = None
    if not isinstance(ours, (list, dict)) or not all(map(plain_name, ours)):
        raise OutError(f'{manifest} is not a list of file names in {out}: '
                       'remove it, or pass another --out')
    foreign = sorted(name for name in files
                     if os.path.lexists(os.path.join(out, name)) and name not in ours)
    if foreign:
        raise OutError(f'{out} holds {", ".join(foreign)}, not written by analyze.py: '
                       'move them or pass another --out')
    kinds = {name.rsplit('.')[-1] for name in files}   # --no_figures removes no figure
    stale = [name for name in ours if name not in files and name.rsplit('.')[-1] in kinds]
    # the manifest lists every file before any is written: a rerun after a full disk owns them
    claimed = json.dumps(sorted(set(ours) | set(files)), indent=0)
    final = json.dumps(sorted(set(ours) - set(stale) | set(files)), indent=0)
    try:
        os.makedirs(out, exist_ok=True)
        for name, data in [(MANIFEST, claimed), *files.items(), (MANIFEST, final)]:
            with open(os.path.join(out, name + '.tmp'), 'wb') as temporary:
                temporary.write(data.encode() if isinstance(data, str) else data)
            os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name))
        for name in stale:
            if os.path.isfile(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
    except OSError as error:
        why = error.strerror or error
        raise OutError(f'cannot write into {out}: {why}; pass another --out') from None
    return [os.path.join(out, name) for name in files]
