"""
Run folders in, files out: each run's config.json, done.json and metrics.jsonl(.gz), read once as arrays; its
settings are the config.json keys but BOOKKEEPING. What is left out gets one line.
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

import stats

BOOKKEEPING = ('out_dir', 'run_name', 'overwrite', 'seed', 'device', 'threads', 'compile', 'ckpt_interval',
               'model_ckpts', 'save_snapshots', 'data_file', 'data_dir', 'data_url', 'dataset', 'cache_dir',
               'torch', 'git_commit', 'world_size', 'n_params', 'vocab_size', 'n_chars', 'data_cache')
CONTROL_KEYS = ('control', 'control_target', 'control_scope', 'control_keep', 'control_layers',
                'control_interval', 'shrink_to', 'shrink_iters')
IGNORED = {'none': CONTROL_KEYS[1:], 'freeze': ('shrink_to', 'shrink_iters')}   # unread by control.py
NUMBER = (int, float)
REQUIRED = {(int,): ('n_layer', 'n_head', 'n_embd', 'block_size', 'seed', 'max_iters', 'warmup_iters'),
            (str,): ('qk_init', 'control', 'control_target', 'control_keep', 'data_sha256'),
            NUMBER: ('shrink_to', 'weight_decay'), (bool,): ('decay_qk',)}
KINDS = ('none', 'shrink', 'freeze')
FINAL_LOGS = 3
LOSSES = ('train_loss', 'val_loss')
MANIFEST = '.analyze.json'
PR_KEYS = ('pr_q', 'pr_k', 'pr_dq', 'pr_dk', 'pr_qk', 'tok_pr_q', 'tok_pr_k', 'tok_pr_qk')   # and _head(s)


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
        self.name, self.C, self.d = os.path.basename(self.path), c['n_embd'], c['n_embd'] / c['n_head']
        self.n_layer, self.seed, self.control = c['n_layer'], c['seed'], c['control']
        self.use(config_settings([c])[0])

    def use(self, settings):
        """settings, and from them setting, base (no control keys), arm."""
        self.settings, self.setting = settings, json.dumps(settings, sort_keys=True)
        self.base = json.dumps({k: v for k, v in settings.items() if k not in CONTROL_KEYS}, sort_keys=True)
        self.arm = tuple((k, settings.get(k)) for k in CONTROL_KEYS)

    def final(self, key, layers=None):
        """Mean of the last FINAL_LOGS records over layers (all, or these), or NaN."""
        return stats.nanmean(self.m[key][-FINAL_LOGS:, slice(None) if layers is None else layers]) \
            if key in self.m else math.nan

    def final_loss(self, key):
        """done.json's train_loss or val_loss, else the last one logged."""
        return next((float(v) for v in (number(self.done.get(key)), *self.losses[key][::-1]) if v < math.inf),
                    math.nan)


def config_settings(cfgs):
    """Each config's keys but BOOKKEEPING, one its control kind ignores as most of its kind have it."""
    out = [{k: v for k, v in c.items() if k not in BOOKKEEPING} for c in cfgs]
    for kind, ss in group(out, lambda s: s.get('control')).items():
        for k in IGNORED.get(kind, ()):
            for v, _ in Counter(json.dumps(s[k]) for s in ss if k in s).most_common(1):
                for s in ss:
                    s[k] = json.loads(v)
    return out


def arm_label(cfg, extra=()):
    """'shrink0.1-k-spec', 'freeze-k' (no dose: 'shrink-k'), then the keys of extra; '' for none."""
    if cfg.get('control', 'none') == 'none':
        return ''
    dose = f"{cfg['shrink_to']:g}" if cfg['control'] == 'shrink' and 'shrink_to' in cfg else ''
    keep = '' if cfg.get('control_keep') == 'fro' else f"-{cfg.get('control_keep')}"
    return f"{cfg['control']}{dose}-{cfg.get('control_target')}{keep}" + ''.join(
        f' {k}={cfg[k]}' for k in extra if k in cfg)


