"""
Train a small character-level GPT on WikiText-103 and log the geometry of its queries and keys.

One GPU (or CPU, or MPS), from the repository root:
    python train.py --n_layer=4 --seed=1
Any local text instead of WikiText-103 (what the CPU runs of this repository use):
    python train.py --data_file=../shared/data/wikitext-103/wiki.test.raw --n_embd=128 --n_head=4
Several GPUs on one node (DDP):
    torchrun --nproc_per_node=4 train.py --n_layer=8 --grad_accum=4
A config file can come first (Python assignments or JSON), then --key=value overrides:
    python train.py my_config.py --seed=2

Each run writes out_dir/run_name/: config.json, metrics.jsonl, snapshots/ (W_Q, W_K at every logged
iteration), models/ (model weights at log-spaced iterations), ckpt.pt (latest state), done.json (last).
Rerunning the same command resumes an unfinished run; --overwrite=True starts it over.
"""
import ast
import builtins
import contextlib
import difflib
import functools
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
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
run_name = ''              # '' = from the settings, e.g. L4_normal_s1 or L4_normal_shrink-k_s1
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


def unknown_key(key, where):
    close = difflib.get_close_matches(key, config_keys, n=1)
    hint = f'; did you mean {close[0]}?' if close else '; see the config block at the top of train.py'
    return ConfigError(f'unknown config key {key!r} in {where}{hint}')


def load_config_file(path, defaults):
    """Python assignments or a JSON object; every name must be a config key."""
    if not os.path.isfile(path):
        raise ConfigError(f'config file {path} does not exist')
    with open(path) as f:
        text = f.read()
    if path.endswith('.json'):
        values = json.loads(text)
    else:
        values = {}
        exec(builtins.compile(text, path, 'exec'), {}, values)
        values = {k: v for k, v in values.items() if not k.startswith('_')}
    for k, v in values.items():
        if k not in defaults:
            raise unknown_key(k, path)
        values[k] = parse_value(k, repr(v), defaults[k])
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
    return cfg


def default_run_name(cfg):
    """The one source of run names: L4_normal_s1, L4_normal_shrink-k_s1, L4_normal_freeze-k-spec_s3."""
    label = spectrum_control.control_label(cfg)
    return f"L{cfg['n_layer']}_{cfg['qk_init']}{'_' + label if label else ''}_s{cfg['seed']}"


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


def check_config(cfg):
    """Stop before any work on settings that cannot run, saying which and how to fix them."""
    if cfg['n_embd'] % cfg['n_head']:
        raise ConfigError(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}; "
                          f"pick n_head among {[h for h in range(1, 17) if cfg['n_embd'] % h == 0]}")
    if cfg['qk_init'] not in QK_INITS:
        raise ConfigError(f"qk_init={cfg['qk_init']!r} is not one of {sorted(QK_INITS)}")
    if cfg['dtype'] not in ('auto', 'float32', 'bfloat16'):
        raise ConfigError(f"dtype={cfg['dtype']!r} is not one of auto, float32, bfloat16")
    for key in ('n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size', 'grad_accum', 'eval_iters',
                'eval_interval', 'ckpt_interval', 'eval_windows', 'control_interval'):
        if cfg[key] < 1:
            raise ConfigError(f'{key}={cfg[key]} must be at least 1')
    if cfg['max_iters'] < 0 or cfg['geom_interval'] < 0:
        raise ConfigError('max_iters and geom_interval must be >= 0')
    try:  # control, control_target, control_scope, control_layers, shrink_to, shrink_iters
        spectrum_control.check_settings(cfg, cfg['n_layer'])
    except ValueError as e:
        raise ConfigError(str(e)) from None


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


def text_chunks(path, size=1 << 25):
    with open(path, encoding='utf-8') as f:
        for chunk in iter(lambda: f.read(size), ''):
            yield chunk


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
    """Encode text chunks through a code point -> id table into a uint16 file; returns its length."""
    n = 0
    with open(path, 'wb') as f:
        for chunk in chunks:
            ids = table[codepoints(chunk)]
            f.write(ids.tobytes())
            n += len(ids)
    return n


