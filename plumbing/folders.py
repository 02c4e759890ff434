"""
Run folders in, files out: each run's config.json, done.json and metrics.jsonl(.gz), read once as
arrays; its settings are the config.json keys but BOOKKEEPING. A pretrained series (pretrained.py)
is read alike: its config.json has pretrained=true; a record is a checkpoint, iter its step.
A fault in a run's files leaves that run (or that record) out with one line, and nothing else.
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


class Skip(Exception):
    """A run, table or figure left out; the reason in one line."""


class OutError(Exception):
    """An --out refused, as one line."""


@dataclass(eq=False)     # a run is itself: hashed and compared by identity
class Run:
    path: str
    cfg: dict
    done: dict
    iters: np.ndarray   # of the geometry records
    m: dict             # metric -> (records, layers[, heads])
    losses: dict        # LOSSES
    notes: list
    memo: dict = field(default_factory=dict)

    def __post_init__(self):
        c = self.cfg
        self.name, self.n_layer = os.path.basename(self.path), c['n_layer']
        self.C, self.d = c['n_embd'], c['n_embd'] / c['n_head']
        # a pretrained series has no seed and no control
        self.seed, self.control = c.get('seed'), c.get('control', 'none')
        self.pretrained = c.get('pretrained') is True
        self.use(config_settings([c])[0])

    def use(self, settings):
        """settings, and from them setting, base (no control keys), arm."""
        self.settings, self.setting = settings, json.dumps(settings, sort_keys=True)
        base = {k: v for k, v in settings.items() if k not in control.KEYS}
        self.base = json.dumps(base, sort_keys=True)
        self.arm = tuple((k, settings[k]) for k in control.KEYS if k in settings)

    def final(self, key, layers=None):
        """Mean of the last FINAL_LOGS records over layers (all, or these), or NaN."""
        if key not in self.m:
            return math.nan
        return stats.nanmean(self.m[key][-FINAL_LOGS:, slice(None) if layers is None else layers])

    def final_loss(self, key):
        """done.json's train_loss or val_loss, else the last one logged."""
        found = [number(self.done.get(key)), *self.losses[key][::-1]]
        return next((float(v) for v in found if v < math.inf), math.nan)


def config_settings(cfgs):
    """Each config's keys but BOOKKEEPING; a key its control kind ignores as most of its kind."""
    out = [{k: v for k, v in c.items() if k not in BOOKKEEPING} for c in cfgs]
    for kind in control.KINDS:
        ss = [s for s in out if s.get('control') == kind]
        for k in control.ignored(kind):
            for v, _ in Counter(json.dumps(s[k]) for s in ss if k in s).most_common(1):
                for s in ss:
                    s[k] = json.loads(v)
    return out


# ---- reading
def read_json(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__})') from None


def read_records(path, last, notes):
    """The records (objects with an int iter) increasing up to iteration last; other lines noted."""
    lines, found = [], []
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        try:
            lines += f
        except (EOFError, OSError, zlib.error):
            pass   # a cut log: what it holds is checked against done.json
    lines = [(i, s) for i, s in enumerate(lines, 1) if s.strip()]
    for i, line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        it = rec.get('iter') if isinstance(rec, dict) else None
        after = found[-1]['iter'] if found else -1
        if type(it) is int and after < it <= last:
            found.append(rec)
            continue
        cut = i == lines[-1][0]
        why = 'is cut short (a kill while it was written?)' if cut else 'is not a record'
        if type(it) is int:   # train.py trims its log to the checkpoint it resumes from
            why = f'has iteration {it}, not after {after} and up to done.json\'s {last}'
        notes.append(f'metrics line {i} {why}: left out')
    return found


def check_config(cfg):
    """Skip naming why a config.json cannot be read as a run (or a pretrained series)."""
    if not isinstance(cfg, dict):
        raise Skip('config.json is not a JSON object')
    series = cfg.get('pretrained') is True
    for kind, keys in (SERIES_REQUIRED if series else REQUIRED).items():
        for key in keys:
            if key not in cfg:
                raise Skip(f'config.json lacks {key}')
            if type(cfg[key]) not in kind:
                what = 'number' if kind == NUMBER else kind[0].__name__
                raise Skip(f'config.json has {key}={cfg[key]!r}, not a {what}')
    wrong = [(k, 'not a finite number') for k, v in cfg.items()
             if type(v) is float and not math.isfinite(v)]
    wrong += [(k, 'not a count of at least 1') for k in SIZES if cfg[k] < 1]
    wrong += [(k, 'negative') for k in ('max_iters', 'warmup_iters') if cfg.get(k, 0) < 0]
    if not series and cfg['control'] not in control.KINDS:
        wrong.append(('control', f"not one of {', '.join(control.KINDS)}"))
    if not wrong and cfg['n_embd'] % cfg['n_head']:   # n_head is at least 1 here
        wrong.append(('n_embd', f"not a multiple of n_head={cfg['n_head']}"))
    if wrong:
        key, why = wrong[0]
        raise Skip(f'config.json has {key}={cfg[key]!r}, {why}')


