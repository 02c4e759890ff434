"""
Run folders in, files out: the analysis' I/O. A run folder holds config.json; the analysis reads its config.json,
done.json (without it the run is unfinished and skipped) and metrics.jsonl(.gz), once, as arrays (Run.m: one
(records, layers) array per per-layer metric, one (records, layers, heads) array per per-head list; NaN where a key
was not logged). fig4 alone opens snapshots/, where they exist.

Settings are every config.json key but BOOKKEEPING: a key a forker adds is a setting with no edit here, and the data
enter as data_sha256, the hash of the text's content, not its file name. A control arm is the values of CONTROL_KEYS.

Left out with one line each: a run whose config.json lacks or mistypes a field of REQUIRED; an unfinished run; a
duplicate (same settings and seed); a line of metrics.jsonl that is not a record; a bad record, with a value not
finite or outside its definitional range (bounds). A metric some seeds of a setting did not log is noted.
Output folders: the analysis writes only files of its own names, listed in MANIFEST, refuses to replace one it did not
write, deletes nothing, and refuses /, a run folder and a folder inside one.
"""
import csv
import gzip
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import reduce

import numpy as np

BOOKKEEPING = ('out_dir', 'run_name', 'overwrite', 'seed', 'device', 'threads', 'compile', 'ckpt_interval',
               'model_ckpts', 'save_snapshots', 'data_file', 'data_dir', 'data_url', 'dataset', 'cache_dir',
               'torch', 'git_commit', 'world_size', 'n_params', 'vocab_size', 'n_chars', 'data_cache')
CONTROL_KEYS = ('control', 'control_target', 'control_scope', 'control_keep', 'control_layers', 'control_interval',
                'shrink_to', 'shrink_iters')
NUMBER = (int, float)
REQUIRED = {'n_layer': int, 'n_head': int, 'n_embd': int, 'block_size': int, 'seed': int, 'max_iters': int,
            'warmup_iters': int, 'qk_init': str, 'control': str, 'control_target': str, 'control_keep': str,
            'shrink_to': NUMBER, 'weight_decay': NUMBER, 'decay_qk': bool, 'data_sha256': str}
KINDS = ('none', 'shrink', 'freeze')
FINAL_LOGS = 3
MANIFEST = '.analyze.json'
PR_KEYS = {f'{p}{w}{h}' for p in ('pr_', 'pr_d', 'tok_pr_') for w in 'qk' for h in ('', '_head')} | {'pr_qk',
                                                                                                     'tok_pr_qk'}


class Skip(Exception):
    """A run, table or figure left out, with the reason in one line."""


class OutError(Exception):
    """An output folder that must not or cannot be written, as one line."""


@dataclass(eq=False)     # a run is itself: hashed and compared by identity
class Run:
    path: str
    cfg: dict
    done: dict
    iters: np.ndarray            # iterations of the geometry records
    m: dict                      # metric -> (records, layers) or (records, layers, heads)
    losses: dict                 # train_loss, val_loss of the loss records
    notes: list
    memo: dict = field(default_factory=dict)

    def __post_init__(self):
        self.name, self.n_layer, self.seed, self.control = os.path.basename(self.path), *(self.cfg[k] for k in (
            'n_layer', 'seed', 'control'))
        self.C, self.d = self.cfg['n_embd'], self.cfg['n_embd'] / self.cfg['n_head']
        self.settings = {k: v for k, v in self.cfg.items() if k not in BOOKKEEPING}
        self.setting = json.dumps(self.settings, sort_keys=True)
        self.base = json.dumps({k: v for k, v in self.settings.items() if k not in CONTROL_KEYS}, sort_keys=True)
        self.arm = tuple((k, self.cfg.get(k)) for k in CONTROL_KEYS)

    def final(self, key, layers=None):
        """The mean over the last FINAL_LOGS records and over layers (all, or the given ones); NaN if not logged."""
        v = self.m[key][-FINAL_LOGS:, slice(None) if layers is None else layers] if key in self.m else \
            np.full(1, np.nan)
        return float(np.mean(v[np.isfinite(v)])) if np.isfinite(v).any() else math.nan

    def final_loss(self, key):
        """done.json's train_loss or val_loss, else the last one logged."""
        v, logged = self.done.get(key), self.losses[key][np.isfinite(self.losses[key])]
        return float(v) if type(v) in NUMBER and math.isfinite(v) else float(logged[-1]) if len(logged) else math.nan


