"""
Train a small character-level GPT on WikiText-103 and log the geometry of its queries and keys.

One GPU (or CPU, or MPS), from the repository root:
    python train.py --n_layer=4 --seed=1
Any local text instead of WikiText-103 (what the CPU runs of this repository use):
    python train.py --data_file=../shared/data/wikitext-103/wiki.test.raw --n_embd=128 --n_head=4
Several GPUs on one node (DDP):
    torchrun --nproc_per_node=4 train.py --n_layer=8 --grad_accum=4
A config file can come first, then --key=value overrides:
    python train.py my_config.py --seed=2
A config file holding a JSON object (recognised by its content, whatever the file's name) sets those keys.
Any other config file is executed as Python, as nanoGPT's configurator does: run only files you trust;
its top-level names are the settings. A config file that sets no known key is refused.
The run names of argument lists, one list per stdin line (sweep.sh names its grid this way):
    printf -- '--n_layer=6 --seed=2\n--control=shrink\n' | python train.py --print_run_names

Each run writes out_dir/run_name/: config.json, metrics.jsonl, snapshots/ (W_Q, W_K at every logged
iteration), models/ (model weights at log-spaced iterations), ckpt.pt (latest state), done.json (last),
and .lock, which one process at a time holds while it trains there. Rerunning the same command resumes an
unfinished run; --overwrite=True starts it over (deleting only the files train.py writes).

Reading order: the config block; data; the model; RESEARCH (what is measured at each record, and the
key-spectrum control: the lines to edit for a new metric or intervention); the run (train()); PLUMBING
(devices, DDP, run folder, locks, checkpoints, signals: none of it needs reading to change the science).
"""
import ast
import builtins
import contextlib
import difflib
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import control as spectrum_control  # "control" is also a config key
import geometry

# -----------------------------------------------------------------------------
# config: module globals, overridden by an optional config file and then --key=value
# I/O
out_dir = 'out'            # runs go to out_dir/run_name/
run_name = ''              # '' = from the settings, e.g. L4_normal_s1 or L4_normal_shrink0.2-k_s1
overwrite = False          # start over even if the run folder holds a finished or partial run
eval_interval = 250        # estimate train/val loss (and log a record) every this many iterations
eval_iters = 20            # batches per loss estimate
geom_interval = 250        # measure Q/K geometry every this many iterations (0 = geometry logging off)
eval_windows = 16          # validation windows of the fixed evaluation batch (entropy, token-level PR)
ckpt_interval = 500        # write ckpt.pt every this many iterations (and at the end)
model_ckpts = 8            # model-weight checkpoints at log-spaced iterations, for token-level analysis
save_snapshots = True      # write W_Q/W_K (float32) at every logged iteration to snapshots/
# data
dataset = 'wikitext103'    # used when data_file is empty
data_dir = 'data/wikitext-103-raw'  # where wiki.{train,valid,test}.raw are, or are downloaded to
data_file = ''             # any UTF-8 text file instead: first 90% train, last 10% validation
data_url = 'https://wikitext.smerity.com/wikitext-103-raw-v1.zip'
cache_dir = ''             # encoded datasets; '' = $QKGEOM_CACHE or ~/.cache/qkgeom
min_char_count = 10        # rarer training characters share one unknown id
# model
n_layer = 4
n_head = 6
n_embd = 384
block_size = 256
bias = False
dropout = 0.0
qk_init = 'normal'         # normal | orthogonal | tied (see QK_INITS)
# optimizer
batch_size = 64            # per micro-step; global batch = batch_size * grad_accum
grad_accum = 1             # micro-steps per iteration, split across DDP ranks
max_iters = 5000
lr = 1e-3
min_lr = 1e-4
warmup_iters = 100
lr_decay_iters = 0         # cosine decay ends here; 0 = max_iters
weight_decay = 0.1
decay_qk = True            # apply weight decay to W_Q and W_K too (it shrinks both spectra: a confound)
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0            # 0 = off
# key-spectrum control (control.py)
control = 'none'           # none | shrink | freeze
control_target = 'k'       # k: control W_K (the experiment); q: control W_Q (the mirror)
control_scope = 'head'     # head: each head's (d, C) block; layer: the whole (C, C) matrix
control_keep = 'fro'       # fro | spec: what reshaping keeps, the Frobenius norm or the top singular value
control_layers = ''        # comma-separated layer indices; '' = all layers
shrink_to = 0.5            # shrink: final target PR as a fraction of the step-0 PR
shrink_iters = 2000        # shrink: iterations over which the target falls linearly
control_interval = 1       # apply control every this many optimizer steps
# system
seed = 1
device = ''                # '' = cuda, then mps, then cpu
dtype = 'auto'             # auto (bfloat16 on CUDA where supported, else float32) | float32 | bfloat16
compile = False            # torch.compile the training forward (where available)
threads = 0                # CPU threads for torch; 0 = torch's default
config_keys = [k for k, v in list(globals().items())
               if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
# -----------------------------------------------------------------------------

EVAL_SEED = 1234  # the evaluation windows are the same for every run, whatever its seed

# the valid range of every numeric setting, checked before any work: (settings, test, what it asks)
RANGES = [
    (('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'grad_accum', 'eval_iters', 'eval_interval',
      'ckpt_interval', 'eval_windows', 'control_interval', 'min_char_count'), lambda v: v >= 1, 'at least 1'),
    (('max_iters', 'geom_interval', 'model_ckpts', 'warmup_iters', 'lr_decay_iters', 'shrink_iters', 'threads',
      'min_lr', 'weight_decay', 'grad_clip'), lambda v: v >= 0, '>= 0'),
    (('lr', 'shrink_to'), lambda v: v > 0, '> 0'),
    (('dropout', 'beta1', 'beta2'), lambda v: 0 <= v < 1, 'in [0, 1)'),
    (('seed',), lambda v: 0 <= v < 2 ** 32, 'in [0, 2**32) (numpy seeds are 32-bit)'),
]


def choices():
    """The valid values of each choice setting (control.check_settings checks its own again)."""
    return {'qk_init': sorted(QK_INITS), 'control': ['none', 'shrink', 'freeze'], 'control_target': ['k', 'q'],
            'control_scope': ['head', 'layer'], 'control_keep': list(spectrum_control.KEEPS),
            'dtype': ['auto', 'float32', 'bfloat16'], 'dataset': ['wikitext103']}


class ConfigError(SystemExit):
    """A user-facing problem with the settings or the inputs: its message is printed, exit status 2."""

    def __init__(self, msg):
        super().__init__(f'error: {msg}')
        self.msg = msg


# ----------------------------------------------------------------------------- config

def parse_value(key, text, default):
    """Turn the text of --key=text into the type of the key's default, or say why not."""
    want = type(default)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare string such as --qk_init=tied
    if want is bool and isinstance(value, str) and value.lower() in ('true', 'false'):
        value = value.lower() == 'true'
    if want is float and type(value) is int:
        value = float(value)
    if want is str and not isinstance(value, str):
        value = text  # --run_name=123 is the string '123'
    if type(value) is not want:
        raise ConfigError(f'--{key}={text}: expected {want.__name__} (default {default!r}), got {value!r}')
    return value


def did_you_mean(text, known):
    low = str(text).lower()
    close = [k for k in known if k == low] or difflib.get_close_matches(low, known, n=1)
    return f'; did you mean {close[0]}?' if close else ''


def unknown_key(key, where):
    hint = did_you_mean(key, config_keys) or '; see the config block at the top of train.py'
    return ConfigError(f'unknown config key {key!r} in {where}{hint}')


def read_utf8(path, what):
    """The text of a file, or one line saying it is not UTF-8 and where."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise not_utf8(path, what, f'byte {e.start}: {data[e.start:e.start + 4]!r}') from None


def not_utf8(path, what, detail):
    return ConfigError(f'{what} {path} is not UTF-8 text ({detail}); convert it, for example with '
                       f'iconv -f latin1 -t utf-8, or pass another file')


def config_file_values(path):
    """The settings a config file sets: a JSON object (recognised by content), else Python that is executed
    as nanoGPT's configurator does, its top-level names the settings (modules and functions left out)."""
    if not os.path.isfile(path):
        raise ConfigError(f'config file {path} does not exist')
    text = read_utf8(path, 'config file')
    if text.lstrip().startswith(('{', '[')):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f'config file {path} is not valid JSON ({e.msg} at line {e.lineno} '
                              f'column {e.colno})') from None
        if not isinstance(values, dict):
            raise ConfigError(f'config file {path} holds a JSON {type(values).__name__}; it must be a JSON '
                              f'object of settings, such as {{"n_layer": 4}}')
        return values
    namespace = {}
    try:
        exec(builtins.compile(text, path, 'exec'), namespace)
    except Exception as e:  # the file is the user's code: whatever it raises is its mistake, shown in one line
        detail = ' '.join(str(e).split())
        raise ConfigError(f'config file {path} failed as Python ({type(e).__name__}: {detail})') from None
    skip = (types.ModuleType, types.FunctionType, type)
    return {k: v for k, v in namespace.items() if not k.startswith('_') and not isinstance(v, skip)}