def encode_dataset(train_chunks, val_chunks, min_count, out_dir, source):
    """train.bin, val.bin (uint16, nanoGPT style) and meta.json in out_dir from chunk factories."""
    kept, counts = build_vocab(train_chunks(), min_count)
    table = np.zeros(0x110000, dtype=np.uint16)
    table[kept] = np.arange(1, len(kept) + 1, dtype=np.uint16)
    n_train = encode_to(train_chunks(), table, os.path.join(out_dir, 'train.bin'))
    n_val = encode_to(val_chunks(), table, os.path.join(out_dir, 'val.bin'))
    meta = dict(source, vocab_size=len(kept) + 1, chars=''.join(map(chr, kept)), min_char_count=min_count,
                n_train=n_train, n_val=n_val, n_unknown_train=int(counts.sum() - counts[kept].sum()))
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)
    return meta


def decode(ids, meta):
    chars = '\ufffd' + meta['chars']
    return ''.join(chars[i] for i in ids)


def download_wikitext(cfg):
    """Fetch and unzip the raw WikiText-103 release into data_dir, or explain the two ways out."""
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
            f"WikiText-103 is not in {data_dir}/ and downloading {cfg['data_url']} failed ({e}).\n"
            f"  Either: download wikitext-103-raw-v1.zip on a machine with network access and unzip it so\n"
            f"  that {data_dir}/wiki.train.raw, wiki.valid.raw and wiki.test.raw exist (or pass --data_dir=),\n"
            f"  or: train on any local UTF-8 text with --data_file=PATH\n"
            f"  (for example --data_file=../shared/data/wikitext-103/wiki.test.raw)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_data(cfg):
    """Encoded train/val memmaps and meta, built once per source into the cache and reused."""
    if cfg['data_file']:
        path = cfg['data_file']
        if not os.path.isfile(path):
            raise ConfigError(f'data_file {path} does not exist; pass the path of a UTF-8 text file')
        sources = [path]

        @functools.lru_cache(maxsize=1)
        def split():  # read only when the cache has to be built, and then once
            text = open(path, encoding='utf-8').read()
            cut = int(0.9 * len(text))
            return text[:cut], text[cut:]
        train_chunks = lambda: [split()[0]]
        val_chunks = lambda: [split()[1]]
        name = os.path.basename(path)
    else:
        if cfg['dataset'] != 'wikitext103':
            raise ConfigError(f"dataset={cfg['dataset']!r} is unknown: use wikitext103 or --data_file=PATH")
        names = ('wiki.train.raw', 'wiki.valid.raw', 'wiki.test.raw')
        if not all(os.path.isfile(os.path.join(cfg['data_dir'], n)) for n in names):
            download_wikitext(cfg)
        sources = [os.path.join(cfg['data_dir'], n) for n in names[:2]]
        train_chunks = lambda: text_chunks(sources[0])
        val_chunks = lambda: text_chunks(sources[1])
        name = 'wikitext103'
    digest = sha256_of(sources)
    folder = os.path.join(cache_root(cfg), f"{name}-{digest[:16]}-min{cfg['min_char_count']}")
    if not os.path.isfile(os.path.join(folder, 'meta.json')):
        os.makedirs(cache_root(cfg), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix='.building-', dir=cache_root(cfg))
        t0 = time.time()
        meta = encode_dataset(train_chunks, val_chunks, cfg['min_char_count'], tmp,
                              dict(source=[os.path.abspath(p) for p in sources], sha256=digest))
        try:
            os.rename(tmp, folder)  # a cache is either complete or absent
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished it first
        print(f"encoded {meta['n_train'] + meta['n_val']:,} characters in {time.time() - t0:.1f}s into {folder}")
    train, val, meta = load_cache(folder, digest)
    if len(train) < 2 * cfg['block_size'] + 2 or len(val) < cfg['block_size'] + 2:
        raise ConfigError(f"{', '.join(sources)}: {len(train)} training and {len(val)} validation characters, "
                          f"too short for block_size={cfg['block_size']} (the 10% validation part needs more than "
                          f"block_size); use a longer text or a smaller --block_size")
    return train, val, meta


