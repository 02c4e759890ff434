"""
Measure a pretrained model's checkpoints at the token level, into a folder that analyze.py reads
like a run folder. Needs transformers (pip install transformers).

    python pretrained.py --model=EleutherAI/pythia-160m --revisions=pythia
    python pretrained.py --model=gpt2 --text=my_text.txt
    python analyze.py out/        # our runs and the series in out/, read alike

--text is by default WikiText-103's test split where train.py puts it (data/wikitext-103-raw/).
--revisions=pythia downloads 20 checkpoints (step0 to step143000) of a 160M-parameter model, a few
hundred MB each: several GB in the hub's cache.

Offline, --model is a local folder: one model as save_pretrained writes it (config, weights,
tokenizer), or a folder of such folders, one a revision (FOLDER/step0/, FOLDER/step1000/, ...) read
with --revisions=step0,step1000. --gguf_file=NAME reads the model and its tokenizer from one GGUF
file in that folder (or hub repository); its quantized weights are dequantized to float32 on load,
and config.json records the file, its type and the quantization of W_Q and W_K (pip install gguf
accelerate):

    python pretrained.py --model=FOLDER --gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf

A series writes out_dir/<name>/: config.json (pretrained=true, the model, its family and sizes, the
text and its windows), metrics.jsonl with one record per revision (iter = its training step, the N
of Pythia's stepN; per layer the token-level values train.py logs, from geometry.token_geometry),
and done.json, written last. Every revision is measured before an old series is replaced.

Queries and keys come from hooks on each family's projections (FAMILIES). On rotary families they
are taken after the rotary embedding, as attention uses them (--rope=before: as projected). A key
head that several query heads share (grouped-query attention) is repeated to each of them, as
attention does: tok_pr_qk and entropy pair each query head with its key head, and tok_pr_k (all
heads and the per-head mean) is its value over the distinct key heads.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import time
from collections import namedtuple
from importlib.util import find_spec

import torch

import geometry


def neox_qk(out, n_head):
    """GPT-NeoX's fused output (B, T, n_head * 3 * d), (q, k, v) per head -> q, k (B, T, C)."""
    q, k, _ = out.unflatten(-1, (n_head, 3, -1)).unbind(-2)
    return q.flatten(-2), k.flatten(-2)


def gpt2_qk(out, n_head):
    """GPT-2's fused output (B, T, 3 * C), q then k then v -> q, k (B, T, C)."""
    return out.chunk(3, dim=-1)[:2]


# A family's model types (the first names it), the modules whose outputs are q and k, and split,
# a fused output -> q, k. Causal language models only: entropy is defined over the keys j <= i.
Family = namedtuple('Family', 'model_types q k split rotary', defaults=(None, False))
FAMILIES = (
    Family(('gpt2',), 'c_attn', 'c_attn', gpt2_qk),
    Family(('gpt_neox',), 'query_key_value', 'query_key_value', neox_qk, rotary=True),
    Family(('opt',), 'q_proj', 'k_proj'),
    Family(('llama', 'mistral', 'qwen2'), 'q_proj', 'k_proj', rotary=True),
    Family(('phi',), 'q_proj', 'k_proj', rotary=True))
PYTHIA = ['step0'] + [f'step{2 ** i}' for i in range(10)]
PYTHIA += [f'step{1000 * 2 ** i}' for i in range(8)]
REVISION_PRESETS = {'pythia': PYTHIA + ['step143000']}
OWN = ('config.json', 'metrics.jsonl', 'done.json')   # what this command writes in a series folder


class Stop(Exception):
    """A plausible mistake, as one line."""


def family_of(config):
    """(name, Family) of a transformers config."""
    kind = getattr(config, 'model_type', None)
    if getattr(config, 'qk_layernorm', False):   # q, k are normalised after the hooked projections
        raise Stop(f'{kind} with qk_layernorm is not supported: its q, k are not the projections')
    for fam in FAMILIES:
        if kind in fam.model_types:
            return fam.model_types[0], fam
    known = ', '.join(t for fam in FAMILIES for t in fam.model_types)
    raise Stop(f'architecture {kind!r} is not supported (causal language models: {known}); '
               'a new one is a row of FAMILIES in pretrained.py')


