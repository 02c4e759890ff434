"""Tests of the token-level analysis (tokens.py, through analyze.py's commands): the trend and link statistics on
planted checkpoint series, `analyze.py tokens` on a real tiny run against what train.py logged, and the
pretrained-family adapters against each model's own weights and attention (tiny random models built from configs:
nothing is downloaded)."""
import itertools
import json
import math
import os
import re
import shlex
import shutil
import string
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
import torch.nn.functional as F

import analyze
import folders
import geometry
import report
import stats
import prepare
import runfolder
import tokens
import train

LOG_STEPS = [0] + [2 ** i for i in range(11)]   # 0, 1, 2, 4, ..., 1024: 12 checkpoints


@pytest.fixture(autouse=True)
def one_thread():
    # small tensors: several threads on a busy machine spin-wait (seen: 1000x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- statistics

def test_contrast_trend_of_a_planted_rise_then_decay():
    x = np.log1p(LOG_STEPS)
    t = tokens.contrast_trend(LOG_STEPS, 5 - (x - math.log1p(32)) ** 2)
    assert t['peak_step'] == 32 and t['peak_position'] == pytest.approx(6 / 11)
    assert t['n_ckpts'] == 12 and t['n_early'] == t['n_late'] == 6   # split at the median log step: 0..16 | 32..1024
    assert t['rho_early'] == pytest.approx(1) and t['rho_late'] == pytest.approx(-1) and t['rise_then_decay']
    assert t['monotonicity'] == pytest.approx((6 - 5) / 11)           # 6 rises, then 5 falls
    rising = tokens.contrast_trend(LOG_STEPS[::-1], x[::-1])           # any input order
    assert rising['rho_all'] == pytest.approx(1) and rising['monotonicity'] == 1
    assert rising['peak_step'] == 1024 and rising['peak_position'] == 1 and not rising['rise_then_decay']
    short = tokens.contrast_trend([0, 1, 4, 16], [1.0, 2.0, 3.0, 2.5])  # 2 early, 2 late: no correlation
    assert math.isnan(short['rho_early']) and math.isnan(short['rho_late']) and short['peak_step'] == 4


def test_permutation_p():
    x = np.arange(20.0)
    assert stats.permutation_p(x, x) == pytest.approx(1 / (1 + stats.N_PERM))
    assert stats.permutation_p(x, -x) == 1.0
    noise = np.random.default_rng(0).normal(size=20)
    assert 0.05 < stats.permutation_p(x, noise) < 0.95
    # against the exact test: all 7! orderings of y, counted by hand; 2000 shuffles land within 4 sigma of it
    x, y = np.arange(7.0), np.array([1.0, 0.0, 3.0, 2.0, 6.0, 4.0, 5.0])
    rho = stats.spearman(x, y)
    exact = np.mean([stats.spearman(x, perm) >= rho - 1e-12 for perm in itertools.permutations(y)])
    assert 0.001 < exact < 0.2
    assert abs(stats.permutation_p(x, y) - exact) < 4 * math.sqrt(exact * (1 - exact) / stats.N_PERM) + 1e-3
    assert math.isnan(stats.permutation_p([1, 2], [1, 2]))


