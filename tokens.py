"""
Token-level analysis of checkpoints: query/key geometry measured on activations, not weights, through
geometry.token_geometry (tok_pr_q, tok_pr_k, per head too, the logits' interaction rank tok_pr_qk, the attention
entropy). The quantity followed over checkpoints is the contrast tok_pr_q - tok_pr_k. Run through analyze.py:

    python analyze.py tokens out/ [--data_file=moved/text.txt]      # our runs' models/model_*.pt -> out/analysis
    python analyze.py pretrained --model=EleutherAI/pythia-160m --revisions=pythia
    python analyze.py out/                                          # REPORT.md, with claims (f1), (f2)

Our checkpoints: each model checkpoint runs its run's fixed evaluation batch, rebuilt as train.py builds it
(prepare.prepare_data on its config.json, then train.eval_batch), so its numbers equal those logged at that
iteration. A text that is not where config.json says skips the run naming the override; one whose SHA-256 differs
from data_sha256 is refused (other windows). Series are grouped by setting (folders.py), never across widths.

Pretrained models (needs transformers, imported only here): each revision loaded in float32 with eager attention,
from a local folder (PATH/REVISION when there) or the model hub's cache; the text (--text, default wiki.test.raw in
train.py's data_dir) cut into --n_seqs windows of --seq_len tokens with the tokenizer's own special tokens. One
adapter per family in FAMILIES: the attention modules and the submodules that output q and k (fused ones split).
Rotary families: --rope=after measures q, k turned by the model's own apply_rotary_pos_emb with the (cos, sin) it
passes to the layer (as attention uses them), before as projected. GQA: Q head h uses K head h // (n_q / n_kv).
Encoders attend both ways: their entropy is over all T keys of every row, normalised by log T.

Per series (one model's checkpoints; our runs: step = iteration) and layer (*_trend): Spearman of the contrast with
log(1 + step) over all checkpoints, the early ones and the late ones (split at the median log step, both inclusive;
NaN below 3), where it peaks. Per checkpoint (*_link): Spearman of tok_pr_qk with entropy across the (layer, head)
pairs and its one-sided permutation p. *_summary: a row per series, layer means, the link at the last checkpoint:
the units of (f1), (f2). tokens_runs names the runs measured (SHA-256 of config.json and done.json): the report uses
the tables only for those runs.
"""
import glob
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure

import folders
import geometry
import plots
import prepare
import stats
import train
from folders import Skip

SAMPLE_CHARS = 100_000
FIG_ROWS = 4
SERIES = ('model', 'family', 'rope', 'setting', 'control', 'seed')
TEXT = set(SERIES) | {'revision', 'run', 'config_sha256', 'done_sha256'}
SOURCES = {'tokens': 'our checkpoints', 'pretrained': 'pretrained models'}


# ----------------------------------------------------------------------------- our checkpoints

def evaluation_batch(cfg, data_file='', data_dir='', cache_dir=''):
    """The run's fixed evaluation batch, rebuilt as train.py builds it; a non-empty argument overrides config.json."""
    cfg = {**cfg, **{k: v for k, v in (('data_file', data_file), ('data_dir', data_dir), ('cache_dir', cache_dir))
                     if v}}
    if cfg.get('data_file') and not os.path.isfile(cfg['data_file']):
        raise Skip(f"its text data_file={cfg['data_file']} is not there; pass --data_file=PATH to the same text")
    if not cfg.get('data_file'):
        needs = ('wiki.test.raw',) if cfg.get('dataset') == 'wikitext103-test' else ('wiki.train.raw', 'wiki.valid.raw')
        if not all(os.path.isfile(os.path.join(cfg.get('data_dir', ''), n)) for n in needs):
            raise Skip(f"its dataset is not in data_dir={cfg.get('data_dir')} ({', '.join(needs)}); pass "
                       f"--data_dir=FOLDER holding them")
    try:
        _, val, meta = prepare.prepare_data(cfg)
    except SystemExit as e:
        raise Skip(str(e).removeprefix('error: ')) from None
    if meta['sha256'] != cfg['data_sha256']:
        raise Skip('the text found is not the one the run was trained on (its SHA-256 differs from data_sha256): '
                   'pass --data_file or --data_dir pointing to the same text')
    return train.eval_batch(val, cfg)[0]