def record_fault(rec, n_layer, n_head):
    """Why a record's losses or layers are not what train.py logs, or ''."""
    for k in LOSSES:
        if k in rec and not (type(rec[k]) in NUMBER and 0 <= rec[k] < math.inf):
            return f'{k} = {rec[k]!r} is not a loss'
    if 'layers' not in rec:   # a record of the losses alone
        return ''
    layers = rec['layers']
    if not isinstance(layers, list) or len(layers) != n_layer:
        return f'layers is not a list of n_layer = {n_layer} layers'
    for layer in layers:
        if not isinstance(layer, dict):
            return f'layers holds {layer!r}, not a layer'
        for k, v in layer.items():   # a per-head list is named *_heads
            if k.endswith('_heads') and not (isinstance(v, list) and len(v) == n_head):
                return f'{k} is not a list of n_head = {n_head} values'
            if isinstance(v, list) and not k.endswith('_heads'):
                return f'{k} is a list, not a number'
    return ''


def number(v):
    """A logged value as floats (a list, or a list of lists for a spectrum per head), +inf where
    it is not a finite number."""
    if isinstance(v, list):
        return [number(x) for x in v]
    return float(v) if type(v) in NUMBER and math.isfinite(v) else math.inf


def layer_arrays(geo, n_layer):
    """{key: (records, layers[, heads])}: NaN where absent, +inf where not a finite number."""
    out = {}
    for r, rec in enumerate(geo):
        for i, layer in enumerate(rec['layers']):
            for k, v in layer.items():
                v = number(v)
                if k not in out:
                    out[k] = np.full((len(geo), n_layer) + np.shape(v), np.nan)
                out[k][r, i] = v
    return out


def bounds(key, m, iters, cfg):
    """(low, high, the logged key high comes from or '') of key's values by geometry.BOUNDS; a key
    not there may be any finite number."""
    base, heads, C = key.removesuffix('_heads'), key.endswith('_heads'), cfg['n_embd']
    row = geometry.BOUNDS.get(base + '_head' if heads else key) or geometry.BOUNDS.get(base)
    low, name = row or (-math.inf, math.inf)
    sizes = {'C': C, 'd': C / cfg['n_head'], 'log T': math.log(cfg['block_size'])}
    if not isinstance(name, str) or name in sizes:
        return low, sizes.get(name, name), ''
    if name == 'drift':   # 2 + 2 qk_gram(0) / qk_gram, head by head, from a first record at step 0
        if 'qk_gram_heads' not in m or iters[0] != 0:
            return low, math.inf, ''
        with np.errstate(divide='ignore', invalid='ignore'):
            ratio = m['qk_gram_heads'][:1] / m['qk_gram_heads']
        return low, 2 + 2 * (ratio if heads else ratio.mean(-1)), 'qk_gram_heads'
    by = name + '_heads' if heads else name
    return (low, m[by], by) if by in m else (low, math.inf, '')


def bad_records(m, iters, cfg, notes):
    """The records to leave out, each noted with its key and value."""
    bad = np.zeros(len(iters), bool)
    for key, a in m.items():
        lo, hi, by = bounds(key, m, iters, cfg)
        # softmax rows in bf16 sum to 1 within ~4e-3: an entropy may pass its bound by that much
        tol = 1e-2 if key.startswith('entropy') else 1e-6
        with np.errstate(invalid='ignore'):   # NaN (not logged) is in range: it bounds nothing
            wrong = np.isinf(a) | (a != 0) & ((a < lo - tol * abs(lo)) | (a > hi + tol * abs(hi)))
        flat, wrong = a.reshape(len(a), -1), wrong.reshape(len(a), -1)
        high = np.broadcast_to(hi, a.shape).reshape(len(a), -1)
        for r in np.flatnonzero(wrong.any(1) & ~bad):
            j = wrong[r].argmax()
            why = f'= {flat[r, j]:.4g} outside [{lo:.4g}, {high[r, j]:.4g}]'
            why += f' (from {by})' if by else ''
            if np.isinf(flat[r, j]):   # number() marks NaN and infinities alike
                why = 'is not a finite number'
            notes.append(f'the record of iteration {iters[r]} is left out: {key} {why}')
        bad |= wrong.any(1)
    return bad