def source(name, revision, gguf_file=''):
    """from_pretrained's arguments: the folder name/revision if there is one, else name at revision,
    and the GGUF file in it, if one is named."""
    found = {'pretrained_model_name_or_path': name}
    if revision and os.path.isdir(f'{name}/{revision}'):
        found = {'pretrained_model_name_or_path': f'{name}/{revision}'}
    elif revision:
        found['revision'] = revision
    return dict(found, gguf_file=gguf_file) if gguf_file else found


def one_line(e):
    return f'{type(e).__name__}: ' + ' '.join(str(e).split())[:300]


def load(tf, a, revision, what):
    """transformers' tokenizer or model of a.model at revision. A GGUF file's weights are
    dequantized to float32 on load. Any error is one line naming the model:
    what transformers cannot load is no bug of this file."""
    where = source(a.model, revision, a.gguf_file)
    try:
        if what == 'tokenizer':
            return tf.AutoTokenizer.from_pretrained(**where)
        if a.gguf_file and hasattr(tf, 'GgufConfig'):   # transformers >= 5 can keep GGUF blocks
            where['quantization_config'] = tf.GgufConfig(dequantize=True)
        return tf.AutoModel.from_pretrained(**where, dtype=torch.float32,
                                            attn_implementation='eager')
    except Exception as e:
        raise Stop(f'{a.model} {revision or "(default)"}: cannot load its {what}: '
                   f'{one_line(e)}') from None


def gguf_quantization(tf, where):
    """The GGUF file's type (general.file_type) and the tensor types of its W_Q, W_K: what
    quantization noise the dequantized weights carry."""
    import gguf
    path = tf.utils.cached_file(where['pretrained_model_name_or_path'], where['gguf_file'],
                                revision=where.get('revision'))
    reader = gguf.GGUFReader(path)
    qk = ('attn_q.weight', 'attn_k.weight', 'attn_qkv.weight')
    found = {'gguf_file': where['gguf_file'],
             'gguf_qk_types': sorted({t.tensor_type.name for t in reader.tensors
                                      if t.name.endswith(qk)})}
    if 'general.file_type' in reader.fields:
        file_type = int(reader.fields['general.file_type'].contents())
        found['gguf_file_type'] = gguf.LlamaFileType(file_type).name
    return found