def arm_label(cfg, extra=()):
    """'shrink0.1-k-spec', 'freeze-k' (without a dose: 'shrink-k'), then the control keys in extra; '' for none."""
    if cfg.get('control', 'none') == 'none':
        return ''
    dose = f"{cfg['shrink_to']:g}" if cfg['control'] == 'shrink' and 'shrink_to' in cfg else ''
    keep = '' if cfg.get('control_keep') == 'fro' else f"-{cfg.get('control_keep')}"
    return f"{cfg['control']}{dose}-{cfg.get('control_target')}{keep}" + ''.join(f' {k}={cfg[k]}' for k in extra
                                                                                 if k in cfg)


# ----------------------------------------------------------------------------- reading
def read_json(path):
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__})') from None
    if isinstance(obj, dict):
        return obj
    raise Skip(f'{os.path.basename(path)} does not hold a JSON object')


def read_records(path, notes):
    """The records (JSON objects with an integer iter) of metrics.jsonl(.gz), by iteration (a repeated one keeps its
    last record). A line that is not one is left out with a note; a cut last line says so."""
    data = b''
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        try:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                data += chunk
        except (EOFError, OSError):
            notes.append(f'{os.path.basename(path)} is cut short: the records after the cut are lost')
    lines, by_iter = [(i, s) for i, s in enumerate(data.split(b'\n'), 1) if s.strip()], {}
    for i, line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and type(rec.get('iter')) is int:
            by_iter[rec['iter']] = rec
        else:
            notes.append(f'metrics line {i} ' + ('is cut short (a kill while it was written?): left out'
                                                  if i == lines[-1][0] else 'is not a record: left out'))
    return [by_iter[it] for it in sorted(by_iter)]


def check_config(cfg):
    """The first field of REQUIRED that config.json lacks or mistypes, as a reason; None when all are fine."""
    for key, kind in REQUIRED.items():
        if key not in cfg:
            return f'config.json lacks {key}'
        if not (type(cfg[key]) in kind if isinstance(kind, tuple) else type(cfg[key]) is kind):
            return f"config.json has {key}={cfg[key]!r}, not {'a number' if kind is NUMBER else 'a ' + kind.__name__}"
    return None if cfg['control'] in KINDS else f"config.json has control={cfg['control']!r}, not one of " \
                                                f"{', '.join(KINDS)}"


def bounds(key, cfg):
    """(lo, hi, relative tolerance) of a logged value's definitional range; None when it has none."""
    base = key[:-len('_heads')] if key.endswith('_heads') else key
    base = base + '_head' if key.endswith('_heads') and base + '_head' in PR_KEYS else base
    if base in PR_KEYS:
        return 1.0, cfg['n_embd'] / (cfg['n_head'] if base.endswith('_head') or 'qk' in base else 1), 1e-9
    if base in ('entropy', 'entropy_norm'):   # a float32 softmax row sums to 1 within ~1e-7; bf16 to ~4e-3
        return 0.0, math.log(cfg['block_size']) if base == 'entropy' else 1.0, 1e-2
    return (0.0, math.inf, 0) if base.endswith(('_norm', '_rel', '_imbalance', '_drift', '_gram')) else None


def number(v):
    return float(v) if type(v) in NUMBER and math.isfinite(v) else math.inf


def layer_arrays(geo, n_layer, notes):
    """{key: array} over the geometry records: NaN where a key is absent, +inf where a value is not a number."""
    cells = {}
    for r, rec in enumerate(geo):
        for i, layer in enumerate(rec['layers']):
            for k, v in layer.items():
                cells.setdefault(k, {})[r, i] = v
    out = {}
    for key, found in cells.items():
        width = max(len(v) if isinstance(v, list) else -1 for v in found.values())
        width = None if width < 0 else width
        out[key] = np.full((len(geo), n_layer) + (() if width is None else (width,)), np.nan)
        for (r, i), v in found.items():
            out[key][r, i] = [number(x) for x in v] if width is not None else number(v)
    return out


