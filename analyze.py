"""
Turn run folders written by train.py into the study's evidence: tables, figures and a claims report
in which every verdict is computed by a rule written below and stated in the report.

    python analyze.py out/                           # every run folder under out/ -> out/analysis/
    python analyze.py out/ more_runs/ --out=results --pdf
    python analyze.py out/ --no_figures              # tables and REPORT.md only

A run folder is any folder holding a config.json; runs without done.json (unfinished) or with a
corrupt config.json or metrics.jsonl are skipped with a warning naming them. Runs are grouped by
depth (n_layer), qk_init, control, control_target and seed; what is missing from the full study
(STUDY_* and CONTROL_* below) is listed. Written to --out (default <first dir>/analysis/):

    REPORT.md                      one row per claim of the study: statistic, value, verdict, rule
    runs                           final losses and wall time, one row per run
    trajectories[_head|_tok]       PR_Q, PR_K per (depth, init, layer), seed means; full-matrix, per-head, token-level
    trajectory_summary             per variant: how many trajectories keep PR_Q - PR_K > 0, have PR_Q up and PR_K down
    attention_link[_runs]          within-run Spearman of PR_K, PR_QK and entropy over training
    control, control_effects       the control experiment: per seed, and paired differences against none
    timeline                       PRs and entropy over training, mean over the runs of each group (which moves when)
    fig1..fig5 *.png (--pdf: also .pdf)

(tables are .csv and .md). The first argument may name a subcommand (SUBCOMMANDS at the bottom);
`runs` is the default, so `python analyze.py out/` and `python analyze.py runs out/` are the same.
Statistics use numpy only: seeded bootstrap, exact sign test, Spearman with average ranks for ties.

Token-level analysis of checkpoints, from activations (query/key vectors and attention probabilities):

    python analyze.py tokens out/                    # every models/model_*.pt of every run -> out/analysis/
    python analyze.py pretrained --model=EleutherAI/pythia-160m --revisions=pythia   # needs transformers
    python analyze.py pretrained --model=gpt2 --text=my.txt --out=out/analysis

`tokens` rebuilds each run's fixed evaluation batch with train.py's own code (config.json) and writes
tokens[_heads|_trend|_link|_summary] and fig6_tokens; `pretrained` runs a fixed text sample through each
revision of a GPT-2, GPT-NeoX (Pythia), OPT, Llama-style or BERT-style model (FAMILIES) and adds its rows to
pretrained[_heads|_trend|_link|_summary] and fig7_pretrained in --out (default out/analysis), replacing earlier
rows of the same model. REPORT.md is written by `runs`: it reads these tables from its --out folder when they are
there (claims f1, f2), so run `python analyze.py out/` after them.
"""
import argparse
import csv
import io
import json
import math
import os
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import reduce

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure  # object-oriented matplotlib: headless, no pyplot state
from matplotlib.ticker import MaxNLocator
from PIL import Image

import geometry
import train  # the trainer's own data and model code: token-level analysis rebuilds its evaluation batch

# -----------------------------------------------------------------------------
# the study (DESIGN.md, "The study"): what a full sweep holds, and the rules that turn numbers into verdicts
STUDY_DEPTHS = (4, 6, 8)
STUDY_INITS = ('normal', 'orthogonal', 'tied')
STUDY_SEEDS = (1, 2, 3, 4)
CONTROL_KINDS = ('none', 'shrink', 'freeze')
CONTROL_SEEDS = (1, 2, 3, 4, 5)
FINAL_LOGS = 3             # a run's "final" entropy or PR: mean over its last FINAL_LOGS logged iterations
N_BOOT = 10000             # bootstrap resamples
BOOT_SEED = 0              # every bootstrap draws from this seed: the report is reproducible
LEVEL = 0.95               # interval level
ALPHA = 0.05               # sign-test threshold
SHARE_HOLDS = 0.90         # share-of-trajectories claims hold at or above this share ...
SHARE_FAILS = 0.50         # ... and do not hold at or below this one
# predicted sign of (controlled - none) per (metric, control): shrink sharpens attention, freeze softens it;
# shrink lowering the controlled PR (pr_k; pr_q in the mirror, control_target=q) is the manipulation check
PREDICTED = {('entropy', 'shrink'): -1, ('entropy', 'freeze'): +1,
             ('entropy_norm', 'shrink'): -1, ('entropy_norm', 'freeze'): +1, ('pr_controlled', 'shrink'): -1}
CONTROL_METRICS = ('entropy', 'entropy_norm', 'pr_k', 'pr_q', 'pr_qk', 'val_loss')
# config keys that make two runs comparable (same training setup); the grid axes and bookkeeping are left out
SETTING_KEYS = ('n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'batch_size', 'grad_accum', 'max_iters',
                'lr', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'weight_decay', 'decay_qk', 'beta1', 'beta2',
                'grad_clip', 'data_file', 'data_sha256', 'min_char_count', 'eval_windows')
# trajectory variants: table suffix -> (query key, key key, what it is)
VARIANTS = {'': ('pr_q', 'pr_k', 'full-matrix weight PR'),
            '_head': ('pr_q_head', 'pr_k_head', 'per-head weight PR (mean over heads)'),
            '_tok': ('tok_pr_q', 'tok_pr_k', 'token-level PR of the query/key vectors')}
# the within-run correlations of table 2: name -> (x, y)
LINKS = {'pr_k~entropy': ('pr_k', 'entropy'), 'pr_k~pr_qk': ('pr_k', 'pr_qk'), 'pr_qk~entropy': ('pr_qk', 'entropy')}
HOLDS, FAILS, MIXED, NOT_MEASURED = 'holds', 'does not hold', 'mixed', 'not measured'
# token level (claims f1, f2): where each source's tables live in the analysis folder, and its rules' numbers
TOKEN_SOURCES = {'tokens': 'our checkpoints', 'pretrained': 'pretrained models'}
N_PERM = 2000              # shuffles of the one-sided permutation test of the PR_QK ~ entropy link
LINK_MODELS = 2            # "visible in several models": at least this many (and at least half of them)


class Skip(Exception):
    """A run, table or figure left out, with the reason (printed and reported, never fatal)."""


# ----------------------------------------------------------------------------- loaders

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
    setting: str = 'A'       # which training setup (SETTING_KEYS) it shares with others; set by load_runs

    n_layer = property(lambda self: int(self.cfg['n_layer']))
    qk_init = property(lambda self: self.cfg['qk_init'])
    seed = property(lambda self: int(self.cfg['seed']))
    control = property(lambda self: self.cfg.get('control', 'none'))
    target = property(lambda self: self.cfg.get('control_target', 'k') if self.control != 'none' else '')
    has_geometry = property(lambda self: len(self.geom_iters) > 0)

    def metric(self, key):
        """(len(geom_iters), n_layer) values of a per-layer metric; NaN where it was not logged."""
        return self.layers.get(key, np.full((len(self.geom_iters), self.n_layer), np.nan))

    def final(self, key):
        """Mean over the last FINAL_LOGS logged iterations and over layers (NaN if not logged)."""
        v = self.metric(key)[-FINAL_LOGS:]
        return float(np.nanmean(v)) if np.isfinite(v).any() else float('nan')


def find_run_dirs(paths):
    """Every folder under paths that holds a config.json (a run folder holds no further runs)."""
    found = []
    for top in paths:
        for root, dirs, files in os.walk(top):
            if 'config.json' in files:
                found.append(os.path.normpath(root))
                dirs[:] = []
            else:
                dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    unique = {}
    for path in found:
        unique.setdefault(os.path.realpath(path), path)
    return sorted(unique.values())


def read_json(path):
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f'{os.path.basename(path)} is unreadable ({type(e).__name__}: {str(e)[:80]})') from None
    if not isinstance(obj, dict):
        raise Skip(f'{os.path.basename(path)} does not hold a JSON object')
    return obj


def read_metrics(path):
    """Records of a metrics.jsonl, and whether its last line was cut short (a kill mid-write) and dropped.
    A corrupt line before the last is a Skip."""
    if not os.path.isfile(path):
        raise Skip('no metrics.jsonl')
    with open(path, errors='replace') as f:
        lines = f.read().split('\n')
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    rows, truncated = [], False
    for i in nonempty:
        try:
            row = json.loads(lines[i])
        except ValueError:
            if i != nonempty[-1]:
                raise Skip(f'metrics.jsonl line {i + 1} is corrupt') from None
            truncated = True
            continue
        if not isinstance(row, dict) or 'iter' not in row:
            raise Skip(f'metrics.jsonl line {i + 1} is not a record with an "iter"')
        rows.append(row)
    return rows, truncated