def load_model(path, qk_init):
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        model = train.GPT(train.GPTConfig(**ckpt['model_config']), qk_init)
        model.load_state_dict(ckpt['model'])
    except Exception as e:   # a truncated or foreign file
        raise Skip(f'{path} is not a readable model checkpoint ({type(e).__name__})') from None
    return model.eval()


@torch.no_grad()
def measure_model(model, x):
    probe = []
    model(x, probe=probe)
    return [geometry.token_geometry(q, k, att, model.config.n_head) for q, k, att in probe]


def checkpoints(path):
    """[(iteration, file)] of a run's models/model_NNNNNNN.pt."""
    found = [(re.fullmatch(r'model_(\d+)\.pt', os.path.basename(f)), f) for f in glob.glob(f'{path}/models/*.pt')]
    return sorted((int(m.group(1)), f) for m, f in found if m)


def identity(path):
    sha = lambda name: hashlib.sha256(open(os.path.join(path, name), 'rb').read()).hexdigest() \
        if os.path.isfile(os.path.join(path, name)) else ''
    return {'run': os.path.basename(os.path.normpath(path)), 'config_sha256': sha('config.json'),
            'done_sha256': sha('done.json')}


def analyze_tokens(paths, out=None, overrides=('', '', ''), device='cpu', pdf=False, figures=True, log=print):
    """Token metrics of every model checkpoint of every run under paths, on its evaluation batch; tables tokens*
    and fig6_tokens in out. Runs that cannot be measured are skipped with one line each."""
    out = out or os.path.join(paths[0], 'analysis')
    folders.check_out(out)
    layer_rows, head_rows, measured, cfgs, batches = [], [], [], {}, {}
    for path in folders.find_runs(paths):
        try:
            cfg = folders.read_json(os.path.join(path, 'config.json'))
            problem = folders.check_config(cfg)
            if problem or not checkpoints(path):
                raise Skip(problem or 'no model checkpoints in models/')
            key = json.dumps([cfg.get(k) for k in ('data_file', 'dataset', 'data_dir', 'data_sha256',
                                                   'min_char_count', 'block_size', 'eval_windows')])
            batches[key] = batches[key] if key in batches else evaluation_batch(cfg, *overrides)
            series = {'model': path, 'rope': 'none', 'control': cfg['control'], 'seed': cfg['seed']}
            for it, f in checkpoints(path):
                rows = token_rows(series, it, measure_model(load_model(f, cfg['qk_init']).to(device),
                                                            batches[key].to(device)))
                layer_rows, head_rows = layer_rows + rows[0], head_rows + rows[1]
        except Skip as e:
            log(f'warning: skipped {path}: {e}')
            continue
        cfgs[path] = {k: v for k, v in cfg.items() if k not in folders.BOOKKEEPING and k != 'seed'}
        measured.append({'model': path, **identity(path)})
        log(f'{path}: {len(checkpoints(path))} checkpoints')
    names = dict(zip(cfgs, folders.labels(list(cfgs.values()), folders.varying(list(cfgs.values())))))
    for r in layer_rows + head_rows:
        r['setting'] = names[r['model']]
    files = {**tables('tokens', layer_rows, head_rows), **folders.table('tokens_runs', measured)}
    if figures and layer_rows:
        files.update(figure_files(layer_rows, head_rows, 'fig6_tokens', 'our runs, mean over the seeds of a setting',
                                  lambda r: r['setting'], pdf))
    written = folders.write_files(out, files) if layer_rows else []
    return {'out': out, 'files': written, 'summary': summary_rows(trend_rows(layer_rows), link_rows(head_rows))}


