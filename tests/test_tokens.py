"""The token level: pretrained.py's family adapters against each model's own attention, and a local
checkpoint series written as a folder the analysis loads like a run (tiny random models built from
configs: nothing is downloaded). A trained run's token level read back: tests/test_paths.py."""
import math
import os
import random
import string
import sys

import numpy as np
import pytest
import torch

from plumbing import folders
import geometry
import pretrained

WORDS = ('the of and to in a is was for on as with by he it at from his an were are '
         'which this').split()
TOKEN_KEYS = ('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'tok_pr_qk_heads', 'entropy', 'entropy_heads',
              'entropy_norm', 'entropy_norm_heads')


def text(n, seed=0):
    rng = random.Random(seed)
    return ''.join(' '.join(rng.choice(WORDS) for _ in range(8)).capitalize() + '. '
                   for _ in range(n // 40))[:n]


# ----------------------------------------------------------------------------- pretrained families

SMALL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
             vocab_size=100, max_position_embeddings=64, initializer_range=0.3)
FAMILIES = {'gpt2': ('GPT2Config', dict(n_layer=2, n_embd=32, n_head=4, vocab_size=100,
                                        n_positions=64, initializer_range=0.3)),
            'gpt_neox': ('GPTNeoXConfig', SMALL),
            'llama': ('LlamaConfig', dict(SMALL, num_key_value_heads=2)),
            'phi': ('PhiConfig', dict(SMALL, num_key_value_heads=2, partial_rotary_factor=0.5)),
            'opt': ('OPTConfig', dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      ffn_dim=64, vocab_size=100, max_position_embeddings=64,
                                      word_embed_proj_dim=32, init_std=0.3))}


@pytest.fixture
def tf():
    return pytest.importorskip('transformers')


def build(tf, name, seed=0):
    torch.manual_seed(seed)
    cls, kw = FAMILIES[name]
    return tf.AutoModel.from_config(getattr(tf, cls)(**kw), attn_implementation='eager').eval()