def load_cache(folder, digest):
    try:
        with open(os.path.join(folder, 'meta.json')) as f:
            meta = json.load(f)
        train = np.memmap(os.path.join(folder, 'train.bin'), dtype=np.uint16, mode='r')
        val = np.memmap(os.path.join(folder, 'val.bin'), dtype=np.uint16, mode='r')
        ok = meta['sha256'] == digest and len(train) == meta['n_train'] and len(val) == meta['n_val']
    except (OSError, ValueError, KeyError):
        ok = False
    if not ok:
        raise ConfigError(f'the data cache {folder} is corrupt or was built from a different file; '
                          f'delete that folder and run again to rebuild it')
    return train, val, meta


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
    """0, max_iters and model_ckpts - 2 log-spaced iterations between them."""
    n, m = cfg['model_ckpts'], cfg['max_iters']
    if n < 1 or m < 1:
        return set()
    return {0, m} | {int(round(m ** (i / max(1, n - 2)))) for i in range(n - 1)} if n > 2 else {0, m}


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


# ----------------------------------------------------------------------------- measuring

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
def measure_geometry(model, eval_x, eval_y, n_head):
    """Per layer: every weight metric of W_Q, W_K, W_QK and every token metric on the evaluation batch;
    and the loss on that batch, which the same forward pass gives for free."""
    model.eval()
    probe = []
    loss = model(eval_x, eval_y, probe=probe)[1].item()  # float32, explicit attention
    model.train()
    layers = []
    for (wq, wk), (q, k, att) in zip(model.qk_weights(), probe):
        row = geometry.layer_geometry(wq, wk, n_head)
        row.update(geometry.token_geometry(q, k, att, n_head))
        layers.append(row)
    return loss, layers


# ----------------------------------------------------------------------------- run folder plumbing

def atomic_save(obj, path):
    """torch.save to a temporary name, flushed, then renamed: a kill never leaves half a file."""
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(obj, path):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


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


