"""
Token-level geometry over checkpoints, ours (`analyze.py tokens`) and pretrained series (`analyze.py
pretrained`, with transformers): tables and fig6, fig7.
"""
import contextlib
import csv
import glob
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections import namedtuple

import numpy as np
import torch
from matplotlib import colormaps

import folders
import geometry
import plots
import prepare
import stats
import train
from folders import Skip, group

SERIES = ('model', 'family', 'rope', 'setting', 'control', 'seed')
SOURCES = {'tokens': 'our checkpoints', 'pretrained': 'pretrained models'}
FIGURES = {'tokens': 'fig6_tokens', 'pretrained': 'fig7_pretrained'}


# ---- our checkpoints
def evaluation_batch(cfg, overrides=('', '', '')):
    """The run's evaluation batch, from its cache (never written) or encoded in cache_dir or a temp dir."""
    cfg = {**cfg, **{k: v for k, v in zip(('data_file', 'data_dir'), overrides) if v}}
    wiki = ('test',) if cfg.get('dataset') == 'wikitext103-test' else ('train', 'valid')
    needs = [f"{cfg.get('data_dir')}/wiki.{n}.raw" for n in wiki]
    needs = [cfg['data_file']] if cfg.get('data_file') else needs
    if not all(map(os.path.isfile, needs)):
        raise Skip(f"its text {', '.join(needs)} is not there; pass --data_file or --data_dir to it")
    key = cfg.get('data_cache') or '-'
    with tempfile.TemporaryDirectory() as tmp:   # the run's cache is linked in
        found = [p for d in (cfg.get('cache_dir'), os.environ.get('QKGEOM_CACHE'), '~/.cache/qkgeom') if d
                 for p in [os.path.expanduser(f'{d}/{key}')] if os.path.isfile(f'{p}/meta.json')]
        if found and not overrides[2]:
            os.symlink(os.path.abspath(found[0]), f'{tmp}/{key}')
        try:
            _, val, meta = prepare.prepare_data({**cfg, 'cache_dir': overrides[2] or tmp})
        except (SystemExit, OSError) as e:
            raise Skip(str(e).removeprefix('error: ')) from None
        if meta['sha256'] != cfg['data_sha256']:
            raise Skip('the text found is not the one the run was trained on')
        return train.eval_batch(val, cfg)[0]


def checkpoints(path):
    found = (re.search(r'/model_(\d+)\.pt$', f) for f in glob.glob(f'{path}/models/*'))
    return sorted((int(m[1]), m.string) for m in found if m)


def identity(path):
    sha = lambda n: hashlib.sha256(open(f'{path}/{n}', 'rb').read()).hexdigest() \
        if os.path.isfile(f'{path}/{n}') else ''
    return os.path.basename(os.path.normpath(path)), sha('config.json'), sha('done.json')


@torch.no_grad()
def measure_run(path, cfg, x, device):
    """[(series, step, token geometry per layer)] of the run's checkpoints on x."""
    series, found = dict(model=path, rope='none', control=cfg['control'], seed=cfg['seed']), []
    for it, f in checkpoints(path):
        try:
            ckpt = torch.load(f, map_location='cpu', weights_only=True)
            model = train.GPT(train.GPTConfig(**ckpt['model_config']), cfg['qk_init'])
            model.load_state_dict(ckpt['model'])
        except Exception as e:   # a truncated or foreign file
            raise Skip(f'{f} is not a readable model checkpoint ({type(e).__name__})') from None
        probe = []
        model.to(device).eval()(x.to(device), probe=probe)
        found.append((series, it, [geometry.token_geometry(q, k, att, cfg['n_head']) for q, k, att in probe]))
    return found


