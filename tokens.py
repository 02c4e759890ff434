"""
Token-level analysis of checkpoints: query/key geometry measured on activations, not weights. Each checkpoint
runs a fixed input; geometry.token_geometry turns its query and key vectors into token-level PRs (tok_pr_q,
tok_pr_k, per head too), the interaction rank of the logits (tok_pr_qk) and the attention entropy. The
quantity followed over checkpoints is the paired contrast tok_pr_q - tok_pr_k. Run it through analyze.py
(`python tokens.py ARGS` is `python analyze.py tokens ARGS`; `python tokens.py --help` lists the options):

    python analyze.py tokens out/                          # our runs: every models/model_*.pt -> out/analysis/
    python analyze.py tokens out/ --data_file=moved/wiki.test.raw   # the training text has moved
    python analyze.py pretrained --model=EleutherAI/pythia-160m --revisions=pythia   # a checkpoint series
    python analyze.py pretrained --model=gpt2 --out=out/analysis   # one checkpoint
    python analyze.py out/                                 # REPORT.md, now with claims (f1), (f2)

Our checkpoints (`tokens`). Every model checkpoint in a run's models/ (weights_only) runs the run's fixed
evaluation batch, rebuilt as train.py builds it (prepare.prepare_data on its config.json, then eval_windows
windows drawn from train.EVAL_SEED), so a checkpoint's numbers equal those logged in metrics.jsonl at that
iteration (test_tokens.py checks them to 1e-6). A text that is not where config.json says skips the run with a
message naming the override (--data_file; --data_dir for WikiText-103 runs; --cache_dir for the cache); a text
whose SHA-256 differs from the run's data_sha256 is refused (other windows).

Pretrained models (`pretrained`; needs `pip install transformers`, imported nowhere else). Each revision is
loaded with AutoModel.from_pretrained(..., attn_implementation='eager') in float32, from a local folder
(--model=PATH; with --revisions, PATH/REVISION when there, e.g. a series saved as step0/, step1000/, ...) or
from the HF cache/hub. --revisions takes a comma-separated list or the preset `pythia` (REVISION_PRESETS: step0,
step1, 2, 4, ..., 512, then step1000, 2000, ..., 128000 and step143000). A revision's training step is the N of
stepN, else its position in the list. The text is --text=FILE, else the first SAMPLE_CHARS characters of
wiki.test.raw in train.py's data_dir (default_text: WikiText-103's test split, which train.py downloads there
with the dataset; without it, one line says where to put it); it is cut into --n_seqs consecutive windows of
--seq_len tokens, each with the special tokens the tokenizer adds by default (BOS for OPT and Llama, [CLS]/[SEP]
for BERT, none for GPT-2 and Pythia), never padded. Rows are added to the pretrained* tables in --out: rows of
the same model are replaced, other models kept, so one folder collects several families.

One adapter per family in FAMILIES (a new family is one line there); any other architecture is an error
naming the supported model types. Queries and keys are caught by forward hooks on the projections:
GPT-2 attn.c_attn split [q, k, v]; GPT-NeoX (Pythia) attention.query_key_value, per head [q_h, k_h, v_h],
partial rotary; OPT self_attn.q_proj, k_proj; Llama-style (llama, mistral, qwen2, GQA) q_proj, k_proj, rotary;
BERT-style (bert, roberta) attention.self.query, key.
- Rotary: --rope=after (default) measures q and k as the attention uses them, turned by the model's own
  apply_rotary_pos_emb with the (cos, sin) the model passes to that layer; before: as projected; both: both
  (column rope). The claims use after; other families have rope = none. Projections include their bias;
  OPT's later 1/sqrt(d) scaling of q changes no PR.
- GQA: Q head h uses K head h // (n_q / n_kv), as HF's repeat_kv pairs them; K is expanded that way, which
  leaves tok_pr_k and tok_pr_k_head unchanged and matters for tok_pr_qk.
- Attention probabilities are the model's own (output_attentions). Encoders attend both ways, which
  geometry.attention_entropy (causal only) rejects: their entropy is over all T keys of every row, row 0
  included, normalised by log T (bidirectional_entropy); the PR metrics are the same.

Statistics (both sources). A series is one model's checkpoints (our runs: one run, step = iteration). Per
series and layer (*_trend): Spearman of the contrast with log(1 + step) over all checkpoints, the early ones
and the late ones (split at the series' median log step, both halves inclusive; NaN for fewer than 3), a
monotonicity score (mean sign of successive differences), and where the contrast peaks. Per checkpoint
(*_link): Spearman of tok_pr_qk with entropy across its (layer, head) pairs, one-sided permutation test.
*_summary: one row per series. Files: tokens.csv / pretrained.csv (series, step, layer), *_heads, *_trend,
*_link, *_summary (.csv and .md), tokens_runs (the runs measured: name, SHA-256 of config.json and done.json;
the report uses the token tables only for those runs), fig6_tokens.png (our runs; fig6_tokens_2.png, ... past
FIG_ROWS configurations) and fig7_pretrained.png. The claims (f1) and (f2) and their rules are report.py's:
`python analyze.py out/` reads these tables from its output folder.
"""
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