def bad_records(m, iters, cfg, notes):
    """The mask of the records to leave out, with a note per bad record naming its key and value."""
    bad = np.zeros(len(iters), bool)
    for key, a in m.items():
        lim, flat = bounds(key, cfg), a.reshape(len(a), -1)
        wrong = np.isinf(flat)
        if lim:
            with np.errstate(invalid='ignore'):
                wrong |= (flat != 0) & ((flat < lim[0] * (1 - lim[2])) | (flat > lim[1] * (1 + lim[2])))
        for r in np.flatnonzero(wrong.any(1) & ~bad):
            v = flat[r][wrong[r]][0]
            why = f'outside [{lim[0]:g}, {lim[1]:.4g}]' if lim and not np.isinf(v) else 'is not a finite number'
            notes.append(f'the record of iteration {iters[r]} is left out: {key} = {v:.4g} {why}')
        bad |= wrong.any(1)
    return bad


def load_run(path):
    """A finished run folder as a Run; Skip with the reason in one line."""
    cfg = read_json(os.path.join(path, 'config.json'))
    problem = check_config(cfg) or ('' if os.path.exists(os.path.join(path, 'done.json')) else 'unfinished (no '
                                                                                                'done.json)')
    log = [p for p in (os.path.join(path, n) for n in ('metrics.jsonl', 'metrics.jsonl.gz')) if os.path.isfile(p)]
    if problem or not log:
        raise Skip(problem or 'no metrics.jsonl')
    notes = []
    recs = read_records(log[0], notes)
    geo = [r for r in recs if isinstance(r.get('layers'), list) and r['layers']]
    ok = [len(r['layers']) == cfg['n_layer'] and all(isinstance(x, dict) for x in r['layers']) for r in geo]
    notes += [f"the record of iteration {r['iter']} is left out: not {cfg['n_layer']} layers of values"
              for r, fine in zip(geo, ok) if not fine]
    geo = [r for r, fine in zip(geo, ok) if fine]
    m, iters = layer_arrays(geo, cfg['n_layer'], notes), np.array([r['iter'] for r in geo], dtype=np.int64)
    keep = ~bad_records(m, iters, cfg, notes)
    loss = [r for r in recs if 'val_loss' in r]
    losses = {k: np.array([number(r.get(k)) for r in loss]) for k in ('train_loss', 'val_loss')}
    losses.update({k: np.where(np.isinf(v), np.nan, v) for k, v in losses.items()})
    return Run(path, cfg, read_json(os.path.join(path, 'done.json')), iters[keep], {k: v[keep] for k, v in m.items()},
               losses, notes)


def find_runs(paths):
    """Every folder under paths that holds config.json (not inside snapshots/ or models/, not through links)."""
    found = []
    for top in paths:
        for root, dirs, files in os.walk(top):
            found += [os.path.normpath(root)] if 'config.json' in files else []
            dirs[:] = sorted(d for d in dirs if d not in ('snapshots', 'models') and not os.path.islink(
                os.path.join(root, d)))
    return sorted(dict.fromkeys(found))


def load_runs(paths, warn):
    """(runs, [(path, why it was skipped)]) of every run folder under paths; notes go to warn."""
    runs, skipped, seen = [], [], {}
    for path in find_runs(paths):
        try:
            run = load_run(path)
        except Skip as e:
            skipped.append((path, str(e)))
            continue
        if (run.setting, run.seed) in seen:
            skipped.append((path, f'duplicate of {seen[run.setting, run.seed]} (the same settings and seed)'))
            continue
        seen[run.setting, run.seed] = path
        runs.append(run)
    for rs in group(runs, lambda r: r.setting).values():
        keys = set().union(*(r.m for r in rs))
        for r in (r for r in rs if keys - set(r.m)):
            r.notes.append(f'{", ".join(sorted(keys - set(r.m)))} not logged, unlike other seeds of its setting: '
                           f'left out of those series, which the other seeds keep')
    for path, why in skipped:
        warn(f'skipped {path}: {why}')
    for r in runs:
        for note in r.notes[:6] + [f'and {len(r.notes) - 6} more notes'] * (len(r.notes) > 6):
            warn(f'{r.path}: {note}')
    return runs, skipped


