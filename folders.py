"""
Run folders in, files out. A run's config.json, done.json (without it the run is unfinished) and metrics.jsonl(.gz)
are read once, as arrays: Run.m holds a (records, layers) array per per-layer metric, a (records, layers, heads) one
per per-head list, NaN where a key was not logged. fig4 alone opens snapshots/. Links to run folders are followed;
a folder reached twice counts once.

Settings are every config.json key but BOOKKEEPING: a key a forker adds is a setting with no edit here, and the data
enter as data_sha256, the hash of the text. A control key a run's kind ignores (IGNORED) takes the value most runs of
that kind have, so it splits no setting; a control arm is the values of CONTROL_KEYS.

Left out with one line each: a run whose config.json lacks or mistypes a field of REQUIRED, an unfinished run, a
duplicate (same settings and seed), a run with no usable geometry record; a metrics line that is not a record; a
record with a value outside its definitional range (bounds, limits). A done.json loss that is not the logged one is
replaced by it, with a note.
The analysis writes into --out only files of its own names, listed in MANIFEST with the command that wrote each;
it never replaces a file it did not write, removes only what the same command wrote before and not now, and
refuses /, a run folder and a folder inside one.
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
CONTROL_KEYS = ('control', 'control_target', 'control_scope', 'control_keep', 'control_layers',
                'control_interval', 'shrink_to', 'shrink_iters')
IGNORED = {'none': CONTROL_KEYS[1:], 'freeze': ('shrink_to', 'shrink_iters')}   # keys control.py leaves unread
NUMBER = (int, float)
REQUIRED = {'n_layer': int, 'n_head': int, 'n_embd': int, 'block_size': int, 'seed': int, 'max_iters': int,
            'warmup_iters': int, 'qk_init': str, 'control': str, 'control_target': str, 'control_keep': str,
            'shrink_to': NUMBER, 'weight_decay': NUMBER, 'decay_qk': bool, 'data_sha256': str}
KINDS = ('none', 'shrink', 'freeze')
FINAL_LOGS = 3
MANIFEST = '.analyze.json'
PR_KEYS = {f'{p}{w}{h}' for p in ('pr_', 'pr_d', 'tok_pr_') for w in 'qk' for h in ('', '_head')} | {
    'pr_qk', 'tok_pr_qk'}


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
        self.name, self.n_layer, self.seed, self.control = os.path.basename(self.path), *(
            self.cfg[k] for k in ('n_layer', 'seed', 'control'))
        self.C, self.d = self.cfg['n_embd'], self.cfg['n_embd'] / self.cfg['n_head']
        self.use(settings_of([self.cfg])[0])

    def use(self, settings):
        """settings (of settings_of) and the keys made of them: setting, base (no control key) and arm."""
        self.settings, self.setting = settings, json.dumps(settings, sort_keys=True)
        self.base = json.dumps({k: v for k, v in settings.items() if k not in CONTROL_KEYS}, sort_keys=True)
        self.arm = tuple((k, settings.get(k)) for k in CONTROL_KEYS)

    def final(self, key, layers=None):
        """The mean over the last FINAL_LOGS records and over layers (all, or these); NaN if not logged."""
        v = self.m[key][-FINAL_LOGS:, slice(None) if layers is None else layers] if key in self.m else \
            np.full(1, np.nan)
        return float(np.mean(v[np.isfinite(v)])) if np.isfinite(v).any() else math.nan

    def final_loss(self, key):
        """done.json's train_loss or val_loss, else the last one logged."""
        v, logged = self.done.get(key), self.losses[key][np.isfinite(self.losses[key])]
        return float(v) if type(v) in NUMBER and math.isfinite(v) else float(logged[-1]) if len(logged) else math.nan


def settings_of(cfgs):
    """Each config's keys but BOOKKEEPING; a control key its kind ignores set to the value most of that kind have."""
    out = [{k: v for k, v in c.items() if k not in BOOKKEEPING} for c in cfgs]
    for kind, ss in group(out, lambda s: s.get('control')).items():
        for k in IGNORED.get(kind, ()):
            top = Counter(json.dumps(s[k]) for s in ss if k in s).most_common(1)
            for s in ss if top else ():
                s[k] = json.loads(top[0][0])
    return out