def trim_run(run_dir, keep_below):
    """Drop records, snapshots and model checkpoints from iteration keep_below on, so that a resumed
    run rewrites them exactly once."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    rows = [r for r in read_metrics(path) if r['iter'] < keep_below]
    with open(path + '.tmp', 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in rows)
    os.replace(path + '.tmp', path)
    for sub in ('snapshots', 'models'):
        folder = os.path.join(run_dir, sub)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if int(name.split('_')[-1].split('.')[0]) >= keep_below:
                os.remove(os.path.join(folder, name))


def clear_run(run_dir):
    """Remove what a run writes (and nothing else a user may have put in the folder)."""
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    os.makedirs(run_dir, exist_ok=True)


RUN_FILES = ('done.json', 'ckpt.pt', 'ckpt.pt.tmp', 'metrics.jsonl', 'config.json', 'snapshots', 'models')


def git_commit():
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


def pick_device(cfg):
    if cfg['device']:
        return cfg['device']
    if torch.cuda.is_available():
        return 'cuda'
    if getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available():
        return 'mps'
    return 'cpu'


def fmt_time(s):
    return f'{s / 3600:.1f}h' if s > 5400 else f'{s / 60:.1f}m' if s > 90 else f'{s:.0f}s'


# ----------------------------------------------------------------------------- the run

def train(cfg):
    # ---- distributed setup, device, dtype, seeding
    ddp = int(os.environ.get('RANK', -1)) != -1
    rank, world = (int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) if ddp else (0, 1)
    master = rank == 0
    dev = pick_device(cfg)
    if ddp:
        import torch.distributed as dist
        local = int(os.environ.get('LOCAL_RANK', 0))
        dist.init_process_group('nccl' if dev.startswith('cuda') else 'gloo')
        if dev.startswith('cuda'):
            dev = f'cuda:{local}'
            torch.cuda.set_device(dev)
    if cfg['grad_accum'] % world:
        raise ConfigError(f"grad_accum={cfg['grad_accum']} must be divisible by the {world} DDP processes")
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    random.seed(cfg['seed'])
    np.random.seed(cfg['seed'])
    torch.manual_seed(cfg['seed'])
    dev_type = dev.split(':')[0]
    use_bf16 = cfg['dtype'] == 'bfloat16' or (cfg['dtype'] == 'auto' and dev_type == 'cuda'
                                               and torch.cuda.is_bf16_supported())
    ctx = torch.autocast(dev_type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    # ---- run folder: fresh, resumed, or refused (decided by every rank before rank 0 changes anything)
    run_dir = os.path.join(cfg['out_dir'], cfg['run_name'])
    ckpt_path = os.path.join(run_dir, 'ckpt.pt')
    if os.path.exists(os.path.join(run_dir, 'done.json')) and not cfg['overwrite']:
        raise ConfigError(f'{run_dir} holds a finished run; pass --overwrite=True to train it again '
                          f'(that deletes it) or choose another --run_name / --out_dir')
    resuming = os.path.exists(ckpt_path) and not cfg['overwrite']
    if ddp:
        dist.barrier()

    # ---- data
    train_data, val_data, meta = prepare_data(cfg)
    data_gen = torch.Generator().manual_seed(cfg['seed'])
    eval_x, eval_y = (t.to(dev) for t in eval_batch(val_data, cfg))

    # ---- model and optimizer
    gcfg = GPTConfig(meta['vocab_size'], cfg['block_size'], cfg['n_layer'], cfg['n_head'], cfg['n_embd'],
                     cfg['bias'], cfg['dropout'])
    model = GPT(gcfg, cfg['qk_init']).to(dev)
    qk_ids = {id(w) for pair in model.qk_weights() for w in pair}
    decays = lambda p: p.dim() >= 2 and (cfg['decay_qk'] or id(p) not in qk_ids)  # matrices, not gains
    decay = [p for p in model.parameters() if decays(p)]
    no_decay = [p for p in model.parameters() if not decays(p)]
    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': cfg['weight_decay']},
                                   {'params': no_decay, 'weight_decay': 0.0}],
                                  lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                                  fused=dev_type == 'cuda')
    ctl = spectrum_control.record(cfg, model.qk_weights())  # the step-0 spectra that control steers from
    start, elapsed = 0, 0.0
    if resuming:
        start, elapsed, ctl = load_checkpoint(ckpt_path, cfg, meta, model, optimizer, data_gen)
        if master:
            trim_run(run_dir, start)
            print(f'resuming {run_dir} from iteration {start}')
    elif master:
        clear_run(run_dir)  # an overwritten run, or leftovers of one killed before its first checkpoint
    if master:
        write_json(dict(cfg, torch=torch.__version__, device=dev, world_size=world, git_commit=git_commit(),
                        vocab_size=meta['vocab_size'], data_sha256=meta['sha256'],
                        n_params=sum(p.numel() for p in model.parameters())),
                   os.path.join(run_dir, 'config.json'))
    train_model = model
    if cfg['compile'] and hasattr(torch, 'compile') and dev_type != 'mps':
        train_model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        train_model = DistributedDataParallel(train_model, device_ids=[int(dev.split(':')[1])] if ':' in dev else None)

    # ---- stop cleanly on SIGINT / SIGTERM: finish the step, checkpoint, exit
    stop, stopping = [], False
    old_handlers = {sig: signal.signal(sig, lambda s, f: stop.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}

    def leave(together=False):
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if ddp:
            if together:  # every rank got here: let rank 0 finish writing before the group goes
                dist.barrier()
            dist.destroy_process_group()

    def checkpoint(it):
        if master:
            atomic_save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter': it,
                         'elapsed': elapsed + time.time() - t_start, 'config': cfg, 'rng': rng_state(data_gen),
                         'data_sha256': meta['sha256'], 'control': ctl},
                        ckpt_path)

    # ---- the loop
    logs, evals, ckpts = log_iters(cfg), loss_iters(cfg), model_ckpt_iters(cfg)
    micro = cfg['grad_accum'] // world
    tokens_per_iter = cfg['batch_size'] * cfg['grad_accum'] * cfg['block_size']
    metrics = open(os.path.join(run_dir, 'metrics.jsonl'), 'a') if master else None
    t_start, t_geom, t_ctl = time.time(), 0.0, 0.0
    t_mark, it_mark = t_start, start  # training time and iteration at the last record, for ms/iter
    last = {}
    for it in range(start, cfg['max_iters'] + 1):
        # -- log a record: losses, and the Q/K geometry (the research part)
        if master and it in logs:
            t0 = time.time()
            ms = 1000 * (t0 - t_mark) / (it - it_mark) if it > it_mark else float('nan')
            row = {'iter': it, 'tokens': it * tokens_per_iter, 'lr': get_lr(it, cfg)}
            if it in evals:
                losses = estimate_loss(model, {'train': train_data, 'val': val_data}, cfg, dev, ctx)
                row.update(train_loss=losses['train'], val_loss=losses['val'])
            t1 = time.time()
            if cfg['geom_interval']:
                row['eval_loss'], row['layers'] = measure_geometry(model, eval_x, eval_y, cfg['n_head'])
                for layer, ctl_row in zip(row['layers'], spectrum_control.report(ctl)):
                    layer.update(ctl_row)
                save_qk(model, run_dir, it, cfg)
            bad = [v for key, v in row.items() if key.endswith('_loss') and not math.isfinite(v)]
            if bad:
                leave()
                nan_stop(bad[0], it, cfg)
            if it in ckpts:
                os.makedirs(os.path.join(run_dir, 'models'), exist_ok=True)
                atomic_save({'model': model.state_dict(), 'model_config': gcfg.__dict__, 'iter': it},
                            os.path.join(run_dir, 'models', f'model_{it:07d}.pt'))
            t_geom += time.time() - t1
            row['time'] = elapsed + time.time() - t_start
            metrics.write(json.dumps(row) + '\n')
            metrics.flush()
            last = row
            print_record(row, ms, tokens_per_iter, cfg, start, t_start)
            t_mark, it_mark = time.time(), it  # time spent measuring is not training time
        if it == cfg['max_iters']:
            break
        if stopping or (it > start and it % cfg['ckpt_interval'] == 0):
            checkpoint(it)
        if stopping:
            leave(together=True)
            sig = stop[0] if stop else signal.SIGTERM
            print(f"stopped by signal {signal.Signals(sig).name} at iteration {it}; checkpoint saved in "
                  f"{ckpt_path}. Run the same command again to resume.", flush=True)
            raise SystemExit(128 + sig)

        # -- one optimizer step over grad_accum micro-batches (this rank's share of them)
        lr_now = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group['lr'] = lr_now
        # every rank draws the whole global batch's offsets, so the data stream does not depend on world
        offsets = random_offsets(train_data, (cfg['grad_accum'], cfg['batch_size']), cfg['block_size'], data_gen)
        step_loss = 0.0
        for m in range(micro):
            x, y = get_batch(train_data, offsets[rank * micro + m], cfg['block_size'])
            if ddp:
                train_model.require_backward_grad_sync = m == micro - 1
            with ctx:
                loss = train_model(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))[1] / micro
            loss.backward()
            step_loss += loss.item()
        # one collective for the ranks to agree on a bad loss or a signal, so they stop together
        flags = torch.tensor([step_loss, float(len(stop))])
        if ddp:
            dist.all_reduce(flags)
        step_loss, stopping = flags[0].item(), flags[1].item() > 0
        if not math.isfinite(step_loss):
            leave()
            nan_stop(step_loss, it, cfg)
        if cfg['grad_clip']:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # -- key-spectrum control: reshape the controlled spectra after the step (the causal experiment)
        if cfg['control'] != 'none':  # a none run reports a control share of exactly 0
            t0 = time.time()
            spectrum_control.apply(ctl, cfg, model.qk_weights(), it + 1)
            t_ctl += time.time() - t0

    # ---- finish: final state, then done.json last so a sweep knows the run is complete
    if master:
        checkpoint(cfg['max_iters'])
    elapsed += time.time() - t_start
    if master:
        metrics.close()
        done = {k: last.get(k) for k in ('iter', 'train_loss', 'val_loss')}
        if last.get('layers'):
            for key in ('pr_q', 'pr_k', 'pr_qk', 'entropy', 'entropy_norm'):
                done[key] = float(np.mean([layer[key] for layer in last['layers']]))
        share = lambda t: t / max(time.time() - t_start, 1e-9)  # of this process's wall time
        done.update(wall_time=elapsed, geometry_share=share(t_geom), control_share=share(t_ctl))
        write_json(done, os.path.join(run_dir, 'done.json'))
        ctl_msg = f" and control {100 * share(t_ctl):.1f}%" if cfg['control'] != 'none' else ''
        print(f"done in {fmt_time(elapsed)}: val loss {done['val_loss']:.4f}; geometry logging took "
              f"{100 * share(t_geom):.1f}%{ctl_msg} of wall time")
    leave(together=True)
    return run_dir


def nan_stop(loss, it, cfg):
    raise ConfigError(f"the loss became {loss} at iteration {it}. The run stops here: ckpt.pt keeps the last good "
                      f"state, metrics.jsonl the records before this one, and no done.json is written. "
                      f"Lower --lr (now {cfg['lr']}), keep --grad_clip on (now {cfg['grad_clip']}), or lengthen "
                      f"--warmup_iters, then rerun with --overwrite=True")


def save_qk(model, run_dir, it, cfg):
    if not cfg['save_snapshots']:
        return
    folder = os.path.join(run_dir, 'snapshots')
    os.makedirs(folder, exist_ok=True)
    q = torch.stack([wq.detach().float().cpu() for wq, _ in model.qk_weights()]).numpy()
    k = torch.stack([wk.detach().float().cpu() for _, wk in model.qk_weights()]).numpy()
    tmp = os.path.join(folder, f'.tmp_{it:07d}.npz')
    np.savez(tmp, q=q, k=k, n_head=cfg['n_head'])
    os.replace(tmp, os.path.join(folder, f'qk_{it:07d}.npz'))


# settings that may differ between a run and its resumption: where things are, not what is computed
RESUMABLE_CHANGES = ('overwrite', 'device', 'threads', 'compile', 'out_dir', 'data_file', 'data_dir', 'cache_dir',
                     'data_url')


def load_checkpoint(path, cfg, meta, model, optimizer, data_gen):
    """Restore everything that decides the rest of the run, or say why this checkpoint cannot do it."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        changed = [k for k in ckpt['config'] if k not in RESUMABLE_CHANGES and ckpt['config'][k] != cfg.get(k)]
        changed += ['the training text'] if ckpt['data_sha256'] != meta['sha256'] else []
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f'cannot resume from {path}, it is corrupt ({type(e).__name__}: {str(e)[:200]}); '
                          f'pass --overwrite=True to start the run over') from None
    if changed:
        raise ConfigError(f"{path} was written with other settings ({', '.join(changed)}); run with the "
                          f"same settings to resume, or pass --overwrite=True to start over")
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    set_rng_state(ckpt['rng'], data_gen)
    return ckpt['iter'], ckpt['elapsed'], ckpt['control']