def token_tables(out, runs, warn):
    """{source: summary rows} of the token tables in out, for the report; ours only for runs among these (by name
    and the SHA-256 of config.json and done.json), with a warning naming the others."""
    found = {}
    for prefix, source in SOURCES.items():
        path = os.path.join(out, f'{prefix}_summary.csv')
        if os.path.isfile(path):
            found[source] = folders.read_table(path, TEXT)
    if 'our checkpoints' in found:
        made = {r['model']: (r['run'], r['config_sha256'], r['done_sha256'] or '') for r in
                folders.read_table(os.path.join(out, 'tokens_runs.csv'), TEXT)} \
            if os.path.isfile(os.path.join(out, 'tokens_runs.csv')) else {}
        ours = {tuple(identity(r.path).values()) for r in runs}
        others = sorted({m for m, ident in made.items() if ident not in ours})
        if others:
            warn(f'the token tables in {out} hold {len(others)} run(s) not among these runs, or trained again since '
                 f'(e.g. {others[0]}): left out of (f1), (f2)')
        found['our checkpoints'] = [r for r in found['our checkpoints'] if made.get(r['model']) in ours]
        lacking = [r.path for r in runs if checkpoints(r.path) and tuple(identity(r.path).values())
                   not in set(made.values())]
        if lacking:
            warn(f'{len(lacking)} runs have model checkpoints but no token tables in {out} (e.g. {lacking[0]}): '
                 f'`python analyze.py tokens RUN_FOLDERS --out={out}` measures them')
    return {k: v for k, v in found.items() if v}


# ----------------------------------------------------------------------------- pretrained models

def split_thirds(out, n_head):
    """GPT-2's c_attn output (B, T, 3C) is [q | k | v] along the channels."""
    q, k, _ = out.chunk(3, dim=-1)
    return q, k


def split_per_head(out, n_head):
    """GPT-NeoX's query_key_value output (B, T, 3C) is, head after head, [q_h | k_h | v_h]."""
    qkv = out.unflatten(-1, (n_head, 3, -1))
    return qkv[..., 0, :].flatten(-2), qkv[..., 1, :].flatten(-2)


@dataclass(frozen=True)
class Family:
    model_types: tuple        # config.model_type values read by this adapter
    attention: tuple          # class names of the self-attention modules
    q: str                    # submodule whose output holds the queries ...
    k: str                    # ... and the keys (the same fused one twice, with split)
    split: object = None
    rotary: bool = False
    causal: bool = True


FAMILIES = {
    'gpt2': Family(('gpt2',), ('GPT2Attention',), 'c_attn', 'c_attn', split=split_thirds),
    'gpt_neox': Family(('gpt_neox',), ('GPTNeoXAttention',), 'query_key_value', 'query_key_value',
                       split=split_per_head, rotary=True),
    'opt': Family(('opt',), ('OPTAttention',), 'q_proj', 'k_proj'),
    'llama': Family(('llama', 'mistral', 'qwen2'), ('LlamaAttention', 'MistralAttention', 'Qwen2Attention'),
                    'q_proj', 'k_proj', rotary=True),
    'bert': Family(('bert', 'roberta'), ('BertSelfAttention', 'RobertaSelfAttention'), 'query', 'key', causal=False),
}
# Pythia saves step0, step1, 2, 4, ..., 512, then every 1000 steps to 143000: the log-spaced ones, then doubling
REVISION_PRESETS = {'pythia': ('step0', *(f'step{2 ** i}' for i in range(10)),
                               *(f'step{1000 * 2 ** i}' for i in range(8)), 'step143000')}


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError('pretrained models need the optional package transformers: pip install transformers') \
            from None
    return transformers