def arm_label(cfg, extra=()):
    """'shrink0.1-k-spec', 'freeze-k' (no dose: 'shrink-k'), then the keys of extra its kind reads; '' for none."""
    if cfg.get('control', 'none') == 'none':
        return ''
    dose = f"{cfg['shrink_to']:g}" if cfg['control'] == 'shrink' and 'shrink_to' in cfg else ''
    keep = '' if cfg.get('control_keep') == 'fro' else f"-{cfg.get('control_keep')}"
    return f"{cfg['control']}{dose}-{cfg.get('control_target')}{keep}" + ''.join(
        f' {k}={cfg[k]}' for k in extra if k in cfg and k not in IGNORED.get(cfg['control'], ()))


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
    """The records (objects with an integer iter) of metrics.jsonl(.gz) by iteration, a repeated one's last;
    a line that is not one is left out with a note. Read by lines: a cut .gz keeps what precedes the cut."""
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
    return None if cfg['control'] in KINDS else \
        f"config.json has control={cfg['control']!r}, not one of {', '.join(KINDS)}"


def bounds(key, cfg):
    """(lo, hi, relative tolerance) of a logged value's definitional range; None when it has none."""
    base = key[:-len('_heads')] if key.endswith('_heads') else key
    base = base + '_head' if key.endswith('_heads') and base + '_head' in PR_KEYS else base
    if base in PR_KEYS:
        return 1.0, cfg['n_embd'] / (cfg['n_head'] if base.endswith('_head') or 'qk' in base else 1), 1e-9
    if base in ('entropy', 'entropy_norm'):   # a float32 softmax row sums to 1 within ~1e-7; bf16 to ~4e-3
        return 0.0, math.log(cfg['block_size']) if base == 'entropy' else 1.0, 1e-2
    return (0.0, math.inf, 0) if base.endswith(('_norm', '_rel', '_imbalance', '_drift', '_gram')) else None


def limits(key, m, cfg):
    """(lo, hi, relative tolerance, the keys they come from) of key's values in m: bounds, and for ||W_QK^h||_2
    (rank <= d) ||W_QK^h||_F / sqrt(d) <= it <= ||W_QK^h||_F and, per head, <= ||W_Q^h||_2 ||W_K^h||_2."""
    lim, by = bounds(key, cfg), []
    if lim is None:
        return None
    (lo, hi, tol), (fro, q, k) = lim, (key.replace('qk_spec', n) for n in ('qk_fro', 'q_spec', 'k_spec'))
    if key.startswith('qk_spec_norm') and fro in m:   # fmax, fmin: a NaN (not a number, not logged) bounds nothing
        f = np.where(np.isinf(m[fro]), np.nan, m[fro])
        lo, hi, tol, by = np.fmax(lo, f / math.sqrt(cfg['n_embd'] / cfg['n_head'])), np.fmin(hi, f), 1e-6, [fro]
        if key.endswith('_heads') and q in m and k in m:
            hi, by = np.fmin(hi, m[q] * m[k]), by + [q, k]
    return lo, hi, tol, by


def number(v):
    return float(v) if type(v) in NUMBER and math.isfinite(v) else math.inf


def layer_arrays(geo, n_layer):
    """{key: array} over the geometry records: NaN where a key is absent, +inf where a value is not a number."""
    cells = {}
    for r, rec in enumerate(geo):
        for i, layer in enumerate(rec['layers']):
            for k, v in layer.items():
                cells.setdefault(k, {})[r, i] = v
    out = {}
    for key, found in cells.items():
        width = max(len(v) if isinstance(v, list) else -1 for v in found.values())
        out[key] = np.full((len(geo), n_layer) + ((width,) if width >= 0 else ()), np.nan)
        for (r, i), v in found.items():
            out[key][r, i] = [number(x) for x in v] if width >= 0 else number(v)
    return out