def load_config_file(path, defaults):
    """A config file's settings, each checked to be a known key with a value of its default's type."""
    values = config_file_values(path)
    if not values:
        raise ConfigError(f'config file {path} sets no config key; set at least one, e.g. n_layer = 4')
    for k, v in values.items():
        if k not in defaults:
            raise unknown_key(k, path)
        want = type(defaults[k])
        ok = type(v) is want or (want is float and type(v) is int)
        if not ok:
            raise ConfigError(f'{k}={v!r} in config file {path}: expected {want.__name__} (default {defaults[k]!r})')
        values[k] = want(v)
    return values


def get_config(argv):
    """Defaults from the globals above, then a config file, then --key=value; returns a dict."""
    defaults = {k: globals()[k] for k in config_keys}
    cfg = dict(defaults)
    for arg in argv:
        if not arg.startswith('--'):
            cfg.update(load_config_file(arg, defaults))
            continue
        key, eq, text = arg[2:].partition('=')
        if key not in defaults:
            raise unknown_key(key, 'the command line')
        if not eq:
            raise ConfigError(f'--{key} needs a value: --{key}=VALUE')
        cfg[key] = parse_value(key, text, defaults[key])
    check_config(cfg)
    if not cfg['run_name']:
        cfg['run_name'] = default_run_name(cfg)
    check_run_name(cfg['run_name'])
    return cfg


def default_run_name(cfg):
    """The one source of run names: L4_normal_s1, L4_normal_shrink0.2-k_s1, L4_normal_freeze-k-spec_s3."""
    label = spectrum_control.control_label(cfg)
    return f"L{cfg['n_layer']}_{cfg['qk_init']}{'_' + label if label else ''}_s{cfg['seed']}"


def check_run_name(name):
    """A run name is one plain folder name: the run folder must lie inside out_dir."""
    seps = [s for s in (os.sep, os.altsep, '/') if s]
    if not name.strip() or name in ('.', '..') or any(s in name for s in seps) or '\0' in name:
        raise ConfigError(f'run_name={name!r} must be one plain folder name inside out_dir (no path separator, '
                          f'not . or .., not blank), for example --run_name=my_run')


def check_config(cfg):
    """Stop before any work on settings that cannot run, saying which and how to fix them."""
    for key, valid in choices().items():
        if cfg[key] not in valid:
            raise ConfigError(f"{key}={cfg[key]!r} is not one of {', '.join(valid)}{did_you_mean(cfg[key], valid)}")
    for key in config_keys:
        if isinstance(cfg[key], float) and not math.isfinite(cfg[key]):
            raise ConfigError(f'{key}={cfg[key]} must be a finite number')
    for keys, ok, words in RANGES:
        for key in keys:
            if not ok(cfg[key]):
                raise ConfigError(f'{key}={cfg[key]} must be {words}')
    if cfg['n_embd'] % cfg['n_head']:
        raise ConfigError(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}; "
                          f"pick n_head among {[h for h in range(1, 17) if cfg['n_embd'] % h == 0]}")
    if 0 < cfg['lr_decay_iters'] < cfg['warmup_iters']:
        raise ConfigError(f"lr_decay_iters={cfg['lr_decay_iters']} ends the decay before the warm-up ends "
                          f"(warmup_iters={cfg['warmup_iters']}); use 0 (= max_iters) or at least warmup_iters")
    if cfg['min_lr'] > cfg['lr']:
        raise ConfigError(f"min_lr={cfg['min_lr']} must not exceed lr={cfg['lr']}: the schedule decays from lr "
                          f"to min_lr")
    try:  # control, control_target, control_scope, control_keep, control_layers, shrink_to, shrink_iters
        spectrum_control.check_settings(cfg, cfg['n_layer'])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def print_run_names(lines):
    """`python train.py --print_run_names`: one argument list per input line, its resolved run name per
    output line; every line is checked before anything is printed. Loads no data, touches no folder."""
    names = []
    for n, line in enumerate(lines, 1):
        try:
            names.append(get_config(line.split())['run_name'])
        except ConfigError as e:
            raise ConfigError(f'--print_run_names: input line {n} ({line.strip()!r}): {e.msg}') from None
    print('\n'.join(names))


# ----------------------------------------------------------------------------- data

def cache_root(cfg):
    return cfg['cache_dir'] or os.environ.get('QKGEOM_CACHE') or os.path.expanduser('~/.cache/qkgeom')


def sha256_of(paths):
    h = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 24), b''):
                h.update(block)
    return h.hexdigest()