def analyze_tokens(paths, out=None, overrides=('', '', ''), device='cpu', figures=True, log=print):
    """Token tables of the runs' model checkpoints under paths, merged by run into out's."""
    out = out or os.path.join(paths[0], 'analysis')
    folders.check_out(out)
    ckpts, runs, batches, cfgs = [], [], {}, {}
    for path in folders.find_runs(paths):
        try:
            cfg = folders.read_config(path)
            if not checkpoints(path):
                raise Skip('no models/model_*.pt')
            data = tuple(cfg.get(k) for k in ('data_sha256', 'min_char_count', 'block_size', 'eval_windows'))
            if data not in batches:
                batches[data] = evaluation_batch(cfg, overrides)
            ckpts += measure_run(path, cfg, batches[data], device)
            runs.append(dict(zip(('model', 'run', 'config_sha256', 'done_sha256'), (path, *identity(path)))))
            log(f'{path}: {len(checkpoints(path))} checkpoints')
        except Skip as e:
            log(f'warning: skipped {path}: {e}')
    layer_rows, head_rows, runs = merged(out, 'tokens', *token_rows(ckpts), runs)
    for path in sorted({r['model'] for r in runs}):   # a run gone keeps its name
        with contextlib.suppress(Skip):
            cfgs[path] = folders.read_json(f'{path}/config.json')
    settings = folders.config_settings(cfgs.values())
    names = dict(zip(cfgs, folders.labels(settings, folders.varying(settings))))
    for r in layer_rows + head_rows:
        r['setting'] = names.get(r['model'], r.get('setting'))
    return finish(out, 'tokens', layer_rows, head_rows, lambda r: r['setting'], figures, runs)


def token_tables(out, runs, warn):
    """{source: summary rows} of out's token tables (their .csv), ours of these runs as they are now."""
    path = lambda name: os.path.join(out, f'{name}.csv')
    read = lambda name: list(csv.DictReader(open(path(name)))) if os.path.isfile(path(name)) else []
    found = {p: [{k: number(v) for k, v in r.items()} for r in read(f'{p}_summary')] for p in SOURCES}
    made = {r['model']: (r['run'], r['config_sha256'], r['done_sha256']) for r in read('tokens_runs')}
    ours = {identity(r.path): r for r in runs}
    others = sorted(m for m, ident in made.items() if ident not in ours)
    lacking = [r.path for ident, r in ours.items() if checkpoints(r.path) and ident not in made.values()]
    for these, what in ((others, 'not among these runs, or trained again since'),
                        (lacking, 'with model checkpoints, not measured')):
        if these and found['tokens']:
            warn(f'{len(these)} run(s) {what} (e.g. {these[0]}): (f1), (f2) use the runs measured')
    found['tokens'] = [r for r in found['tokens'] if made.get(r['model']) in ours]
    return {SOURCES[p]: rows for p, rows in found.items() if rows}


def number(v):
    """A table cell read back: a number, None for an empty cell, else the text."""
    try:
        return float(v)
    except ValueError:
        return v or None


# ---- pretrained models
# model types (the first names the family), the attention's q and k modules (split: a fused output -> q, k)
Family = namedtuple('Family', 'model_types q k split rotary causal', defaults=(None, False, True))
FAMILIES = (
    Family(('gpt2',), 'c_attn', 'c_attn', lambda o, n: o.chunk(3, dim=-1)[:2]),
    Family(('gpt_neox',), 'query_key_value', 'query_key_value',
           lambda o, n: [t.flatten(-2) for t in o.unflatten(-1, (n, 3, -1)).unbind(-2)[:2]], rotary=True),
    Family(('opt',), 'q_proj', 'k_proj'),
    Family(('llama', 'mistral', 'qwen2'), 'q_proj', 'k_proj', rotary=True),
    Family(('bert', 'roberta'), 'query', 'key', causal=False))
REVISION_PRESETS = {'pythia': ('step0', *(f'step{2 ** i}' for i in range(10)),
                               *(f'step{1000 * 2 ** i}' for i in range(8)), 'step143000')}


def family_of(config):
    """(name, Family) of a transformers config."""
    kind = getattr(config, 'model_type', None)
    for f in FAMILIES:
        if kind in f.model_types:
            return f.model_types[0], f
    raise ValueError(f"architecture {kind!r} is not supported; supported: "
                     f"{', '.join(t for f in FAMILIES for t in f.model_types)}")