def bad_records(m, iters, cfg, notes):
    """The mask of the records to leave out, with a note per bad record naming its key and value."""
    bad = np.zeros(len(iters), bool)
    for key, a in m.items():
        lim, flat, wrong = limits(key, m, cfg), a.reshape(len(a), -1), np.isinf(a.reshape(len(a), -1))
        if lim:
            lo, hi = (np.broadcast_to(x, a.shape).reshape(len(a), -1) for x in lim[:2])
            with np.errstate(invalid='ignore'):
                wrong |= (flat != 0) & ((flat < lo * (1 - lim[2])) | (flat > hi * (1 + lim[2])))
        for r in np.flatnonzero(wrong.any(1) & ~bad):
            j = np.flatnonzero(wrong[r])[0]
            why = 'is not a finite number' if np.isinf(flat[r, j]) else f'outside [{lo[r, j]:.4g}, {hi[r, j]:.4g}]' \
                + (f' (from {", ".join(lim[3])})' if lim[3] else '')
            notes.append(f'the record of iteration {iters[r]} is left out: {key} = {flat[r, j]:.4g} {why}')
        bad |= wrong.any(1)
    return bad


def load_run(path):
    """A finished run folder as a Run; Skip with the reason in one line."""
    cfg, done = read_json(os.path.join(path, 'config.json')), os.path.join(path, 'done.json')
    problem = check_config(cfg) or ('' if os.path.exists(done) else 'unfinished (no done.json)')
    log = [p for p in (os.path.join(path, n) for n in ('metrics.jsonl', 'metrics.jsonl.gz')) if os.path.isfile(p)]
    if problem or not log:
        raise Skip(problem or 'no metrics.jsonl')
    notes, done = [], read_json(done)
    recs = read_records(log[0], notes)
    geo = [r for r in recs if isinstance(r.get('layers'), list) and r['layers']]
    ok = [len(r['layers']) == cfg['n_layer'] and all(isinstance(x, dict) for x in r['layers']) for r in geo]
    notes += [f"the record of iteration {r['iter']} is left out: not {cfg['n_layer']} layers of values"
              for r, fine in zip(geo, ok) if not fine]
    m, iters = layer_arrays([r for r, fine in zip(geo, ok) if fine], cfg['n_layer']), np.array(
        [r['iter'] for r, fine in zip(geo, ok) if fine], dtype=np.int64)
    keep = ~bad_records(m, iters, cfg, notes)
    if not keep.any():
        left = [n for n in notes if n.startswith('the record')]
        raise Skip(f'none of its {len(geo)} geometry records is usable ({left[0]})' if left else
                   f'{os.path.basename(log[0])} holds no geometry record')
    last = next((r for r in recs if r['iter'] == done.get('iter')), {})   # train.py copies its losses
    for k in ('train_loss', 'val_loss'):
        if k in last and done.get(k) != last[k]:
            notes.append(f"done.json has {k} = {done.get(k)!r}, not {last[k]!r} as logged at its iteration "
                         f"{last['iter']}: the logged one is used")
            done[k] = last[k]
    losses = {k: np.array([number(r.get(k)) for r in recs if 'val_loss' in r]) for k in ('train_loss', 'val_loss')}
    losses = {k: np.where(np.isinf(v), np.nan, v) for k, v in losses.items()}
    return Run(path, cfg, done, iters[keep], {k: v[keep] for k, v in m.items()}, losses, notes)


def find_runs(paths):
    """Every folder under paths that holds config.json, through links, each once (not in snapshots/, models/)."""
    found, seen = [], set()
    for top in paths:
        for root, dirs, files in os.walk(top, followlinks=True):
            real = os.path.realpath(root)
            dirs[:] = [] if real in seen else sorted(d for d in dirs if d not in ('snapshots', 'models'))
            found += [os.path.normpath(root)] if 'config.json' in files and real not in seen else []
            seen.add(real)
    return sorted(found)