import folders
import geometry
import plots
import prepare
import runfolder
import report
import train  # the trainer's own data and model code: the evaluation batch is rebuilt with it
from folders import Skip
from stats import mean_or_nan, permutation_p, spearman

SERIES_COLUMNS = ('model', 'family', 'rope', 'n_layer', 'qk_init', 'control', 'target', 'seed')
SAMPLE_CHARS = 100_000        # of the sample text (--text, default_text): far more than n_seqs x seq_len tokens need
FIG_ROWS = 4                  # configurations (or models) per figure file: more rows make every label unreadable
# the files each subcommand writes into its --out folder: a folder holding one that analyze.py did not write is refused
TOKENS_OUTPUTS = re.compile(r'tokens(_heads|_trend|_link|_summary|_runs)?\.(csv|md)|fig6_tokens(_\d+)?\.(png|pdf)')
PRETRAINED_OUTPUTS = re.compile(r'pretrained(_heads|_trend|_link|_summary)?\.(csv|md)'
                                r'|fig7_pretrained(_\d+)?\.(png|pdf)')


def default_device():
    return 'cuda' if torch.cuda.is_available() else 'cpu'


# ----------------------------------------------------------------------------- our checkpoints

def model_checkpoints(run_dir):
    """[(iteration, path)] of the model checkpoints train.py saved in run_dir/models/, by iteration."""
    return runfolder.listing(run_dir, 'models')


def evaluation_batch(cfg, data_file='', data_dir='', cache_dir=''):
    """The run's fixed evaluation batch (eval_windows x block_size token ids), rebuilt as train.train() builds
    it. A non-empty argument overrides the config.json value of the same name (the text moved). Skip, naming
    the missing source and the override, when the text is not there or is not the one the run was trained on."""
    cfg = dict(cfg)
    cfg.update({k: v for k, v in (('data_file', data_file), ('data_dir', data_dir), ('cache_dir', cache_dir)) if v})
    if cfg.get('data_file'):
        if not os.path.isfile(cfg['data_file']):
            raise Skip(f"its training text data_file={cfg['data_file']} (config.json) is not there; pass "
                       f"--data_file=PATH to the same text")
    else:
        needs = ('wiki.test.raw',) if cfg.get('dataset') == 'wikitext103-test' else ('wiki.train.raw', 'wiki.valid.raw')
        missing = [n for n in needs if not os.path.isfile(os.path.join(cfg.get('data_dir', ''), n))]
        if missing:  # prepare.prepare_data would try to download: not here
            raise Skip(f"its dataset {cfg.get('dataset')} is not in data_dir={cfg.get('data_dir')} (config.json: "
                       f"no {', '.join(missing)}); pass --data_dir=FOLDER holding them")
    try:
        _, val, meta = prepare.prepare_data(cfg)
    except SystemExit as e:  # configurator.Stop: a message for the user
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


