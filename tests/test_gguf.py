"""pretrained.py on a GGUF file: a tiny llama with grouped key heads and Q8_0 query and key weights,
written here with the gguf package (random weights, a byte-level tokenizer in the file), measured
into a series that the analysis loads like a run."""
import argparse
import json
import sys

import numpy as np
import pytest
import torch

from plumbing import folders
import pretrained

from test_tokens import TOKEN_KEYS, text

C, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2   # Q8_0 packs rows in blocks of 32


def tokenizer_fields(writer):
    """A byte-level BPE vocabulary (the 256 byte symbols and two merges) in llama.cpp's keys."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    merges = ['Ġ t', 'h e']
    tokens = list(bytes_to_unicode().values()) + [m.replace(' ', '') for m in merges]
    writer.add_tokenizer_model('gpt2')
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    return len(tokens)


def write_tiny_llama(gguf, path):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), 'llama')
    vocab = tokenizer_fields(writer)
    d = C // HEADS
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(C)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(d)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    def add(name, *shape, quantized=False):
        w = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if quantized:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, w)
    add('token_embd.weight', vocab, C)
    add('output_norm.weight', C)
    for i in range(LAYERS):
        add(f'blk.{i}.attn_norm.weight', C)
        add(f'blk.{i}.attn_q.weight', C, C, quantized=True)
        add(f'blk.{i}.attn_k.weight', KV_HEADS * d, C, quantized=True)
        add(f'blk.{i}.attn_v.weight', KV_HEADS * d, C)
        add(f'blk.{i}.attn_output.weight', C, C)
        add(f'blk.{i}.ffn_norm.weight', C)
        add(f'blk.{i}.ffn_gate.weight', FFN, C)
        add(f'blk.{i}.ffn_up.weight', FFN, C)
        add(f'blk.{i}.ffn_down.weight', C, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_is_measured_dequantized_and_its_quantization_recorded(tmp_path):
    tf = pytest.importorskip('transformers')
    gguf = pytest.importorskip('gguf', reason='the GGUF route needs gguf: pip install gguf')
    pytest.importorskip('accelerate', reason='the GGUF route needs accelerate')
    write_tiny_llama(gguf, tmp_path / 'tiny.gguf')
    (tmp_path / 'sample.txt').write_text(text(3000), encoding='utf-8')
    args = [f'--model={tmp_path}', '--gguf_file=tiny.gguf', f'--text={tmp_path / "sample.txt"}',
            '--n_seqs=2', '--seq_len=16', f'--out_dir={tmp_path / "series"}']
    assert pretrained.main(args) == 0
    config = json.load(open(tmp_path / 'series' / 'tiny' / 'config.json'))
    assert config['gguf_file'] == 'tiny.gguf' and config['gguf_file_type'] == 'MOSTLY_Q8_0'
    assert config['gguf_qk_types'] == ['Q8_0']
    (r,), _ = folders.load_runs([str(tmp_path / 'series')], print)
    assert r.pretrained and r.notes == [] and list(r.iters) == [0]
    sizes = {k: r.cfg[k] for k in ('family', 'n_layer', 'n_head', 'n_embd', 'block_size')}
    assert sizes == dict(family='llama', n_layer=LAYERS, n_head=HEADS, n_embd=C, block_size=16)
    tokenizer = tf.AutoTokenizer.from_pretrained(tmp_path, gguf_file='tiny.gguf')
    ids = pretrained.text_windows(tokenizer, text(3000), 2, 16)
    model = pretrained.load(tf, argparse.Namespace(model=tmp_path, gguf_file='tiny.gguf'), None,
                            'model').eval()
    k_proj = model.layers[0].self_attn.k_proj.weight   # dequantized: float32, 2 key heads
    assert k_proj.dtype == torch.float32 and k_proj.shape == (KV_HEADS * C // HEADS, C)
    for i, layer in enumerate(pretrained.measure(model, ids)[0]):
        for k in TOKEN_KEYS:
            assert np.allclose(r.m[k][0, i], layer[k], rtol=1e-6, atol=0), k


def test_without_gguf_one_line_says_what_to_install(monkeypatch, tmp_path, capsys):
    pytest.importorskip('transformers')
    monkeypatch.setitem(sys.modules, 'gguf', None)
    (tmp_path / 'sample.txt').write_text('some text', encoding='utf-8')
    args = [f'--model={tmp_path}', '--gguf_file=x.gguf', f'--text={tmp_path / "sample.txt"}',
            f'--out_dir={tmp_path}']
    assert pretrained.main(args) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'pip install gguf accelerate' in err