def text_windows(tokenizer, text, n_seqs, seq_len):
    """Up to n_seqs windows of seq_len token ids (B, T), each with the tokenizer's special ids."""
    ids = tokenizer(text, add_special_tokens=False)['input_ids']
    bare, full = (tokenizer('a', add_special_tokens=s)['input_ids'] for s in (False, True))
    at = full.index(bare[0]) if bare and bare[0] in full else 0   # full: head + bare + tail
    head, tail = full[:at], full[at + len(bare):]
    n = seq_len - len(head) - len(tail)
    count = min(n_seqs, len(ids) // n) or 1
    return torch.tensor([head + ids[i * n:i * n + n] + tail for i in range(count)])


def rotate(attn, q, k, cos_sin, d):
    """q, k (B, T, heads * d) turned as attention turns them (its module's apply_rotary_pos_emb).
    Partial rotary (phi, Pythia) turns the first r dims of each head, r the angles' width;
    the rest pass through."""
    if cos_sin is None:
        raise Stop(f'{type(attn).__name__} was called without position_embeddings;'
                   ' use --rope=before')
    def heads(t):
        return t.unflatten(-1, (-1, d)).transpose(1, 2)
    def flat(t):
        return t.transpose(1, 2).flatten(-2)
    r, q, k = cos_sin[0].shape[-1], heads(q), heads(k)
    turn = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q_rot, k_rot = turn(q[..., :r], k[..., :r], *cos_sin)
    return flat(torch.cat((q_rot, q[..., r:]), -1)), flat(torch.cat((k_rot, k[..., r:]), -1))


@torch.no_grad()
def capture_qk(model, ids, rope='after'):
    """Per layer (q, k) from hooks on the family's projections, and the attention probabilities."""
    fam, n_head = family_of(model.config)[1], model.config.num_attention_heads
    def holds_qk(m):
        return hasattr(m, fam.q) and hasattr(m, fam.k)
    attns = [m for m in model.modules()   # self-attention: the modules holding q and k
             if holds_qk(m) and not getattr(m, 'is_cross_attention', False)]
    seen = {}   # a projection's output, an attention's rotary angles
    def keep(module, inputs, out):   # returns None: the output goes on unchanged
        seen[module] = out
    hooks = [getattr(a, name).register_forward_hook(keep) for a in attns for name in {fam.q, fam.k}]
    if fam.rotary:
        def angles(m, args, kwargs):
            seen[m] = kwargs.get('position_embeddings')
        hooks += [a.register_forward_pre_hook(angles, with_kwargs=True) for a in attns]
    try:
        ids = ids.to(model.device)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    except Exception as e:   # a model that transformers cannot run on these ids
        raise Stop(f'{type(model).__name__} failed on the text: {one_line(e)}') from None
    finally:
        for h in hooks:
            h.remove()
    if not attns or out.attentions is None or len(out.attentions) != len(attns):
        raise Stop(f'{type(model).__name__}: no attention probabilities per layer holding {fam.q}')
    q, k = ([seen[getattr(a, name)] for a in attns] for name in (fam.q, fam.k))
    layers = [fam.split(o, n_head) for o in q] if fam.split else list(zip(q, k))
    if fam.rotary and rope == 'after':
        d = layers[0][0].shape[-1] // n_head
        layers = [rotate(a, q, k, seen[a], d) for a, (q, k) in zip(attns, layers)]
    return layers, list(out.attentions)


def measure(model, ids, rope='after'):
    """(geometry.token_geometry of each layer of a causal transformers model on ids, q's width)."""
    n_head, found = model.config.num_attention_heads, []
    for (q, k), att in zip(*capture_qk(model, ids, rope)):
        d = q.shape[-1] // n_head
        shared = n_head // (k.shape[-1] // d)   # query heads per key head
        k = k.unflatten(-1, (-1, d)).repeat_interleave(shared, dim=-2).flatten(-2)
        found.append(geometry.token_geometry(q, k, att, n_head))
    return found, q.shape[-1]


def steps_of(revisions):
    """The training step of each revision, the N of its stepN (a lone revision without one: 0)."""
    found = [re.search(r'step(\d+)', r or '') for r in revisions]
    if len(revisions) == 1:
        return [int(found[0][1]) if found[0] else 0]
    lacking = [r for r, m in zip(revisions, found) if not m]
    if lacking:
        raise Stop(f'revision {lacking[0]!r} names no training step (as step1000 does): '
                   'pass revisions that do, or one revision')
    steps = [int(m[1]) for m in found]
    if len(set(steps)) < len(steps):
        raise Stop(f'--revisions names a step twice: {", ".join(revisions)}')
    return steps


def is_series(path):
    try:
        return json.load(open(os.path.join(path, 'config.json'))).get('pretrained') is True
    except (OSError, ValueError, AttributeError):
        return False


def series_folder(out_dir, name, overwrite):
    """out_dir/name, refused when name is not a plain name, when the folder holds a config.json
    not written here, or (without overwrite) a series. Nothing is removed here."""
    path = os.path.join(out_dir, name)
    if name in ('', '.', '..') or os.path.basename(name) != name:
        raise Stop(f'--name={name!r} must be one plain folder name inside out_dir')
    if os.path.exists(os.path.join(path, 'config.json')) and not is_series(path):
        raise Stop(f'{path} holds a config.json not written here; pass another --name or --out_dir')
    ours = [f for f in OWN if os.path.exists(os.path.join(path, f))]
    if ours and not overwrite:
        raise Stop(f'{path} holds a series ({", ".join(ours)}); '
                   'pass --overwrite to measure it again, or another --name')
    return path


def write_json(obj, path):
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=1)
    os.replace(path + '.tmp', path)


def measure_series(a, tf, revisions, ids, config, log):
    """Each revision's record, by step; the first revision adds its family and sizes to config."""
    records = []
    for step, revision in sorted(zip(steps_of(revisions), revisions)):
        t0 = time.time()
        model = load(tf, a, revision, 'model')
        family, fam = family_of(model.config)
        layers, width = measure(model.to(config['device']).eval(), ids, a.rope)
        sizes = {'n_layer': len(layers), 'n_head': model.config.num_attention_heads,
                 'n_embd': width}
        if 'family' not in config:
            config.update(family=family, rope=a.rope if fam.rotary else 'none', **sizes)
            if a.gguf_file:
                config.update(gguf_quantization(tf, source(a.model, revision, a.gguf_file)))
        if sizes != {k: config[k] for k in sizes}:
            raise Stop(f'revision {revision} has {sizes}, unlike the first revision')
        records.append({'iter': step, 'revision': revision or '', 'time': time.time() - t0,
                        'layers': layers})
        log(f'{a.model} {revision or "(default)"}: step {step}, {time.time() - t0:.1f}s')
    return records