def load_run(path):
    """A finished run folder (or pretrained series) as a Run, or Skip naming why."""
    cfg = read_json(f'{path}/config.json')
    check_config(cfg)
    log = [p for p in (f'{path}/metrics.jsonl', f'{path}/metrics.jsonl.gz') if os.path.isfile(p)]
    if not os.path.exists(f'{path}/done.json'):
        raise Skip('unfinished (no done.json)')
    if not log:
        raise Skip('no metrics.jsonl')
    done = read_json(f'{path}/done.json')   # its iteration is the last a finished run logged
    it = done.get('iter') if isinstance(done, dict) else None
    if type(it) is not int or it < 0:
        raise Skip(f'done.json has iter={it!r}, not an iteration')
    if it != cfg.get('max_iters', it):
        raise Skip(f"done.json is at iteration {it}, config.json has max_iters={cfg['max_iters']}")
    notes = []
    recs = read_records(log[0], it, notes)
    if recs and recs[-1]['iter'] < done['iter']:   # its final values would be read at the cut
        raise Skip(f"{os.path.basename(log[0])} ends at iteration {recs[-1]['iter']}, done.json at "
                   f"{done['iter']}: cut short")
    faults = {r['iter']: record_fault(r, cfg['n_layer'], cfg['n_head']) for r in recs}
    notes += [f'the record of iteration {it} is left out: {why}' for it, why in faults.items()
              if why]
    recs = [r for r in recs if not faults[r['iter']]]
    geo = [r for r in recs if 'layers' in r]
    m, iters = layer_arrays(geo, cfg['n_layer']), np.array([r['iter'] for r in geo], dtype=int)
    keep = ~bad_records(m, iters, cfg, notes)
    if not keep.any():
        left = next((n for n in notes if n.startswith('the record')), '')
        raise Skip(f'none of its {len(geo)} geometry records is usable ({left})' if geo else
                   f'{os.path.basename(log[0])} holds no geometry record')
    last = next((r for r in recs if r['iter'] == done['iter']), {})   # train.py copies its losses
    for k in LOSSES:
        if k in last and done.get(k) != last[k]:
            notes.append(f"done.json has {k} = {done.get(k)!r}, not {last[k]!r} as logged at its "
                         f"iteration {last['iter']}: the logged one is used")
            done[k] = last[k]
    losses = {k: np.array([number(r.get(k)) for r in recs if 'val_loss' in r]) for k in LOSSES}
    return Run(path, cfg, done, iters[keep], {k: v[keep] for k, v in m.items()}, losses, notes)


def find_runs(paths, left_out):
    """Folders holding config.json under paths, each once, not in snapshots/ or models/. A link is
    followed where it stays under paths (one to an ancestor would pull sibling studies in); the
    others go to left_out as (link, why)."""
    tops = [os.path.realpath(p) for p in paths]
    found, seen = [], set()
    for top in paths:
        for root, dirs, files in os.walk(top, followlinks=True):
            real = os.path.realpath(root)
            names, dirs[:] = sorted(d for d in dirs if d not in ('snapshots', 'models')), []
            if real in seen:
                continue
            seen.add(real)
            if 'config.json' in files:
                found.append(os.path.normpath(root))
            for d in names:
                target = os.path.realpath(os.path.join(root, d))
                if any(os.path.commonpath([t, target]) == t for t in tops):
                    dirs.append(d)
                else:
                    why = f'a link to {target}, outside the folders given'
                    left_out.append((os.path.join(root, d), why))
    return sorted(found)


def load_runs(paths, warn):
    """(runs, [(path, why skipped)]) of the run folders under paths; notes go to warn."""
    loaded, skipped, seen = [], [], {}
    for path in find_runs(paths, skipped):
        try:
            loaded.append(load_run(path))
        except Skip as e:
            skipped.append((path, str(e)))
    for r, settings in zip(loaded, config_settings([r.cfg for r in loaded])):
        r.use(settings)
        first = seen.setdefault((r.setting, r.seed), r.path)
        if first != r.path:
            skipped.append((r.path, f'duplicate of {first} (the same settings and seed)'))
    runs = [r for r in loaded if seen[r.setting, r.seed] == r.path]
    for r in runs:   # kept apart: it may differ in what it lacks
        logged = set().union(*(s.m for s in runs if s.setting == r.setting))
        lost = ', '.join(sorted(logged - set(r.m)))
        like = [s.settings for s in runs if r.settings.items() < s.settings.items()]
        if like:
            keys = ', '.join(sorted(set().union(*like) - set(r.settings)))
            r.notes.insert(0, f'config.json lacks {keys}, which {len(like)} run(s) of '
                              'otherwise the same settings have: kept as a setting of its own')
        if lost:
            r.notes.append(f'{lost} not logged, unlike other seeds of its setting')
    skipped.sort()
    for path, why in skipped:
        warn(f'skipped {path}: {why}')
    for r in runs:
        more = [f'and {len(r.notes) - 6} more notes'] if len(r.notes) > 6 else []
        for note in r.notes[:6] + more:
            warn(f'{r.path}: {note}')
    return runs, skipped