# ---- reading
def read_json(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__})') from None


def read_records(path, notes):
    """The records (objects with an int iter) by iteration, a repeated one's last."""
    lines, by_iter = [], {}
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        try:
            lines += f
        except (EOFError, OSError):
            notes.append(f'{os.path.basename(path)} is cut short: the records after the cut are lost')
    lines = [(i, s) for i, s in enumerate(lines, 1) if s.strip()]
    for i, line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and type(rec.get('iter')) is int:
            by_iter[rec['iter']] = rec
        else:
            why = 'is cut short (a kill while it was written?)' if i == lines[-1][0] else 'is not a record'
            notes.append(f'metrics line {i} {why}: left out')
    return [by_iter[it] for it in sorted(by_iter)]


def read_config(path):
    """The run folder's config.json, or Skip naming how it fails REQUIRED."""
    cfg = read_json(f'{path}/config.json')
    for kind, keys in REQUIRED.items():
        for key in keys:
            if key not in cfg:
                raise Skip(f'config.json lacks {key}')
            if type(cfg[key]) not in kind:
                what = 'number' if kind == NUMBER else kind[0].__name__
                raise Skip(f'config.json has {key}={cfg[key]!r}, not a {what}')
    if cfg['control'] not in KINDS:
        raise Skip(f"config.json has control={cfg['control']!r}, not one of {', '.join(KINDS)}")
    return cfg


def bounds(key, m, cfg):
    """(lo, hi, relative tolerance, the keys of m that set hi) of a value's definitional range."""
    base, (fro, q, k) = key.removesuffix('_heads').removesuffix('_head'), (
        key.replace('qk_spec', n) for n in ('qk_fro', 'q_spec', 'k_spec'))
    if base in PR_KEYS:
        return 1, cfg['n_embd'] / (cfg['n_head'] if base != key or 'qk' in base else 1), 1e-9, []
    if base in ('entropy', 'entropy_norm'):   # bf16 softmax rows sum to 1 within ~4e-3
        return 0, math.log(cfg['block_size']) if base == 'entropy' else 1, 1e-2, []
    if base == 'qk_spec_norm' and fro in m:   # ||W_QK^h||_2 <= ||W_QK^h||_F, ||W_Q^h||_2 ||W_K^h||_2
        by = [fro] + [q, k] * (key != base and {q, k} <= set(m))
        return 0, np.fmin(m[fro], m[q] * m[k]) if by[1:] else m[fro], 1e-6, by   # fmin: NaN bounds nothing
    scale = base.endswith(('_norm', '_rel', '_imbalance', '_drift', '_gram'))
    return 0 if scale else -math.inf, math.inf, 0, []


def number(v):
    return float(v) if type(v) in NUMBER and math.isfinite(v) else math.inf


def layer_arrays(geo, n_layer):
    """{key: (records, layers[, heads])}: NaN where absent, +inf where not a number."""
    out = {}
    for r, rec in enumerate(geo):
        for i, layer in enumerate(rec['layers']):
            for k, v in layer.items():
                v = [number(x) for x in v] if isinstance(v, list) else number(v)
                if k not in out:
                    out[k] = np.full((len(geo), n_layer) + np.shape(v), np.nan)
                out[k][r, i] = v
    return out


def bad_records(m, iters, cfg, notes):
    """The records to leave out, each noted with its key and value."""
    bad = np.zeros(len(iters), bool)
    for key, a in m.items():
        lo, hi, tol, by = bounds(key, m, cfg)
        lo, hi, flat = (np.broadcast_to(x, a.shape).reshape(len(a), -1) for x in (lo, hi, a))
        with np.errstate(invalid='ignore'):
            wrong = np.isinf(flat) | (flat != 0) & ((flat < lo * (1 - tol)) | (flat > hi * (1 + tol)))
        for r in np.flatnonzero(wrong.any(1) & ~bad):
            j = wrong[r].argmax()
            why = 'is not a finite number' if np.isinf(flat[r, j]) else \
                f'outside [{lo[r, j]:.4g}, {hi[r, j]:.4g}]' + f' (from {", ".join(by)})' * bool(by)
            notes.append(f'the record of iteration {iters[r]} is left out: {key} = {flat[r, j]:.4g} {why}')
        bad |= wrong.any(1)
    return bad