def synthetic_series(model, shape, link, n_layer=3, n_head=4, seed=0):
    """Per-layer and per-head rows of one model's checkpoints at LOG_STEPS: the contrast follows
    shape(log(1 + step)) (plus a layer offset and noise); per head, entropy = link * 0.2 * tok_pr_qk + noise."""
    rng = np.random.default_rng(seed)
    layer_rows, head_rows = [], []
    for step in LOG_STEPS:
        layers = []
        for layer in range(n_layer):
            c = shape(math.log1p(step)) + 0.1 * layer + rng.normal(0, 0.01)
            qk = rng.uniform(1, 8, n_head)
            ent = 2 + link * 0.2 * qk + rng.normal(0, 0.05, n_head)
            layers.append({'tok_pr_q': 10 + c, 'tok_pr_k': 10.0, 'tok_pr_q_head': 3 + c / 2, 'tok_pr_k_head': 3.0,
                           'tok_pr_qk': qk.mean(), 'entropy': ent.mean(), 'entropy_norm': ent.mean() / 3,
                           'tok_pr_q_heads': [3 + c / 2] * n_head, 'tok_pr_k_heads': [3.0] * n_head,
                           'tok_pr_qk_heads': qk.tolist(), 'entropy_heads': ent.tolist(),
                           'entropy_norm_heads': (ent / 3).tolist()})
        rows = tokens.token_rows({'model': model, 'family': 'gpt_neox', 'rope': 'after', 'revision': f'step{step}'},
                                  step, layers)
        layer_rows += rows[0]
        head_rows += rows[1]
    return layer_rows, head_rows


def planted_tables(out, sign):
    """pretrained_* tables of three models whose contrast rises to a peak at step 32 and decays (sign=+1), or
    falls to a trough there and recovers (-1), with a PR_QK ~ entropy link of that sign."""
    layer_rows, head_rows = [], []
    for i, model in enumerate(('m1', 'm2', 'm3')):
        rows = synthetic_series(model, lambda x: sign * (4 - (x - math.log1p(32)) ** 2 / 4), link=sign, seed=i)
        layer_rows += rows[0]
        head_rows += rows[1]
    return tokens.write_token_tables(layer_rows, head_rows, str(out), 'pretrained')


@pytest.mark.parametrize('sign, verdict', [(+1, 'holds'), (-1, 'does not hold')])
def test_planted_token_claims(tmp_path, sign, verdict):
    _, trend, link = planted_tables(tmp_path, sign)
    assert len(trend) == 9 and len(link) == 3 * len(LOG_STEPS)
    assert {r['peak_step'] for r in trend} == ({32} if sign > 0 else {0})   # a trough at 32: the peak is at 0
    assert all((r['rho_early'] > 0.9 and r['rho_late'] < -0.9) == (sign > 0) for r in trend)
    f1, f2 = report.token_claims('pretrained', trend, link)
    assert f1['verdict'] == verdict and f2['verdict'] == verdict
    assert ('rise then decay in 9/9' in f1['value']) == (sign > 0)
    assert f2['value'].startswith('visible in 3/3' if sign > 0 else 'visible in 0/3')


def test_report_picks_up_token_tables(tmp_path, write_run):
    runs, out = tmp_path / 'runs', tmp_path / 'analysis'
    write_run(str(runs), 'L2_normal_s1')
    res = analyze.analyze([str(runs)], out=str(out), figures=False, log=lambda msg: None)
    assert [c['verdict'] for c in res['claims'] if c['claim'].startswith('(f')] == ['not measured'] * 4
    planted_tables(out, +1)
    res = analyze.analyze([str(runs)], out=str(out), figures=False, log=lambda msg: None)
    verdicts = {(report.claim_label(c), c['claim'].split('[')[-1]): c['verdict'] for c in res['claims']}
    assert verdicts[('(f1)', 'pretrained models]')] == verdicts[('(f2)', 'pretrained models]')] == 'holds'
    assert verdicts[('(f1)', 'our checkpoints]')] == 'not measured'
    text = (out / 'REPORT.md').read_text()
    assert '## Token-level analysis' in text and '### pretrained models' in text
    assert report.TREND_RULE in text and report.TOKEN_LINK_RULE in text
    assert '[pretrained_trend.md](pretrained_trend.md)' in text


# ----------------------------------------------------------------------------- our checkpoints

@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, synthetic_text, tiny_config):
    """A real run folder: 16 iterations, 2 layers, 4 model checkpoints (iteration 0, then log-spaced from the end of
    warm-up to 16)."""
    root = tmp_path_factory.mktemp('tokens')
    (root / 'src').mkdir()
    text = root / 'src' / 'corpus.txt'
    text.write_text(synthetic_text(40_000), encoding='utf-8')
    threads = torch.get_num_threads()
    run_dir = train.train(tiny_config(root, str(text)))
    torch.set_num_threads(threads)
    return root, run_dir, str(text)