def file_stamp(path):
    """What changes when a file is rewritten: its size, modification time and inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def read_json_or_empty(path):
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def remember(obj, path):
    """Best effort: a small JSON file written whole (a unique temporary name, then renamed), or nothing
    where it cannot be written (a read-only cache still works: it is only hashed again)."""
    tmp = f'{path}.{os.getpid()}.tmp'
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, 'w') as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.remove(tmp)


def digest_of(paths, memo):
    """SHA-256 of the files, remembered in the JSON file memo with their size, mtime and inode: files left
    unchanged since are not read again (WikiText-103 is 540 MB), and any rewrite, same length or not, is."""
    stamp = [file_stamp(p) for p in paths]
    known = read_json_or_empty(memo)
    if known.get('stamp') != stamp or not isinstance(known.get('sha256'), str):
        known = {'stamp': stamp, 'sha256': sha256_of(paths)}
        remember(known, memo)
    return known['sha256']


def text_chunks(path, size=1 << 25):
    with open(path, encoding='utf-8', newline='') as f:  # newline='': '\r' stays, as in a --data_file text
        try:
            yield from iter(lambda: f.read(size), '')
        except UnicodeDecodeError as e:
            raise not_utf8(path, 'the text', e.reason) from None


def codepoints(text):
    """A str as a numpy array of Unicode code points, without a Python-level loop."""
    return np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)


def build_vocab(train_chunks, min_count):
    """Characters seen at least min_count times in train, sorted; id 0 is the unknown character."""
    counts = np.zeros(0x110000, dtype=np.int64)
    for chunk in train_chunks:
        counts += np.bincount(codepoints(chunk), minlength=0x110000)
    kept = np.flatnonzero(counts >= min_count)
    if len(kept) + 1 > 65535:
        raise ConfigError(f'{len(kept)} distinct characters do not fit uint16; raise min_char_count')
    return kept, counts


def encode_to(chunks, table, path):
    """Encode text chunks through a code point -> id table into a uint16 file; returns its length and the
    SHA-256 of its bytes (computed as they are written, so the checksum costs no second read)."""
    n, h = 0, hashlib.sha256()
    with open(path, 'wb') as f:
        for chunk in chunks:
            ids = table[codepoints(chunk)].tobytes()
            f.write(ids)
            h.update(ids)
            n += len(ids) // 2
    return n, h.hexdigest()


BINS = ('train.bin', 'val.bin')
# part of every cache's key: bump it with any change to how the text is read, the vocabulary built or the
# characters encoded, so that a cache made by other encoding code is never reused
ENCODER_VERSION = 1


def encode_dataset(train_chunks, val_chunks, min_count, out_dir, source):
    """train.bin, val.bin (uint16, nanoGPT style) and meta.json (with their checksums) in out_dir."""
    kept, counts = build_vocab(train_chunks(), min_count)
    table = np.zeros(0x110000, dtype=np.uint16)
    table[kept] = np.arange(1, len(kept) + 1, dtype=np.uint16)
    n_train, train_sha = encode_to(train_chunks(), table, os.path.join(out_dir, 'train.bin'))
    n_val, val_sha = encode_to(val_chunks(), table, os.path.join(out_dir, 'val.bin'))
    meta = dict(source, encoder_version=ENCODER_VERSION, vocab_size=len(kept) + 1, chars=''.join(map(chr, kept)),
                min_char_count=min_count,
                n_train=n_train, n_val=n_val, n_unknown_train=int(counts.sum() - counts[kept].sum()),
                train_sha256=train_sha, val_sha256=val_sha)
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)
    for name, sha in zip(BINS, (train_sha, val_sha)):  # hashed as written: no second read to verify them
        remember({'stamp': [file_stamp(os.path.join(out_dir, name))], 'sha256': sha}, memo_of(out_dir, name))
    return meta


def memo_of(folder, name):
    return os.path.join(folder, f'.{name}.sha256')


def decode(ids, meta):
    chars = '\ufffd' + meta['chars']
    return ''.join(chars[i] for i in ids)


def download_wikitext(cfg):
    """Fetch and unzip the raw WikiText-103 release into data_dir, or explain the two ways out."""
    import urllib.request  # only here: most runs never download
    import zipfile
    data_dir = cfg['data_dir']
    os.makedirs(os.path.dirname(os.path.abspath(data_dir)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.download-', dir=os.path.dirname(os.path.abspath(data_dir)))
    try:
        zip_path = os.path.join(tmp, 'wikitext-103-raw-v1.zip')
        print(f"downloading {cfg['data_url']} (about 190 MB) ...")
        # the maintainer's mirror refuses Python's default User-Agent
        req = urllib.request.Request(cfg['data_url'], headers={'User-Agent': 'qkgeom/0.1 (research code)'})
        with urllib.request.urlopen(req, timeout=60) as r, open(zip_path, 'wb') as f:
            shutil.copyfileobj(r, f, 1 << 20)
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(tmp)
        found = [root for root, _, files in os.walk(tmp) if 'wiki.train.raw' in files]
        if not found:
            raise OSError('the archive holds no wiki.train.raw')
        os.makedirs(data_dir, exist_ok=True)
        for name in ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw'):
            os.replace(os.path.join(found[0], name), os.path.join(data_dir, name))
    except (OSError, zipfile.BadZipFile) as e:  # URLError and timeouts are OSErrors
        raise ConfigError(
            f"WikiText-103 is not in {data_dir}/ and downloading {cfg['data_url']} failed ({e}). Either put "
            f"wiki.train.raw, wiki.valid.raw and wiki.test.raw from wikitext-103-raw-v1.zip there (or pass "
            f"--data_dir=), or train on any local UTF-8 text with --data_file=PATH (for example "
            f"--data_file=../shared/data/wikitext-103/wiki.test.raw)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def data_sources(cfg):
    """(source paths, train and val chunk factories, cache name) of the configured text."""
    if cfg['data_file']:
        path = cfg['data_file']
        if not os.path.isfile(path):
            raise ConfigError(f'data_file {path} does not exist; pass the path of a UTF-8 text file')

        @functools.lru_cache(maxsize=1)
        def split():  # read only when the cache has to be built, and then once
            text = read_utf8(path, 'the text')
            cut = int(0.9 * len(text))
            return text[:cut], text[cut:]
        return [path], lambda: [split()[0]], lambda: [split()[1]], os.path.basename(path)
    names = ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw')
    if not all(os.path.isfile(os.path.join(cfg['data_dir'], n)) for n in names):
        download_wikitext(cfg)
    sources = [os.path.join(cfg['data_dir'], n) for n in names[:2]]
    return sources, lambda: text_chunks(sources[0]), lambda: text_chunks(sources[1]), 'wikitext103'


def prepare_data(cfg):
    """Encoded train/val memmaps and meta, built once per source into the cache and reused."""
    sources, train_chunks, val_chunks, name = data_sources(cfg)
    if os.path.isdir(cache_root(cfg)):
        remove_stale_builds(cache_root(cfg))
    where = hashlib.sha1(json.dumps([os.path.abspath(p) for p in sources]).encode()).hexdigest()[:16]
    digest = digest_of(sources, os.path.join(cache_root(cfg), '.sources', f'{where}.json'))
    key = f"{name}-{digest[:16]}-min{cfg['min_char_count']}-enc{ENCODER_VERSION}"
    folder = os.path.join(cache_root(cfg), key)
    if not os.path.isfile(os.path.join(folder, 'meta.json')):
        build_cache(folder, train_chunks, val_chunks, cfg,
                    dict(source=[os.path.abspath(p) for p in sources], sha256=digest))
    train, val, meta = load_cache(folder, digest)
    meta['cache_key'] = key
    if len(train) < 2 * cfg['block_size'] + 2 or len(val) < cfg['block_size'] + 2:
        raise ConfigError(f"{', '.join(sources)}: {len(train)} training and {len(val)} validation characters, "
                          f"too short for block_size={cfg['block_size']} (the 10% validation part needs more than "
                          f"block_size); use a longer text or a smaller --block_size")
    return train, val, meta


def build_cache(folder, train_chunks, val_chunks, cfg, source):
    """Encode into a .building-HOST-PID-* folder, then rename it into place: a cache is complete or absent.
    The temporary folder goes on any failure or signal; one left by a killed process goes at the next start."""
    root = cache_root(cfg)
    with writing(root, 'free some disk space or pass another --cache_dir'):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f'.building-{socket.gethostname()}-{os.getpid()}-', dir=root)
    t0 = time.time()
    try:
        meta = encode_dataset(train_chunks, val_chunks, cfg['min_char_count'], tmp, source)
        os.rename(tmp, folder)
    except OSError as e:
        if not os.path.isfile(os.path.join(folder, 'meta.json')):  # else another process finished it first
            raise disk_error(folder, e, 'free some disk space or pass another --cache_dir') from None
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"encoded {meta['n_train'] + meta['n_val']:,} characters in {time.time() - t0:.1f}s into {folder}")


def remove_stale_builds(root):
    """.building-HOST-PID-* folders of dead processes: on this host when the PID is gone, else after a day."""
    for name in os.listdir(root):
        if not name.startswith('.building-'):
            continue
        host, _, pid = name[len('.building-'):].rpartition('-')[0].rpartition('-')
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if host == socket.gethostname() and pid.isdigit():
                stale = not pid_alive(int(pid))
            else:  # another host's (a shared cache), or an older train.py's
                stale = time.time() - os.path.getmtime(path) > 86400
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno != errno.ESRCH  # EPERM: someone else's process
    return True


def load_cache(folder, digest):
    """The cache's memmaps and meta, checked: built from this text, of the recorded lengths and checksums."""
    try:
        with open(os.path.join(folder, 'meta.json')) as f:
            meta = json.load(f)
        ok = meta['sha256'] == digest and meta['encoder_version'] == ENCODER_VERSION and [
            os.path.getsize(os.path.join(folder, n)) for n in BINS] == [2 * meta['n_train'], 2 * meta['n_val']]
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ConfigError(f'the data cache {folder} is corrupt or was built from a different file; '
                          f'delete that folder and run again to rebuild it')
    verify_checksums(folder, meta)
    train, val = (np.memmap(os.path.join(folder, n), dtype=np.uint16, mode='r') if meta[f'n_{n[:-4]}'] else
                  np.zeros(0, dtype=np.uint16) for n in BINS)  # numpy cannot map an empty file
    return train, val, meta