def load_run(path):
    """A finished run folder as a Run, or Skip naming why."""
    cfg, done = read_config(path), f'{path}/done.json'
    log = [p for p in (f'{path}/metrics.jsonl', f'{path}/metrics.jsonl.gz') if os.path.isfile(p)]
    if not (os.path.exists(done) and log):
        raise Skip('no metrics.jsonl' if os.path.exists(done) else 'unfinished (no done.json)')
    notes, done = [], read_json(done)
    recs = read_records(log[0], notes)
    geo = [r for r in recs if r.get('layers')]
    m, iters = layer_arrays(geo, cfg['n_layer']), np.array([r['iter'] for r in geo], dtype=int)
    keep = ~bad_records(m, iters, cfg, notes)
    if not keep.any():
        left = next((n for n in notes if n.startswith('the record')), '')
        raise Skip(f'none of its {len(geo)} geometry records is usable ({left})' if geo else
                   f'{os.path.basename(log[0])} holds no geometry record')
    last = next((r for r in recs if r['iter'] == done.get('iter')), {})   # train.py copies its losses
    for k in LOSSES:
        if k in last and done.get(k) != last[k]:
            notes.append(f"done.json has {k} = {done.get(k)!r}, not {last[k]!r} as logged at its iteration "
                         f"{last['iter']}: the logged one is used")
            done[k] = last[k]
    losses = {k: np.array([number(r.get(k)) for r in recs if 'val_loss' in r]) for k in LOSSES}
    return Run(path, cfg, done, iters[keep], {k: v[keep] for k, v in m.items()}, losses, notes)


def find_runs(paths):
    """Folders holding config.json under paths, through links, each once (not in snapshots/, models/)."""
    found, seen = [], set()
    for top in paths:
        for root, dirs, files in os.walk(top, followlinks=True):
            real = os.path.realpath(root)
            dirs[:] = [] if real in seen else sorted(d for d in dirs if d not in ('snapshots', 'models'))
            found += [os.path.normpath(root)] * ('config.json' in files and real not in seen)
            seen.add(real)
    return sorted(found)


def load_runs(paths, warn):
    """(runs, [(path, why skipped)]) of the run folders under paths; notes go to warn."""
    loaded, skipped, seen = [], [], {}
    for path in find_runs(paths):
        try:
            loaded.append(load_run(path))
        except Skip as e:
            skipped.append((path, str(e)))
    for r, settings in zip(loaded, config_settings([r.cfg for r in loaded])):
        r.use(settings)
        first = seen.setdefault((r.setting, r.seed), r.path)
        skipped += [(r.path, f'duplicate of {first} (the same settings and seed)')] * (first != r.path)
    runs = [r for r in loaded if seen[r.setting, r.seed] == r.path]
    for rs in group(runs, lambda r: r.setting).values():
        logged = set().union(*(r.m for r in rs))
        for r in rs:   # kept apart: it may differ in what it lacks
            lost = ', '.join(sorted(logged - set(r.m)))
            like = [s.settings for s in runs if r.settings.items() < s.settings.items()]
            r.notes[:0] = [f'config.json lacks {", ".join(sorted(set().union(*like) - set(r.settings)))}, '
                           f'which {len(like)} run(s) of otherwise the same settings have: kept as a setting '
                           'of its own'] * bool(like)
            r.notes += [f'{lost} not logged, unlike other seeds of its setting'] * bool(lost)
    skipped.sort()
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
    """(its, default all runs'; (runs, its, layers[, heads]) of key, NaN where not logged)."""
    its = reduce(np.union1d, [r.iters for r in runs], np.zeros(0, int)) if its is None else np.asarray(its)
    shape = next((r.m[key].shape[2:] for r in runs if key in r.m), ())
    out = np.full((len(runs), len(its), runs[0].n_layer if runs else 0) + shape, np.nan)
    for a, r in (x for x in zip(out, runs) if key in x[1].m):
        have = np.isin(its, r.iters)
        a[have] = r.m[key][np.searchsorted(r.iters, its[have])]
    return its, out