def family_of(config):
    for name, fam in FAMILIES.items():
        if getattr(config, 'model_type', None) in fam.model_types:
            return name, fam
    raise ValueError(f"architecture {getattr(config, 'model_type', None)!r} is not supported; supported: "
                     f"{', '.join(t for f in FAMILIES.values() for t in f.model_types)} (one line in FAMILIES)")


def source(name, revision):
    if revision and os.path.isdir(os.path.join(name, revision)):
        return {'pretrained_model_name_or_path': os.path.join(name, revision)}
    return {'pretrained_model_name_or_path': name, **({'revision': revision} if revision else {})}


def sample_text(path=''):
    """(the first SAMPLE_CHARS characters of path, else of wiki.test.raw in train.py's data_dir; where from)."""
    if path and not os.path.isfile(path):
        raise ValueError(f'--text={path}: no such file')
    path = path or os.path.join(train.data_dir, 'wiki.test.raw')
    if not os.path.isfile(path):
        raise ValueError(f'no text to run the model on: {path} (WikiText-103\'s test split) is not there; put '
                         f'wiki.test.raw there, or pass --text=FILE (any UTF-8 text)')
    with open(path, encoding='utf-8', errors='replace') as f:
        return f.read(SAMPLE_CHARS), f'first {SAMPLE_CHARS} characters of {os.path.normpath(path)}'