def test_tokens_match_the_metrics_logged_in_training(tiny_run, capsys):
    root, run_dir, _ = tiny_run
    out = root / 'analysis_match'
    assert analyze.main(['tokens', str(root / 'out'), f'--out={out}', '--device=cpu']) == 0
    assert '1 of 1 runs measured' in capsys.readouterr().out
    logged = {r['iter']: r['layers'] for r in runfolder.read_metrics(os.path.join(run_dir, 'metrics.jsonl'))}
    rows = folders.read_table(out / 'tokens.csv')
    ckpts = sorted(int(name[len('model_'):-len('.pt')]) for name in os.listdir(os.path.join(run_dir, 'models')))
    assert len(ckpts) == 4 and ckpts[0] == 0 and ckpts[-1] == 16
    assert sorted({r['step'] for r in rows}) == ckpts and len(rows) == 4 * 2
    for r in rows:   # the same evaluation batch and weights: the same numbers
        m = logged[r['step']][r['layer']]
        for key in ('tok_pr_q', 'tok_pr_k', 'tok_pr_q_head', 'tok_pr_k_head', 'tok_pr_qk', 'entropy', 'entropy_norm'):
            assert r[key] == pytest.approx(m[key], rel=1e-6, abs=1e-9), key
        assert r['contrast'] == pytest.approx(m['tok_pr_q'] - m['tok_pr_k'], rel=1e-6)
    heads = folders.read_table(out / 'tokens_heads.csv')
    assert len(heads) == 4 * 2 * 2
    for h in heads:
        m = logged[h['step']][h['layer']]
        for key, logged_key in (('tok_pr_qk', 'tok_pr_qk_heads'), ('entropy', 'entropy_heads'),
                                ('tok_pr_k_head', 'tok_pr_k_heads')):
            assert h[key] == pytest.approx(m[logged_key][h['head']], rel=1e-6), key
    trend = folders.read_table(out / 'tokens_trend.csv')
    assert [(r['layer'], r['n_ckpts'], r['first_step'], r['last_step']) for r in trend] == \
        [(0, 4, 0, 16), (1, 4, 0, 16)]
    link = folders.read_table(out / 'tokens_link.csv')
    assert [(r['step'], r['n_pairs'], r['last']) for r in link] == [(it, 4, it == 16) for it in ckpts]
    for name in ('tokens.md', 'tokens_summary.md', 'fig6_tokens.png'):
        assert (out / name).exists(), name
    # the runs report puts the token-level rows in
    res = analyze.analyze([str(root / 'out')], out=str(out), figures=False, log=lambda msg: None)
    f2 = next(c for c in res['claims'] if c['claim'].startswith('(f2)') and 'our checkpoints' in c['claim'])
    assert f2['verdict'] != 'not measured' and 'L2_normal_s1' in f2['value']
    assert '### our checkpoints' in (out / 'REPORT.md').read_text()


def test_the_printed_hint_is_the_exact_command(tiny_run, tmp_path, capsys, monkeypatch):
    root, _, _ = tiny_run
    monkeypatch.chdir(tmp_path)
    for out in (f'{tmp_path}/my results', None):             # a path that needs quoting, then the default --out
        args = ['tokens', str(root / 'out'), '--no_figures', '--device=cpu'] + ([f'--out={out}'] if out else [])
        assert analyze.main(args) == 0
        hint = re.search(r'`(python analyze\.py [^`]*)`', capsys.readouterr().out).group(1)
        assert ('--out' in hint) == bool(out)
        assert analyze.main(shlex.split(hint)[2:] + ['--no_figures']) == 0
        report_path = os.path.join(out or root / 'out' / 'analysis', 'REPORT.md')
        assert '### our checkpoints' in open(report_path).read()
    shutil.rmtree(root / 'out' / 'analysis')                  # the module's run folder as it was