# ----------------------------------------------------------------------------- pretrained models
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
                     f"types: {supported} (an adapter is one line in FAMILIES in tokens.py)")


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


def default_text():
    """The sample text when --text is not given: WikiText-103's test split in train.py's data_dir."""
    return os.path.join(train.get_config([])['data_dir'], 'wiki.test.raw')


def sample_text(path=''):
    """(text, where it came from): the first SAMPLE_CHARS characters of path, else of default_text(); ValueError
    naming the file and the way out when it is not there."""
    if path and not os.path.isfile(path):
        raise ValueError(f'--text={path}: no such file')
    path = path or default_text()
    if not os.path.isfile(path):
        raise ValueError(f'no text to run the model on: {path} (WikiText-103\'s test split, which `python train.py` '
                         f'downloads into its data_dir) is not there; put wiki.test.raw from wikitext-103-raw-v1.zip '
                         f'there, or pass --text=FILE (any UTF-8 text)')
    with open(path, encoding='utf-8', errors='replace') as f:
        return f.read(SAMPLE_CHARS), f'first {SAMPLE_CHARS} characters of {os.path.normpath(path)}'


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


def hook_projections(attns, fam):
    """Forward hooks that keep, per attention layer, its q and k projection outputs (and the rotary (cos, sin)):
    (one store dict per layer, the hook handles)."""
    stores, hooks = [{} for _ in attns], []
    for store, attn in zip(stores, attns):
        for role in dict.fromkeys((fam.q, fam.k)):
            hooks.append(getattr(attn, role).register_forward_hook(keep_output(store, role)))
        if fam.rotary:
            hooks.append(attn.register_forward_pre_hook(keep_rotary(store), with_kwargs=True))
    return stores, hooks


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
    stores, hooks = hook_projections(attns, fam)
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


# ----------------------------------------------------------------------------- tables
# one row per (series, step, layer) and per head; a series is one model's checkpoints (our runs: model = the
# run folder, step = iteration; pretrained: model = name, step from its stepN revision)

def series_columns(row):
    """The SERIES_COLUMNS a row has: what names its series in every derived table."""
    return {k: row[k] for k in SERIES_COLUMNS if k in row}


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
        groups[(report.series_of(r), r['layer'])].append(r)
    rows = []
    for (_, layer), rs in groups.items():
        rs = sorted(rs, key=lambda r: r['step'])
        steps, c = [r['step'] for r in rs], [r['contrast'] for r in rs]
        rows.append({**series_columns(rs[0]), 'layer': layer,
                     **contrast_trend(steps, c), 'first_step': steps[0], 'last_step': steps[-1],
                     'contrast_first': c[0], 'contrast_max': float(np.nanmax(c)), 'contrast_last': c[-1],
                     'entropy_rho_all': spearman(np.log1p(steps), [r['entropy'] for r in rs])})
    return rows


def token_link_rows(head_rows):
    """One row per (series, step): Spearman of tok_pr_qk with entropy across the checkpoint's (layer, head)
    pairs, its one-sided permutation p, and whether it is the series' last checkpoint."""
    groups = defaultdict(list)
    for r in head_rows:
        groups[(report.series_of(r), r['step'])].append(r)
    last = defaultdict(lambda: -math.inf)
    for series, step in groups:
        last[series] = max(last[series], step)
    rows = []
    for (series, step), rs in groups.items():
        x, y = [r['tok_pr_qk'] for r in rs], [r['entropy'] for r in rs]
        rows.append({**series_columns(rs[0]), 'step': step, 'n_pairs': len(rs),
                     'rho': spearman(x, y), 'p': permutation_p(x, y), 'last': step == last[series]})
    return rows