def verify_checksums(folder, meta):
    """train.bin and val.bin against the SHA-256 in meta.json (hashed again only when a file changed)."""
    for name in BINS if 'train_sha256' in meta else ():  # a cache from before checksums: nothing to check
        if digest_of([os.path.join(folder, name)], memo_of(folder, name)) != meta[f'{name[:-4]}_sha256']:
            raise ConfigError(f'the data cache {folder}: {name} does not match its checksum in meta.json (it changed '
                              f'after it was built); delete that folder and run again to rebuild it')


def get_batch(data, idx, block_size):
    """Windows of block_size starting at the given offsets: inputs and next-character targets."""
    x = np.stack([data[i:i + block_size] for i in idx.tolist()]).astype(np.int64)
    y = np.stack([data[i + 1:i + 1 + block_size] for i in idx.tolist()]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def random_offsets(data, shape, block_size, generator):
    return torch.randint(len(data) - block_size - 1, shape, generator=generator)


def eval_batch(val_data, cfg):
    """The fixed evaluation batch for entropy and token-level PR: eval_windows validation windows drawn from
    EVAL_SEED, the same tokens for every run whatever its seed (analyze.py rebuilds it from config.json)."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    return get_batch(val_data, random_offsets(val_data, (cfg['eval_windows'],), cfg['block_size'], gen),
                     cfg['block_size'])


# ----------------------------------------------------------------------------- model

@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 6
    n_embd: int = 384
    bias: bool = False
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        # separate q and k (not one fused c_attn) so W_Q and W_K are plain (C, C) weights to measure
        self.q = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.k = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.v = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.n_head, self.dropout = c.n_head, c.dropout
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x, probe=None):
        B, T, C = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        split = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if probe is None:  # training: the fused kernel, probabilities never materialised
            y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # measuring: the same attention written out, so the probabilities can be kept
            logits = split(q) @ split(k).transpose(-2, -1) / math.sqrt(C // self.n_head)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = logits.masked_fill(~mask, float('-inf')).softmax(dim=-1)
            y = att @ split(v)
            probe.append((q.detach(), k.detach(), att.detach()))
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x, probe=None):
        x = x + self.attn(self.ln1(x), probe)
        return x + self.mlp(self.ln2(x))


def init_normal(wq, wk):
    nn.init.normal_(wq, std=0.02)
    nn.init.normal_(wk, std=0.02)


def init_orthogonal(wq, wk):
    # E||W||_F^2 of N(0, 0.02^2) entries is C^2 * 0.02^2; an orthogonal matrix has ||W||_F^2 = C
    for w in (wq, wk):
        nn.init.orthogonal_(w)
        w.mul_(0.02 * math.sqrt(w.shape[0]))


def init_tied(wq, wk):
    nn.init.normal_(wq, std=0.02)
    wk.copy_(wq)


QK_INITS = {'normal': init_normal, 'orthogonal': init_orthogonal, 'tied': init_tied}


class GPT(nn.Module):
    def __init__(self, c, qk_init='normal'):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        for name, p in self.named_parameters():
            if name.endswith('bias') or name.startswith('ln') or '.ln' in name:
                continue
            # residual projections scaled down with depth, as in GPT-2
            std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith('proj.weight') else 0.02
            nn.init.normal_(p, std=std)
        with torch.no_grad():
            for block in self.blocks:
                QK_INITS[qk_init](block.attn.q.weight, block.attn.k.weight)

    def forward(self, idx, targets=None, probe=None):
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x, probe)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def qk_weights(self):
        """W_Q and W_K of every layer: the objects of the study."""
        return [(b.attn.q.weight, b.attn.k.weight) for b in self.blocks]


# ----------------------------------------------------------------------------- schedules

def get_lr(it, cfg):
    decay_iters = cfg['lr_decay_iters'] or cfg['max_iters']
    if it < cfg['warmup_iters']:
        return cfg['lr'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= decay_iters:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / max(1, decay_iters - cfg['warmup_iters'])
    return cfg['min_lr'] + 0.5 * (1 + math.cos(math.pi * ratio)) * (cfg['lr'] - cfg['min_lr'])


def model_ckpt_iters(cfg):
    """0, then model_ckpts - 1 iterations log-spaced from the end of warm-up (warmup_iters, at least 1) to
    max_iters: the token-level analysis sees training, not model_ckpts copies of the init."""
    n, m = cfg['model_ckpts'], cfg['max_iters']
    if n < 1 or m < 1:
        return {0} if n >= 1 else set()
    lo, k = min(max(1, cfg['warmup_iters']), m), n - 1
    return {0} | {int(round(lo * (m / lo) ** (i / (k - 1)))) if k > 1 else m for i in range(k)}


def loss_iters(cfg):
    """Iterations whose record has train_loss and val_loss (estimated on eval_iters batches): every
    eval_interval, the first and the last (and the model-checkpoint iterations when geometry is off)."""
    m = cfg['max_iters']
    its = {0, m} | set(range(0, m + 1, cfg['eval_interval']))
    return its if cfg['geom_interval'] else its | model_ckpt_iters(cfg)


def log_iters(cfg):
    """Iterations that get a metrics record: the loss iterations and, with geometry on, 0,1,2,4,... early
    (the fast change), every geom_interval and the model-checkpoint iterations."""
    m, g = cfg['max_iters'], cfg['geom_interval']
    its = loss_iters(cfg)
    if g:
        its |= set(range(0, m + 1, g)) | {2 ** i for i in range(int(math.log2(g)) + 1) if 2 ** i <= m}
        its |= model_ckpt_iters(cfg)
    return its


# =============================================================================
# RESEARCH: what each record measures, and the key-spectrum control. A new metric goes into
# measure_geometry (its math into geometry.py); a new intervention goes where control_step calls control.py.
# =============================================================================

@torch.no_grad()
def estimate_loss(model, data, cfg, dev, ctx):
    """Mean loss over eval_iters batches drawn from a fixed generator: every evaluation of every run
    sees the same windows, and the training RNG is not touched."""
    model.eval()
    g = torch.Generator().manual_seed(EVAL_SEED)
    out = {}
    for split, arr in data.items():
        losses = []
        for _ in range(cfg['eval_iters']):
            x, y = get_batch(arr, random_offsets(arr, (cfg['batch_size'],), cfg['block_size'], g), cfg['block_size'])
            with ctx:
                losses.append(model(x.to(dev), y.to(dev))[1].item())
        out[split] = float(np.mean(losses))
    model.train()
    return out


@torch.no_grad()
def measure_geometry(model, eval_x, eval_y, n_head, w0=None):
    """Per layer: every weight metric of W_Q, W_K, W_QK, the learned part W - W(0) when w0 (a list per layer
    of (W_Q(0), W_K(0))) is given, and every token metric on the evaluation batch; and the loss on that
    batch, which the same forward pass gives for free. Layers are None when the loss or an activation is not
    finite (the caller stops the run: geometry.py refuses NaN)."""
    model.eval()
    probe = []
    loss = model(eval_x, eval_y, probe=probe)[1].item()  # float32, explicit attention
    model.train()
    if not math.isfinite(loss) or not all(torch.isfinite(t).all() for acts in probe for t in acts):
        return loss, None
    layers = []
    for i, ((wq, wk), (q, k, att)) in enumerate(zip(model.qk_weights(), probe)):
        row = geometry.layer_geometry(wq, wk, n_head)
        if w0 is not None:  # which directions training opened, whatever the init (a random W has PR ~ C/2)
            row.update(geometry.learned_geometry(wq, wk, *w0[i], n_head))
        row.update(geometry.token_geometry(q, k, att, n_head))
        layers.append(row)
    return loss, layers


def measure(run, it):
    """One metrics.jsonl record at iteration it: losses (at the loss iterations), checked before anything
    else, then the Q/K geometry of every layer and the control's targets and reached PRs."""
    cfg = run.cfg
    row = {'iter': it, 'tokens': it * run.tokens_per_iter, 'lr': get_lr(it, cfg)}
    if it in run.evals:
        losses = estimate_loss(run.model, run.data, cfg, run.dev, run.ctx)
        row.update(train_loss=losses['train'], val_loss=losses['val'])
    for key in ('train_loss', 'val_loss'):
        if not math.isfinite(row.get(key, 0.0)):
            nan_stop(row[key], it, cfg)
    t0 = time.time()
    if cfg['geom_interval']:
        loss, layers = measure_geometry(run.model, run.eval_x, run.eval_y, cfg['n_head'], run.w0)
        if layers is None:
            nan_stop(loss if not math.isfinite(loss) else float('nan'), it, cfg)
        for layer, ctl_row in zip(layers, spectrum_control.report(run.ctl)):
            layer.update(ctl_row)
        row['eval_loss'], row['layers'] = loss, layers
    run.t_geom += time.time() - t0
    return row


def control_step(run, step):
    """The causal experiment: reshape the controlled spectra after optimizer step number `step`."""
    if run.cfg['control'] == 'none':  # a none run reports a control share of exactly 0
        return
    t0 = time.time()
    spectrum_control.apply(run.ctl, run.cfg, run.model.qk_weights(), step)
    run.t_ctl += time.time() - t0


# ----------------------------------------------------------------------------- the run

def train(cfg):
    """One run from its config: trains, logs, checkpoints; resumes an unfinished run. Returns the run folder."""
    dev = pick_device(cfg)  # first: an unusable device is named before any work
    ddp, rank, world, dev = start_ddp(dev)
    run = types.SimpleNamespace(cfg=cfg, dev=dev, ddp=ddp, rank=rank, world=world, master=rank == 0)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(release, run)  # however this ends: signal handlers, lock, process group released
        if cfg['grad_accum'] % world:
            raise ConfigError(f"grad_accum={cfg['grad_accum']} must be divisible by the {world} DDP processes")
        # ---- seeding: python, numpy, torch (the data order has its own generator, saved in checkpoints)
        if cfg['threads']:
            torch.set_num_threads(cfg['threads'])
        random.seed(cfg['seed'])
        np.random.seed(cfg['seed'])
        torch.manual_seed(cfg['seed'])
        dev_type = dev.split(':')[0]
        use_bf16 = cfg['dtype'] == 'bfloat16' or (cfg['dtype'] == 'auto' and dev_type == 'cuda'
                                                   and torch.cuda.is_bf16_supported())
        run.dtype = 'bfloat16' if use_bf16 else 'float32'
        run.ctx = torch.autocast(dev_type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

        # ---- run folder: checked and locked; resumed or started over below (rank 0 writes)
        run.dir = run_folder(cfg)
        run.lock = lock_run(run.dir) if run.master else None
        run.ckpt_path = os.path.join(run.dir, 'ckpt.pt')
        resuming = os.path.exists(run.ckpt_path) and not cfg['overwrite']
        if run.master:
            print(f'run folder {run.dir}', flush=True)
            if not resuming:  # an overwritten run, or the leftovers of one killed before its first checkpoint
                start_over(run.dir)
        if ddp:
            torch.distributed.barrier()

        # ---- data
        train_data, val_data, run.meta = prepare_data(cfg)
        run.data = {'train': train_data, 'val': val_data}
        run.data_gen = torch.Generator().manual_seed(cfg['seed'])
        run.eval_x, run.eval_y = (t.to(dev) for t in eval_batch(val_data, cfg))

        # ---- model, optimizer, control state; then the checkpoint over them when resuming
        run.gcfg = GPTConfig(run.meta['vocab_size'], cfg['block_size'], cfg['n_layer'], cfg['n_head'],
                             cfg['n_embd'], cfg['bias'], cfg['dropout'])
        run.model = GPT(run.gcfg, cfg['qk_init']).to(dev)
        run.optimizer = make_optimizer(run.model, cfg, dev_type)
        run.ctl = spectrum_control.record(cfg, run.model.qk_weights())  # the step-0 spectra control steers from
        run.w0 = [(wq.detach().cpu().clone(), wk.detach().cpu().clone()) for wq, wk in run.model.qk_weights()]
        run.start, run.elapsed = 0, 0.0
        if resuming:  # the state at the checkpoint, W(0) and the control's step-0 spectra included
            run.start, run.elapsed, run.ctl, run.w0 = load_checkpoint(run.ckpt_path, cfg, run.meta, run.model,
                                                                      run.optimizer, run.data_gen, run.w0)
        if run.master:
            open_run_files(run, resuming)
        run.train_model = run.model
        if cfg['compile'] and hasattr(torch, 'compile') and dev_type != 'mps':
            run.train_model = torch.compile(run.model)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel
            run.train_model = DistributedDataParallel(run.train_model, device_ids=[int(dev.split(':')[1])]
                                                      if ':' in dev else None)

        # ---- the loop: a record at the logged iterations, then one optimizer step and the control
        run.stop, stopping = [], False
        run.old_handlers = {s: signal.signal(s, lambda sig, frame: run.stop.append(sig))
                            for s in (signal.SIGINT, signal.SIGTERM)}  # finish the step, checkpoint, exit
        run.logs, run.evals, run.ckpts = log_iters(cfg), loss_iters(cfg), model_ckpt_iters(cfg)
        run.tokens_per_iter = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size']
        run.t_start, run.t_geom, run.t_ctl = time.time(), 0.0, 0.0
        run.t_mark, run.it_mark, run.last = run.t_start, run.start, {}  # for ms/iter: training time only
        for it in range(run.start, cfg['max_iters'] + 1):
            if run.master and it in run.logs:
                record(run, it)
            if it == cfg['max_iters']:
                break
            if stopping or (it > run.start and it % cfg['ckpt_interval'] == 0):
                checkpoint(run, it)
            if stopping:
                stop_on_signal(run, it)
            stopping = train_step(run, it)
            control_step(run, it + 1)
        finish(run)
    return run.dir


def make_optimizer(model, cfg, dev_type):
    """AdamW; weight decay on matrices (not gains), and on W_Q and W_K only with decay_qk."""
    qk_ids = {id(w) for pair in model.qk_weights() for w in pair}
    decays = lambda p: p.dim() >= 2 and (cfg['decay_qk'] or id(p) not in qk_ids)
    decay = [p for p in model.parameters() if decays(p)]
    no_decay = [p for p in model.parameters() if not decays(p)]
    return torch.optim.AdamW([{'params': decay, 'weight_decay': cfg['weight_decay']},
                              {'params': no_decay, 'weight_decay': 0.0}],
                             lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']), fused=dev_type == 'cuda')


def train_step(run, it):
    """One optimizer step over grad_accum micro-batches (this rank's share of them). Returns whether a
    signal asks every rank to stop."""
    cfg, micro = run.cfg, run.cfg['grad_accum'] // run.world
    for group in run.optimizer.param_groups:
        group['lr'] = get_lr(it, cfg)
    # every rank draws the whole global batch's offsets, so the data stream does not depend on world
    offsets = random_offsets(run.data['train'], (cfg['grad_accum'], cfg['batch_size']), cfg['block_size'],
                             run.data_gen)
    step_loss = 0.0
    for m in range(micro):
        x, y = get_batch(run.data['train'], offsets[run.rank * micro + m], cfg['block_size'])
        if run.ddp:
            run.train_model.require_backward_grad_sync = m == micro - 1
        with run.ctx:
            loss = run.train_model(x.to(run.dev, non_blocking=True), y.to(run.dev, non_blocking=True))[1] / micro
        loss.backward()
        step_loss += loss.item()
    # one collective for the ranks to agree on a bad loss or a signal, so they stop together
    flags = torch.tensor([step_loss, float(len(run.stop))])
    if run.ddp:
        torch.distributed.all_reduce(flags)
    if not math.isfinite(flags[0].item()):
        nan_stop(flags[0].item(), it, cfg)
    if cfg['grad_clip']:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg['grad_clip'])
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return flags[1].item() > 0


def nan_stop(loss, it, cfg):
    raise ConfigError(f"the loss became {loss} at iteration {it}. The run stops here: ckpt.pt keeps the last good "
                      f"state, metrics.jsonl the records before this one, and no done.json is written. "
                      f"Lower --lr (now {cfg['lr']}), keep --grad_clip on (now {cfg['grad_clip']}), or lengthen "
                      f"--warmup_iters, then rerun with --overwrite=True")


# =============================================================================
# PLUMBING: devices, DDP, the run folder and its lock, records on disk, checkpoints and resume, signals,
# errors. None of it needs reading to change the science.
# =============================================================================

def available_devices():
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available()
    return ', '.join(['cpu'] + [f'cuda ({cuda} device{"s" * (cuda > 1)}: cuda:0..cuda:{cuda - 1})'] * (cuda > 0)
                     + ['mps'] * mps)


def pick_device(cfg):
    """cfg['device'] checked against what this machine has, or (empty) the best available."""
    name, here = cfg['device'], available_devices()
    if not name:
        return 'cuda' if 'cuda' in here else 'mps' if 'mps' in here else 'cpu'
    kind, _, index = name.partition(':')
    fix = f'available here: {here}; pass one of them (--device=cpu always works) or leave --device= empty'
    if kind not in ('cpu', 'cuda', 'mps') or (index and not index.isdigit()):
        raise ConfigError(f'--device={name}: {name!r} is not a device train.py can use; {fix}')
    if kind == 'cuda' and not torch.cuda.is_available():
        build = 'is a CPU-only build' if torch.version.cuda is None else 'finds no CUDA GPU'
        raise ConfigError(f'--device={name}: torch {torch.__version__} here {build}; {fix}, or install a CUDA '
                          f'build of torch on a GPU machine')
    if kind == 'cuda' and index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f'--device={name}: there is no CUDA device {index}; {fix}')
    if kind == 'mps' and 'mps' not in here:
        raise ConfigError(f'--device={name}: MPS (Apple GPUs) is not available here; {fix}')
    return name


def start_ddp(dev):
    """(ddp, rank, world size, device) from torchrun's environment; one plain process without it."""
    if int(os.environ.get('RANK', -1)) == -1:
        return False, 0, 1, dev
    import torch.distributed as dist
    dist.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
    if dev.startswith('cuda'):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(dev)
    return True, int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), dev