def print_record(row, ms, tokens_per_iter, cfg, start, t_start):
    it = row['iter']
    done_frac = (it - start) / max(1, cfg['max_iters'] - start)
    eta = (time.time() - t_start) * (1 - done_frac) / done_frac if done_frac > 0 else float('nan')
    msg = f"iter {it}: "
    if 'val_loss' in row:
        msg += f"train {row['train_loss']:.4f}, val {row['val_loss']:.4f}, "
    if 'eval_loss' in row:
        msg += f"eval batch {row['eval_loss']:.4f}, "
    speed = f"{ms:.1f} ms/iter, {1000 * tokens_per_iter / ms:.0f} tok/s" if ms == ms else "- ms/iter"  # none yet at the start
    msg += f"lr {row['lr']:.2e}, {speed}, ETA {fmt_time(eta) if eta == eta else '-'}"
    if row.get('layers'):
        mean = lambda key: np.mean([layer[key] for layer in row['layers']])
        msg += f" | pr_q {mean('pr_q'):.1f} pr_k {mean('pr_k'):.1f} entropy {mean('entropy'):.3f}"
    print(msg, flush=True)


if __name__ == '__main__':
    try:
        if sys.argv[1:] == ['--print_run_names']:
            print_run_names(sys.stdin)
        elif '--print_run_names' in sys.argv[1:]:
            raise ConfigError('--print_run_names takes no other arguments: it reads one argument list per line '
                              'from stdin')
        else:
            train(get_config(sys.argv[1:]))
    except ConfigError as e:
        print(e.code, file=sys.stderr, flush=True)
        sys.exit(2)