def token_summary_rows(trend_rows, link_rows):
    """One row per series: the layer means of its trend statistics and its link at the last checkpoint."""
    groups = defaultdict(list)
    for r in trend_rows:
        groups[report.series_of(r)].append(r)
    final = {report.series_of(r): r for r in link_rows if r['last']}
    rows = []
    for series, rs in groups.items():
        mean = lambda key: mean_or_nan([r[key] for r in rs])
        peaks = [r['peak_step'] for r in rs if r['peak_step'] is not None]
        link = final.get(series, {})
        rows.append({**series_columns(rs[0]), 'layers': len(rs),
                     'ckpts': rs[0]['n_ckpts'], 'first_step': rs[0]['first_step'], 'last_step': rs[0]['last_step'],
                     'rho_all': mean('rho_all'), 'rho_early': mean('rho_early'), 'rho_late': mean('rho_late'),
                     'rise_then_decay': sum(bool(r['rise_then_decay']) for r in rs),
                     'monotonicity': mean('monotonicity'),
                     'peak_step_median': float(np.median(peaks)) if peaks else None,
                     'contrast_last_positive': sum(r['contrast_last'] > 0 for r in rs),
                     'link_rho': link.get('rho'), 'link_p': link.get('p')})
    return rows


def write_token_tables(layer_rows, head_rows, out, prefix):
    """prefix[_heads|_trend|_link|_summary] (.csv, .md) from the per-layer and per-head rows; returns
    (paths written, trend rows, link rows)."""
    trend, link = token_trend_rows(layer_rows), token_link_rows(head_rows)
    paths = folders.write_table(layer_rows, out, prefix) + folders.write_table(head_rows, out, prefix + '_heads')
    paths += folders.write_table(trend, out, prefix + '_trend') + folders.write_table(link, out, prefix + '_link')
    paths += folders.write_table(token_summary_rows(trend, link), out, prefix + '_summary')
    return paths, trend, link


# ----------------------------------------------------------------------------- figures

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
        last[report.series_of(r)] = max(last.get(report.series_of(r), r['step']), r['step'])
    for (ax_c, ax_h, ax_s), (label, rows) in zip(axes, groups.items()):
        draw_series(ax_c, ax_h, label, rows)
        heads = [h for h in head_rows if label_of(h) == label and h['step'] == last[report.series_of(h)]]
        x, y = [h['tok_pr_qk'] for h in heads], [h['entropy'] for h in heads]
        ax_s.scatter(x, y, c=[h['layer'] for h in heads], cmap='viridis', s=12)
        ax_s.set_xlabel('tok_pr_qk (per head)')
        ax_s.set_ylabel('entropy (per head)')
        ax_s.set_title(f'last checkpoint, layers x heads: Spearman {spearman(x, y):+.2f}', fontsize=9)
    widest = max(range(len(groups)), key=lambda i: len(axes[i][0].get_legend_handles_labels()[0]))
    if axes[widest][0].get_legend_handles_labels()[0]:
        axes[widest][0].legend(fontsize=8, ncol=2)
    fig.suptitle(title)
    return fig


def save_token_figures(layer_rows, head_rows, label_of, out, stem, title, pdf):
    """plot_token_contrast in files of at most FIG_ROWS rows each (stem.png, stem_2.png, ...), so that every label
    reads at 100% zoom; returns the paths written."""
    labels = list(dict.fromkeys(label_of(r) for r in layer_rows))
    parts = [set(labels[i:i + FIG_ROWS]) for i in range(0, len(labels), FIG_ROWS)]
    paths = []
    for n, part in enumerate(parts, 1):
        fig = plot_token_contrast([r for r in layer_rows if label_of(r) in part],
                                  [h for h in head_rows if label_of(h) in part], label_of,
                                  title if len(parts) == 1 else f'{title}, part {n} of {len(parts)}')
        paths += plots.save_figure(fig, out, stem if n == 1 else f'{stem}_{n}', pdf)
    return paths