LOCK_FILE = '.lock'
# what train.py writes in a run folder (with snapshots/ and models/): starting over deletes these, nothing else
RUN_FILE = re.compile(r'(done\.json|ckpt\.pt|metrics\.jsonl|config\.json)(\.tmp)?')
SNAPSHOT = re.compile(r'(?:\.tmp_|qk_)(\d{7})\.npz')
MODEL = re.compile(r'model_(\d{7})\.pt(?:\.tmp)?')


def run_folder(cfg):
    """out_dir/run_name, checked before anything is written: inside out_dir (a symlink out of it is refused)
    and not a finished run (unless --overwrite=True)."""
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    out, real = os.path.realpath(cfg['out_dir']), os.path.realpath(run_dir)
    if real == out or os.path.commonpath([real, out]) != out:
        raise ConfigError(f'the run folder {run_dir} resolves to {real}, outside out_dir={cfg["out_dir"]}; '
                          f'choose another --run_name')
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise ConfigError(f'{run_dir} holds a finished run; pass --overwrite=True to train it again '
                          f'(that deletes it) or choose another --run_name / --out_dir')
    return run_dir


def lock_run(run_dir):
    """Make the run folder and hold its lock file (fcntl.flock: the OS releases it when the process ends,
    however it ends), or refuse, naming the PID of the process that holds it."""
    with writing(run_dir):
        os.makedirs(run_dir, exist_ok=True)
        f = open(os.path.join(run_dir, LOCK_FILE), 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or '?'
        f.close()
        raise ConfigError(f'another train.py (PID {pid}) is running on {run_dir}; wait for it to finish, or stop it '
                          f'(kill {pid}: it checkpoints and exits), then run the same command again') from None
    f.seek(0)
    f.truncate()
    f.write(f'{os.getpid()}\n')
    f.flush()
    return f


def train_py_wrote(run_dir):
    """Whether the folder's config.json is one train.py wrote (it holds what only train.py adds)."""
    cfg = read_json_or_empty(os.path.join(run_dir, 'config.json'))
    return all(k in cfg for k in ('run_name', 'torch', 'n_params', 'data_sha256'))


def own_files(run_dir):
    """The paths in run_dir that train.py writes, present now; config.json last (see start_over)."""
    found = [n for n in os.listdir(run_dir) if RUN_FILE.fullmatch(n) and n != 'config.json']
    for sub, pattern in (('snapshots', SNAPSHOT), ('models', MODEL)):
        folder = os.path.join(run_dir, sub)
        found += [os.path.join(sub, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                  if pattern.fullmatch(n)]
    found += ['config.json'] * os.path.exists(os.path.join(run_dir, 'config.json'))
    return found


def start_over(run_dir):
    """Remove what train.py writes in run_dir, and nothing else; refuse where those files are not train.py's
    (no config.json of its own). config.json goes last: a folder cleared halfway is still recognised."""
    found = own_files(run_dir)
    if found and not train_py_wrote(run_dir):
        raise ConfigError(f"{run_dir} holds {', '.join(found[:4])}{' ...' * (len(found) > 4)} not written by "
                          f"train.py (no config.json of its own); starting over would delete them: move them away "
                          f"or choose another --run_name")
    with writing(run_dir):
        for name in found:
            os.remove(os.path.join(run_dir, name))
        for sub in ('snapshots', 'models'):
            with contextlib.suppress(OSError):  # kept where it holds something of the user's
                os.rmdir(os.path.join(run_dir, sub))


def trim_run(run_dir, keep_below):
    """Drop records, snapshots and model checkpoints from iteration keep_below on, so that a resumed
    run rewrites them exactly once. Files train.py did not write are left alone."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [r for r in read_metrics(path) if r['iter'] < keep_below]
    with writing(path):
        with open(path + '.tmp', 'w') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)
        os.replace(path + '.tmp', path)
        for name in own_files(run_dir):
            match = (SNAPSHOT.fullmatch(os.path.basename(name)) or MODEL.fullmatch(os.path.basename(name)))
            if match and int(match.group(1)) >= keep_below:
                os.remove(os.path.join(run_dir, name))


def open_run_files(run, resuming):
    """Rank 0: the run folder trimmed to the checkpoint (resuming) or cleared, config.json written (every
    value as resolved), metrics.jsonl opened for appending."""
    cfg = run.cfg
    if resuming:
        trim_run(run.dir, run.start)
        print(f'resuming {run.dir} from iteration {run.start}', flush=True)
    write_json(dict(cfg, dtype=run.dtype, torch=torch.__version__, device=run.dev, world_size=run.world,
                    git_commit=git_commit(), vocab_size=run.meta['vocab_size'], data_sha256=run.meta['sha256'],
                    n_chars=run.meta['n_train'] + run.meta['n_val'], data_cache=run.meta['cache_key'],
                    n_params=sum(p.numel() for p in run.model.parameters())),
               os.path.join(run.dir, 'config.json'))
    path = os.path.join(run.dir, 'metrics.jsonl')
    with writing(path):
        run.metrics = open(path, 'a')


def record(run, it):
    """Measure (RESEARCH above), then write: the snapshot, a model checkpoint at its iterations, the record."""
    ms = 1000 * (time.time() - run.t_mark) / (it - run.it_mark) if it > run.it_mark else float('nan')
    row = measure(run, it)
    t0 = time.time()
    if run.cfg['geom_interval']:
        save_qk(run.model, run.dir, it, run.cfg)
    if it in run.ckpts:
        atomic_save({'model': run.model.state_dict(), 'model_config': run.gcfg.__dict__, 'iter': it},
                    os.path.join(run.dir, 'models', f'model_{it:07d}.pt'))
    run.t_geom += time.time() - t0  # geometry share: measuring (in measure) and these writes, not the losses
    row['time'] = run.elapsed + time.time() - run.t_start
    with writing(run.metrics.name):
        run.metrics.write(json.dumps(row) + '\n')
        run.metrics.flush()
    run.last = row
    print_record(row, ms, run.tokens_per_iter, run.cfg, run.start, run.t_start)
    run.t_mark, run.it_mark = time.time(), it  # time spent measuring is not training time


def checkpoint(run, it):
    """ckpt.pt: everything that decides the rest of the run. metrics.jsonl is fsynced first, so that after a
    power loss a checkpoint never lies ahead of the records on disk."""
    if not run.master:
        return
    with writing(run.metrics.name):
        run.metrics.flush()
        os.fsync(run.metrics.fileno())
    atomic_save({'model': run.model.state_dict(), 'optimizer': run.optimizer.state_dict(), 'iter': it,
                 'elapsed': run.elapsed + time.time() - run.t_start, 'config': run.cfg,
                 'rng': rng_state(run.data_gen), 'data_sha256': run.meta['sha256'],
                 'data_cache': run.meta['cache_key'], 'control': run.ctl,
                 'w0': run.w0},
                run.ckpt_path)


def stop_on_signal(run, it):
    """After SIGINT/SIGTERM: the checkpoint is written; every rank leaves together."""
    if run.ddp:
        torch.distributed.barrier()
    sig = run.stop[0] if run.stop else signal.SIGTERM
    if run.master:
        print(f"stopped by signal {signal.Signals(sig).name} at iteration {it}; checkpoint saved in "
              f"{run.ckpt_path}. Run the same command again to resume.", flush=True)
    raise SystemExit(128 + sig)


def finish(run):
    """The final checkpoint, then done.json last, so a sweep knows the run is complete."""
    checkpoint(run, run.cfg['max_iters'])
    run.elapsed += time.time() - run.t_start
    if run.master:
        run.metrics.close()
        last = run.last
        done = {k: last.get(k) for k in ('iter', 'train_loss', 'val_loss')}
        if last.get('layers'):
            for key in ('pr_q', 'pr_k', 'pr_qk', 'entropy', 'entropy_norm'):
                done[key] = float(np.mean([layer[key] for layer in last['layers']]))
        share = lambda t: t / max(time.time() - run.t_start, 1e-9)  # of this process's wall time
        done.update(wall_time=run.elapsed, geometry_share=share(run.t_geom), control_share=share(run.t_ctl))
        write_json(done, os.path.join(run.dir, 'done.json'))
        ctl_msg = f" and control {100 * share(run.t_ctl):.1f}%" if run.cfg['control'] != 'none' else ''
        print(f"done in {fmt_time(run.elapsed)}: val loss {done['val_loss']:.4f}; geometry logging took "
              f"{100 * share(run.t_geom):.1f}%{ctl_msg} of wall time; run folder {run.dir}", flush=True)
    if run.ddp:
        torch.distributed.barrier()  # every rank got here: rank 0 has finished writing


def release(run):
    """Whatever way the loop ended: the signal handlers back, the lock and the process group released."""
    for sig, handler in getattr(run, 'old_handlers', {}).items():
        signal.signal(sig, handler)
    if getattr(run, 'lock', None):
        run.lock.close()
    if run.ddp:
        torch.distributed.destroy_process_group()


RUN_FIX = ('free some disk space or choose another --out_dir. Files already written are intact: the same command '
           'resumes from the last checkpoint')


def disk_error(path, e, fix=RUN_FIX):
    return ConfigError(f'cannot write {path}: {e.strerror or e}; {fix}')


@contextlib.contextmanager
def writing(path, fix=RUN_FIX):
    """A failed write (a full disk, a read-only or missing folder) as one line naming the path and the cause."""
    try:
        yield
    except OSError as e:
        raise disk_error(path, e, fix) from None


def atomic_save(obj, path):
    """torch.save to a temporary name, flushed, then renamed: a kill never leaves half a file. Serialised in
    memory first, so a failed write is the OSError it is (torch.save's writer turns it into a RuntimeError)."""
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    tmp = path + '.tmp'
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, 'wb') as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise disk_error(path, e) from None


def write_json(obj, path):
    with writing(path):
        with open(path + '.tmp', 'w') as f:
            json.dump(obj, f, indent=1)
        os.replace(path + '.tmp', path)


def read_metrics(path, warn=None):
    """Records of a metrics.jsonl: the one tolerant reader (analyze.py uses it too). The last line may have
    been cut short by a kill mid-write: if it does not parse, it is dropped silently. Any other line that is
    not a JSON object with an integer 'iter' raises ConfigError, or, given warn, is skipped after
    warn(a message naming the file and the line)."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, 'rb') as f:
        lines = f.read().split(b'\n')
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    for i in nonempty:
        try:
            row = json.loads(lines[i].decode('utf-8'))
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            if i == nonempty[-1]:
                continue  # cut short by a kill
            problem = 'is not valid JSON'
        else:
            if isinstance(row, dict) and type(row.get('iter')) is int:
                rows.append(row)
                continue
            problem = "is not a record (a JSON object with an integer 'iter')"
        msg = f'{path} line {i + 1} {problem}'
        if warn is None:
            raise ConfigError(f'{msg}; delete the run folder or pass --overwrite=True')
        warn(msg)
    return rows


def save_qk(model, run_dir, it, cfg):
    if not cfg['save_snapshots']:
        return
    folder = os.path.join(run_dir, 'snapshots')
    q = torch.stack([wq.detach().float().cpu() for wq, _ in model.qk_weights()]).numpy()
    k = torch.stack([wk.detach().float().cpu() for _, wk in model.qk_weights()]).numpy()
    tmp = os.path.join(folder, f'.tmp_{it:07d}.npz')
    with writing(folder):
        os.makedirs(folder, exist_ok=True)
        np.savez(tmp, q=q, k=k, n_head=cfg['n_head'])
        os.replace(tmp, os.path.join(folder, f'qk_{it:07d}.npz'))


def git_commit():
    import subprocess  # only here
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def rng_state(data_gen):
    np_state = np.random.get_state()
    return {'torch': torch.get_rng_state(), 'data': data_gen.get_state(), 'python': random.getstate(),
            'numpy': (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state, data_gen):
    torch.set_rng_state(state['torch'])
    data_gen.set_state(state['data'])
    random.setstate(state['python'])
    n = state['numpy']
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    if state['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


# settings that may differ between a run and its resumption: where things are, not what is computed
RESUMABLE_CHANGES = ('overwrite', 'device', 'threads', 'compile', 'out_dir', 'data_file', 'data_dir', 'cache_dir',
                     'data_url')


def load_checkpoint(path, cfg, meta, model, optimizer, data_gen, w0):
    """Restore everything that decides the rest of the run, or say why this checkpoint cannot do it. A
    checkpoint from before W(0) was saved gives w0 back: the same seed's init, W(0) itself."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        changed = [k for k in ckpt['config'] if k not in RESUMABLE_CHANGES and ckpt['config'][k] != cfg.get(k)]
        changed += ['the training text or its encoding'] if (ckpt['data_sha256'], ckpt.get('data_cache')) != (
            meta['sha256'], meta['cache_key']) else []
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f'cannot resume from {path}, it is corrupt ({type(e).__name__}: {str(e)[:200]}); '
                          f'pass --overwrite=True to start the run over') from None
    if changed:
        raise ConfigError(f"{path} was written with other settings ({', '.join(changed)}); run with the "
                          f"same settings to resume, or pass --overwrite=True to start over")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    set_rng_state(ckpt['rng'], data_gen)
    return ckpt['iter'], ckpt['elapsed'], ckpt['control'], [tuple(pair) for pair in ckpt.get('w0', w0)]


def print_record(row, ms, tokens_per_iter, cfg, start, t_start):
    it = row['iter']
    done_frac = (it - start) / max(1, cfg['max_iters'] - start)
    eta = (time.time() - t_start) * (1 - done_frac) / done_frac if done_frac > 0 else float('nan')
    msg = f"iter {it}: "
    if 'val_loss' in row:
        msg += f"train {row['train_loss']:.4f}, val {row['val_loss']:.4f}, "
    if 'eval_loss' in row:
        msg += f"eval batch {row['eval_loss']:.4f}, "
    # no speed yet at the start
    speed = f"{ms:.1f} ms/iter, {1000 * tokens_per_iter / ms:.0f} tok/s" if ms == ms else "- ms/iter"
    msg += f"lr {row['lr']:.2e}, {speed}, ETA {fmt_time(eta) if eta == eta else '-'}"
    if row.get('layers'):
        mean = lambda key: np.mean([layer[key] for layer in row['layers']])
        msg += f" | pr_q {mean('pr_q'):.1f} pr_k {mean('pr_k'):.1f} entropy {mean('entropy'):.3f}"
    print(msg, flush=True)


def fmt_time(s):
    return f'{s / 3600:.1f}h' if s > 5400 else f'{s / 60:.1f}m' if s > 90 else f'{s:.0f}s'


class Stopped(BaseException):
    """SIGTERM outside the training loop (which checkpoints instead): unwinds like Ctrl-C, cleaning up."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def stopped(signum, frame):
    raise Stopped(signum)


def main(argv):
    """The command line: train.py [CONFIG_FILE] [--key=value ...], or --print_run_names."""
    signal.signal(signal.SIGTERM, stopped)
    try:
        if argv == ['--print_run_names']:
            print_run_names(sys.stdin)
        elif '--print_run_names' in argv:
            raise ConfigError('--print_run_names takes no other arguments: it reads one argument list per line '
                              'from stdin')
        else:
            train(get_config(argv))
    except ConfigError as e:
        print(e.code, file=sys.stderr, flush=True)
        sys.exit(2)
    except (KeyboardInterrupt, Stopped) as e:
        sig = getattr(e, 'signum', signal.SIGINT)
        print(f'error: stopped by {signal.Signals(sig).name}; nothing half-written was kept. Run the same command '
              f'again to continue.', file=sys.stderr, flush=True)
        sys.exit(128 + sig)


if __name__ == '__main__':
    main(sys.argv[1:])