def load_runs(paths, warn):
    """(runs, [(path, why it was skipped)]) of every run folder under paths; notes go to warn."""
    loaded, skipped, seen = [], [], {}
    for path in find_runs(paths):
        try:
            loaded.append(load_run(path))
        except Skip as e:
            skipped.append((path, str(e)))
    for r, settings in zip(loaded, settings_of([r.cfg for r in loaded])):
        r.use(settings)
        first = seen.setdefault((r.setting, r.seed), r.path)
        skipped += [(r.path, f'duplicate of {first} (the same settings and seed)')] if first != r.path else []
    runs = [r for r in loaded if seen[r.setting, r.seed] == r.path]
    keys = set().union(*(r.settings for r in runs))
    for rs in group(runs, lambda r: r.setting).values():
        logged = set().union(*(r.m for r in rs))
        for r in (r for r in rs if logged - set(r.m)):
            r.notes.append(f'{", ".join(sorted(logged - set(r.m)))} not logged, unlike other seeds of its setting: '
                           f'left out of those series, which the other seeds keep')
    for r in (r for r in runs if keys - set(r.settings)):   # kept apart: it may differ in what it lacks
        like = [s.settings for s in runs if set(r.settings) < set(s.settings) and json.dumps(
            {k: s.settings[k] for k in r.settings}, sort_keys=True) == r.setting]
        r.notes[:0] = [f'config.json lacks {", ".join(sorted(set().union(*like) - set(r.settings)))}, which '
                       f'{len(like)} run{"s" * (len(like) > 1)} of otherwise the same settings '
                       f'ha{"ve" if len(like) > 1 else "s"}: kept as a setting of its own'] if like else []
    for path, why in sorted(skipped):
        warn(f'skipped {path}: {why}')
    for r in runs:
        for note in r.notes[:6] + [f'and {len(r.notes) - 6} more notes'] * (len(r.notes) > 6):
            warn(f'{r.path}: {note}')
    return runs, sorted(skipped)


def group(items, key):
    """{key(x): [x, ...]} in the order first seen."""
    out = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return out


def stack(runs, key, its=None):
    """(its, default every iteration some run logged; (runs, its, layers[, heads]) of key, NaN where not logged)."""
    its = reduce(np.union1d, [r.iters for r in runs], np.zeros(0, np.int64)) if its is None else np.asarray(its)
    shape = next((r.m[key].shape[2:] for r in runs if key in r.m), ())
    out = np.full((len(runs), len(its), runs[0].n_layer if runs else 0) + shape, np.nan)
    for a, r in (x for x in zip(out, runs) if key in x[1].m):
        have = np.isin(its, r.iters)
        a[have] = r.m[key][np.searchsorted(r.iters, its[have])]
    return its, out


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


def write_files(out, files, kind='runs'):
    """Write {name: text or bytes} into out, and remove the files that kind (runs, tokens, pretrained) wrote there
    last time and not now; OutError first if a file of these names is there that analyze.py did not write."""
    check_out(out)
    path = os.path.join(out, MANIFEST)
    ours = json.load(open(path)) if os.path.exists(path) else {}
    ours = dict.fromkeys(ours, '') if isinstance(ours, list) else ours   # a list: who wrote each is not known
    foreign = sorted(n for n in files if os.path.lexists(os.path.join(out, n)) and n not in ours)
    if foreign:
        raise OutError(f'{out} holds {", ".join(foreign[:3])}{" ..." if len(foreign) > 3 else ""}, not written by '
                       f'analyze.py: move them away or pass another --out')
    stale = [n for n, k in ours.items() if k == kind and n not in files]
    try:
        os.makedirs(out, exist_ok=True)
        mine = {n: k for n, k in ours.items() if n not in stale} | dict.fromkeys(files, kind)
        for name, data in {**files, MANIFEST: json.dumps(dict(sorted(mine.items())), indent=0)}.items():
            with open(os.path.join(out, name + '.tmp'), 'wb') as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name))
        for name in (n for n in stale if os.path.isfile(os.path.join(out, n))):
            os.remove(os.path.join(out, name))
    except OSError as e:
        raise OutError(f'cannot write into {out}: {e.strerror or e}; pass another --out') from None
    return [os.path.join(out, n) for n in files]