def draw_series(ax_c, ax_h, label, rows):
    """One row of figures 6 and 7: the contrast and the entropy of one configuration over its checkpoints."""
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
            plots.iteration_axis(ax)
            ax.set_xlabel('step')
        else:
            ax.plot(layers, mean[:, 0], 'o-', color='k')
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel(f'layer (one checkpoint, step {steps[0]})')
        ax.set_ylabel(name)
    ax_c.axhline(0, color='k', lw=0.8)
    ax_c.set_title(label, fontsize=9, fontweight='bold')
    ax_h.set_title('attention entropy', fontsize=9)
    if len(steps) > 1:
        ax_c.set_title(f'{label}\n{trend_title(token_trend_rows(rows))}', fontsize=8)


def trend_title(trend):
    """The trend statistics of the contrast (token_trend_rows), means over layers and seeds, for a figure title;
    a Spearman over fewer than 3 checkpoints is not measured, and says so."""
    parts = []
    for name in ('all', 'early', 'late'):
        v = mean_or_nan([t[f'rho_{name}'] for t in trend])
        parts.append(f'{name} {v:+.2f}' if np.isfinite(v) else f'{name} not measured')
    text = 'contrast ~ log step, Spearman: ' + ', '.join(parts)
    if any(p.endswith('not measured') for p in parts):
        text += ' (fewer than 3 checkpoints)'
    peaks = [t['peak_step'] for t in trend if t['peak_step'] is not None]
    return text + (f'; median peak at step {np.median(peaks):g}' if peaks else '')


# ----------------------------------------------------------------------------- the two analyses

def measure_run(path, batches, overrides, device):
    """(per-layer rows, per-head rows, checkpoints) of one run folder's model checkpoints on its evaluation
    batch; batches caches the batch of each text (runs on the same text share one). Skip with the reason."""
    cfg = folders.read_json(os.path.join(path, 'config.json'))
    ckpts = model_checkpoints(path)
    if not ckpts:
        raise Skip('no model checkpoints in models/ (model_ckpts=0?)')
    data_key = json.dumps([cfg.get(k) for k in ('data_file', 'dataset', 'data_dir', 'cache_dir', 'data_sha256',
                                                'min_char_count', 'block_size', 'eval_windows')])
    if data_key not in batches:
        batches[data_key] = evaluation_batch(cfg, *overrides)
    x = batches[data_key].to(device)
    series = {'model': path, 'rope': 'none', 'n_layer': cfg.get('n_layer'), 'qk_init': cfg.get('qk_init'),
              'control': cfg.get('control', 'none'), 'target': folders.target_of(cfg), 'seed': cfg.get('seed')}
    layer_rows, head_rows = [], []
    for it, ckpt in ckpts:
        model, _ = load_model(ckpt)
        rows = token_rows(series, it, measure_tokens(model.to(device), x))
        layer_rows += rows[0]
        head_rows += rows[1]
    return layer_rows, head_rows, ckpts


def analyze_tokens(paths, out=None, data_file='', data_dir='', cache_dir='', device='cpu', pdf=False, figures=True,
                   log=print):
    """Token metrics of every saved model checkpoint of every run folder under paths, each on its run's fixed
    evaluation batch: tables tokens[_heads|_trend|_link|_summary] and fig6_tokens in out (default
    <first path>/analysis). Returns a dict with the rows, files and warnings; Skip when no run folder is found.
    Runs that cannot be measured (no checkpoints, data not found) are skipped with a warning."""
    warnings, warn = folders.collector(log)
    out = out or os.path.join(paths[0], 'analysis')
    folders.check_out(out, TOKENS_OUTPUTS)
    run_dirs = folders.discover(paths, warn)[0]
    layer_rows, head_rows, batches, measured, labels = [], [], {}, [], {}
    for path in run_dirs:
        try:
            rows = measure_run(path, batches, (data_file, data_dir, cache_dir), device)
        except Skip as e:
            warn(f'skipped {path}: {e}')
            continue
        layer_rows += rows[0]
        head_rows += rows[1]
        measured.append({'model': path, **folders.run_identity(path)})
        labels[path] = folders.group_label(folders.read_json(os.path.join(path, 'config.json')))
        done = os.path.exists(os.path.join(path, 'done.json'))
        log(f'{path}: {len(rows[2])} checkpoints (iterations {", ".join(str(i) for i, _ in rows[2])})'
            f'{"" if done else ", unfinished run"}')
    result = {'out': out, 'n_found': len(run_dirs), 'measured': measured, 'warnings': warnings,
              'layer_rows': layer_rows, 'head_rows': head_rows, 'files': [], 'claims': []}
    if not layer_rows:
        return result
    with folders.staging(out) as staged:
        files, trend, link = write_token_tables(layer_rows, head_rows, staged, 'tokens')
        files += folders.write_table(measured, staged, 'tokens_runs')   # which runs: the report uses only these
        if figures:
            files += save_token_figures(layer_rows, head_rows, lambda r: labels[r['model']], staged, 'fig6_tokens',
                                        'token-level contrast and entropy over checkpoints, our runs (mean over seeds)',
                                        pdf)
        result.update(files=folders.moved(files, out), claims=report.token_claims('tokens', trend, link),
                      report_removed=folders.publish(staged, out, 'tokens'))
    return result