def test_token_tables_count_only_for_the_runs_they_were_made_from(tiny_run, tmp_path, write_run):
    _, run_dir, _ = tiny_run
    study, out = tmp_path / 'A', tmp_path / 'X'
    copy = study / os.path.basename(run_dir)
    shutil.copytree(run_dir, copy)
    assert analyze.main(['tokens', str(study), f'--out={out}', '--device=cpu', '--no_figures']) == 0
    analysis = lambda *dirs: analyze.analyze([str(d) for d in dirs], out=str(out), figures=False, log=lambda m: None)
    f2 = lambda res: next(c for c in res['claims'] if c['key'] == 'f2-tokens')
    token_warnings = lambda res: [w for w in res['warnings'] if 'token tables' in w]
    res = analysis(study)                                       # the runs they were made from: they count
    assert not f2(res)['value'].startswith('no tokens tables') and token_warnings(res) == []
    write_run(str(tmp_path / 'B'), 'L2_normal_s1')
    res = analysis(tmp_path / 'B')                              # another analysis' runs: left out, with a warning
    assert f2(res)['verdict'] == 'not measured' and f2(res)['value'].startswith('no tokens tables')
    assert any('1 run(s) not among these runs' in w and copy.name in w for w in token_warnings(res))
    assert '### our checkpoints' not in (out / 'REPORT.md').read_text()
    added = write_run(str(study), 'L2_normal_s9', seed=9)       # a run added after `tokens` ran: named
    os.makedirs(os.path.join(added, 'models'))
    open(os.path.join(added, 'models', 'model_0000000.pt'), 'wb').close()
    res = analysis(study)
    assert not f2(res)['value'].startswith('no tokens tables')
    assert any('1 of these runs have model checkpoints but no token tables' in w and added in w
               for w in token_warnings(res))
    done = json.loads((copy / 'done.json').read_text())         # the run trained again: its tables no longer count
    (copy / 'done.json').write_text(json.dumps(dict(done, wall_time=done['wall_time'] + 1)))
    res = analysis(study)
    assert f2(res)['verdict'] == 'not measured' and any('trained again' in w for w in token_warnings(res))


def test_fig6_says_not_measured_where_a_series_is_too_short():
    layer_rows, head_rows = synthetic_series('run0', lambda x: x, link=1, seed=0)
    short = [r for r in layer_rows if r['step'] in (0, 4)]        # two checkpoints: no Spearman of any half
    fig = tokens.plot_token_contrast(short, [h for h in head_rows if h['step'] in (0, 4)], lambda r: r['model'], 't')
    title = fig.axes[0].get_title()
    assert 'nan' not in title and 'early not measured' in title and 'late not measured' in title
    fig = tokens.plot_token_contrast(layer_rows, head_rows, lambda r: r['model'], 't')
    assert re.search(r'early [+-]\d\.\d\d, late [+-]\d\.\d\d', fig.axes[0].get_title())


def test_fig6_keeps_every_row_readable(tmp_path):
    layer_rows, head_rows = [], []
    for i in range(10):                                         # ten configurations: three files, four rows at most
        rows = synthetic_series(f'run{i}', lambda x: x, link=1, seed=i)
        layer_rows += rows[0]
        head_rows += rows[1]
    paths = tokens.save_token_figures(layer_rows, head_rows, lambda r: r['model'], str(tmp_path), 'fig6_tokens',
                                      'test', pdf=False)
    assert [os.path.basename(p) for p in paths] == ['fig6_tokens.png', 'fig6_tokens_2.png', 'fig6_tokens_3.png']
    for p in paths:
        with Image.open(p) as im:
            assert im.size[1] <= 1500 and im.size[0] <= 1700     # 100% zoom on a laptop screen, about