def write_series(path, config, records, done):
    """config.json, metrics.jsonl and done.json (last) into path, once what this command wrote
    there before is removed (done.json first)."""
    for f in reversed(OWN):
        if os.path.exists(os.path.join(path, f)):
            os.remove(os.path.join(path, f))
    os.makedirs(path, exist_ok=True)
    write_json(config, os.path.join(path, 'config.json'))
    with open(os.path.join(path, 'metrics.jsonl'), 'w') as metrics:
        metrics.writelines(json.dumps(record) + '\n' for record in records)
    write_json(done, os.path.join(path, 'done.json'))


def run(a, tf, log=print):
    """Measure each revision of a.model into its series folder, and return that folder.
    Each revision is measured before --overwrite removes anything: a failure keeps an old series."""
    if a.rope not in ('after', 'before'):
        raise Stop(f'--rope={a.rope}: after or before')
    if not os.path.isfile(a.text):
        raise Stop(f'{a.text} is not there; pass --text=FILE (any UTF-8 text)')
    missing = [m for m in ('gguf', 'accelerate') if a.gguf_file and not find_spec(m)]
    if missing:
        raise Stop(f'--gguf_file needs {" and ".join(missing)}: pip install gguf accelerate')
    revisions = [r or None for r in REVISION_PRESETS.get(a.revisions) or a.revisions.split(',')]
    steps_of(revisions)
    stem = os.path.basename(os.path.normpath(a.gguf_file or a.model)).removesuffix('.gguf')
    name = a.name or stem
    path = series_folder(a.out_dir, name if a.rope == 'after' else f'{name}-before', a.overwrite)
    text = open(a.text, encoding='utf-8', errors='replace').read(100_000)
    ids = text_windows(load(tf, a, revisions[0], 'tokenizer'), text, a.n_seqs, a.seq_len)
    if ids.shape[1] < 2:
        raise Stop(f'{a.text} gives fewer than 2 tokens a window; pass a longer text')
    device = a.device or ('cuda' if torch.cuda.is_available() else
                          'mps' if torch.backends.mps.is_available() else 'cpu')
    config = {'pretrained': True, 'model': a.model, 'revisions': revisions,
              'block_size': ids.shape[1], 'eval_windows': ids.shape[0], 'data_file': a.text,
              'data_sha256': hashlib.sha256(text.encode()).hexdigest(), 'device': device,
              'torch': torch.__version__, 'transformers': tf.__version__}
    t0 = time.time()
    records = measure_series(a, tf, revisions, ids, config, log)
    done = {'iter': records[-1]['iter'], 'revisions': len(revisions), 'wall_time': time.time() - t0}
    write_series(path, config, records, done)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', required=True,
                   help='a model name, a local model folder, or a local folder of revisions')
    p.add_argument('--gguf_file', default='',
                   help="a GGUF file in --model's folder (or hub repository): model and tokenizer "
                   'from it, its weights dequantized (pip install gguf accelerate)')
    p.add_argument('--revisions', default='',
                   help="R1,R2,... or 'pythia' (default: the model as it is)")
    p.add_argument('--text', default='data/wikitext-103-raw/wiki.test.raw',
                   help='a UTF-8 text, of which the first 100,000 characters are read '
                   '(default: WikiText-103 test, where train.py downloads it)')
    p.add_argument('--rope', default='after',
                   help='rotary families: q, k after the rotary embedding or before it')
    p.add_argument('--n_seqs', type=int, default=8, help='windows of the text')
    p.add_argument('--seq_len', type=int, default=256, help='tokens a window')
    p.add_argument('--out_dir', default='out', help='series go to out_dir/name/')
    p.add_argument('--name', default='',
                   help="the series' folder (default: the last name of the model or GGUF file;"
                   ' -before is added with --rope=before)')
    p.add_argument('--overwrite', action='store_true', help='measure a series in its folder again')
    p.add_argument('--device', default='', help="'' = cuda, then mps, then cpu")
    a = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print('error: pretrained.py needs transformers: pip install transformers', file=sys.stderr)
        return 2
    try:
        path = run(a, transformers)
    except (Stop, OSError) as e:   # OSError: the text or out_dir cannot be read or written
        print(f'error: {e}'.splitlines()[0], file=sys.stderr)
        return 2
    print(f'wrote {path}; `python analyze.py {a.out_dir}` reads it')
    return 0


if __name__ == '__main__':
    sys.exit(main())