def load_run(path):
    """A finished run folder as a Run; Skip (with the reason) for an unfinished or corrupt one."""
    cfg = read_json(os.path.join(path, 'config.json'))
    lacking = [k for k in ('n_layer', 'qk_init', 'seed') if k not in cfg]
    if lacking:
        raise Skip(f"config.json lacks {', '.join(lacking)}")
    if not (type(cfg['n_layer']) is int and type(cfg['seed']) is int and isinstance(cfg['qk_init'], str)):
        raise Skip('config.json: n_layer and seed must be integers and qk_init a string')
    if not os.path.exists(os.path.join(path, 'done.json')):
        raise Skip('unfinished (no done.json)')
    done = read_json(os.path.join(path, 'done.json'))
    rows, truncated = read_metrics(os.path.join(path, 'metrics.jsonl'))
    if not rows:
        raise Skip('metrics.jsonl holds no records')
    try:
        by_iter = {int(r['iter']): r for r in rows}  # a repeated iteration: the last record wins
        iters = np.array(sorted(by_iter), dtype=np.int64)
        recs = [by_iter[i] for i in iters]
        geo = [r for r in recs if r.get('layers')]
        n_layer = int(cfg['n_layer'])
        bad = [int(r['iter']) for r in geo if len(r['layers']) != n_layer]
        if bad:
            first = next(r for r in geo if len(r['layers']) != n_layer)
            raise Skip(f"metrics.jsonl at iteration {bad[0]} has {len(first['layers'])} layers, "
                       f"config.json says n_layer={n_layer}")
        keys = sorted({k for r in geo for layer in r['layers'] for k, v in layer.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        layers = {k: np.array([[layer.get(k) for layer in r['layers']] for r in geo], dtype=float) for k in keys}
        run = Run(path, cfg, done, iters,
                  np.array([r.get('train_loss') for r in recs], dtype=float),
                  np.array([r.get('val_loss') for r in recs], dtype=float),
                  np.array([int(r['iter']) for r in geo], dtype=np.int64), layers)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Skip(f'metrics.jsonl is malformed ({type(e).__name__}: {str(e)[:80]})') from None
    if truncated:
        run.notes.append('truncated last line of metrics.jsonl dropped')
    if not run.has_geometry:
        run.notes.append('no geometry logged (geom_interval=0): losses only')
    return run


def setting_of(cfg):
    return tuple((k, json.dumps(cfg.get(k))) for k in SETTING_KEYS)


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
        key = (run.setting, run.n_layer, run.qk_init, run.control, run.target, run.seed)
        if key in seen:
            skipped.append((run.path, f'duplicate of {seen[key].path} (same settings, depth, init, control, seed)'))
            warn(f'skipped {run.path}: duplicate of {seen[key].path}')
            continue
        seen[key] = run
        used.append(run)
        for note in run.notes:
            warn(f'{run.path}: {note}')
    return used, skipped, {v: dict(k) for k, v in letters.items()}


def study_cells(runs):
    """{(depth, init): [runs by seed]} of the uncontrolled runs with geometry, in the main setting A."""
    cells = defaultdict(list)
    for r in runs:
        if r.control == 'none' and r.setting == 'A' and r.has_geometry:
            cells[(r.n_layer, r.qk_init)].append(r)
    order = sorted(cells, key=lambda cell: (cell[0], init_order(cell[1])))
    return {cell: sorted(cells[cell], key=lambda r: r.seed) for cell in order}


def init_order(name):
    return STUDY_INITS.index(name) if name in STUDY_INITS else len(STUDY_INITS)


def seed_stack(runs, key, layer_mean=False):
    """The iterations logged by every run and a metric over them: (iters (T,), values (S, T, n_layer)), or
    with layer_mean each run's mean over its layers, (S, T), which also stacks runs of different depths."""
    common = reduce(np.intersect1d, [r.geom_iters for r in runs])
    if len(common) == 0:
        raise Skip(f'runs {", ".join(r.path for r in runs)} share no logged iteration')
    values = [r.metric(key)[np.searchsorted(r.geom_iters, common)] for r in runs]
    return common, np.stack([v.mean(axis=1) for v in values] if layer_mean else values)


# ---- token level, our runs: every saved model checkpoint on the run's own fixed evaluation batch

def model_checkpoints(run_dir):
    """[(iteration, path)] of the model checkpoints train.py saved in run_dir/models/, by iteration."""
    folder = os.path.join(run_dir, 'models')
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        stem = name[len('model_'):-len('.pt')]
        if name.startswith('model_') and name.endswith('.pt') and stem.isdigit():
            found.append((int(stem), os.path.join(folder, name)))
    return sorted(found)


def evaluation_batch(cfg, data_file='', data_dir='', cache_dir=''):
    """The run's fixed evaluation batch (eval_windows x block_size token ids), rebuilt as train.train() builds
    it: train.prepare_data on the run's config, then the windows drawn from train.EVAL_SEED. A non-empty
    argument overrides the config.json value of the same name (the text moved). Skip, naming the missing
    source and the override, when the text is not there or is not the one the run was trained on."""
    cfg = dict(cfg)
    cfg.update({k: v for k, v in (('data_file', data_file), ('data_dir', data_dir), ('cache_dir', cache_dir)) if v})
    if cfg.get('data_file'):
        if not os.path.isfile(cfg['data_file']):
            raise Skip(f"its training text data_file={cfg['data_file']} (config.json) is not there; pass "
                       f"--data_file=PATH to the same text")
    else:
        missing = [n for n in ('wiki.train.raw', 'wiki.valid.raw')
                   if not os.path.isfile(os.path.join(cfg.get('data_dir', ''), n))]
        if missing:  # train.prepare_data would try to download: not here
            raise Skip(f"its dataset {cfg.get('dataset')} is not in data_dir={cfg.get('data_dir')} (config.json: "
                       f"no {', '.join(missing)}); pass --data_dir=FOLDER holding them")
    try:
        _, val, meta = train.prepare_data(cfg)
    except SystemExit as e:  # train.ConfigError: a message for the user
        raise Skip(str(e).removeprefix('error: ')) from None
    if cfg.get('data_sha256') and meta['sha256'] != cfg['data_sha256']:
        raise Skip(f"the text found ({', '.join(meta['source'])}) is not the one the run was trained on (its "
                   f"SHA-256 differs from data_sha256 in config.json): the evaluation windows would differ; pass "
                   f"--data_file or --data_dir pointing to the same text")
    return train.eval_batch(val, cfg)[0]


def load_model(path):
    """A model checkpoint (models/model_*.pt) as (train.GPT in eval mode, iteration); weights only."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        model = train.GPT(train.GPTConfig(**ckpt['model_config']))
        model.load_state_dict(ckpt['model'])
        it = int(ckpt['iter'])
    except Exception as e:  # a truncated or foreign file
        raise Skip(f'{path} is not a readable model checkpoint ({type(e).__name__}: {str(e)[:80]})') from None
    return model.eval(), it


@torch.no_grad()
def measure_tokens(model, x):
    """geometry.token_geometry of every layer of a train.GPT on the batch x, as train.measure_geometry logs it."""
    probe = []
    model(x, probe=probe)  # float32, attention written out: (q, k, att) per layer
    return [geometry.token_geometry(q, k, att, model.config.n_head) for q, k, att in probe]


# ---- token level, pretrained models (transformers: optional, imported only here)
# One adapter per family: which modules are the self-attention layers, which of their submodules output the
# queries and the keys (one name twice for a fused q|k|v projection, with the function that splits it), and
# whether a rotary embedding turns them after the projection. q and k come out as (B, T, heads * d), head h on
# channels h*d:(h+1)*d, as geometry.token_geometry expects.

def split_thirds(out, n_head):
    """GPT-2's c_attn output (B, T, 3C) is [q | k | v] along the channels."""
    q, k, _ = out.chunk(3, dim=-1)
    return q, k


def split_per_head(out, n_head):
    """GPT-NeoX's query_key_value output (B, T, 3C) is, head after head, [q_h | k_h | v_h] of head_size each."""
    qkv = out.unflatten(-1, (n_head, 3, -1))
    return qkv[..., 0, :].flatten(-2), qkv[..., 1, :].flatten(-2)


@dataclass(frozen=True)
class Family:
    model_types: tuple        # config.model_type values read by this adapter
    attention: tuple          # class names of the self-attention modules (one per layer)
    q: str                    # submodule of the attention module whose output holds the queries ...
    k: str                    # ... and the keys
    split: object = None      # fused projection: output -> (q, k); None: q and k are separate projections
    rotary: bool = False      # rotary position embedding applied to q and k after the projection
    causal: bool = True       # False: an encoder, attention over every key (entropy: bidirectional_entropy)


FAMILIES = {
    'gpt2': Family(('gpt2',), ('GPT2Attention',), 'c_attn', 'c_attn', split=split_thirds),
    'gpt_neox': Family(('gpt_neox',), ('GPTNeoXAttention',), 'query_key_value', 'query_key_value',
                       split=split_per_head, rotary=True),   # Pythia; partial rotary (rotary_pct) included
    'opt': Family(('opt',), ('OPTAttention',), 'q_proj', 'k_proj'),
    'llama': Family(('llama', 'mistral', 'qwen2'), ('LlamaAttention', 'MistralAttention', 'Qwen2Attention'),
                    'q_proj', 'k_proj', rotary=True),        # GQA: fewer key than query heads
    'bert': Family(('bert', 'roberta'), ('BertSelfAttention', 'RobertaSelfAttention'), 'query', 'key',
                   causal=False),
}
# the Pythia checkpoint series saves step0, the log-spaced step1, 2, 4, ..., 512, then every 1000 steps to
# step143000; this preset keeps the log-spaced ones and continues doubling (1000, 2000, ..., 128000) to the end
REVISION_PRESETS = {'pythia': ('step0', *(f'step{2 ** i}' for i in range(10)),
                               *(f'step{1000 * 2 ** i}' for i in range(8)), 'step143000')}
ROPES = ('after', 'before')   # rotary families: q, k as the attention uses them (after) or as projected (before)
SAMPLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'shared', 'data', 'wikitext-103',
                           'wiki.test.raw')
SAMPLE_CHARS = 100_000        # of SAMPLE_FILE or --text: far more than n_seqs x seq_len tokens need
SAMPLE_TEXT = (  # the fallback sample when neither --text nor SAMPLE_FILE is there
    'The river rises in the hills north of the town and runs south through a wide valley of farms and small '
    'woods before it reaches the sea. In the early nineteenth century a canal was cut beside it, so that coal '
    'and grain could be carried to the port without waiting for the spring floods, and for some fifty years the '
    'canal company was the largest employer in the district. The railway arrived in 1846. Within a decade most '
    'of the traffic had left the water, the company was sold, and the locks were allowed to decay. A local '
    'society was formed in 1962 to restore the canal; it reopened the first three miles to small boats in 1978 '
    'and the whole length in 2004, when the last lock, which had been filled in and built over, was dug out and '
    'rebuilt to its original plan. Today the towpath is a public footpath and cycle route, and the old company '
    'warehouse by the harbour holds a museum of the canal and of the trades that used it, from the barges and '
    'their horses to the clerks who kept the tolls. Visitors can walk from the museum to the first lock in '
    'about twenty minutes, passing the site of the wharf where the boats were once loaded by hand.')


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError('pretrained models need the optional package transformers: pip install transformers') \
            from None
    return transformers


def family_of(config):
    """(name, Family) of a transformers config; ValueError naming the supported architectures otherwise."""
    for name, fam in FAMILIES.items():
        if getattr(config, 'model_type', None) in fam.model_types:
            return name, fam
    supported = ', '.join(t for fam in FAMILIES.values() for t in fam.model_types)
    raise ValueError(f"architecture {getattr(config, 'model_type', None)!r} is not supported; supported model "
                     f"types: {supported} (an adapter is one line in FAMILIES in analyze.py)")


def checkpoint_source(name, revision):
    """from_pretrained arguments: the local folder name/revision if there is one (a series saved as step0/,
    step1000/, ...), else name (a local folder, or the HF cache/hub) at that revision."""
    if revision and os.path.isdir(os.path.join(name, revision)):
        return {'pretrained_model_name_or_path': os.path.join(name, revision)}
    return {'pretrained_model_name_or_path': name, **({'revision': revision} if revision else {})}


def load_pretrained(name, revision=None, device='cpu'):
    """A transformers model in float32 with eager attention (the probabilities are materialised), in eval mode."""
    transformers = import_transformers()
    model = transformers.AutoModel.from_pretrained(**checkpoint_source(name, revision), attn_implementation='eager',
                                                   dtype=torch.float32)
    family_of(model.config)
    return model.to(device).eval()


def sample_text(path=''):
    """(text, where it came from): the first SAMPLE_CHARS characters of path, else of SAMPLE_FILE if it is there,
    else SAMPLE_TEXT."""
    if path and not os.path.isfile(path):
        raise ValueError(f'--text={path}: no such file')
    for candidate in (path, SAMPLE_FILE):
        if candidate and os.path.isfile(candidate):
            with open(candidate, encoding='utf-8', errors='replace') as f:
                return f.read(SAMPLE_CHARS), f'first {SAMPLE_CHARS} characters of {os.path.normpath(candidate)}'
    return SAMPLE_TEXT, 'the built-in sample paragraph (analyze.SAMPLE_TEXT)'


def text_windows(tokenizer, text, n_seqs, seq_len):
    """(B, T) token ids: up to n_seqs consecutive pieces of the text, each wrapped in the special tokens the
    tokenizer adds around a sequence by default (BOS for OPT and Llama, [CLS] ... [SEP] for BERT, none for GPT-2
    and Pythia) to seq_len tokens; one shorter window when the text is shorter. Never padded."""
    ids = tokenizer(text, add_special_tokens=False)['input_ids']
    bare, full = (tokenizer('a', add_special_tokens=s)['input_ids'] for s in (False, True))
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    head, tail = (full[:at], full[at + len(bare):]) if bare else ([], [])
    n = seq_len - len(head) - len(tail)
    if n < 2 or len(ids) < 2:
        raise ValueError(f'seq_len={seq_len} leaves {n} text tokens per window and the text has {len(ids)}: '
                         f'need at least 2 of each')
    count = min(n_seqs, len(ids) // n) or 1
    return torch.tensor([head + ids[i * n:(i + 1) * n] + tail for i in range(count)])


def attention_modules(model, fam):
    mods = [m for m in model.modules()
            if type(m).__name__ in fam.attention and not getattr(m, 'is_cross_attention', False)]
    if not mods:
        raise ValueError(f'no attention module of class {", ".join(fam.attention)} in {type(model).__name__}')
    return mods


def keep_output(store, key):
    return lambda module, args, output: store.__setitem__(key, output.detach())


def keep_rotary(store):
    # the (cos, sin) the model passes to this attention layer: exactly the rotation its attention uses
    return lambda module, args, kwargs: store.__setitem__('cos_sin', kwargs.get('position_embeddings'))


def rotate(attn, q, k, cos_sin, d):
    """q, k (B, T, heads * d) after the model's own rotary embedding: its module's apply_rotary_pos_emb on the
    (B, heads, T, d) layout HF uses, with the layer's (cos, sin); partial rotary (GPT-NeoX) is handled there."""
    if cos_sin is None:
        raise ValueError(f'{type(attn).__name__} was called without position_embeddings: cannot apply its rotary '
                         f'embedding; use --rope=before')
    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    heads = lambda t: t.unflatten(-1, (-1, d)).transpose(1, 2)
    q, k = apply(heads(q), heads(k), *cos_sin)
    return q.transpose(1, 2).flatten(-2), k.transpose(1, 2).flatten(-2)


def bidirectional_entropy(att):
    """Attention entropy of an encoder on unpadded windows: row i spreads over all T keys, so
    H_i = -sum_j a_ij log a_ij over j = 0..T-1 (nats), normalised by log T; every row counts, row 0 too.
    geometry.attention_entropy is causal-only (it rejects mass above the diagonal), hence this one. Returns the
    entropy keys of geometry.token_geometry."""
    att = att.detach().to('cpu', torch.promote_types(att.dtype, torch.float32))   # as geometry: no float64 copy
    H = -torch.special.xlogy(att, att).sum(-1).double()   # (B, heads, T)
    Hn = H / math.log(att.shape[-1])
    return {'entropy': H.mean().item(), 'entropy_norm': Hn.mean().item(),
            'entropy_heads': H.mean((0, 2)).tolist(), 'entropy_norm_heads': Hn.mean((0, 2)).tolist()}


def qk_token_geometry(q, k, att, n_head, causal=True):
    """token_geometry of captured q (B, T, n_head * d), k (B, T, n_kv * d) and att (B, n_head, T, T).

    GQA (n_kv < n_head): Q head h uses K head h // (n_head / n_kv), as HF's repeat_kv pairs them, so K is expanded
    to n_head heads that way; duplicating heads scales the key covariance's eigenvalues by n_head / n_kv and leaves
    tok_pr_k and tok_pr_k_head unchanged. An encoder's attention is not causal, which token_geometry checks: it
    gets a one-hot diagonal (a valid causal placeholder) for the PR metrics, and the entropy comes from
    bidirectional_entropy."""
    d = q.shape[-1] // n_head
    n_kv = k.shape[-1] // d
    k = k.unflatten(-1, (n_kv, d)).repeat_interleave(n_head // n_kv, dim=-2).flatten(-2)
    if causal:
        return geometry.token_geometry(q, k, att, n_head)
    B, T = q.shape[:2]
    return {**geometry.token_geometry(q, k, torch.eye(T).expand(B, n_head, T, T), n_head), **bidirectional_entropy(att)}


@torch.no_grad()
def capture_qk(model, ids, ropes=ROPES[:1]):
    """Run a transformers model on ids (B, T) and catch, per layer, its query and key vectors and its attention
    probabilities: ([{rope: (q (B, T, n_head * d), k (B, T, n_kv * d))} per layer], [att (B, n_head, T, T)]).
    rope is 'after' and/or 'before' the rotary embedding (as asked) for rotary families, 'none' for the others.

    q and k are the outputs of the family's projection modules, caught by forward hooks (bias included; OPT
    multiplies q by 1/sqrt(d) afterwards, which no PR sees); 'after' turns them with the model's own rotary
    function and the (cos, sin) the model passes to the layer (rotate): the vectors its attention uses. The
    probabilities are the model's own (output_attentions, eager attention)."""
    _, fam = family_of(model.config)
    attns = attention_modules(model, fam)
    stores, hooks = [{} for _ in attns], []
    for store, attn in zip(stores, attns):
        for role in dict.fromkeys((fam.q, fam.k)):
            hooks.append(getattr(attn, role).register_forward_hook(keep_output(store, role)))
        if fam.rotary:
            hooks.append(attn.register_forward_pre_hook(keep_rotary(store), with_kwargs=True))
    try:
        ids = ids.to(model.device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    if out.attentions is None or len(out.attentions) != len(attns):
        raise ValueError(f'{type(model).__name__} returned attention probabilities for '
                         f'{len(out.attentions or ())} layers, not {len(attns)}: it needs eager attention')
    n_head = model.config.num_attention_heads
    layers = []
    for attn, store in zip(attns, stores):
        q, k = fam.split(store[fam.q], n_head) if fam.split else (store[fam.q], store[fam.k])
        if not fam.rotary:
            layers.append({'none': (q, k)})
            continue
        d = q.shape[-1] // n_head
        layers.append({rope: (q, k) if rope == 'before' else rotate(attn, q, k, store['cos_sin'], d) for rope in ropes})
    return layers, list(out.attentions)


def pretrained_tokens(model, ids, ropes=ROPES[:1]):
    """Token metrics per layer of a transformers model on ids (B, T): a list over layers of {rope: metrics}
    (capture_qk, then qk_token_geometry)."""
    causal = family_of(model.config)[1].causal
    layers, atts = capture_qk(model, ids, ropes)
    n_head = model.config.num_attention_heads
    return [{rope: qk_token_geometry(q, k, att, n_head, causal) for rope, (q, k) in variants.items()}
            for variants, att in zip(layers, atts)]


# ----------------------------------------------------------------------------- statistics

def rankdata(x):
    """Ranks 1..n of x; tied values get the average of the ranks they span."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind='mergesort')
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + 1 + ends) / 2, ends - starts)
    return ranks


def spearman(x, y):
    """Spearman rank correlation: the Pearson correlation of the (average-tied) ranks. Pairs with a NaN
    are dropped; NaN with fewer than 3 pairs or a constant series."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return float('nan')
    rx, ry = rankdata(x[ok]), rankdata(y[ok])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float('nan')


def bootstrap_means(x, n_boot=N_BOOT, seed=BOOT_SEED):
    """Means of n_boot resamples (with replacement) of x, from a fixed seed."""
    x = np.asarray(x, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    return x[idx].mean(1)


def bootstrap_ci(x, level=LEVEL, n_boot=N_BOOT, seed=BOOT_SEED):
    """Percentile bootstrap interval of the mean of x (NaNs dropped); (nan, nan) for fewer than 2 values,
    where resampling says nothing."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float('nan'), float('nan')
    lo, hi = np.percentile(bootstrap_means(x, n_boot, seed), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def sign_test_p(n_predicted, n):
    """Exact one-sided sign test: P(X >= n_predicted) for X ~ Binomial(n, 1/2); NaN when n = 0."""
    if n == 0:
        return float('nan')
    return sum(math.comb(n, i) for i in range(n_predicted, n + 1)) / 2 ** n


def paired_effect(diffs, sign=None):
    """Mean paired difference with its bootstrap interval; with a predicted sign (+1 or -1) also the
    count with that sign, the sign test (exact zeros dropped) and the directional confidence: the share
    of bootstrap means with the predicted sign."""
    d = np.asarray([v for v in diffs if np.isfinite(v)], dtype=float)
    out = {'n': len(d), 'mean': float(d.mean()) if len(d) else float('nan')}
    out['ci_lo'], out['ci_hi'] = bootstrap_ci(d)
    out.update(predicted='' if sign is None else '+' if sign > 0 else '-', n_predicted=None, sign_p=None,
               confidence=None)
    if sign is not None and len(d):
        nonzero = d[d != 0]
        out['n_predicted'] = int((sign * nonzero > 0).sum())
        out['sign_p'] = sign_test_p(out['n_predicted'], len(nonzero))
        out['confidence'] = float((sign * bootstrap_means(d) > 0).mean())
    return out


def mean_ci(values):
    """{'mean', 'lo', 'hi', 'n'} of the finite values: mean and bootstrap interval."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    lo, hi = bootstrap_ci(v)
    return {'mean': float(v.mean()) if len(v) else float('nan'), 'lo': lo, 'hi': hi, 'n': len(v)}


def contrast_trend(steps, values):
    """Trend of one checkpoint series (one layer of one model) of values (the contrast tok_pr_q - tok_pr_k).

    x = log(1 + step): step 0 has a place, and Spearman sees only ranks (the same as for log step). Returns
      rho_all, rho_early, rho_late   Spearman of the values with x over all checkpoints, over those with x at or
                                     below the median of x (early) and those at or above it (late); NaN for
                                     fewer than 3 checkpoints
      monotonicity                   mean sign of the successive differences: +1 rising, -1 falling throughout
      peak_step, peak_position       where the values peak: the step, and the place in the series (0 first, 1 last)
      rise_then_decay                rho_early > 0 and rho_late < 0
    """
    steps, v = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    order = np.argsort(steps, kind='mergesort')
    steps, v = steps[order], v[order]
    x = np.log1p(steps)
    early, late = x <= np.median(x), x >= np.median(x)
    finite = np.flatnonzero(np.isfinite(v))
    peak = int(finite[np.argmax(v[finite])]) if len(finite) else None
    rho_early, rho_late = spearman(x[early], v[early]), spearman(x[late], v[late])
    return {'n_ckpts': len(v), 'rho_all': spearman(x, v), 'n_early': int(early.sum()), 'rho_early': rho_early,
            'n_late': int(late.sum()), 'rho_late': rho_late,
            'monotonicity': float(np.sign(np.diff(v[finite])).mean()) if len(finite) > 1 else float('nan'),
            'peak_step': None if peak is None else int(steps[peak]),
            'peak_position': peak / (len(v) - 1) if peak is not None and len(v) > 1 else float('nan'),
            'rise_then_decay': bool(rho_early > 0 and rho_late < 0)}


def permutation_p(x, y, n_perm=N_PERM, seed=BOOT_SEED):
    """One-sided permutation test of a positive Spearman correlation: (1 + the shuffles of y whose correlation
    with x reaches the observed one) / (1 + n_perm), shuffles from a fixed seed; NaN where spearman is NaN."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    rho = spearman(x, y)
    if not np.isfinite(rho):
        return float('nan')
    ok = np.isfinite(x) & np.isfinite(y)
    rx, ry = rankdata(x[ok]), rankdata(y[ok])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    shuffled = np.random.default_rng(seed).permuted(np.tile(ry, (n_perm, 1)), axis=1)
    null = shuffled @ rx / math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((1 + (null >= rho - 1e-12).sum()) / (1 + n_perm))


# ---- verdict rules (each stated in the report by the text beside it)

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


# ----------------------------------------------------------------------------- tables

def fmt(v):
    """A cell for Markdown: 4 significant digits for floats, blank for None."""
    if v is None:
        return ''
    if isinstance(v, float):
        return 'nan' if v != v else f'{v:.4g}'
    return str(v)


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


def markdown_table(rows, columns):
    lines = ['| ' + ' | '.join(columns) + ' |', '|' + ' --- |' * len(columns)]
    lines += ['| ' + ' | '.join(fmt(row.get(c)) for c in columns) + ' |' for row in rows]
    return '\n'.join(lines) + '\n'


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
        rhos = [spearman(X[:, layer], Y[:, layer]) for layer in range(run.n_layer)]
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
        s = mean_ci(values[name])
        row['n_runs'] = s['n']
        row.update({f'{name}': s['mean'], f'{name}_lo': s['lo'], f'{name}_hi': s['hi']})
    return row


def control_rows(runs, target):
    """Per (setting, depth, init, seed) of the control experiment with control_target = target: final
    entropy, PRs and validation loss of none, shrink and freeze, and the differences against none."""
    controlled = [r for r in runs if r.control in ('shrink', 'freeze') and r.target == target]
    cells = sorted({(r.setting, r.n_layer, r.qk_init) for r in controlled},
                   key=lambda c: (c[0], c[1], init_order(c[2])))
    index = {(r.setting, r.n_layer, r.qk_init, r.control, r.target, r.seed): r for r in runs}
    rows = []
    for setting, depth, init in cells:
        seeds = sorted({r.seed for r in runs if (r.setting, r.n_layer, r.qk_init) == (setting, depth, init)
                        and (r.control == 'none' or r.target == target)})
        for seed in seeds:
            row = {'target': target, 'setting': setting, 'n_layer': depth, 'qk_init': init, 'seed': seed}
            for kind in CONTROL_KINDS:
                r = index.get((setting, depth, init, kind, '' if kind == 'none' else target, seed))
                for metric in CONTROL_METRICS:
                    if r is None or (metric != 'val_loss' and not r.has_geometry):
                        row[f'{metric}_{kind}'] = None
                    else:
                        row[f'{metric}_{kind}'] = float(r.val_loss[-1]) if metric == 'val_loss' else r.final(metric)
            for kind in ('shrink', 'freeze'):
                for metric in CONTROL_METRICS:
                    a, b = row[f'{metric}_{kind}'], row[f'{metric}_none']
                    row[f'd_{metric}_{kind}'] = a - b if a is not None and b is not None else None
            rows.append(row)
    return rows


def control_effect_rows(rows, target):
    """Per (control, metric): the paired differences against none, summarised (paired_effect)."""
    out = []
    for kind in ('shrink', 'freeze'):
        for metric in CONTROL_METRICS:
            d = [r[f'd_{metric}_{kind}'] for r in rows if r[f'd_{metric}_{kind}'] is not None]
            if not d:
                continue
            role = 'pr_controlled' if metric == f'pr_{target}' else metric
            out.append({'target': target, 'contrast': f'{kind} - none', 'metric': metric,
                        **paired_effect(d, PREDICTED.get((role, kind)))})
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


def missing_runs(runs):
    """Lines naming what the full study lacks: the grid of uncontrolled runs (setting A) and the control
    experiment (none, shrink, freeze x CONTROL_SEEDS where controlled runs were found)."""
    have = {(r.setting, r.n_layer, r.qk_init, r.control, r.target, r.seed) for r in runs}
    lines = []
    for depth in STUDY_DEPTHS:
        for init in STUDY_INITS:
            seeds = [s for s in STUDY_SEEDS if ('A', depth, init, 'none', '', s) not in have]
            if seeds:
                lines.append(f'L{depth} {init}: seed {", ".join(map(str, seeds))}')
    controlled = {(r.setting, r.n_layer, r.qk_init, r.target) for r in runs if r.control != 'none'}
    if not any(t == 'k' for *_, t in controlled):
        lines.append(f'control experiment (control_target=k): no shrink/freeze runs found '
                     f'(expected none, shrink, freeze x {len(CONTROL_SEEDS)} seeds)')
    for setting, depth, init, target in sorted(controlled):
        for kind in CONTROL_KINDS:
            seeds = [s for s in CONTROL_SEEDS
                     if (setting, depth, init, kind, '' if kind == 'none' else target, s) not in have]
            if seeds:
                lines.append(f'control L{depth} {init} (setting {setting}) {kind}'
                             f'{"" if kind == "none" else "-" + target}: seed {", ".join(map(str, seeds))}')
    return list(dict.fromkeys(lines))  # none baselines are shared by the k and q experiments


# ---- token level: one row per (series, step, layer) and per head; a series is one model's checkpoints
# (our runs: model = the run folder, step = iteration; pretrained: model = name, step from its stepN revision)

SERIES_COLUMNS = ('model', 'family', 'rope', 'n_layer', 'qk_init', 'control', 'target', 'seed')
TEXT_COLUMNS = {'model', 'family', 'rope', 'revision', 'qk_init', 'control', 'target'}


def series_of(row):
    return row['model'], row.get('rope') or 'none'


def token_rows(series, step, layers):
    """(per-layer rows, per-head rows) of one checkpoint: series (a dict of SERIES_COLUMNS and revision) and
    token_geometry dicts, one per layer. contrast = tok_pr_q - tok_pr_k (all heads), contrast_head = the same on
    the per-head means."""
    layer_rows, head_rows = [], []
    for layer, g in enumerate(layers):
        layer_rows.append({**series, 'step': step, 'layer': layer, 'contrast': g['tok_pr_q'] - g['tok_pr_k'],
                           'tok_pr_q': g['tok_pr_q'], 'tok_pr_k': g['tok_pr_k'],
                           'contrast_head': g['tok_pr_q_head'] - g['tok_pr_k_head'],
                           'tok_pr_q_head': g['tok_pr_q_head'], 'tok_pr_k_head': g['tok_pr_k_head'],
                           'tok_pr_qk': g['tok_pr_qk'], 'entropy': g['entropy'], 'entropy_norm': g['entropy_norm']})
        for h in range(len(g['tok_pr_q_heads'])):
            head_rows.append({**series, 'step': step, 'layer': layer, 'head': h,
                              'tok_pr_q_head': g['tok_pr_q_heads'][h], 'tok_pr_k_head': g['tok_pr_k_heads'][h],
                              'tok_pr_qk': g['tok_pr_qk_heads'][h], 'entropy': g['entropy_heads'][h],
                              'entropy_norm': g['entropy_norm_heads'][h]})
    return layer_rows, head_rows


def token_trend_rows(layer_rows):
    """One row per (series, layer): contrast_trend of its contrast over the checkpoints, the contrast at the
    first, peak and last checkpoint, and the Spearman of its entropy with log(1 + step)."""
    groups = defaultdict(list)
    for r in layer_rows:
        groups[(series_of(r), r['layer'])].append(r)
    rows = []
    for (_, layer), rs in groups.items():
        rs = sorted(rs, key=lambda r: r['step'])
        steps, c = [r['step'] for r in rs], [r['contrast'] for r in rs]
        rows.append({**{k: rs[0][k] for k in SERIES_COLUMNS if k in rs[0]}, 'layer': layer,
                     **contrast_trend(steps, c), 'first_step': steps[0], 'last_step': steps[-1],
                     'contrast_first': c[0], 'contrast_max': float(np.nanmax(c)), 'contrast_last': c[-1],
                     'entropy_rho_all': spearman(np.log1p(steps), [r['entropy'] for r in rs])})
    return rows


def token_link_rows(head_rows):
    """One row per (series, step): Spearman of tok_pr_qk with entropy across the checkpoint's (layer, head)
    pairs, its one-sided permutation p, and whether it is the series' last checkpoint."""
    groups = defaultdict(list)
    for r in head_rows:
        groups[(series_of(r), r['step'])].append(r)
    last = defaultdict(lambda: -math.inf)
    for series, step in groups:
        last[series] = max(last[series], step)
    rows = []
    for (series, step), rs in groups.items():
        x, y = [r['tok_pr_qk'] for r in rs], [r['entropy'] for r in rs]
        rows.append({**{k: rs[0][k] for k in SERIES_COLUMNS if k in rs[0]}, 'step': step, 'n_pairs': len(rs),
                     'rho': spearman(x, y), 'p': permutation_p(x, y), 'last': step == last[series]})
    return rows


def token_summary_rows(trend_rows, link_rows):
    """One row per series: the layer means of its trend statistics and its link at the last checkpoint."""
    groups = defaultdict(list)
    for r in trend_rows:
        groups[series_of(r)].append(r)
    final = {series_of(r): r for r in link_rows if r['last']}
    rows = []
    for series, rs in groups.items():
        mean = lambda key: float(np.nanmean([r[key] for r in rs])) if np.isfinite([r[key] for r in rs]).any() \
            else float('nan')
        link = final.get(series, {})
        rows.append({**{k: rs[0][k] for k in SERIES_COLUMNS if k in rs[0]}, 'layers': len(rs),
                     'ckpts': rs[0]['n_ckpts'], 'first_step': rs[0]['first_step'], 'last_step': rs[0]['last_step'],
                     'rho_all': mean('rho_all'), 'rho_early': mean('rho_early'), 'rho_late': mean('rho_late'),
                     'rise_then_decay': sum(bool(r['rise_then_decay']) for r in rs),
                     'monotonicity': mean('monotonicity'),
                     'peak_step_median': float(np.median([r['peak_step'] for r in rs if r['peak_step'] is not None]))
                     if any(r['peak_step'] is not None for r in rs) else None,
                     'contrast_last_positive': sum(r['contrast_last'] > 0 for r in rs),
                     'link_rho': link.get('rho'), 'link_p': link.get('p')})
    return rows


def write_token_tables(layer_rows, head_rows, out, prefix):
    """prefix[_heads|_trend|_link|_summary] (.csv, .md) from the per-layer and per-head rows; returns
    (paths written, trend rows, link rows)."""
    trend, link = token_trend_rows(layer_rows), token_link_rows(head_rows)
    paths = write_table(layer_rows, out, prefix) + write_table(head_rows, out, prefix + '_heads')
    paths += write_table(trend, out, prefix + '_trend') + write_table(link, out, prefix + '_link')
    paths += write_table(token_summary_rows(trend, link), out, prefix + '_summary')
    return paths, trend, link


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


def token_results(out):
    """{prefix: (trend rows, link rows)} of the token-level tables found in out (written by `tokens` and
    `pretrained`), for the report."""
    found = {}
    for prefix in TOKEN_SOURCES:
        paths = [os.path.join(out, f'{prefix}_{kind}.csv') for kind in ('trend', 'link')]
        if all(os.path.isfile(p) for p in paths):
            found[prefix] = tuple(read_table(p) for p in paths)
    return found


def clip(text, width):
    """text cut to width characters for the console, with '...' where it was cut (REPORT.md has it whole)."""
    return text if len(text) <= width else text[:width - 3] + '...'


# ----------------------------------------------------------------------------- figures

def save_figure(fig, out, stem, pdf):
    """stem.png as a 256-colour palette PNG: line plots look the same and the file is about 3x smaller,
    which matters for figures committed with results (PIL comes with matplotlib)."""
    paths = [os.path.join(out, stem + '.png')]
    buf = io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    rgb = Image.open(buf).convert('RGB')
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(paths[0], optimize=True)
    if pdf:
        paths.append(os.path.join(out, stem + '.pdf'))
        fig.savefig(paths[1], bbox_inches='tight')
    return paths


def iteration_axis(ax):
    """Iterations 0, 1, 2, 4, ... on a symlog axis: 0 is plotted, the log-spaced early logs spread out."""
    ax.set_xscale('symlog', linthresh=1)
    ax.set_xlabel('iteration')
    ax.set_xlim(left=0)


def plot_pr_over_training(cells):
    """Figure 1: PR_Q (solid) and PR_K (dashed) over training, a panel per depth x init, a line per layer,
    min-max band over seeds."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    depths = sorted({d for d, _ in cells})
    inits = sorted({i for _, i in cells}, key=init_order)
    fig = Figure(layout='constrained', figsize=(4.2 * len(inits), 3.2 * len(depths)))
    axes = fig.subplots(len(depths), len(inits), squeeze=False, sharex=True)
    for (depth, init), runs in cells.items():
        ax = axes[depths.index(depth)][inits.index(init)]
        iters, Q = seed_stack(runs, 'pr_q')
        K = seed_stack(runs, 'pr_k')[1]
        colors = colormaps['viridis'](np.linspace(0, 0.9, depth))
        for layer in range(depth):
            for vals, style in ((Q, '-'), (K, '--')):
                v = vals[:, :, layer]
                ax.plot(iters, v.mean(0), style, color=colors[layer], lw=1.2,
                        label=f'layer {layer}' if style == '-' else None)
                if len(runs) > 1:
                    ax.fill_between(iters, v.min(0), v.max(0), color=colors[layer], alpha=0.15, lw=0)
        ax.set_title(f'L{depth} {init} ({len(runs)} seeds)', fontsize=9)
        ax.set_ylabel('PR')
        iteration_axis(ax)
        if depth != depths[-1]:
            ax.set_xlabel('')  # the axes are shared: name them once, on the bottom row
    axes[-1][0].legend(fontsize=6, title='solid PR_Q, dashed PR_K', title_fontsize=6, ncol=2)  # deepest: every layer
    fig.suptitle('PR_Q and PR_K over training (seed mean, min-max band)')
    return fig


def plot_pr_gap(cells):
    """Figure 2: PR_Q - PR_K along every (depth, init, layer) trajectory (seed means), zero marked."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    fig = Figure(layout='constrained', figsize=(7, 4.5))
    ax = fig.subplots()
    colors = {init: colormaps['tab10'](i) for i, init in enumerate(sorted({i for _, i in cells}, key=init_order))}
    styles = ['-', '--', ':', '-.']
    depths = sorted({d for d, _ in cells})
    for (depth, init), runs in cells.items():
        iters, Q = seed_stack(runs, 'pr_q')
        gap = Q.mean(0) - seed_stack(runs, 'pr_k')[1].mean(0)
        for layer in range(depth):
            ax.plot(iters, gap[:, layer], styles[depths.index(depth) % 4], color=colors[init], lw=0.9, alpha=0.8,
                    label=f'L{depth} {init}' if layer == 0 else None)
    ax.axhline(0, color='k', lw=1)
    iteration_axis(ax)
    ax.set_ylabel('PR_Q - PR_K')
    ax.set_title('PR_Q - PR_K, every trajectory (line style = depth, colour = init)', fontsize=10)
    ax.legend(fontsize=6, ncol=3)
    return fig


def plot_entropy_and_pr(cells):
    """Figure 3: attention entropy over training (seed and layer mean per configuration), and PR_K and
    PR_QK against entropy for every run, layer and logged iteration, coloured by iteration."""
    if not cells:
        raise Skip('no uncontrolled runs with geometry')
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_h, ax_k, ax_qk = fig.subplots(1, 3)
    for (depth, init), runs in cells.items():
        iters, H = seed_stack(runs, 'entropy')
        ax_h.plot(iters, np.nanmean(H, axis=(0, 2)), lw=1.2, label=f'L{depth} {init}')
    iteration_axis(ax_h)
    ax_h.set_ylabel('attention entropy (nats)')
    ax_h.legend(fontsize=6, ncol=2)
    runs = [r for rs in cells.values() for r in rs]
    it = np.concatenate([np.repeat(r.geom_iters, r.n_layer) for r in runs])
    ent = np.concatenate([r.metric('entropy').ravel() for r in runs])
    color = np.log10(1 + it)
    for ax, key, name in ((ax_k, 'pr_k', 'PR_K'), (ax_qk, 'pr_qk', 'PR_QK')):
        x = np.concatenate([r.metric(key).ravel() for r in runs])
        sc = ax.scatter(x, ent, c=color, s=4, cmap='viridis', alpha=0.6, lw=0)
        ax.set_xlabel(name)
        ax.set_ylabel('attention entropy (nats)')
        ax.set_title(f'{name} against entropy (all runs, layers, iterations)', fontsize=9)
    fig.colorbar(sc, ax=[ax_k, ax_qk], label='log10(1 + iteration)')
    ax_h.set_title('entropy over training (seed and layer mean)', fontsize=9)
    return fig


def representative_runs(cells):
    """Per init, the lowest-seed run at the middle depth found; its middle layer is the one shown."""
    depths = sorted({d for d, _ in cells})
    depth = depths[len(depths) // 2]
    return [(init, runs[0]) for (d, init), runs in cells.items() if d == depth]


def plot_spectra(cells):
    """Figure 4: singular values of W_Q, W_K and W_QK (head mean of each rank) at the first and the last
    snapshot, for the middle layer of one representative run per init. Reads two snapshots per run."""
    reps = []
    for init, run in representative_runs(cells) if cells else []:
        folder = os.path.join(run.path, 'snapshots')
        files = sorted(f for f in os.listdir(folder) if f.startswith('qk_') and f.endswith('.npz')) \
            if os.path.isdir(folder) else []
        if files:
            reps.append((init, run, files[0], files[-1]))
    if not reps:
        raise Skip('no Q/K snapshots in the uncontrolled runs')
    fig = Figure(layout='constrained', figsize=(13, 3.3 * len(reps)))
    axes = fig.subplots(len(reps), 3, squeeze=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: several threads on a busy machine spin-wait (seen: 1000x slower)
    try:
        draw_spectra(axes, reps)
    finally:
        torch.set_num_threads(threads)
    fig.suptitle('singular value spectra at the start and the end')
    return fig


def draw_spectra(axes, reps):
    for row, (init, run, first, last) in enumerate(reps):
        layer = run.n_layer // 2
        for name, color in ((first, 'tab:blue'), (last, 'tab:red')):
            with np.load(os.path.join(run.path, 'snapshots', name)) as z:
                q, k, n_head = z['q'][layer], z['k'][layer], int(z['n_head'])
            it = int(name[3:-4])
            s_qk = geometry.interaction_singular_values(q, k, n_head)
            spectra = ((geometry.singular_values(q), geometry.matrix_pr(q)),
                       (geometry.singular_values(k), geometry.matrix_pr(k)),
                       (s_qk.mean(0), geometry.participation_ratio(s_qk ** 2).mean().item()))  # pr_qk: mean of head PRs
            for col, (s, pr) in enumerate(spectra):
                s = s.numpy()
                axes[row][col].semilogy(np.arange(1, len(s) + 1), np.maximum(s, 1e-12), color=color,
                                        label=f'iter {it}: PR {pr:.1f}')
        for col, title in enumerate(('W_Q', 'W_K', 'W_QK (head mean)')):
            ax = axes[row][col]
            ax.set_title(f'{title}, {os.path.basename(run.path)} layer {layer}', fontsize=9)
            ax.set_xlabel('index')
            ax.set_ylabel('singular value')
            ax.legend(fontsize=7)


def plot_control(runs, rows, target):
    """Figure 5: PR of the controlled projection and attention entropy over training for none, shrink and
    freeze (seed mean, min-max band), and the per-seed paired entropy differences with the mean and its
    bootstrap interval."""
    if not rows:
        raise Skip(f'no controlled runs (control_target={target})')
    cells = {(r['setting'], r['n_layer'], r['qk_init']) for r in rows}
    groups = {kind: [r for r in runs if (r.setting, r.n_layer, r.qk_init) in cells and r.control == kind
                     and r.target == ('' if kind == 'none' else target) and r.has_geometry]
              for kind in CONTROL_KINDS}
    # show the PR the control acts on: per head (mean over heads) in head scope, else the whole matrix
    scopes = {r.cfg.get('control_scope', 'head') for kind in ('shrink', 'freeze') for r in groups[kind]}
    ctl_pr = ('pr_k' if target == 'k' else 'pr_q') + ('_head' if scopes == {'head'} else '')
    fig = Figure(layout='constrained', figsize=(15, 4.3))
    ax_pr, ax_h, ax_d = fig.subplots(1, 3)
    colors = {'none': 'k', 'shrink': 'tab:blue', 'freeze': 'tab:red'}
    for kind, group in groups.items():
        if not group:
            continue
        for ax, key in ((ax_pr, ctl_pr), (ax_h, 'entropy')):
            iters, v = seed_stack(group, key)
            v = np.nanmean(v, axis=2)   # layer mean, (S, T)
            ax.plot(iters, v.mean(0), color=colors[kind], label=f'{kind} ({len(group)} seeds)')
            ax.fill_between(iters, v.min(0), v.max(0), color=colors[kind], alpha=0.2, lw=0)
    for ax, name in ((ax_pr, ctl_pr.upper().replace('_HEAD', ' per head')), (ax_h, 'attention entropy (nats)')):
        iteration_axis(ax)
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    ax_pr.set_title(f'controlled PR ({ctl_pr}, layer mean)', fontsize=9)
    ax_h.set_title('entropy (layer mean)', fontsize=9)
    for x, kind in enumerate(('shrink', 'freeze')):
        d = np.array([r[f'd_entropy_{kind}'] for r in rows if r[f'd_entropy_{kind}'] is not None], dtype=float)
        if len(d) == 0:
            continue
        jitter = np.linspace(-0.12, 0.12, len(d)) if len(d) > 1 else np.zeros(1)
        ax_d.scatter(x + jitter, d, color=colors[kind], s=18, zorder=3)
        lo, hi = bootstrap_ci(d)
        ax_d.errorbar([x + 0.3], [d.mean()], yerr=[[d.mean() - lo], [hi - d.mean()]], fmt='D', color='k',
                      capsize=4, zorder=4)
    ax_d.axhline(0, color='k', lw=1)
    ax_d.set_xticks([0, 1], ['shrink - none', 'freeze - none'])
    ax_d.set_xlim(-0.5, 1.6)
    ax_d.set_ylabel('paired final entropy difference (nats)')
    ax_d.set_title(f'per seed, mean and {LEVEL:.0%} bootstrap interval', fontsize=9)
    fig.suptitle(f'control experiment (control_target={target})')
    return fig


def plot_token_contrast(layer_rows, head_rows, label_of, title):
    """Figures 6 (our runs, a row per configuration) and 7 (pretrained, a row per model): the token-level contrast
    tok_pr_q - tok_pr_k and the attention entropy over checkpoints, a line per layer (mean over the seeds of a
    configuration), against the layer where there is one checkpoint; and tok_pr_qk against entropy per
    (layer, head) at the last checkpoint of each series, with their Spearman correlation."""
    groups = defaultdict(list)
    for r in layer_rows:
        groups[label_of(r)].append(r)
    if not groups:
        raise Skip('no token-level results')
    fig = Figure(layout='constrained', figsize=(14, 3.1 * len(groups)))
    axes = fig.subplots(len(groups), 3, squeeze=False)
    last = {}
    for r in layer_rows:
        last[series_of(r)] = max(last.get(series_of(r), r['step']), r['step'])
    for (ax_c, ax_h, ax_s), (label, rows) in zip(axes, groups.items()):
        steps = sorted({r['step'] for r in rows})
        layers = sorted({r['layer'] for r in rows})
        colors = colormaps['viridis'](np.linspace(0, 0.9, len(layers)))
        for ax, key, name in ((ax_c, 'contrast', 'tok_pr_q - tok_pr_k'), (ax_h, 'entropy', 'attention entropy (nats)')):
            cell = defaultdict(list)
            for r in rows:
                cell[(r['step'], r['layer'])].append(r[key])
            mean = np.array([[np.mean(cell[(s, layer)]) if cell[(s, layer)] else np.nan for s in steps]
                             for layer in layers])
            if len(steps) > 1:
                for i, layer in enumerate(layers):
                    ax.plot(steps, mean[i], '.-', color=colors[i], lw=1.2, label=f'layer {layer}')
                iteration_axis(ax)
                ax.set_xlabel('step')
            else:
                ax.plot(layers, mean[:, 0], 'o-', color='k')
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.set_xlabel(f'layer (one checkpoint, step {steps[0]})')
            ax.set_ylabel(name)
        ax_c.axhline(0, color='k', lw=0.8)
        ax_c.set_title(label, fontsize=9, fontweight='bold')
        ax_h.set_title('attention entropy', fontsize=9)
        if len(steps) > 1:   # the trend statistics of the contrast (token_trend_rows), means over layers and seeds
            trend = token_trend_rows(rows)
            mean = lambda key: np.mean([v for t in trend if np.isfinite(v := t[key])] or [np.nan])
            ax_c.set_title(f'{label}\ncontrast ~ log step, Spearman: all {mean("rho_all"):+.2f}, early '
                           f'{mean("rho_early"):+.2f}, late {mean("rho_late"):+.2f}; median peak at step '
                           f'{np.median([t["peak_step"] for t in trend]):g}', fontsize=8)
        heads = [h for h in head_rows if label_of(h) == label and h['step'] == last[series_of(h)]]
        x, y = [h['tok_pr_qk'] for h in heads], [h['entropy'] for h in heads]
        ax_s.scatter(x, y, c=[h['layer'] for h in heads], cmap='viridis', s=12)
        ax_s.set_xlabel('tok_pr_qk (per head)')
        ax_s.set_ylabel('entropy (per head)')
        ax_s.set_title(f'last checkpoint, layers x heads: Spearman {spearman(x, y):+.2f}', fontsize=9)
    widest = max(range(len(groups)), key=lambda i: len(axes[i][0].get_legend_handles_labels()[0]))
    if axes[widest][0].get_legend_handles_labels()[0]:
        axes[widest][0].legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    return fig


# ----------------------------------------------------------------------------- report

def claims(summary, link_pooled, effects, token=None):
    """The claims of the study as report rows: claim, statistic, value, verdict, rule. token: the token-level
    results found (token_results), for the rows (f1) and (f2)."""
    rows = []
    n = summary['trajectories'] if summary else 0
    c = summary['q_up_k_down'] if summary else 0
    rows.append({'claim': '(a) PR_Q grows and PR_K falls over training',
                 'statistic': 'share of (depth, init, layer) trajectories (seed means) with PR_Q(end) > PR_Q(0) '
                              'and PR_K(end) < PR_K(0)',
                 'value': f'{c}/{n} = {c / n:.0%}' if n else 'no trajectories', 'verdict': share_verdict(c, n),
                 'rule': SHARE_RULE})
    c = summary['gap_positive_throughout'] if summary else 0
    rows.append({'claim': '(b) PR_Q - PR_K > 0 along every trajectory',
                 'statistic': 'share of trajectories with PR_Q - PR_K > 0 at every logged iteration after 0',
                 'value': f'{c}/{n} = {c / n:.0%}' if n else 'no trajectories', 'verdict': share_verdict(c, n),
                 'rule': SHARE_RULE})
    if link_pooled:
        parts, values = [], []
        for name in ('pr_k~pr_qk', 'pr_k~entropy'):
            m, lo, hi = link_pooled[name], link_pooled[f'{name}_lo'], link_pooled[f'{name}_hi']
            v = interval_verdict(m, lo, hi, +1)
            parts.append(v)
            values.append(f'{name}: {m:.2f} [{lo:.2f}, {hi:.2f}] ({v})')
        rows.append({'claim': '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy',
                     'statistic': f'within-run Spearman over logged iterations (per layer, mean over layers), '
                                  f'mean over {link_pooled["n_runs"]} uncontrolled runs',
                     'value': '; '.join(values), 'verdict': combine_verdicts(parts), 'rule': LINK_RULE})
    else:
        rows.append({'claim': '(c) falling PR_K goes with a narrower QK^T spectrum and lower attention entropy',
                     'statistic': 'within-run Spearman PR_K~PR_QK and PR_K~entropy', 'value': 'no runs',
                     'verdict': NOT_MEASURED, 'rule': LINK_RULE})
    for label, kind, sign, word in (('(d) shrinking the key spectrum sharpens attention', 'shrink', -1, 'lower'),
                                    ('(e) freezing the key spectrum softens attention', 'freeze', +1, 'higher')):
        e = next((e for e in effects if e['target'] == 'k' and e['contrast'] == f'{kind} - none'
                  and e['metric'] == 'entropy'), None)
        stat = (f'final attention entropy (mean of the last {FINAL_LOGS} logs and of layers), {kind} - none '
                f'paired by seed; predicted {word}')
        if e is None:
            rows.append({'claim': label, 'statistic': stat, 'value': f'no {kind}/none pairs',
                         'verdict': NOT_MEASURED, 'rule': EFFECT_RULE})
            continue
        value = (f'mean {e["mean"]:+.4f} [{e["ci_lo"]:+.4f}, {e["ci_hi"]:+.4f}], {e["n_predicted"]}/{e["n"]} '
                 f'{word}, sign test p = {e["sign_p"]:.3g}, directional confidence {e["confidence"]:.2f}')
        rows.append({'claim': label, 'statistic': stat, 'value': value,
                     'verdict': interval_verdict(e['mean'], e['ci_lo'], e['ci_hi'], sign, e['sign_p']),
                     'rule': EFFECT_RULE})
    for prefix in TOKEN_SOURCES:
        rows += token_claims(prefix, *(token or {}).get(prefix, ([], [])))
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


def write_report(path, ctx):
    L = ['# qkgeom: claims report', '',
         f'Generated by `python analyze.py {" ".join(ctx["paths"])}` on {time.strftime("%Y-%m-%d %H:%M")}. '
         f'Every value and verdict below is computed from the run folders by the rules stated here; '
         f'none is typed by hand.', '',
         f'Runs: {ctx["n_found"]} run folders found, {len(ctx["runs"])} used, {len(ctx["skipped"])} skipped; '
         f'{sum(len(v) for v in ctx["cells"].values())} uncontrolled runs in {len(ctx["cells"])} (depth, init) '
         f'configurations give {ctx["summary"]["trajectories"] if ctx["summary"] else 0} layer trajectories.', '',
         '## Claims', '',
         markdown_table(ctx['claims'], ['claim', 'statistic', 'value', 'verdict']),
         '### Verdict rules', '']
    for rule in dict.fromkeys(c['rule'] for c in ctx['claims'] if c['rule'] != '-'):
        which = ', '.join(dict.fromkeys(claim_label(c) for c in ctx['claims'] if c['rule'] == rule))
        L.append(f'- {which}: {rule}.')
    L += ['', f'Intervals are {LEVEL:.0%} percentile bootstrap intervals of the mean ({N_BOOT} resamples, seed '
              f'{BOOT_SEED}); the sign test is exact and one-sided, exact zeros dropped; the directional '
              f'confidence is the share of bootstrap means with the predicted sign; Spearman uses average ranks '
              f'for ties. Trajectories are seed means over the iterations every seed logged.', '',
          '## Trajectory summary', '',
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
    L += ['## Missing from the full study', '',
          f'The full study: depths {", ".join(map(str, STUDY_DEPTHS))} x inits {", ".join(STUDY_INITS)} x seeds '
          f'{", ".join(map(str, STUDY_SEEDS))} (uncontrolled), and none, shrink, freeze x seeds '
          f'{", ".join(map(str, CONTROL_SEEDS))} (control).', '']
    L += [f'- {m}' for m in ctx['missing']] or ['- nothing']
    L += ['', '## Skipped runs and warnings', '']
    L += [f'- {w}' for w in ctx['warnings']] or ['- none']
    L += ['', '## Files', '']
    L += [f'- [{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['tables'] if p.endswith('.md')]
    L += [f'- figure skipped: {n}' for n in ctx['figure_notes']]
    L += [''] + [f'![{os.path.basename(p)}]({os.path.basename(p)})' for p in ctx['figures'] if p.endswith('.png')]
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


def token_report(out, token):
    """The report's token-level section: per source found in out, one row per series (token_summary_rows),
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
    for prefix, (trend, link) in token.items():
        L += [f'### {TOKEN_SOURCES[prefix]}', '']
        rows = token_summary_rows(trend, link)
        L.append(markdown_table(rows, list(rows[0]) if rows else ['model']))
        L += [', '.join(f'[{prefix}{kind}.md]({prefix}{kind}.md)' for kind in ('', '_heads', '_trend', '_link')
                        if os.path.isfile(os.path.join(out, f'{prefix}{kind}.md'))), '']
        if os.path.isfile(os.path.join(out, figures[prefix] + '.png')):
            L += [f'![{figures[prefix]}.png]({figures[prefix]}.png)', '']
    return L


# ----------------------------------------------------------------------------- the analysis

def analyze(paths, out=None, pdf=False, figures=True, log=print):
    """Everything: load the runs under paths, write tables, figures and REPORT.md to out. Returns a dict
    with the claims, the files written, the warnings and what is missing. Raises Skip when no run
    folder is found."""
    warnings = []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')

    run_dirs = find_run_dirs(paths)
    if not run_dirs:
        raise Skip(f'no run folder (a folder with config.json) found under {", ".join(paths)}')
    runs, skipped, settings = load_runs(run_dirs, warn)
    out = out or os.path.join(paths[0], 'analysis')
    os.makedirs(out, exist_ok=True)
    cells = study_cells(runs)
    tables = write_table(runs_table(runs, skipped), out, 'runs')

    # 1. trajectories
    traj, summaries = {}, []
    for suffix, (q_key, k_key, what) in VARIANTS.items():
        traj[suffix] = trajectory_rows(cells, q_key, k_key, warn)
        if traj[suffix]:
            tables += write_table(traj[suffix], out, 'trajectories' + suffix)
            summaries.append(trajectory_summary(traj[suffix], suffix.strip('_'), what))
    if summaries:
        tables += write_table(summaries, out, 'trajectory_summary')
    summary = summaries[0] if summaries and summaries[0]['variant'] == 'full' else None

    # 2. attention link
    link_runs, link_rows = attention_link_tables(cells)
    if link_rows:
        tables += write_table(link_runs, out, 'attention_link_runs')
        tables += write_table(link_rows, out, 'attention_link')

    # 3. control
    ctl_rows, effects = {}, []
    for target in ('k', 'q'):
        ctl_rows[target] = control_rows(runs, target)
        effects += control_effect_rows(ctl_rows[target], target)
    if ctl_rows['k'] or ctl_rows['q']:
        tables += write_table(ctl_rows['k'] + ctl_rows['q'], out, 'control')
    if effects:
        tables += write_table(effects, out, 'control_effects')

    # 4. which quantity moves when
    timeline = timeline_rows(runs)
    if timeline:
        tables += write_table(timeline, out, 'timeline')

    # figures
    written, figure_notes = [], []
    if figures:
        plots = [('fig1_pr_over_training', lambda: plot_pr_over_training(cells)),
                 ('fig2_pr_gap', lambda: plot_pr_gap(cells)),
                 ('fig3_entropy_and_pr', lambda: plot_entropy_and_pr(cells)),
                 ('fig4_spectra', lambda: plot_spectra(cells)),
                 ('fig5_control_k', lambda: plot_control(runs, ctl_rows['k'], 'k'))]
        if ctl_rows['q']:
            plots.append(('fig5_control_q', lambda: plot_control(runs, ctl_rows['q'], 'q')))
        for stem, make in plots:
            try:
                written += save_figure(make(), out, stem, pdf)
            except Skip as e:
                figure_notes.append(f'{stem}: {e}')
                log(f'note: {stem} skipped: {e}')

    # report, with the token-level results written earlier into out by `tokens` and `pretrained`
    token = token_results(out)
    link_pooled = link_rows[-1] if link_rows else None
    result = {'paths': list(paths), 'out': out, 'n_found': len(run_dirs), 'runs': runs, 'skipped': skipped,
              'cells': cells, 'summary': summary, 'summaries': summaries, 'link_rows': link_rows,
              'effects': effects, 'claims': claims(summary, link_pooled, effects, token), 'token': token,
              'confounds': confound_notes(runs, cells, traj['']), 'setting_notes': setting_notes(runs, settings),
              'missing': missing_runs(runs), 'warnings': warnings, 'tables': tables, 'figures': written,
              'figure_notes': figure_notes}
    report = os.path.join(out, 'REPORT.md')
    write_report(report, result)
    result['files'] = tables + written + [report]
    return result


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
    print('missing from the full study:' + ('' if res['missing'] else ' nothing'))
    for line in res['missing']:
        print(f'  {line}')
    for c in res['claims']:
        print(f'{claim_label(c):<4} {c["verdict"]:<14} {clip(c["value"], 100)}')
    print(f'wrote {len(res["files"])} files to {res["out"]} in {time.time() - t0:.1f}s: '
          f'{len(res["tables"]) // 2} tables (csv, md), {len(res["figures"])} figure files, REPORT.md')
    return 0


def default_device():
    return 'cuda' if torch.cuda.is_available() else 'cpu'


def config_label(row):
    ctl = '' if (row.get('control') or 'none') == 'none' else f" {row['control']}-{row['target']}"
    return f"L{row['n_layer']} {row['qk_init']}{ctl}"


def analyze_tokens(paths, out=None, data_file='', data_dir='', cache_dir='', device='cpu', pdf=False, figures=True,
                   log=print):
    """Token metrics of every saved model checkpoint of every run folder under paths, each on its run's fixed
    evaluation batch: tables tokens[_heads|_trend|_link|_summary] and fig6_tokens in out (default
    <first path>/analysis). Returns a dict with the rows, claims (f1, f2), files and warnings; Skip when no run
    folder is found. Runs that cannot be measured (no checkpoints, data not found) are skipped with a warning."""
    run_dirs = find_run_dirs(paths)
    if not run_dirs:
        raise Skip(f'no run folder (a folder with config.json) found under {", ".join(paths)}')
    out = out or os.path.join(paths[0], 'analysis')
    warnings, layer_rows, head_rows, batches, measured = [], [], [], {}, []

    def warn(msg):
        warnings.append(msg)
        log(f'warning: {msg}')

    for path in run_dirs:
        try:
            cfg = read_json(os.path.join(path, 'config.json'))
            ckpts = model_checkpoints(path)
            if not ckpts:
                raise Skip('no model checkpoints in models/ (model_ckpts=0?)')
            data_key = json.dumps([cfg.get(k) for k in ('data_file', 'dataset', 'data_dir', 'cache_dir', 'data_sha256',
                                                        'min_char_count', 'block_size', 'eval_windows')])
            if data_key not in batches:  # runs on the same text share one evaluation batch
                batches[data_key] = evaluation_batch(cfg, data_file, data_dir, cache_dir)
            x = batches[data_key].to(device)
            control = cfg.get('control', 'none')
            series = {'model': path, 'rope': 'none', 'n_layer': cfg.get('n_layer'), 'qk_init': cfg.get('qk_init'),
                      'control': control, 'target': cfg.get('control_target', 'k') if control != 'none' else '',
                      'seed': cfg.get('seed')}
            rows = ([], [])
            for it, ckpt in ckpts:
                model, _ = load_model(ckpt)
                for acc, new in zip(rows, token_rows(series, it, measure_tokens(model.to(device), x))):
                    acc += new
        except Skip as e:
            warn(f'skipped {path}: {e}')
            continue
        layer_rows += rows[0]
        head_rows += rows[1]
        measured.append(path)
        done = os.path.exists(os.path.join(path, 'done.json'))
        log(f'{path}: {len(ckpts)} checkpoints (iterations {", ".join(str(i) for i, _ in ckpts)})'
            f'{"" if done else ", unfinished run"}')
    result = {'out': out, 'n_found': len(run_dirs), 'measured': measured, 'warnings': warnings,
              'layer_rows': layer_rows, 'head_rows': head_rows, 'files': [], 'claims': []}
    if not layer_rows:
        return result
    os.makedirs(out, exist_ok=True)
    result['files'], trend, link = write_token_tables(layer_rows, head_rows, out, 'tokens')
    result['claims'] = token_claims('tokens', trend, link)
    if figures:
        result['files'] += save_figure(plot_token_contrast(
            layer_rows, head_rows, config_label, 'token-level contrast and entropy over checkpoints, our runs '
            '(mean over seeds)'), out, 'fig6_tokens', pdf)
    return result


def step_of(revision, position):
    """The training step of a revision named stepN (Pythia), else its position in the list of revisions."""
    m = re.search(r'step(\d+)', revision or '')
    return int(m.group(1)) if m else position


def analyze_pretrained(name, revisions=(None,), text='', out='out/analysis', rope='after', n_seqs=8, seq_len=256,
                       device='cpu', pdf=False, figures=True, log=print):
    """Token metrics of each revision of a pretrained model on a fixed text sample, added to the tables
    pretrained[_heads|_trend|_link|_summary] in out (rows of the same model and rope written earlier are
    replaced; other models are kept) and fig7_pretrained. Returns a dict like analyze_tokens."""
    transformers = import_transformers()
    ropes = ROPES if rope == 'both' else (rope,)
    text, where = sample_text(text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**checkpoint_source(name, revisions[0]))
    ids = text_windows(tokenizer, text, n_seqs, seq_len)
    log(f'text: {where}; {ids.shape[0]} windows of {ids.shape[1]} tokens')
    layer_rows, head_rows = [], []
    for position, revision in enumerate(revisions):
        t0 = time.time()
        model = load_pretrained(name, revision, device)
        family, fam = family_of(model.config)
        limit = getattr(model.config, 'max_position_embeddings', None)
        if limit and ids.shape[1] > limit:
            raise ValueError(f'seq_len={ids.shape[1]} is more than the {limit} positions of {name}: lower --seq_len')
        layers = pretrained_tokens(model, ids, ropes)
        for variant in layers[0]:
            series = {'model': name, 'family': family, 'rope': variant, 'revision': revision or ''}
            rows = token_rows(series, step_of(revision, position), [layer[variant] for layer in layers])
            layer_rows += rows[0]
            head_rows += rows[1]
        del model
        log(f'{name} {revision or ""}: {len(layers)} layers ({family}) in {time.time() - t0:.1f}s')
    os.makedirs(out, exist_ok=True)
    new = {series_of(r) for r in layer_rows}
    for rows, stem in ((layer_rows, 'pretrained'), (head_rows, 'pretrained_heads')):
        path = os.path.join(out, stem + '.csv')
        if os.path.isfile(path):  # earlier models stay, earlier rows of this one are replaced
            rows[:0] = [r for r in read_table(path) if series_of(r) not in new]
    files, trend, link = write_token_tables(layer_rows, head_rows, out, 'pretrained')
    result = {'out': out, 'text': where, 'ids': ids, 'layer_rows': layer_rows, 'head_rows': head_rows,
              'files': files, 'claims': token_claims('pretrained', trend, link), 'warnings': []}
    if figures:
        label = lambda r: os.path.basename(os.path.normpath(r['model'])) + \
            ('' if r['rope'] == 'none' else f" (q, k {r['rope']} rotary)")
        result['files'] += save_figure(plot_token_contrast(
            layer_rows, head_rows, label, 'token-level contrast and entropy over checkpoints, pretrained models'),
            out, 'fig7_pretrained', pdf)
    return result


def print_token_result(res):
    for c in res['claims']:
        print(f'{claim_label(c):<4} {c["verdict"]:<14} {clip(c["value"], 110)}')
    print(f'wrote {len(res["files"])} files to {res["out"]}; `python analyze.py DIR --out={res["out"]}` puts claims '
          f'(f1), (f2) into its REPORT.md')


def tokens_command(argv):
    """python analyze.py tokens DIR [DIR ...] [--out OUT] [--data_file F] [--data_dir D] [--cache_dir C] ..."""
    p = folders_parser('analyze.py tokens', 'Token-level query/key geometry and attention entropy of every saved '
                       'model checkpoint (models/*.pt) of the runs, on the fixed evaluation batch of each run, '
                       'rebuilt from its config.json.')
    p.add_argument('--data_file', default='', help="the runs' training text, where config.json's data_file moved")
    p.add_argument('--data_dir', default='', help="the folder holding wiki.{train,valid}.raw (dataset runs), if moved")
    p.add_argument('--cache_dir', default='', help="where encoded data is cached; default: each run's config")
    p.add_argument('--device', default=default_device(), help='cuda if available, else cpu')
    args = p.parse_args(argv)
    if not folders_exist(args.dirs):
        return 2
    t0 = time.time()
    try:
        res = analyze_tokens(args.dirs, args.out, args.data_file, args.data_dir, args.cache_dir, args.device,
                             args.pdf, not args.no_figures)
    except Skip as e:
        print(f'error: {e}; pass the out_dir of train.py (or a folder above it)', file=sys.stderr)
        return 2
    if not res['measured']:
        print(f'error: none of the {res["n_found"]} run folders could be measured (reasons above)', file=sys.stderr)
        return 1
    print(f'{len(res["measured"])} of {res["n_found"]} runs measured in {time.time() - t0:.1f}s')
    print_token_result(res)
    return 0


def pretrained_command(argv):
    """python analyze.py pretrained --model=NAME_OR_PATH [--revisions=...] [--text=FILE] [--rope=after] ..."""
    p = argparse.ArgumentParser(prog='analyze.py pretrained', description='Token-level query/key geometry and '
                                'attention entropy of a pretrained model (each revision: a checkpoint series) on a '
                                'fixed text sample. Needs transformers. Families: ' + ', '.join(
                                    t for fam in FAMILIES.values() for t in fam.model_types) + '.')
    p.add_argument('--model', required=True, help='a local folder or a HF name (from the cache, else the hub)')
    p.add_argument('--revisions', default='', help='comma-separated revisions (a local folder MODEL/REVISION is '
                   'used if there), or a preset: ' + ', '.join(REVISION_PRESETS) + '; default: the default revision')
    p.add_argument('--text', default='', help=f'UTF-8 text to sample (first {SAMPLE_CHARS} characters); default '
                   f'{os.path.normpath(SAMPLE_FILE)} if present, else a built-in paragraph')
    p.add_argument('--rope', default='after', choices=('after', 'before', 'both'),
                   help='rotary families: q and k after the rotary embedding (as attention uses them), before it '
                        '(as projected), or both')
    p.add_argument('--n_seqs', type=int, default=8, help='windows of the text')
    p.add_argument('--seq_len', type=int, default=256, help='tokens per window, special tokens included')
    p.add_argument('--out', default=os.path.join('out', 'analysis'), help='where to write (default out/analysis, '
                   'where `python analyze.py out/` reads it)')
    p.add_argument('--device', default=default_device(), help='cuda if available, else cpu')
    p.add_argument('--pdf', action='store_true', help='write the figure as PDF too')
    p.add_argument('--no_figures', action='store_true', help='tables only')
    args = p.parse_args(argv)
    revisions = REVISION_PRESETS.get(args.revisions) or [r for r in args.revisions.split(',') if r] or [None]
    t0 = time.time()
    try:
        res = analyze_pretrained(args.model, list(revisions), args.text, args.out, args.rope, args.n_seqs,
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