def test_tokens_name_a_missing_text_and_the_override(tiny_run, tmp_path, capsys, synthetic_text):
    root, run_dir, text = tiny_run
    moved = tmp_path / 'runs' / 'L2_normal_s1'
    shutil.copytree(run_dir, moved)
    cfg = json.loads((moved / 'config.json').read_text())
    cfg['data_file'] = str(tmp_path / 'gone' / 'corpus.txt')
    (moved / 'config.json').write_text(json.dumps(cfg))
    args = ['tokens', str(tmp_path / 'runs'), '--no_figures', '--device=cpu', f'--out={tmp_path / "res"}']
    assert analyze.main(args) == 1
    captured = capsys.readouterr()
    assert 'gone/corpus.txt' in captured.out and '--data_file=PATH' in captured.out
    assert 'none of the 1 run folders could be measured' in captured.err
    other = tmp_path / 'other.txt'
    other.write_text(synthetic_text(40_000, seed=1), encoding='utf-8')
    assert analyze.main(args + [f'--data_file={other}']) == 1     # another text: other windows, refused
    assert 'SHA-256' in capsys.readouterr().out
    assert analyze.main(args + [f'--data_file={text}']) == 0      # the same text, moved
    assert len(folders.read_table(tmp_path / 'res' / 'tokens.csv')) == 4 * 2


# ----------------------------------------------------------------------------- pretrained families

SMALL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100,
             max_position_embeddings=64, initializer_range=0.3)   # large weights: peaked attention, rotary visible
FAMILY_CONFIGS = {
    'gpt2': ('GPT2Config', dict(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                                initializer_range=0.3, bos_token_id=0, eos_token_id=0)),
    'gpt_neox': ('GPTNeoXConfig', SMALL),                       # partial rotary: a quarter of each head by default
    'opt': ('OPTConfig', dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64, vocab_size=100,
                              max_position_embeddings=64, word_embed_proj_dim=32, init_std=0.3)),
    'llama': ('LlamaConfig', dict(SMALL, num_key_value_heads=2)),   # GQA: 2 query heads per key head
    'mistral': ('MistralConfig', dict(SMALL, num_key_value_heads=1)),
    'qwen2': ('Qwen2Config', dict(SMALL, num_key_value_heads=2)),
    'bert': ('BertConfig', SMALL),                              # bidirectional
    'roberta': ('RobertaConfig', SMALL),
}


@pytest.fixture
def tf():
    return pytest.importorskip('transformers', reason='the pretrained-family tests need transformers')


def build(tf, name, seed=0):
    torch.manual_seed(seed)
    cls, kw = FAMILY_CONFIGS[name]
    return tf.AutoModel.from_config(getattr(tf, cls)(**kw), attn_implementation='eager').eval()