def source(name, revision):
    local = revision and os.path.isdir(f'{name}/{revision}')
    return {'pretrained_model_name_or_path': f'{name}/{revision}' if local else name,
            **({'revision': revision} if revision and not local else {})}


def text_windows(tokenizer, text, n_seqs, seq_len):
    """(B, T) ids: up to n_seqs windows of seq_len tokens with the tokenizer's special tokens."""
    ids = tokenizer(text, add_special_tokens=False)['input_ids']
    bare, full = (tokenizer('a', add_special_tokens=s)['input_ids'] for s in (False, True))
    at = full.index(bare[0]) if bare and bare[0] in full else 0   # full: head + bare + tail
    head, tail = full[:at], full[at + len(bare):]
    n = seq_len - len(head) - len(tail)
    return torch.tensor([head + ids[i * n:i * n + n] + tail for i in range(min(n_seqs, len(ids) // n) or 1)])


def rotate(attn, q, k, cos_sin, d):
    """q, k (B, T, heads * d) turned as attention uses them, by the model's apply_rotary_pos_emb."""
    if cos_sin is None:
        raise ValueError(f'{type(attn).__name__} was called without position_embeddings; use --rope=before')
    heads = lambda t: t.unflatten(-1, (-1, d)).transpose(1, 2)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(heads(q), heads(k), *cos_sin)
    return q.transpose(1, 2).flatten(-2), k.transpose(1, 2).flatten(-2)


@torch.no_grad()
def capture_qk(model, ids, rope='after'):
    """Per layer (q, k) from hooks on the family's projections; the attention probabilities."""
    fam, n_head = family_of(model.config)[1], model.config.num_attention_heads
    attns = [m for m in model.modules()   # self-attention: the modules holding q and k
             if hasattr(m, fam.q) and hasattr(m, fam.k) and not getattr(m, 'is_cross_attention', False)]
    seen = {}   # a projection's output, an attention's rotary angles
    hooks = [getattr(a, n).register_forward_hook(lambda m, i, o: seen.update({m: o}))
             for a in attns for n in {fam.q, fam.k}]
    if fam.rotary:
        angles = lambda m, i, kw: seen.update({m: kw.get('position_embeddings')})
        hooks += [a.register_forward_pre_hook(angles, with_kwargs=True) for a in attns]
    try:
        ids = ids.to(model.device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    if not attns or out.attentions is None or len(out.attentions) != len(attns):
        raise ValueError(f'{type(model).__name__}: no attention probabilities per layer holding {fam.q}')
    q, k = ([seen[getattr(a, n)] for a in attns] for n in (fam.q, fam.k))
    layers = [fam.split(o, n_head) for o in q] if fam.split else list(zip(q, k))
    if fam.rotary and rope == 'after':
        d = layers[0][0].shape[-1] // n_head
        layers = [rotate(a, q, k, seen[a], d) for a, (q, k) in zip(attns, layers)]
    return layers, list(out.attentions)


def pretrained_tokens(model, ids, rope='after'):
    """token_geometry per layer of a transformers model on ids, k (GQA) repeated to the query heads; an
    encoder's entropy over all T keys, / log T."""
    causal, n_head = family_of(model.config)[1].causal, model.config.num_attention_heads
    found = []
    for (q, k), att in zip(*capture_qk(model, ids, rope)):
        (B, T), d = q.shape[:2], q.shape[-1] // n_head
        k = k.unflatten(-1, (-1, d)).repeat_interleave(n_head // (k.shape[-1] // d), dim=-2).flatten(-2)
        probs = att if causal else torch.eye(T).expand(B, n_head, T, T)
        found.append(geometry.token_geometry(q, k, probs, n_head))
        if not causal:
            H = -torch.special.xlogy(att, att).sum(-1).double().cpu()
            h = H.mean((0, 2))
            found[-1].update(entropy=H.mean().item(), entropy_norm=H.mean().item() / math.log(T),
                             entropy_heads=h.tolist(), entropy_norm_heads=(h / math.log(T)).tolist())
    return found


def analyze_pretrained(name, revisions=(None,), text='', out='out/analysis', rope='after', n_seqs=8,
                       seq_len=256, device='cpu', figures=True, log=print):
    """Pretrained tables of each revision of a model on a text (default: wiki.test.raw in data_dir)."""
    try:
        import transformers as tf
    except ImportError:
        raise ImportError('pretrained models need transformers: pip install transformers') from None
    folders.check_out(out)
    if rope not in ('after', 'before'):
        raise ValueError(f'--rope={rope}: after or before')
    path = text or os.path.join(train.data_dir, 'wiki.test.raw')
    if not os.path.isfile(path):
        raise ValueError(f'{path} is not there; pass --text=FILE')
    ids = text_windows(tf.AutoTokenizer.from_pretrained(**source(name, revisions[0])),
                       open(path, encoding='utf-8', errors='replace').read(100_000), n_seqs, seq_len)
    ckpts = []
    for position, revision in enumerate(r or '' for r in revisions):
        t0, m = time.time(), re.search(r'step(\d+)', revision)
        model = tf.AutoModel.from_pretrained(**source(name, revision), attn_implementation='eager',
                                             dtype=torch.float32).to(device).eval()
        family, fam = family_of(model.config)
        series = dict(model=name, family=family, rope=rope if fam.rotary else 'none', revision=revision)
        ckpts.append((series, int(m[1]) if m else position, pretrained_tokens(model, ids, rope)))
        log(f'{name} {revision}: {time.time() - t0:.1f}s')
    layer_rows, head_rows, _ = merged(out, 'pretrained', *token_rows(ckpts))
    label = lambda r: f"{os.path.basename(r['model'])} ({r['rope']})"
    return finish(out, 'pretrained', layer_rows, head_rows, label, figures)


# ---- tables and fig6, fig7
def token_rows(ckpts):
    """(layer rows, head rows) of [(series, step, token geometry per layer)]; contrast: PR_Q - PR_K."""
    at = [({**series, 'step': step, 'layer': i}, g) for series, step, gs in ckpts for i, g in enumerate(gs)]
    scalars = lambda g: {k: v for k, v in g.items() if not isinstance(v, list)}
    return ([{**s, 'contrast': g['tok_pr_q'] - g['tok_pr_k'], **scalars(g)} for s, g in at],
            [{**s, 'head': h, 'tok_pr_qk': qk, 'entropy': g['entropy_heads'][h], 'tok_pr_k_head':
              g['tok_pr_k_heads'][h]} for s, g in at for h, qk in enumerate(g['tok_pr_qk_heads'])])


def series_of(row):
    return tuple((k, row.get(k)) for k in SERIES)


def contrast_trend(steps, values):
    """Spearman with x = log(1 + step) over all, early (x <= median) and late (>=) checkpoints; the first and
    last step and value (steps in order)."""
    steps, v = np.asarray(steps, float), np.asarray(values, float)
    x = np.log1p(steps)
    early, late = x <= np.median(x), x >= np.median(x)
    rho = lambda w: stats.spearman(x[w], v[w])
    return {'n_ckpts': len(v), 'rho_all': rho(x == x), 'rho_early': rho(early), 'rho_late': rho(late),
            'n_early': int(early.sum()), 'n_late': int(late.sum()),
            'peak_step': int(steps[np.nanargmax(v)]) if np.isfinite(v).any() else None,
            'first_step': int(steps[0]), 'last_step': int(steps[-1]), 'contrast_last': float(v[-1])}


def trend_rows(layer_rows):
    rows = []
    for (series, layer), rs in group(layer_rows, lambda r: (series_of(r), r['layer'])).items():
        rs = sorted(rs, key=lambda r: r['step'])
        trend = contrast_trend([r['step'] for r in rs], [r['contrast'] for r in rs])
        rows.append({**dict(series), 'layer': layer, **trend})
    return rows


def link_rows(head_rows):
    """Per checkpoint: Spearman of tok_pr_qk with entropy across its (layer, head) pairs."""
    groups = group(head_rows, lambda r: (series_of(r), r['step']))
    last = dict(sorted(groups, key=lambda g: g[1]))
    return [{**dict(series), 'step': step, 'n_pairs': len(rs), 'last': step == last[series],
             'rho': stats.spearman(*([r[k] for r in rs] for k in ('tok_pr_qk', 'entropy')))}
            for (series, step), rs in groups.items()]


def summary_rows(trend, link):
    """Per series: layer means of the trend (of (f1)), the link at its last checkpoint (of (f2))."""
    final = {series_of(r): r for r in link if r['last']}
    return [{**dict(series), 'layers': len(rs), 'ckpts': rs[0]['n_ckpts'],
             'first_step': rs[0]['first_step'], 'last_step': rs[0]['last_step'],
             **{k: stats.nanmean([r[k] for r in rs]) for k in ('rho_all', 'rho_early', 'rho_late')},
             'contrast_last_positive': sum(r['contrast_last'] > 0 for r in rs),
             'link_rho': final.get(series, {}).get('rho')}
            for series, rs in group(trend, series_of).items()]


def merged(out, prefix, layer_rows, head_rows, runs=()):
    """Out's rows (layers, heads, runs) of the models not measured now, then these."""
    path, now = f'{out}/{prefix}.json', {r['model'] for r in layer_rows}
    earlier = json.load(open(path)) if layer_rows and os.path.isfile(path) else {}
    return [[r for r in earlier.get(k, []) if r['model'] not in now] + list(rows)
            for k, rows in (('layers', layer_rows), ('heads', head_rows), ('runs', runs))]


def finish(out, prefix, layer_rows, head_rows, label_of, figures, runs=()):
    """prefix* tables, prefix.json (rows the report reads) and figures, written into out."""
    trend, link = trend_rows(layer_rows), link_rows(head_rows)
    tables = {'layers': layer_rows, 'heads': head_rows, 'trend': trend, 'link': link,
              'summary': summary_rows(trend, link), 'runs': list(runs)}
    files = {f'{prefix}.json': json.dumps(tables)}
    for name, rows in tables.items():
        files.update(folders.table(prefix if name == 'layers' else f'{prefix}_{name}', rows))
    labels = list(dict.fromkeys(map(label_of, layer_rows))) if figures else []
    for n in range(0, len(labels), 4):   # 4 rows a figure
        fig = token_figure(layer_rows, head_rows, label_of, labels[n:n + 4], SOURCES[prefix])
        files.update(plots.save(FIGURES[prefix] + f'_{n // 4 + 1}' * (n > 0), fig))
    return {'summary': tables['summary'], 'files': layer_rows and folders.write_files(out, files, prefix)}


def token_figure(layer_rows, head_rows, label_of, labels, title):
    """Per label: contrast, entropy per layer over checkpoints; tok_pr_qk ~ entropy at the last."""
    fig, axes = plots.panels(3 * len(labels), 14 / 3, 3.1, 3)
    for (ax_c, ax_h, ax_s), label in zip(axes.reshape(-1, 3), labels):
        rows = [r for r in layer_rows if label_of(r) == label]
        steps, layers = sorted({r['step'] for r in rows}), sorted({r['layer'] for r in rows})
        for ax, key, name in ((ax_c, 'contrast', 'tok_pr_q - tok_pr_k'), (ax_h, 'entropy', 'entropy (nats)')):
            for color, layer in zip(colormaps['viridis'](np.linspace(0, 0.9, len(layers))), layers):
                ax.plot(steps, [np.mean([r[key] for r in rows if r['step'] == s and r['layer'] == layer])
                                for s in steps], '.-', color=color, label=f'layer {layer}')
            plots.iteration_axis(ax, name, label)
        ax_c.axhline(0, color='k', lw=0.8)
        heads = [h for h in head_rows if label_of(h) == label and h['step'] == steps[-1]]
        x, y = [h['tok_pr_qk'] for h in heads], [h['entropy'] for h in heads]
        ax_s.scatter(x, y, c=[h['layer'] for h in heads], s=12)
        ax_s.set(xlabel='tok_pr_qk (per head)', ylabel='entropy (per head)',
                 title=f'last checkpoint: Spearman {stats.spearman(x, y):+.2f}')
    fig.axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f'token-level contrast and entropy over checkpoints, {title}')
    return fig