def step_of(revision, position):
    """The training step of a revision named stepN (Pythia), else its position in the list of revisions."""
    m = re.search(r'step(\d+)', revision or '')
    return int(m.group(1)) if m else position


def measure_revisions(name, revisions, ids, ropes, device, log):
    """(per-layer rows, per-head rows) of every revision of a pretrained model on the token ids."""
    layer_rows, head_rows = [], []
    for position, revision in enumerate(revisions):
        t0 = time.time()
        model = load_pretrained(name, revision, device)
        family, _ = family_of(model.config)
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
    return layer_rows, head_rows


def analyze_pretrained(name, revisions=(None,), text='', out='out/analysis', rope='after', n_seqs=8, seq_len=256,
                       device='cpu', pdf=False, figures=True, log=print):
    """Token metrics of each revision of a pretrained model on a fixed text sample, added to the tables
    pretrained[_heads|_trend|_link|_summary] in out (rows of the same model and rope written earlier are
    replaced; other models are kept) and fig7_pretrained. Returns a dict like analyze_tokens."""
    transformers = import_transformers()
    folders.check_out(out, PRETRAINED_OUTPUTS)
    text, where = sample_text(text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**checkpoint_source(name, revisions[0]))
    ids = text_windows(tokenizer, text, n_seqs, seq_len)
    log(f'text: {where}; {ids.shape[0]} windows of {ids.shape[1]} tokens')
    layer_rows, head_rows = measure_revisions(name, revisions, ids, ROPES if rope == 'both' else (rope,), device, log)
    new = {report.series_of(r) for r in layer_rows}
    for rows, stem in ((layer_rows, 'pretrained'), (head_rows, 'pretrained_heads')):
        path = os.path.join(out, stem + '.csv')
        if os.path.isfile(path):  # earlier models stay, earlier rows of this one are replaced
            rows[:0] = [r for r in folders.read_table(path) if report.series_of(r) not in new]
    label = lambda r: os.path.basename(os.path.normpath(r['model'])) + \
        ('' if r['rope'] == 'none' else f" (q, k {r['rope']} rotary)")
    with folders.staging(out) as staged:
        files, trend, link = write_token_tables(layer_rows, head_rows, staged, 'pretrained')
        if figures:
            files += save_token_figures(layer_rows, head_rows, label, staged, 'fig7_pretrained', 'token-level '
                                        'contrast and entropy over checkpoints, pretrained models', pdf)
        return {'out': out, 'text': where, 'ids': ids, 'layer_rows': layer_rows, 'head_rows': head_rows,
                'files': folders.moved(files, out), 'claims': report.token_claims('pretrained', trend, link),
                'warnings': [], 'report_removed': folders.publish(staged, out, 'pretrained')}


if __name__ == '__main__':
    import analyze   # the command line lives there (it imports this module)
    sys.exit(analyze.main(sys.argv[1:] if sys.argv[1:2] == ['pretrained'] else ['tokens', *sys.argv[1:]]))