def families(arms, kind=None):
    """{(setting, arm without its dose): [arm keys]} of arms, of one control kind or all."""
    return group([k for k in arms if kind in (None, dict(k[1])['control'])],
                 lambda k: (k[0], tuple(x for x in k[1] if x[0] != 'shrink_to')))


def varying(dicts):
    """The keys whose values differ between the dicts (absent differs)."""
    return [k for k in dict.fromkeys(k for d in dicts for k in d)
            if len({json.dumps(d.get(k)) for d in dicts}) > 1]


def labels(dicts, keys, reference=None):
    """Per dict, its values of keys unlike the most common in reference (default: dicts), or 'base'."""
    common = {}
    for k in keys:
        (top, n), *rest = Counter(json.dumps(d.get(k)) for d in reference or dicts).most_common(2) + [('', 0)]
        common[k] = top if n > rest[0][1] else None
    return [', '.join(f'{k}={d.get(k)}' for k in keys if json.dumps(d.get(k)) != common[k]) or 'base'
            for d in dicts]


# ---- tables and the output folder
def cell(v):
    return '' if v is None else f'{v:.4g}' if isinstance(v, float) else str(v).replace('|', '\\|')


def markdown(rows, columns=None):
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    lines = ['| ' + ' | '.join(map(cell, columns)) + ' |', '|' + ' --- |' * len(columns)]
    return '\n'.join(lines + ['| ' + ' | '.join(cell(r.get(c)) for c in columns) + ' |' for r in rows]) + '\n'


def table(stem, rows, columns=None):
    """{stem.csv: text, stem.md: text} of rows (dicts); {} without rows."""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    csv.writer(buf, lineterminator='\n').writerows([columns] + [[r.get(c) for c in columns] for r in rows])
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
            raise OutError(f'--out={out} is {"inside " * (p != real)}the run folder {p}; pass another --out')
        p = os.path.dirname(p)


def write_files(out, files, kind='runs'):
    """Write {name: text or bytes} into out, remove what kind wrote before and not now; OutError first if a
    name is there but not in MANIFEST."""
    check_out(out)
    at = lambda n: os.path.join(out, n)
    ours = json.load(open(at(MANIFEST))) if os.path.exists(at(MANIFEST)) else {}
    ours = dict.fromkeys(ours, '') if isinstance(ours, list) else ours   # a list names no writer
    foreign = sorted(n for n in files if os.path.lexists(at(n)) and n not in ours)
    if foreign:
        raise OutError(f'{out} holds {", ".join(foreign)}, not written by analyze.py: move them or pass '
                       'another --out')
    ext = {n.rsplit('.')[-1] for n in files}   # --no_figures removes no figure
    stale = [n for n, k in ours.items() if k == kind and n not in files and n.rsplit('.')[-1] in ext]
    mine = {n: k for n, k in ours.items() if n not in stale} | dict.fromkeys(files, kind)
    try:
        os.makedirs(out, exist_ok=True)
        for name, data in {**files, MANIFEST: json.dumps(dict(sorted(mine.items())), indent=0)}.items():
            with open(at(name + '.tmp'), 'wb') as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.replace(at(name + '.tmp'), at(name))
        for name in (n for n in stale if os.path.isfile(at(n))):
            os.remove(at(name))
    except OSError as e:
        raise OutError(f'cannot write into {out}: {e.strerror or e}; pass another --out') from None
    return list(map(at, files))