@pytest.mark.parametrize('name', FAMILIES)
def test_the_captured_queries_and_keys_give_the_model_s_own_attention(tf, name):
    model = build(tf, name)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    layers, atts = pretrained.capture_qk(model, ids)
    measured, width = pretrained.measure(model, ids)
    H, causal = model.config.num_attention_heads, torch.ones(12, 12, dtype=torch.bool).tril()
    assert width == 32 and len(measured) == len(layers) == 2
    for (q, k), att, model_att, metrics in zip(layers, atts, attentions, measured):
        d = q.shape[-1] // H
        kh = k.view(2, 12, -1, d).transpose(1, 2).repeat_interleave(H * d // k.shape[-1], dim=1)
        logits = q.view(2, 12, H, d).transpose(1, 2) @ kh.transpose(-2, -1) / math.sqrt(d)
        probs = logits.masked_fill(~causal, float('-inf')).softmax(-1)
        torch.testing.assert_close(probs, model_att, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(att, model_att)
        tok_pr_q = geometry.activation_pr(q.reshape(-1, q.shape[-1]))
        assert metrics['tok_pr_q'] == pytest.approx(tok_pr_q, rel=1e-9)
        assert metrics['entropy'] == pytest.approx(geometry.mean_attention_entropy(att), rel=1e-9)


def char_tokenizer(tf, folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(['[UNK]'] + sorted(string.ascii_letters + ' .'))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='[UNK]').save_pretrained(folder)


def test_a_local_checkpoint_series_is_a_folder_the_analysis_loads_like_a_run(tf, tmp_path, capsys):
    steps, neox = (0, 1, 2, 4, 8, 16), tmp_path / 'neox'
    for seed, step in enumerate(steps):
        build(tf, 'gpt_neox', seed).save_pretrained(neox / f'step{step}')
        char_tokenizer(tf, neox / f'step{step}')
    (tmp_path / 'sample.txt').write_text(text(3000), encoding='utf-8')
    revisions = ','.join(f'step{s}' for s in steps[::-1])
    args = [f'--model={neox}', f'--revisions={revisions}', f'--text={tmp_path / "sample.txt"}',
            '--n_seqs=2', '--seq_len=16', f'--out_dir={tmp_path / "series"}']
    assert pretrained.main(args) == 0
    (r,), _ = folders.load_runs([str(tmp_path / 'series')], print)
    assert r.pretrained and r.notes == [] and list(r.iters) == list(steps)   # in training's order
    sizes = {k: r.cfg[k] for k in ('family', 'rope', 'n_layer', 'n_head', 'n_embd', 'block_size')}
    assert sizes == dict(family='gpt_neox', rope='after', n_layer=2, n_head=4, n_embd=32,
                         block_size=16)
    tokenizer = tf.AutoTokenizer.from_pretrained(neox / 'step0')
    ids = pretrained.text_windows(tokenizer, text(3000), 2, 16)
    model = tf.AutoModel.from_pretrained(neox / 'step4', attn_implementation='eager').eval()
    for i, layer in enumerate(pretrained.measure(model, ids)[0]):   # step 4: the fourth record
        for k in TOKEN_KEYS:
            assert np.allclose(r.m[k][3, i], layer[k], rtol=1e-9, atol=0), k
    assert pretrained.main(args) == 2 and 'pass --overwrite' in capsys.readouterr().err
    assert pretrained.main(args + ['--overwrite']) == 0
    (tmp_path / 'series' / 'run').mkdir()
    (tmp_path / 'series' / 'run' / 'config.json').write_text('{"n_layer": 2}')   # train.py's
    assert pretrained.main(args + ['--name=run', '--overwrite']) == 2
    assert 'not written here' in capsys.readouterr().err
    assert os.listdir(tmp_path / 'series' / 'run') == ['config.json']


def test_a_failed_overwrite_leaves_the_old_series_and_says_why_in_one_line(tf, tmp_path, capsys):
    neox = tmp_path / 'neox'
    for step in (0, 1):
        build(tf, 'gpt_neox', step).save_pretrained(neox / f'step{step}')
        char_tokenizer(tf, neox / f'step{step}')
    torch.manual_seed(0)   # a model whose vocabulary is smaller than its tokenizer's: it cannot run
    small = dict(SMALL, vocab_size=10)
    tf.AutoModel.from_config(tf.GPTNeoXConfig(**small)).save_pretrained(neox / 'step2')
    (tmp_path / 'sample.txt').write_text(text(3000), encoding='utf-8')
    args = [f'--model={neox}', f'--text={tmp_path / "sample.txt"}', '--n_seqs=2', '--seq_len=16',
            f'--out_dir={tmp_path / "series"}', '--name=neox', '--overwrite']
    assert pretrained.main(args + ['--revisions=step0,step1']) == 0
    series = tmp_path / 'series' / 'neox'
    before = {f: (series / f).read_bytes() for f in os.listdir(series)}
    assert set(before) == {'config.json', 'metrics.jsonl', 'done.json'}
    capsys.readouterr()
    for revisions, cause in (('step0,step1,step5', 'step5: cannot load its model'),
                             ('step0,step2', 'failed on the text: IndexError'),
                             ('step0', 'step0: cannot load its tokenizer')):
        if cause.endswith('tokenizer'):
            args[0] = f'--model={tmp_path}'   # a folder that holds no model
        assert pretrained.main(args + [f'--revisions={revisions}']) == 2
        err = capsys.readouterr().err
        assert 'Traceback' not in err and cause in err.splitlines()[-1], err
        assert {f: (series / f).read_bytes() for f in os.listdir(series)} == before


def test_an_unknown_family_or_a_revision_without_a_step_stops_and_windows_carry_special_tokens(tf):
    with pytest.raises(pretrained.Stop, match=r"'bert' is not supported.*gpt2, gpt_neox, opt"):
        pretrained.family_of(tf.BertConfig())
    with pytest.raises(pretrained.Stop, match='qk_layernorm is not supported'):
        pretrained.family_of(tf.PhiConfig(qk_layernorm=True))
    with pytest.raises(pretrained.Stop, match="revision 'main' names no training step"):
        pretrained.steps_of(['step1', 'main'])
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {c: i for i, c in enumerate(['[UNK]', '[CLS]', '[SEP]', *string.ascii_lowercase, ' '])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
    tok.post_processor = processors.TemplateProcessing(single='[CLS] $A [SEP]',
                                                       special_tokens=[('[CLS]', 1), ('[SEP]', 2)])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = pretrained.text_windows(fast, 'the cat sat on a mat' * 5, 3, 10)
    assert ids.shape == (3, 10) and (ids[:, 0] == 1).all() and (ids[:, -1] == 2).all()


def test_without_transformers_one_line_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'transformers', None)
    assert pretrained.main(['--model=gpt2', f'--out_dir={tmp_path}']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'pip install transformers' in err
