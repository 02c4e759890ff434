"""The token level and the whole pipeline end to end: two tiny runs trained by train.py, `analyze.py tokens` against
what train.py logged, the report with claims (f1), (f2); the pretrained-family adapters against each model's own
attention (tiny random models built from configs: nothing is downloaded)."""
import csv
import json
import math
import os
import random
import string
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze
import folders
import geometry
import tokens

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = 'the of and to in a is was for on as with by he it at from his an were are which this'.split()


def text(n, seed=0):
    rng = random.Random(seed)
    return ''.join(' '.join(rng.choice(WORDS) for _ in range(8)).capitalize() + '. ' for _ in range(n // 40))[:n]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """Two seeds of one tiny setting, trained by this checkout's train.py on a synthetic text."""
    root = tmp_path_factory.mktemp('smoke')
    (root / 'corpus.txt').write_text(text(40_000), encoding='utf-8')
    args = [f'--data_file={root / "corpus.txt"}', f'--out_dir={root / "out"}', f'--cache_dir={root / "cache"}',
            '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=8', '--max_iters=24',
            '--eval_interval=8', '--geom_interval=8', '--eval_iters=2', '--eval_windows=4', '--ckpt_interval=8',
            '--model_ckpts=4', '--warmup_iters=2', '--min_char_count=1', '--threads=1']
    for seed in (1, 2):
        done = subprocess.run([sys.executable, 'train.py', *args, f'--seed={seed}'], cwd=HERE, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    return root


def test_train_then_tokens_then_the_report_end_to_end(trained, capsys):
    out = trained / 'analysis'
    assert analyze.main(['tokens', str(trained / 'out'), f'--out={out}']) == 0
    assert 'puts (f1), (f2) into its REPORT.md' in capsys.readouterr().out
    rows = json.load(open(out / 'tokens.json'))['layers']
    assert len({r['model'] for r in rows}) == 2 and {r['setting'] for r in rows} == {'base'}
    for r in rows:   # the same evaluation batch and weights as in training: the same numbers
        logged = {rec['iter']: rec for rec in map(json.loads, open(os.path.join(r['model'], 'metrics.jsonl')))}
        m = logged[r['step']]['layers'][r['layer']]
        for key in ('tok_pr_q', 'tok_pr_k', 'tok_pr_qk', 'entropy', 'entropy_norm'):
            assert r[key] == pytest.approx(m[key], rel=1e-6), key
    assert analyze.main([str(trained / 'out'), f'--out={out}']) == 0
    printed = capsys.readouterr().out
    assert '2 runs used, 0 skipped, 1 settings' in printed and 'f2 ' in printed
    report = (out / 'REPORT.md').read_text()
    assert '### our checkpoints' in report and '(fig6_tokens.png)' in report and '(fig1_pr_over_training.png)' in report
    claims = {r['key']: r for r in csv.DictReader(open(out / 'claims.csv'))}
    assert claims['f2']['n'] == '2' and claims['f2']['scope'] == 'our checkpoints: 2 series'
    assert claims['a']['scope'].startswith('2 uncontrolled runs in 1 settings')
    assert {'fig1_pr_over_training.png', 'fig3_entropy_and_pr.png', 'fig6_tokens.png'} <= set(os.listdir(out))


def test_token_tables_count_only_for_the_runs_they_were_made_from(trained, tmp_path):
    out = tmp_path / 'a'
    assert analyze.main(['tokens', str(trained / 'out'), f'--out={out}', '--no_figures']) == 0
    run_dir = sorted((trained / 'out').iterdir())[0]
    done = json.load(open(run_dir / 'done.json'))
    json.dump({**done, 'wall_time': done['wall_time'] + 1}, open(run_dir / 'done.json', 'w'))  # trained again
    try:
        s = analyze.analyze([str(trained / 'out')], out=str(out), figures=False, log=lambda m: None)
    finally:
        json.dump(done, open(run_dir / 'done.json', 'w'))
    assert [r['n'] for r in s.tables['claims'] if r['key'] == 'f2'] == [1]
    assert any('not among these runs, or trained again since' in w for w in s.warnings)


def test_a_moved_text_is_named_with_its_override(trained, tmp_path, capsys):
    cfg = json.load(open(sorted((trained / 'out').iterdir())[0] / 'config.json'))
    with pytest.raises(folders.Skip, match='--data_file'):
        tokens.evaluation_batch({**cfg, 'data_file': str(tmp_path / 'gone.txt')})
    (tmp_path / 'other.txt').write_text(text(40_000, seed=1), encoding='utf-8')
    with pytest.raises(folders.Skip, match='not the one the run was trained on'):
        tokens.evaluation_batch(cfg, (str(tmp_path / 'other.txt'), '', ''))


def test_planted_token_series_give_the_token_claims():
    steps = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    rise_then_decay = [0, 1, 2, 3, 4, 5, 4, 3, 2, 1]
    t = tokens.contrast_trend(steps, rise_then_decay)
    assert (t['rho_early'], t['rho_late'], t['peak_step']) == (1.0, -1.0, 16)
    rows = [{'model': f'm{i}', 'rho_early': 0.9 + 0.01 * i, 'rho_late': -0.8 - 0.01 * i, 'link_rho': 0.02 * i - 0.03,
             'control': 'none', 'rope': 'after' if i else 'before'} for i in range(5)]
    verdicts = {k: analyze.judge(analyze.ALL[k], rows) for k in ('f1-early', 'f1-late', 'f2')}
    assert [(v['verdict'], v['n']) for v in verdicts.values()] == [('holds', 4), ('holds', 4), ('no effect', 4)]


# ----------------------------------------------------------------------------- pretrained families

SMALL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64, initializer_range=0.3)
FAMILIES = {'gpt2': ('GPT2Config', dict(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                                         initializer_range=0.3)),
            'gpt_neox': ('GPTNeoXConfig', SMALL), 'llama': ('LlamaConfig', dict(SMALL, num_key_value_heads=2)),
            'opt': ('OPTConfig', dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                      vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=32,
                                      init_std=0.3)),
            'bert': ('BertConfig', SMALL)}


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
    fam = tokens.family_of(model.config)[1]
    layers, atts = tokens.capture_qk(model, ids)
    H = model.config.num_attention_heads
    for (q, k), att, model_att, metrics in zip(layers, atts, attentions, tokens.pretrained_tokens(model, ids)):
        d = q.shape[-1] // H
        kh = k.view(2, 12, -1, d).transpose(1, 2).repeat_interleave(H * d // k.shape[-1], dim=1)
        logits = q.view(2, 12, H, d).transpose(1, 2) @ kh.transpose(-2, -1) / math.sqrt(d)
        if fam.causal:
            logits = logits.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float('-inf'))
        torch.testing.assert_close(logits.softmax(-1), model_att, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(att, model_att)
        assert metrics['tok_pr_q'] == pytest.approx(geometry.activation_pr(q.reshape(-1, q.shape[-1])), rel=1e-9)
        if fam.causal:
            assert metrics['entropy'] == pytest.approx(geometry.mean_attention_entropy(model_att), rel=1e-9)


def char_tokenizer(tf, folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(['[UNK]'] + sorted(string.ascii_letters + ' .'))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='[UNK]').save_pretrained(folder)


def test_a_local_checkpoint_series_enters_the_report(tf, tmp_path, capsys):
    for seed, step in enumerate((0, 1, 2, 4, 8, 16)):
        build(tf, 'gpt_neox', seed).save_pretrained(tmp_path / 'neox' / f'step{step}')
        char_tokenizer(tf, tmp_path / 'neox' / f'step{step}')
    (tmp_path / 'sample.txt').write_text(text(3000), encoding='utf-8')
    out = tmp_path / 'analysis'
    args = ['pretrained', f'--model={tmp_path / "neox"}', '--revisions=' + ','.join(f'step{s}' for s in
            (0, 1, 2, 4, 8, 16)), f'--text={tmp_path / "sample.txt"}', '--n_seqs=2', '--seq_len=16', f'--out={out}']
    assert analyze.main(args) == 0
    summary = json.load(open(out / 'pretrained.json'))['summary']
    assert [(r['rope'], r['ckpts'], r['layers']) for r in summary] == [('after', 6, 2)]
    import test_analyze
    test_analyze.study(tmp_path / 'runs')
    s = analyze.analyze([str(tmp_path / 'runs')], out=str(out), figures=False, log=lambda m: None)
    assert [r['n'] for r in s.tables['claims'] if r['key'] == 'f1-early'] == [1]
    assert 'fig7_pretrained.png' in (out / 'REPORT.md').read_text()


def test_an_unsupported_architecture_names_the_supported_ones_and_windows_carry_special_tokens(tf):
    with pytest.raises(ValueError, match=r"'gptj' is not supported.*gpt2, gpt_neox, opt, llama"):
        tokens.family_of(tf.GPTJConfig())
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(['[UNK]', '[CLS]', '[SEP]', *string.ascii_lowercase,
                                                                  ' '])}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
    tok.post_processor = processors.TemplateProcessing(single='[CLS] $A [SEP]', special_tokens=[('[CLS]', 1),
                                                                                                ('[SEP]', 2)])
    ids = tokens.text_windows(tf.PreTrainedTokenizerFast(tokenizer_object=tok), 'the cat sat on a mat' * 5, 3, 10)
    assert ids.shape == (3, 10) and (ids[:, 0] == 1).all() and (ids[:, -1] == 2).all()


def test_without_transformers_one_line_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'transformers', None)
    assert analyze.main(['pretrained', '--model=gpt2', f'--out={tmp_path}']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'pip install transformers' in err


def test_tokens_merges_by_run_and_reads_the_run_s_cache_without_writing_there(trained, tmp_path, monkeypatch):
    out, runs = tmp_path / 'a', sorted((trained / 'out').iterdir())
    assert analyze.main(['tokens', str(trained / 'out'), f'--out={out}', '--no_figures']) == 0
    before, cache = json.load(open(out / 'tokens.json')), sorted(os.listdir(trained / 'cache'))
    monkeypatch.setattr(tokens.prepare, 'encode', None)   # the run's cache is read: nothing is encoded
    assert analyze.main(['tokens', str(runs[0]), f'--out={out}', '--no_figures']) == 0
    after = json.load(open(out / 'tokens.json'))
    assert sorted(map(json.dumps, after['layers'])) == sorted(map(json.dumps, before['layers']))
    assert len(after['runs']) == 2 and sorted(os.listdir(trained / 'cache')) == cache
    monkeypatch.undo()
    cfg = json.load(open(runs[0] / 'config.json'))
    x = tokens.evaluation_batch(cfg)
    (tmp_path / 'file').write_text('')   # a cache_dir that cannot be made: encoded aside, and removed
    (tmp_path / 'tmp').mkdir()
    monkeypatch.setattr(tokens.tempfile, 'tempdir', str(tmp_path / 'tmp'))
    assert torch.equal(x, tokens.evaluation_batch({**cfg, 'cache_dir': str(tmp_path / 'file' / 'cache')}))
    assert os.listdir(tmp_path / 'tmp') == [] and sorted(os.listdir(tmp_path)) == ['a', 'file', 'tmp']