def text_windows(tokenizer, text, n_seqs, seq_len):
    """(B, T) ids: up to n_seqs consecutive pieces of the text, each wrapped in the special tokens the tokenizer adds
    by default, to seq_len tokens; one shorter window when the text is shorter. Never padded."""
    ids = tokenizer(text, add_special_tokens=False)['input_ids']
    bare, full = (tokenizer('a', add_special_tokens=s)['input_ids'] for s in (False, True))
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    head, tail = (full[:at], full[at + len(bare):]) if bare else ([], [])
    n = seq_len - len(head) - len(tail)
    if n < 2 or len(ids) < 2:
        raise ValueError(f'seq_len={seq_len} leaves {n} text tokens per window and the text has {len(ids)}')
    return torch.tensor([head + ids[i * n:(i + 1) * n] + tail for i in range(min(n_seqs, len(ids) // n) or 1)])


def rotate(attn, q, k, cos_sin, d):
    """q, k (B, T, heads * d) turned by the model's own apply_rotary_pos_emb with the layer's (cos, sin)."""
    if cos_sin is None:
        raise ValueError(f'{type(attn).__name__} was called without position_embeddings; use --rope=before')
    heads = lambda t: t.unflatten(-1, (-1, d)).transpose(1, 2)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(heads(q), heads(k), *cos_sin)
    return q.transpose(1, 2).flatten(-2), k.transpose(1, 2).flatten(-2)


def qk_token_geometry(q, k, att, n_head, causal=True):
    """token_geometry of q (B, T, n_head d), k (B, T, n_kv d), att (B, n_head, T, T): K expanded to the query heads
    as GQA pairs them; an encoder's entropy over all T keys of every row, normalised by log T."""
    d = q.shape[-1] // n_head
    k = k.unflatten(-1, (-1, d)).repeat_interleave(n_head // (k.shape[-1] // d), dim=-2).flatten(-2)
    if causal:
        return geometry.token_geometry(q, k, att, n_head)
    B, T = q.shape[:2]
    att = att.detach().to('cpu', torch.promote_types(att.dtype, torch.float32))
    H = -torch.special.xlogy(att, att).sum(-1).double()
    return {**geometry.token_geometry(q, k, torch.eye(T).expand(B, n_head, T, T), n_head),
            'entropy': H.mean().item(), 'entropy_norm': H.mean().item() / math.log(T),
            'entropy_heads': H.mean((0, 2)).tolist(), 'entropy_norm_heads': (H.mean((0, 2)) / math.log(T)).tolist()}


@torch.no_grad()
def capture_qk(model, ids, ropes=('after',)):
    """Per layer {rope: (q, k)} from forward hooks on the family's projections, and the attention probabilities."""
    _, fam = family_of(model.config)
    attns = [m for m in model.modules() if type(m).__name__ in fam.attention and not getattr(m, 'is_cross_attention',
                                                                                              False)]
    if not attns:
        raise ValueError(f'no attention module of class {", ".join(fam.attention)} in {type(model).__name__}')
    stores, hooks = [{} for _ in attns], []
    for store, attn in zip(stores, attns):
        for role in dict.fromkeys((fam.q, fam.k)):
            hooks.append(getattr(attn, role).register_forward_hook(
                lambda mod, args, out, store=store, role=role: store.__setitem__(role, out.detach())))
        if fam.rotary:
            hooks.append(attn.register_forward_pre_hook(
                lambda mod, args, kw, store=store: store.__setitem__('cs', kw.get('position_embeddings')),
                with_kwargs=True))
    try:
        ids = ids.to(model.device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    if out.attentions is None or len(out.attentions) != len(attns):
        raise ValueError(f'{type(model).__name__} returned no attention probabilities per layer: it needs eager '
                         f'attention')
    n_head, layers = model.config.num_attention_heads, []
    for attn, store in zip(attns, stores):
        q, k = fam.split(store[fam.q], n_head) if fam.split else (store[fam.q], store[fam.k])
        layers.append({rope: (q, k) if rope == 'before' else rotate(attn, q, k, store['cs'], q.shape[-1] // n_head)
                       for rope in ropes} if fam.rotary else {'none': (q, k)})
    return layers, list(out.attentions)


def pretrained_tokens(model, ids, ropes=('after',)):
    """Token metrics per layer of a transformers model on ids: [{rope: metrics}]."""
    causal, n_head = family_of(model.config)[1].causal, model.config.num_attention_heads
    layers, atts = capture_qk(model, ids, ropes)
    return [{rope: qk_token_geometry(q, k, att, n_head, causal) for rope, (q, k) in v.items()}
            for v, att in zip(layers, atts)]


def analyze_pretrained(name, revisions=(None,), text='', out='out/analysis', rope='after', n_seqs=8, seq_len=256,
                       device='cpu', figures=True, log=print):
    """Token metrics of each revision of a pretrained model, added to the pretrained* tables in out (earlier rows
    of the same model replaced, other models kept) and fig7_pretrained."""
    tf = import_transformers()
    folders.check_out(out)
    text, where = sample_text(text)
    ids = text_windows(tf.AutoTokenizer.from_pretrained(**source(name, revisions[0])), text, n_seqs, seq_len)
    log(f'text: {where}; {ids.shape[0]} windows of {ids.shape[1]} tokens')
    layer_rows, head_rows = [], []
    for position, revision in enumerate(revisions):
        t0 = time.time()
        model = tf.AutoModel.from_pretrained(**source(name, revision), attn_implementation='eager',
                                             dtype=torch.float32).to(device).eval()
        family = family_of(model.config)[0]
        m = re.search(r'step(\d+)', revision or '')
        layers = pretrained_tokens(model, ids, ('after', 'before') if rope == 'both' else (rope,))
        for variant in layers[0]:
            rows = token_rows({'model': name, 'family': family, 'rope': variant, 'revision': revision or ''},
                              int(m.group(1)) if m else position, [layer[variant] for layer in layers])
            layer_rows, head_rows = layer_rows + rows[0], head_rows + rows[1]
        log(f'{name} {revision or ""}: {len(layers)} layers ({family}) in {time.time() - t0:.1f}s')
    for rows, stem in ((layer_rows, 'pretrained'), (head_rows, 'pretrained_heads')):
        if os.path.isfile(os.path.join(out, stem + '.csv')):
            rows[:0] = [r for r in folders.read_table(os.path.join(out, stem + '.csv'), TEXT) if r['model'] != name]
    files = tables('pretrained', layer_rows, head_rows)
    if figures:
        files.update(figure_files(layer_rows, head_rows, 'fig7_pretrained', 'pretrained models',
                                  lambda r: os.path.basename(os.path.normpath(r['model'])) + f" ({r['rope']})", False))
    return {'out': out, 'files': folders.write_files(out, files),
            'summary': summary_rows(trend_rows(layer_rows), link_rows(head_rows))}


# ----------------------------------------------------------------------------- tables

def token_rows(series, step, layers):
    """(per-layer rows, per-head rows) of one checkpoint; contrast = tok_pr_q - tok_pr_k."""
    layer_rows, head_rows = [], []
    for i, g in enumerate(layers):
        layer_rows.append({**series, 'step': step, 'layer': i, 'contrast': g['tok_pr_q'] - g['tok_pr_k'],
                           **{k: g[k] for k in ('tok_pr_q', 'tok_pr_k', 'tok_pr_q_head', 'tok_pr_k_head', 'tok_pr_qk',
                                                'entropy', 'entropy_norm')}})
        head_rows += [{**series, 'step': step, 'layer': i, 'head': h, 'tok_pr_qk': g['tok_pr_qk_heads'][h],
                       'entropy': g['entropy_heads'][h], 'tok_pr_k_head': g['tok_pr_k_heads'][h]}
                      for h in range(len(g['tok_pr_qk_heads']))]
    return layer_rows, head_rows


def series_of(row):
    return tuple(row.get(k) for k in SERIES)


def contrast_trend(steps, values):
    """Spearman of values with x = log(1 + step) over all, the early (x <= median) and the late (x >= median)
    checkpoints; where they peak (the step, and its place 0..1 in the series)."""
    order = np.argsort(steps, kind='mergesort')
    steps, v = np.asarray(steps, dtype=float)[order], np.asarray(values, dtype=float)[order]
    x = np.log1p(steps)
    early, late = x <= np.median(x), x >= np.median(x)
    peak = int(np.nanargmax(v)) if np.isfinite(v).any() else None
    return {'n_ckpts': len(v), 'rho_all': stats.spearman(x, v), 'n_early': int(early.sum()),
            'rho_early': stats.spearman(x[early], v[early]), 'n_late': int(late.sum()),
            'rho_late': stats.spearman(x[late], v[late]), 'peak_step': None if peak is None else int(steps[peak]),
            'peak_position': peak / (len(v) - 1) if peak is not None and len(v) > 1 else math.nan}


def trend_rows(layer_rows):
    rows = []
    for (series, layer), rs in folders.group(layer_rows, lambda r: (series_of(r), r['layer'])).items():
        rs = sorted(rs, key=lambda r: r['step'])
        c = [r['contrast'] for r in rs]
        rows.append({**dict(zip(SERIES, series)), 'layer': layer, **contrast_trend([r['step'] for r in rs], c),
                     'first_step': rs[0]['step'], 'last_step': rs[-1]['step'], 'contrast_last': c[-1]})
    return rows


def link_rows(head_rows):
    groups = folders.group(head_rows, lambda r: (series_of(r), r['step']))
    last = {}
    for series, step in groups:
        last[series] = max(last.get(series, step), step)
    return [{**dict(zip(SERIES, series)), 'step': step, 'n_pairs': len(rs),
             'rho': stats.spearman([r['tok_pr_qk'] for r in rs], [r['entropy'] for r in rs]),
             'p': stats.permutation_p([r['tok_pr_qk'] for r in rs], [r['entropy'] for r in rs]),
             'last': step == last[series]} for (series, step), rs in groups.items()]


def summary_rows(trend, link):
    """One row per series: the units of (f1) (layer means of rho_early, rho_late) and (f2) (link_rho)."""
    final = {series_of(r): r for r in link if r['last']}
    rows = []
    for series, rs in folders.group(trend, series_of).items():
        mean = lambda k: float(np.nanmean([r[k] for r in rs])) if np.isfinite([r[k] for r in rs]).any() else math.nan
        rows.append({**dict(zip(SERIES, series)), 'layers': len(rs), 'ckpts': rs[0]['n_ckpts'],
                     'first_step': rs[0]['first_step'], 'last_step': rs[0]['last_step'], 'rho_all': mean('rho_all'),
                     'rho_early': mean('rho_early'), 'rho_late': mean('rho_late'),
                     'contrast_last_positive': sum(r['contrast_last'] > 0 for r in rs),
                     'link_rho': final.get(series, {}).get('rho'), 'link_p': final.get(series, {}).get('p')})
    return rows


def tables(prefix, layer_rows, head_rows):
    trend, link = trend_rows(layer_rows), link_rows(head_rows)
    return {**folders.table(prefix, layer_rows), **folders.table(prefix + '_heads', head_rows),
            **folders.table(prefix + '_trend', trend), **folders.table(prefix + '_link', link),
            **folders.table(prefix + '_summary', summary_rows(trend, link))}


# ----------------------------------------------------------------------------- fig6 and fig7

def token_figure(layer_rows, head_rows, label_of, title):
    """A row per setting (or model): the contrast and the entropy over checkpoints, a line per layer (mean over
    the seeds), and tok_pr_qk against entropy per (layer, head) at the last checkpoint."""
    groups = folders.group(layer_rows, label_of)
    fig = Figure(layout='constrained', figsize=(14, 3.1 * len(groups)))
    for (ax_c, ax_h, ax_s), (label, rows) in zip(fig.subplots(len(groups), 3, squeeze=False), groups.items()):
        steps, layers = sorted({r['step'] for r in rows}), sorted({r['layer'] for r in rows})
        colors = colormaps['viridis'](np.linspace(0, 0.9, len(layers)))
        for ax, key in ((ax_c, 'contrast'), (ax_h, 'entropy')):
            for color, layer in zip(colors, layers):
                ax.plot(steps, [np.mean([r[key] for r in rows if r['step'] == s and r['layer'] == layer])
                                for s in steps], '.-', color=color, label=f'layer {layer}')
            plots.iteration_axis(ax)
            ax.set(xlabel='step', ylabel='tok_pr_q - tok_pr_k' if key == 'contrast' else 'entropy (nats)')
        ax_c.axhline(0, color='k', lw=0.8)
        ax_c.set_title(label, fontsize=9)
        heads = [h for h in head_rows if label_of(h) == label and h['step'] == steps[-1]]
        x, y = [h['tok_pr_qk'] for h in heads], [h['entropy'] for h in heads]
        ax_s.scatter(x, y, c=[h['layer'] for h in heads], cmap='viridis', s=12)
        ax_s.set(xlabel='tok_pr_qk (per head)', ylabel='entropy (per head)',
                 title=f'last checkpoint: Spearman {stats.spearman(x, y):+.2f}')
    fig.axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f'token-level contrast and entropy over checkpoints, {title}')
    return fig


def figure_files(layer_rows, head_rows, stem, title, label_of, pdf):
    """token_figure in files of FIG_ROWS rows each (stem.png, stem_2.png, ...)."""
    labels = list(dict.fromkeys(map(label_of, layer_rows)))
    files = {}
    for n, i in enumerate(range(0, len(labels), FIG_ROWS), 1):
        part = set(labels[i:i + FIG_ROWS])
        fig = token_figure([r for r in layer_rows if label_of(r) in part],
                           [h for h in head_rows if label_of(h) in part], label_of, title)
        name = f'{stem}{"" if n == 1 else f"_{n}"}'
        files.update({f'{name}.png': plots.png(fig), **({f'{name}.pdf': plots.pdf(fig)} if pdf else {})})
    return files