def reference_qk(name, model, hidden, layer):
    """q and k before any rotary embedding, from the model's weights and the hidden states entering the layer."""
    C, H = model.config.hidden_size, model.config.num_attention_heads
    if name == 'gpt2':
        block = model.h[layer]
        qkv = block.ln_1(hidden) @ block.attn.c_attn.weight + block.attn.c_attn.bias   # Conv1D weight: (in, out)
        return qkv[..., :C], qkv[..., C:2 * C]
    if name == 'gpt_neox':
        block = model.layers[layer]
        lin = block.attention.query_key_value
        W, b = lin.weight.view(H, 3, C // H, C), lin.bias.view(H, 3, C // H)   # head by head: q_h, k_h, v_h
        x = block.input_layernorm(hidden)
        return tuple(F.linear(x, W[:, j].reshape(C, C), b[:, j].reshape(C)) for j in (0, 1))
    if name == 'opt':
        block = model.decoder.layers[layer]
        x, (q, k) = block.self_attn_layer_norm(hidden), (block.self_attn.q_proj, block.self_attn.k_proj)
    elif name in ('bert', 'roberta'):
        attn = model.encoder.layer[layer].attention.self
        x, (q, k) = hidden, (attn.query, attn.key)                 # post-LN: the layer input goes straight in
    else:
        block = model.layers[layer]
        x, (q, k) = block.input_layernorm(hidden), (block.self_attn.q_proj, block.self_attn.k_proj)
    return F.linear(x, q.weight, q.bias), F.linear(x, k.weight, k.bias)


def attention_from(q, k, n_head, causal):
    """softmax(q_h k_h'^T / sqrt(d)) with Q head h on K head h' = h // (n_head / n_kv), masked if causal."""
    B, T, _ = q.shape
    d = q.shape[-1] // n_head
    n_kv = k.shape[-1] // d
    qh = q.view(B, T, n_head, d).transpose(1, 2)
    kh = k.view(B, T, n_kv, d).transpose(1, 2)[:, torch.arange(n_head) // (n_head // n_kv)]
    logits = qh @ kh.transpose(-2, -1) / math.sqrt(d)
    if causal:
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
    return logits.softmax(-1)


@pytest.mark.parametrize('name', FAMILY_CONFIGS)
def test_captured_queries_keys_and_attention_are_the_model_s(tf, name):
    model = build(tf, name)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    _, fam = tokens.family_of(model.config)
    H, T = model.config.num_attention_heads, ids.shape[1]
    layers, atts = tokens.capture_qk(model, ids, ('after', 'before'))
    metrics = tokens.pretrained_tokens(model, ids)
    assert len(layers) == len(metrics) == 2
    for layer, (variants, att, m) in enumerate(zip(layers, atts, metrics)):
        assert set(variants) == ({'after', 'before'} if fam.rotary else {'none'})
        model_att = out.attentions[layer]
        torch.testing.assert_close(att, model_att)
        projected = variants['before' if fam.rotary else 'none']   # what the projections output
        with torch.no_grad():
            ref_q, ref_k = reference_qk(name, model, out.hidden_states[layer], layer)
        torch.testing.assert_close(projected[0], ref_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(projected[1], ref_k, atol=1e-5, rtol=1e-5)
        used = variants['after' if fam.rotary else 'none']          # what the attention uses
        torch.testing.assert_close(attention_from(*used, H, fam.causal), model_att, atol=1e-5, rtol=1e-4)
        if fam.rotary:  # the rotation matters: the projected vectors alone do not give the model's attention
            assert (attention_from(*projected, H, True) - model_att).abs().max() > 1e-3
        (g,) = m.values()
        if fam.causal:
            assert g['entropy'] == pytest.approx(geometry.mean_attention_entropy(model_att), rel=1e-9)
            assert g['entropy_norm'] == pytest.approx(geometry.mean_attention_entropy(model_att, True), rel=1e-9)
        else:   # every row over all T keys, row 0 included, normalised by log T
            a = model_att.double()
            H_rows = -(a * a.log()).sum(-1)
            assert g['entropy'] == pytest.approx(H_rows.mean().item(), rel=1e-6)   # float32 probabilities
            assert g['entropy_norm'] == pytest.approx(H_rows.mean().item() / math.log(T), rel=1e-6)
            assert g['entropy_heads'] == pytest.approx(H_rows.mean((0, 2)).tolist(), rel=1e-6)
        assert g['entropy'] < 0.9 * math.log(T)   # peaked attention: the checks above are not about uniform rows
        # PRs of the vectors used; GQA's expanded keys have the PR of the n_kv heads themselves
        assert g['tok_pr_q'] == pytest.approx(geometry.activation_pr(used[0].reshape(-1, used[0].shape[-1])), rel=1e-9)
        assert g['tok_pr_k'] == pytest.approx(geometry.activation_pr(used[1].reshape(-1, used[1].shape[-1])), rel=1e-9)
        assert g['tok_pr_qk'] == pytest.approx(logit_pr(*used, H), rel=1e-6)


def logit_pr(q, k, n_head):
    """Mean over sequences and heads of the PR of the singular values of Q_h K_h'^T / sqrt(d), by SVD, with
    Q head h on K head h' = h // (n_head / n_kv): checks the GQA pairing."""
    B, T, _ = q.shape
    d = q.shape[-1] // n_head
    n_kv = k.shape[-1] // d
    qh = q.double().view(B, T, n_head, d).transpose(1, 2)
    kh = k.double().view(B, T, n_kv, d).transpose(1, 2)
    prs = []
    for b in range(B):
        for h in range(n_head):
            s2 = torch.linalg.svdvals(qh[b, h] @ kh[b, h // (n_head // n_kv)].T / math.sqrt(d)) ** 2
            prs.append((s2.sum() ** 2 / (s2 ** 2).sum()).item())
    return float(np.mean(prs))


def test_unsupported_architecture_names_the_supported_ones(tf):
    model = tf.AutoModel.from_config(tf.GPTJConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                                                   rotary_dim=4, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match=r"'gptj' is not supported.*gpt2, gpt_neox, opt, llama"):
        tokens.pretrained_tokens(model, torch.zeros(1, 4, dtype=torch.long))


def test_pretrained_without_transformers_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'transformers', None)   # import transformers now fails
    assert analyze.main(['pretrained', '--model=gpt2', f'--out={tmp_path}']) == 2
    assert 'pip install transformers' in capsys.readouterr().err


def test_the_sample_text_defaults_to_wikitext_test_in_train_s_data_dir(tf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)                                # a clone with no data beside it
    where = os.path.join('data', 'wikitext-103-raw', 'wiki.test.raw')
    assert analyze.main(['pretrained', '--model=gpt2', f'--out={tmp_path / "res"}']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and where in err and '--text=FILE' in err and 'shared' not in err
    os.makedirs(os.path.dirname(where))
    with open(where, 'w', encoding='utf-8') as f:
        f.write('some text ' * 20_000)
    text, said = tokens.sample_text()
    assert len(text) == tokens.SAMPLE_CHARS and where in said


def test_tokens_py_help_prints_the_usage():
    done = subprocess.run([sys.executable, 'tokens.py', '--help'], cwd=os.path.dirname(os.path.abspath(__file__)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith('usage:') and '--data_file' in done.stdout
    assert 'shared' not in done.stdout


def char_tokenizer(tf, folder=None, special=False):
    """A character-level tokenizer (a fast tokenizer built offline), saved to folder if given."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {c: i for i, c in enumerate(['[UNK]', '[CLS]', '[SEP]'] + sorted(string.ascii_letters + ' .'))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
    if special:
        tok.post_processor = processors.TemplateProcessing(single='[CLS] $A [SEP]',
                                                           special_tokens=[('[CLS]', 1), ('[SEP]', 2)])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='[UNK]')
    if folder:
        fast.save_pretrained(folder)
    return fast


def test_text_windows_wrap_each_window_in_the_special_tokens(tf, synthetic_text):
    tok, text = char_tokenizer(tf, special=True), synthetic_text(200)
    ids = tokens.text_windows(tok, text, n_seqs=3, seq_len=10)
    assert ids.shape == (3, 10) and (ids[:, 0] == 1).all() and (ids[:, -1] == 2).all()
    assert ids[:, 1:-1].flatten().tolist() == tok(text, add_special_tokens=False)['input_ids'][:24]
    short = tokens.text_windows(tok, text[:5], n_seqs=3, seq_len=10)   # shorter than a window: one, unpadded
    assert short.tolist() == [[1] + tok(text[:5], add_special_tokens=False)['input_ids'] + [2]]
    plain = tokens.text_windows(char_tokenizer(tf), text, n_seqs=2, seq_len=10)
    assert plain.flatten().tolist() == tok(text, add_special_tokens=False)['input_ids'][:20]


def test_pretrained_command_on_local_checkpoint_series(tf, tmp_path, capsys, synthetic_text, write_run):
    steps = (0, 1, 2, 4, 8, 16)
    series = tmp_path / 'neox-tiny'   # a series saved as one folder per revision, as a user would keep Pythia's
    for seed, step in enumerate(steps):
        build(tf, 'gpt_neox', seed).save_pretrained(series / f'step{step}')
        char_tokenizer(tf, series / f'step{step}')
    text, out = tmp_path / 'sample.txt', tmp_path / 'analysis'
    text.write_text(synthetic_text(2000), encoding='utf-8')
    common = [f'--text={text}', '--n_seqs=2', '--seq_len=16', f'--out={out}', '--device=cpu']
    neox = ['pretrained', f'--model={series}', '--revisions=' + ','.join(f'step{s}' for s in steps), '--rope=both']
    assert analyze.main(neox + common) == 0
    assert 'windows of 16 tokens' in capsys.readouterr().out
    trend = folders.read_table(out / 'pretrained_trend.csv')
    assert sorted((r['rope'], r['layer']) for r in trend) == [('after', 0), ('after', 1), ('before', 0), ('before', 1)]
    assert all((r['n_ckpts'], r['n_early'], r['n_late'], r['family']) == (6, 3, 3, 'gpt_neox') for r in trend)
    link = folders.read_table(out / 'pretrained_link.csv')
    assert len(link) == 2 * 6 and [r['step'] for r in link if r['last']] == [16, 16]
    rows = folders.read_table(out / 'pretrained.csv')
    assert sorted({(r['step'], r['revision']) for r in rows}) == [(s, f'step{s}') for s in steps]
    # a second model is added to the tables; running the first again replaces its rows
    gpt2 = tmp_path / 'gpt2-tiny'
    build(tf, 'gpt2').save_pretrained(gpt2)
    char_tokenizer(tf, gpt2)
    assert analyze.main(['pretrained', f'--model={gpt2}', '--no_figures'] + common) == 0
    assert analyze.main(neox + common) == 0
    rows = folders.read_table(out / 'pretrained.csv')
    assert len(rows) == 6 * 2 * 2 + 2 and {(r['model'], r['rope']) for r in rows if r['family'] == 'gpt2'} == \
        {(str(gpt2), 'none')}
    assert (out / 'fig7_pretrained.png').exists() and (out / 'pretrained_summary.md').exists()
    # the runs report reads them: (f1) from the series after rotary only (one model, two layers)
    write_run(str(tmp_path / 'runs'), 'L2_normal_s1')
    res = analyze.analyze([str(tmp_path / 'runs')], out=str(out), figures=False, log=lambda msg: None)
    f1 = next(c for c in res['claims'] if c['claim'].startswith('(f1)') and 'pretrained' in c['claim'])
    assert 'over 2 series of 1 model(s)' in f1['value']
    assert 'fig7_pretrained.png' in (out / 'REPORT.md').read_text()


def test_the_evaluation_batch_of_a_wikitext103_test_run_needs_only_wiki_test_raw(tmp_path, synthetic_text):
    """A run trained with --dataset=wikitext103-test is rebuilt from data_dir/wiki.test.raw alone, the same
    windows as train.py's; without that file it is skipped naming it."""
    data_dir = tmp_path / 'wt'
    data_dir.mkdir()
    (data_dir / 'wiki.test.raw').write_text(synthetic_text(20_000), encoding='utf-8')
    cfg = train.get_config(['--dataset=wikitext103-test', f'--data_dir={data_dir}', f'--cache_dir={tmp_path / "c"}',
                            '--block_size=16', '--eval_windows=2', '--min_char_count=1'])
    _, val, _ = prepare.prepare_data(cfg)
    assert torch.equal(tokens.evaluation_batch(cfg), train.eval_batch(val, cfg)[0])
    os.remove(data_dir / 'wiki.test.raw')
    with pytest.raises(folders.Skip, match='wiki.test.raw'):
        tokens.evaluation_batch(cfg)