# ---- tables and the output folder
def markdown(rows, columns=None, missing=None):
    """A markdown table of rows (dicts); a cell a row lacks shows missing."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    def cell(v):
        if isinstance(v, float):
            return f'{v:.4g}' if math.isfinite(v) else NOT_MEASURED
        return '' if v is None else str(v)
    def line(values):
        return '| ' + ' | '.join(cell(v).replace('|', '\\|') for v in values) + ' |'
    lines = [line(columns), '|' + ' --- |' * len(columns)]
    for r in rows:
        lines.append(line(r.get(c, missing) for c in columns))
    return '\n'.join(lines) + '\n'


def csv_cell(v):
    """A value as csv writes it; a number that could not be computed is an empty cell."""
    return '' if isinstance(v, float) and not math.isfinite(v) else v


def table(stem, rows, columns=None):
    """{stem.csv: text, stem.md: text} of rows (dicts); {} without rows."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    csv.writer(buf, lineterminator='\n').writerow(columns)
    for r in rows:
        csv.writer(buf, lineterminator='\n').writerow([csv_cell(r.get(c)) for c in columns])
    return {f'{stem}.csv': buf.getvalue(), f'{stem}.md': markdown(rows, columns)} if rows else {}


def check_out(out):
    """OutError when out is /, a file, a run folder or a folder inside one."""
    real = p = os.path.realpath(out)
    if os.path.dirname(real) == real:
        raise OutError(f'--out={out} is the root folder; pass a folder of its own')
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutError(f'--out={out} is a file; pass a folder')
    while os.path.dirname(p) != p:
        if os.path.isfile(os.path.join(p, 'config.json')):
            where = 'inside the run folder' if p != real else 'the run folder'
            raise OutError(f'--out={out} is {where} {p}; pass another --out')
        p = os.path.dirname(p)


def write_files(out, files):
    """Write {name: text or bytes} into out and remove the files MANIFEST lists but files does not;
    OutError first if a name is there but not in MANIFEST."""
    check_out(out)
    def at(n):
        return os.path.join(out, n)
    try:   # the plain names the analysis wrote into out
        ours = json.load(open(at(MANIFEST))) if os.path.exists(at(MANIFEST)) else []
    except (OSError, ValueError):
        ours = None
    def plain(n):
        return isinstance(n, str) and n not in ('', '.', '..') and os.path.basename(n) == n
    if not isinstance(ours, (list, dict)) or not all(map(plain, ours)):   # an object: its keys
        raise OutError(f'{at(MANIFEST)} is not a list of file names in {out}: remove it, or pass '
                       'another --out')
    foreign = sorted(n for n in files if os.path.lexists(at(n)) and n not in ours)
    if foreign:
        raise OutError(f'{out} holds {", ".join(foreign)}, not written by analyze.py: move them or '
                       'pass another --out')
    written = {n.rsplit('.')[-1] for n in files}   # --no_figures removes no figure
    stale = [n for n in ours if n not in files and n.rsplit('.')[-1] in written]
    mine = sorted(set(ours) - set(stale) | set(files))
    # the manifest names every file before any is written, so a stop half-way (a full disk)
    # leaves files that a rerun knows as its own
    claimed = json.dumps(sorted(set(ours) | set(files)), indent=0)
    try:
        os.makedirs(out, exist_ok=True)
        final = [(MANIFEST, json.dumps(mine, indent=0))]
        for name, data in [(MANIFEST, claimed), *files.items(), *final]:
            with open(at(name + '.tmp'), 'wb') as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.replace(at(name + '.tmp'), at(name))
        for name in (n for n in stale if os.path.isfile(at(n))):
            os.remove(at(name))
    except OSError as e:
        raise OutError(f'cannot write into {out}: {e.strerror or e}; pass another --out') from None
    return list(map(at, files))