def group(items, key):
    """{key(x): [x, ...]} in the order first seen."""
    out = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return out


def stack(runs, key, its=None):
    """(its, default the iterations every run logged; (runs, its, layers) of key, NaN for a run that did not log it)."""
    its = reduce(np.intersect1d, [r.iters for r in runs]) if its is None else its
    return its, np.stack([r.m[key][np.searchsorted(r.iters, its)] if key in r.m else
                          np.full((len(its), r.n_layer), np.nan) for r in runs])


def families(arms, kind=None):
    """{(setting, arm without its dose): [arm keys]} of the keys of arms (of one control kind, or all)."""
    return group([k for k in arms if kind in (None, dict(k[1])['control'])],
                 lambda k: (k[0], tuple(x for x in k[1] if x[0] != 'shrink_to')))


def varying(dicts):
    """The keys whose values differ between the dicts (a key absent from some counts as differing)."""
    return [k for k in dict.fromkeys(k for d in dicts for k in d) if len({json.dumps(d.get(k)) for d in dicts}) > 1]


def labels(dicts, keys, reference=None):
    """A name per dict: its values of keys that differ from the common value, the one more of the reference dicts
    (default: dicts; one per run) have than any other ('base' where none differ; a tie names every value)."""
    common = {}
    for k in keys:
        (top, n), *rest = Counter(json.dumps(d.get(k)) for d in reference or dicts).most_common(2) + [(None, 0)]
        common[k] = top if n > rest[0][1] else None
    return [', '.join(f'{k}={d.get(k)}' for k in keys if json.dumps(d.get(k)) != common[k]) or 'base' for d in dicts]


# ----------------------------------------------------------------------------- tables and the output folder
def cell(v):
    return '' if v is None else ('nan' if v != v else f'{v:.4g}') if isinstance(v, float) else \
        str(v).replace('|', '\\|')


def markdown(rows, columns=None):
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    lines = ['| ' + ' | '.join(map(cell, columns)) + ' |', '|' + ' --- |' * len(columns)]
    return '\n'.join(lines + ['| ' + ' | '.join(cell(r.get(c)) for c in columns) + ' |' for r in rows]) + '\n'


def table(stem, rows, columns=None):
    """{stem.csv: text, stem.md: text} of rows (dicts); {} without rows."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    csv.writer(buf, lineterminator='\n').writerows([columns] + [['' if r.get(c) is None else r.get(c)
                                                                  for c in columns] for r in rows])
    return {f'{stem}.csv': buf.getvalue(), f'{stem}.md': markdown(rows, columns)} if rows else {}


def check_out(out):
    """OutError when out is /, a file, a run folder or a folder inside one."""
    real = p = os.path.realpath(out)
    if os.path.dirname(real) == real:
        raise OutError(f'--out={out} is the root of the file system; pass a folder of its own')
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutError(f'--out={out} is a file; pass a folder')
    while os.path.dirname(p) != p:
        if os.path.isfile(os.path.join(p, 'config.json')):
            raise OutError(f'--out={out} is {"" if p == real else "inside "}the run folder {p}; pass another --out')
        p = os.path.dirname(p)


def write_files(out, files):
    """Write {name: text or bytes} into out and MANIFEST; OutError first if one is there that it did not write."""
    check_out(out)
    path = os.path.join(out, MANIFEST)
    ours = set(json.load(open(path))) if os.path.exists(path) else set()
    foreign = sorted(n for n in files if os.path.lexists(os.path.join(out, n)) and n not in ours)
    if foreign:
        raise OutError(f'{out} holds {", ".join(foreign[:3])}{" ..." if len(foreign) > 3 else ""}, not written by '
                       f'analyze.py: move them away or pass another --out')
    try:
        os.makedirs(out, exist_ok=True)
        for name, data in {**files, MANIFEST: json.dumps(sorted(ours | set(files)), indent=0)}.items():
            with open(os.path.join(out, name + '.tmp'), 'wb') as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name))
    except OSError as e:
        raise OutError(f'cannot write into {out}: {e.strerror or e}; pass another --out') from None
    return [os.path.join(out, n) for n in files]
