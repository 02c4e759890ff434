"""control.py: the spectrum transform, the shrink and freeze schedules, apply on small weights, and
the control inside a tiny training run."""
import csv
import os
import re
import shutil
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import control
import geometry
from conftest import REPO, run_train, tiny_args


def control_spectrum(s, target_pr, keep='fro'):
    """control._control on one spectrum s (n,), values below n * eps(float64) * max(s) counting as
    zero: returns (s' float64, alpha float)."""
    s = torch.as_tensor(s, dtype=torch.float64)
    target = torch.tensor(target_pr, dtype=torch.float64)
    s_new, alpha = control._control(s, target, len(s) * torch.finfo(torch.float64).eps, keep)[:2]
    return s_new, alpha.item()


def reachable_pr(s):
    """(pr_min, pr_max) that s^alpha covers, with control_spectrum's zero threshold."""
    s = torch.as_tensor(s, dtype=torch.float64)
    return tuple(pr.item() for pr in control._reach(s, len(s) * torch.finfo(torch.float64).eps)[2:])


def ctl_cfg(**overrides):
    cfg = dict(control='shrink', control_target='k', control_scope='head', control_layers='',
               shrink_to=0.5,
               shrink_iters=10, control_interval=1, control_keep='fro', n_head=4)
    return {**cfg, **overrides}


def make_qk(n_layer=3, C=32, seed=0, dtype=torch.float32):
    """W_Q, W_K pairs of nn.Linear weights, as model.qk_weights() returns them."""
    torch.manual_seed(seed)
    return [(torch.nn.Linear(C, C, bias=False).to(dtype).weight,
             torch.nn.Linear(C, C, bias=False).to(dtype).weight)
            for _ in range(n_layer)]


def pr(s):
    return geometry.participation_ratio(torch.as_tensor(s, dtype=torch.float64) ** 2)


def random_spectrum(seed):
    """A descending spectrum of one of several shapes: spread, power law, near-flat, with exact
    ties, or rank-deficient (exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 48, (1,), generator=g))
    kind = seed % 5
    if kind == 0:
        s = torch.rand(n, generator=g, dtype=torch.float64)
    elif kind == 1:
        power = 3 * torch.rand(1, generator=g, dtype=torch.float64)
        s = torch.arange(1, n + 1, dtype=torch.float64) ** -power
    elif kind == 2:
        s = 1 + 1e-3 * torch.rand(n, generator=g, dtype=torch.float64)
    elif kind == 3:
        s = torch.rand(n, generator=g, dtype=torch.float64)
        # the top value repeated: the lowest reachable PR is its multiplicity
        s[: 1 + n // 4] = s.max()
    else:
        s = torch.exp(3 * torch.randn(n, generator=g, dtype=torch.float64))
        s[torch.randperm(n, generator=g)[: n // 2]] = 0.0
    # 1e-4 .. 1e4: scale-free
    scale = 10 ** (8 * torch.rand(1, generator=g, dtype=torch.float64) - 4)
    return (scale * s).sort(descending=True).values


# ----------------------------------------------------------------------------- the transform

def np_control(s, target, keep):
    """An independent numpy reference of the transform: bisection on alpha itself (geometric
    midpoints), the PR from its definition, then c from the kept quantity."""
    s = np.asarray(s, dtype=np.float64)
    nz = s > len(s) * np.finfo(np.float64).eps * s.max()
    x = s[nz] / s[nz].max()

    def pr_of(alpha):
        lam = x ** (2 * alpha)
        return lam.sum() ** 2 / (lam ** 2).sum()
    lo, hi = 1e-13, 1e13
    for _ in range(300):
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if pr_of(mid) > target else (lo, mid)
    xa = x ** np.sqrt(lo * hi)
    c = s.max() if keep == 'spec' else np.sqrt((s[nz] ** 2).sum() / (xa ** 2).sum())
    out = s.copy()
    out[nz] = c * xa
    return out


@pytest.mark.parametrize('keep', ['fro', 'spec'])
@pytest.mark.parametrize('seed', range(60))
def test_transform_hits_target_keeps_its_quantity_is_a_power_and_matches_numpy(seed, keep):
    s = random_spectrum(seed)
    pr_min, pr_max = reachable_pr(s)
    # shrinking and growing targets, inside the reachable range (the ends are tested on their own)
    frac = 0.02 + 0.96 * torch.rand(1, generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.float64).item()
    target = pr_min + (pr_max - pr_min) * frac
    s_new, alpha = control_spectrum(s, target, keep=keep)
    assert abs(pr(s_new) - target) <= 1e-10 * target
    if keep == 'fro':
        assert abs((s_new ** 2).sum() - (s ** 2).sum()) <= 1e-10 * (s ** 2).sum()
    else:
        assert abs(s_new.max() - s.max()) <= 1e-10 * s.max()
    assert torch.equal(s_new[s == 0], s[s == 0])   # zeros stay zero
    nz = s > 0
    assert alpha > 0 and torch.all(s_new[nz] > 0)
    # s' = c s^alpha, checked as ratios to the top value (s^alpha alone can overflow: alpha reaches
    # 1e3 here)
    assert torch.allclose(s_new[nz] / s_new[0], (s[nz] / s[0]) ** alpha, rtol=1e-9, atol=1e-300)
    ref = torch.from_numpy(np_control(s.numpy(), target, keep))
    assert torch.allclose(s_new, ref, rtol=1e-8, atol=1e-12 * s.max().item())


def test_out_of_reach_targets_clamp_to_rank_and_top_multiplicity():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert reachable_pr(s)[1] == 3.0   # rank-deficient: the reachable maximum is the rank
    high, _ = control_spectrum(s, 10.0)
    assert abs(pr(high) - 3.0) < 1e-9
    assert torch.allclose(high[:3], high[0].expand(3)) and torch.all(high[3:] == 0)
    low, _ = control_spectrum(s, 0.5)     # below 1: no spectrum has it
    assert abs(pr(low) - 1.0) < 1e-9 and abs((low ** 2).sum() - 14.0) < 1e-9
    tied = torch.tensor([2.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    low, _ = control_spectrum(tied, 1.2)  # the top value twice: PR >= 2
    assert abs(pr(low) - 2.0) < 1e-9


@pytest.mark.parametrize('s', [torch.ones(8), torch.tensor([2.0, 2.0, 2.0, 0.0]), torch.zeros(5)])
@pytest.mark.parametrize('target', [0.5, 2.5, 100.0])
def test_flat_spectrum_is_left_as_it_is(s, target):
    s_new, alpha = control_spectrum(s, target)
    assert torch.equal(s_new, s.double()) and alpha == 1.0


# ------------------------------------------------------------------------ control_keep: fro or spec

def _planted(C=24, seed=0):
    """U, s, V of a float64 (C, C) weight U diag(s) V^T: random orthogonal U, V, a descending
    spectrum s."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(C, C, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(C, C, generator=g, dtype=torch.float64)).Q
    return U, torch.rand(C, generator=g, dtype=torch.float64).sort(descending=True).values, V


@pytest.mark.parametrize('scope', ['head', 'layer'])
@pytest.mark.parametrize('control_name', ['shrink', 'freeze'])
def test_apply_spec_keeps_each_blocks_top_singular_value_and_only_its_scale_differs(
        scope, control_name):
    """spec and fro use the same alpha (PR is scale-free), so their results differ by one factor per
    block: the top singular value (spec) against the Frobenius norm (fro)."""
    results = {}
    for keep in ('fro', 'spec'):
        U, s, V = _planted(seed=5)
        W = U @ torch.diag(s) @ V.T
        qk = [(torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone()))]
        cfg = ctl_cfg(control=control_name, control_scope=scope, control_keep=keep, shrink_to=0.4,
                      shrink_iters=0)
        state = control.record(cfg, qk)
        if control_name == 'freeze':   # a rank-1 push, so that freeze has a PR to restore
            with torch.no_grad():
                qk[0][1].add_(0.3 * W[:, :1] @ W[:1, :] / W[:1].norm())
        before = control._blocks(qk[0][1], scope, 4)
        control.apply(state, cfg, qk, 1)
        after = control._blocks(qk[0][1], scope, 4)
        top, fro = (lambda b: torch.linalg.matrix_norm(b, ord=2)), (lambda b: b.norm(dim=(-2, -1)))
        kept = top if keep == 'spec' else fro
        assert torch.allclose(kept(after), kept(before), rtol=1e-10, atol=0)
        want = control.target_pr(state, cfg, 1)[0]
        assert torch.allclose(geometry.matrix_pr(after), want, rtol=1e-6, atol=0)
        results[keep] = after
    ratio = results['spec'] / results['fro']   # one factor per block
    factor = ratio.flatten(1)[:, :1, None]
    assert torch.allclose(ratio, factor.expand_as(ratio), rtol=1e-9)
    # a narrower spectrum at the same Frobenius norm has a larger top value
    if control_name == 'shrink':
        assert torch.all(factor < 1)


# ----------------------------------------------------------------------------- the schedules

def test_shrink_falls_linearly_then_stays_freeze_is_constant_and_none_has_no_target():
    cfg = ctl_cfg(shrink_to=0.25, shrink_iters=100)
    assert control.target_pr(8.0, cfg, 0) == 8.0
    for step, want in ((50, 5.0), (100, 2.0), (10_000, 2.0)):
        assert control.target_pr(8.0, cfg, step) == pytest.approx(want)
    assert control.target_pr([[8.0, 4.0]], cfg, 100)[0] == pytest.approx([2.0, 1.0])
    assert torch.allclose(control.target_pr(torch.tensor([8.0, 4.0]), cfg, 100),
                          torch.tensor([2.0, 1.0]))
    assert control.target_pr(8.0, ctl_cfg(shrink_to=0.25, shrink_iters=0), 0) == pytest.approx(2.0)
    assert [control.target_pr(8.0, ctl_cfg(control='freeze'), step)
            for step in (0, 1, 10 ** 6)] == [8.0] * 3
    with pytest.raises(ValueError, match='no target'):
        control.target_pr(8.0, ctl_cfg(control='none'), 1)


def test_shrink_never_raises_a_pr_already_below_its_target():
    qk = make_qk(n_layer=1, C=32, seed=1)
    cfg = ctl_cfg(shrink_iters=1000)
    state = control.record(cfg, qk)
    # heads 0 and 1 sharpened far below the target, heads 2 and 3 as they were
    with torch.no_grad():
        wk = qk[0][1]
        wk[:16] = wk[:16] + 2 * wk[:1].abs().max() * torch.randn(16, 1) @ torch.randn(1, 32)
    before = qk[0][1].detach().clone()
    heads_before = geometry.matrix_pr(geometry.split_heads(before, 4))
    target = control.target_pr(state, cfg, 1)[0]
    assert torch.all(heads_before[:2] < target[:2])
    control.apply(state, cfg, qk, 1)
    assert torch.equal(qk[0][1][:16], before[:16])   # below the target: bit for bit
    heads_after = geometry.matrix_pr(geometry.split_heads(qk[0][1], 4))
    for h in range(4):
        assert heads_after[h] <= target[h] * (1 + 1e-5)


@pytest.mark.parametrize('direction', ['sharpen', 'spread'])
def test_freeze_restores_the_step0_pr_both_ways(direction):
    qk = make_qk(n_layer=2, C=32, seed=2)
    with torch.no_grad():   # start from a mid-range spectrum, so that both directions are open
        for _, wk in qk:
            wk.mul_(torch.logspace(0, -1, 32)[None, :])
    for scope in ('head', 'layer'):
        cfg = ctl_cfg(control='freeze', control_scope=scope)
        state = control.record(cfg, qk)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, wk in qk:
                if direction == 'sharpen':   # a strong rank-1 push lowers every PR
                    wk.add_(0.5 * torch.randn(32, 1, generator=g) @ torch.randn(1, 32, generator=g))
                else:                        # isotropic noise raises it
                    wk.add_(0.5 * torch.randn(32, 32, generator=g))
        moved = [geometry.matrix_pr(control._blocks(wk, scope, 4)) for _, wk in qk]
        pr0 = state['pr0']
        assert all(((m < p) if direction == 'sharpen' else (m > p)).all() for m,
                   p in zip(moved, pr0))
        control.apply(state, cfg, qk, 1)
        for (_, wk), p in zip(qk, pr0):
            assert torch.allclose(geometry.matrix_pr(control._blocks(wk, scope, 4)), p, rtol=1e-5,
                                  atol=0)
        assert torch.allclose(state['pr'], pr0, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- apply on weights

def test_apply_keeps_singular_vectors_and_norm_float64():
    """W' = U diag(s') V^T with the original U and V, reaching the target, for random and
    rank-deficient W."""
    for seed in range(10):
        U, s, V = _planted(seed=seed)
        if seed % 2:
            s[12:] = 0.0   # rank-deficient
        W = U @ torch.diag(s) @ V.T
        qk = [(torch.nn.Parameter(W.clone()), torch.nn.Parameter(W.clone()))]
        for factor, control_name in ((0.4, 'shrink'), (1.0, 'freeze')):
            cfg = ctl_cfg(control=control_name, control_scope='layer', shrink_to=factor,
                          shrink_iters=0)
            state = control.record(cfg, qk)
            # spread the spectrum (same U, V) so that freeze must lower it back
            if control_name == 'freeze':
                with torch.no_grad():
                    qk[0][1].copy_(U @ torch.diag(s.sqrt() * s[0].sqrt()) @ V.T)
            norm = qk[0][1].detach().norm()
            control.apply(state, cfg, qk, 1)
            W_new = qk[0][1].detach()
            core = U.T @ W_new @ V
            off = core - torch.diag(core.diagonal())
            assert off.abs().max() <= 1e-12 * core.abs().max()
            assert torch.all(core.diagonal()[s == 0].abs() <= 1e-12 * core.abs().max())
            assert abs(W_new.norm() - norm) <= 1e-9 * norm
            target = factor * state['pr0'][0][0]
            assert abs(geometry.matrix_pr(W_new) - target) <= 1e-6 * state['pr0'][0][0]


@pytest.mark.parametrize('overrides, moved', [   # moved: per layer, whether (W_Q, W_K) changed
    (dict(control_target='k'), [(False, True)] * 3),
    (dict(control_target='q'), [(True, False)] * 3),
    (dict(control='none'), [(False, False)] * 3),
    (dict(control_layers='1'), [(False, False), (False, True), (False, False)])])
def test_control_moves_only_its_target_in_its_layers_and_reports_those(overrides, moved):
    qk = make_qk()
    before = [(wq.detach().clone(), wk.detach().clone()) for wq, wk in qk]
    cfg = ctl_cfg(shrink_iters=1, **overrides)
    state = control.record(cfg, qk)
    for step in range(1, 4):
        control.apply(state, cfg, qk, step)
    assert [tuple(not torch.equal(w, b) for w, b in zip(*pairs))
            for pairs in zip(qk, before)] == moved
    rows = control.report(state)
    assert [row != {} for row in rows] == [any(m) for m in moved]
    for layer, pr0 in zip(state['layers'], state['pr0']):   # shrink_to=0.5: the mean head PR halves
        assert rows[layer]['ctl_pr'] < 0.6 * pr0.mean().item()


def test_bf16_weights_reach_their_target():
    """The zero threshold is the float64 eigensolver's round-off, not the weight's: bf16's (eps
    2^-7, times 64 wide) would count every value below s_max / 2 as zero, and miss the target by
    20%."""
    qk = make_qk(n_layer=1, C=64, seed=7, dtype=torch.bfloat16)
    cfg = ctl_cfg(shrink_iters=0)
    state = control.record(cfg, qk)
    control.apply(state, cfg, qk, 1)
    assert torch.allclose(state['pr'], state['target_pr'], rtol=1e-3, atol=0)


def test_a_control_step_launches_no_more_kernels_than_a_training_step(capsys):
    """bench.py --overhead counts each step's aten operations (about one GPU kernel each); the
    counts do not depend on the widths, so a narrow model of the paper's 4 layers stands for the
    paper shape."""
    import bench
    bench.main(['--overhead', '--device=cpu', '--n_embd=32', '--n_head=2', '--block_size=32',
                '--batch_size=4',
                '--eval_windows=2', '--repeats=1'])
    counts = dict(re.findall(r'(training|control) step (\d+)', capsys.readouterr().out))
    assert 0 < int(counts['control']) <= int(counts['training'])


@pytest.mark.parametrize('scope, blocks', [('head', lambda w: geometry.split_heads(w, 4)),
                                           ('layer', lambda w: w[None])])   # one block: the matrix
def test_scope_reaches_each_blocks_target_and_reports_it(scope, blocks):
    qk = make_qk(seed=4)
    cfg = ctl_cfg(control_scope=scope, shrink_to=0.4, shrink_iters=4)
    state = control.record(cfg, qk)
    control.apply(state, cfg, qk, 2)
    for (_, wk), p0, row in zip(qk, state['pr0'], control.report(state)):
        target = 0.7 * p0   # step 2 of 4: halfway from 1 x pr0 to 0.4 x pr0
        assert torch.allclose(geometry.matrix_pr(blocks(wk)), target, rtol=1e-5, atol=0)
        heads = ['ctl_target_pr_heads', 'ctl_pr_heads'] if scope == 'head' else []
        assert set(row) == {'ctl_target_pr', 'ctl_pr', *heads}
        assert row['ctl_target_pr'] == pytest.approx(target.mean().item(), rel=1e-12)
        assert row['ctl_pr'] == pytest.approx(target.mean().item(), rel=1e-5)
        if heads:
            assert row['ctl_target_pr_heads'] == pytest.approx(target.tolist(), rel=1e-12)
            assert row['ctl_pr_heads'] == pytest.approx(target.tolist(), rel=1e-5)
            assert row['ctl_pr'] == pytest.approx(sum(row['ctl_pr_heads']) / 4, rel=1e-12)


def test_out_of_reach_target_clamps_and_warns_once_per_run():
    qk = make_qk(n_layer=2, seed=6)
    # every head's target falls below 1: out of reach
    cfg = ctl_cfg(shrink_to=0.01, shrink_iters=1)
    state = control.record(cfg, qk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for step in range(1, 4):
            control.apply(state, cfg, qk, step)
            # the warning comes with the record, which reads the state on the host
            control.report(state)
    assert len(caught) == 1 and 'out of reach' in str(caught[0].message) and state['warned']
    # clamped to (about) rank 1
    assert all(abs(p - 1) < 1e-3 for layer in state['pr'] for p in layer)


@pytest.mark.parametrize('name, scope', [('shrink', 'head'), ('freeze', 'layer')])
def test_a_control_step_and_a_record_copy_to_the_host_only_the_record_s_values(
        monkeypatch, name, scope):
    """On a GPU each host copy stalls the device: a control step makes none but its timing's syncs
    (Tensor.cpu, .item, .tolist, .numpy and bool() of a tensor raise inside it), and a geometry
    record makes one .tolist of its finished values."""
    import train
    torch.manual_seed(0)
    model = train.GPT(train.GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=4, n_embd=32))
    cfg = ctl_cfg(control=name, control_scope=scope, shrink_iters=2)
    state = control.record(cfg, model.qk_weights())
    w0 = torch.stack([torch.stack(p) for p in model.qk_weights()])
    x = torch.randint(20, (2, 8))
    for method in ('cpu', 'item', 'tolist', 'numpy', '__bool__'):
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, m=method,
                            **k: pytest.fail(f'a host copy: Tensor.{m}'))
    syncs, run = [], types.SimpleNamespace(cfg=cfg, ctl=state, model=model, dev='cuda', t_ctl=0.0)
    # timed between two syncs
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: syncs.append(a))
    for step in (1, 2, 3):
        with torch.no_grad():
            # a move for the control to undo
            model.qk_weights()[0][1].add_(0.01 * torch.ones(32, 32))
        train.control_step(run, step)
    assert len(syncs) == 6 and run.t_ctl > 0
    monkeypatch.undo()
    tolist, copies = torch.Tensor.tolist, []
    monkeypatch.setattr(torch.Tensor, 'tolist', lambda t: copies.append('tolist') or tolist(t))
    loss, layers = train.measure_geometry(model, x, x, 4, w0)
    assert copies == ['tolist'] and len(layers) == 2 and isinstance(loss, float)
    assert layers[0] == {**geometry.layer_geometry(*model.qk_weights()[0], 4), **layers[0]}


# -------------------------------------------------------------------------- control inside train.py

@pytest.fixture
def train_run(tmp_path, text_file):
    """train_run(*extra): a 24-iteration tiny run in tmp_path; returns its folder and records."""
    import train
    from conftest import records, tiny_args

    def run(*extra):
        args = tiny_args(tmp_path, text_file, '--max_iters=24', *extra)
        run_dir = train.train(train.get_config(args))
        return run_dir, records(run_dir)
    return run


def _snapshot_heads(run_dir, it, side):
    snap = np.load(os.path.join(run_dir, 'snapshots', f'qk_{it:07d}.npz'))
    return [geometry.matrix_pr(geometry.split_heads(w, int(snap['n_head']))).tolist()
            for w in snap[side]]


def test_freeze_in_training_holds_the_step0_pr_at_every_logged_iteration(tmp_path, train_run):
    run_dir, rows = train_run('--control=freeze', '--lr=1e-2')
    pr0 = _snapshot_heads(run_dir, 0, 'k')
    for row in rows:
        for layer, (want, got) in enumerate(zip(pr0, _snapshot_heads(run_dir, row['iter'], 'k'))):
            assert got == pytest.approx(want, rel=1e-5), (row['iter'], layer)
            # the log keeps 7 significant digits (runfolder.DIGITS)
            assert row['layers'][layer]['ctl_pr_heads'] == pytest.approx(got, rel=1e-6)
    # W_Q is free: its PR moves
    q0, q24 = _snapshot_heads(run_dir, 0, 'q'), _snapshot_heads(run_dir, 24, 'q')
    assert max(abs(a - b) / a for a, b in zip(sum(q0, []), sum(q24, []))) > 0.05


def test_control_keep_reaches_train_py(tmp_path, train_run):
    """Both keeps hit the same PR targets; spec leaves the largest logits smaller than fro does
    (shrinking the PR at a fixed Frobenius norm raises the top singular value), so the runs differ
    in qk_spec_norm."""
    runs = {keep: train_run('--control=shrink', '--shrink_iters=8', '--shrink_to=0.3',
                            f'--control_keep={keep}',
                            f'--run_name={keep}')[1] for keep in ('fro', 'spec')}
    for fro_row, spec_row in zip(runs['fro'], runs['spec']):
        for a, b in zip(fro_row['layers'], spec_row['layers']):
            assert a['ctl_target_pr'] == pytest.approx(b['ctl_target_pr'], rel=1e-9)
    # the record at iteration 0: the target is pr0
    pr0 = runs['fro'][0]['layers'][0]['ctl_target_pr_heads']
    # a record at iteration i follows control step i: the schedule at step i
    for row in runs['fro']:
        want = [p * (1 - 0.7 * min(row['iter'] / 8, 1)) for p in pr0]
        # the log keeps 7 significant digits (runfolder.DIGITS)
        assert row['layers'][0]['ctl_target_pr_heads'] == pytest.approx(want, rel=1e-6), row['iter']
    last = {keep: rows[-1]['layers'] for keep, rows in runs.items()}
    assert all(s['qk_spec_norm'] < f['qk_spec_norm'] for f, s in zip(last['fro'], last['spec']))
    assert torch.load(tmp_path / 'out' / 'spec' / 'ckpt.pt',
                      weights_only=True)['control']['keep'] == 'spec'


# ----------------------------------------------------------------------------- a fork's new kind

CLIP = """    'clip': Kind(EVERY_KIND_READS + ('clip_to',), 'clip_to', clip_fraction,
                 upper_bound=True),
}"""


def test_a_new_control_kind_is_control_py_and_train_py_and_the_analysis_pairs_it(
        tmp_path, text_file):
    """A fork's `clip` kind (the key PR held below clip_to x its step-0 value from the first step):
    one entry in control.py's KINDS and its setting in train.py. Its runs, at a dose that is not the
    default, get their seed's baseline and a control_dose row with no verdict."""
    fork = tmp_path / 'fork'
    shutil.copytree(os.path.join(REPO, 'plumbing'), fork / 'plumbing')
    for f in os.listdir(REPO):
        if f.endswith('.py'):
            shutil.copy(os.path.join(REPO, f), fork)
    src = (fork / 'control.py').read_text()
    src = src.replace("    'freeze': Kind(EVERY_KIND_READS, '', freeze_fraction),\n}",
                      "    'freeze': Kind(EVERY_KIND_READS, '', freeze_fraction),\n" + CLIP, 1)
    src = src.replace('\n@dataclass(frozen=True)\nclass Kind:',
                      "\ndef clip_fraction(cfg, step):\n    return cfg['clip_to']\n\n"
                      "\n@dataclass(frozen=True)\nclass Kind:", 1)
    (fork / 'control.py').write_text(src)
    src = (fork / 'train.py').read_text()
    (fork / 'train.py').write_text(src.replace('shrink_to = ', 'clip_to = 0.5\nshrink_to = ', 1))
    args = tiny_args(tmp_path, text_file, '--max_iters=8', '--model_ckpts=0')
    for extra in (['--seed=1'], ['--seed=2'], ['--control=clip', '--clip_to=0.7', '--seed=1'],
                  ['--control=clip', '--clip_to=0.7', '--seed=2']):
        out = run_train(args + extra, cwd=fork, script=fork / 'train.py')
        assert out.returncode == 0, out.stderr
    assert sorted(n.split('-')[0] for n in os.listdir(tmp_path / 'out'))[:2] == [
        'L2_normal_clip0.7', 'L2_normal_clip0.7']
    out = subprocess.run([sys.executable, 'analyze.py', str(tmp_path / 'out'), '--no_figures',
                          f'--out={tmp_path / "analysis"}'], cwd=fork, capture_output=True,
                         text=True)
    assert out.returncode == 0 and 'Traceback' not in out.stderr, out.stderr
    assert 'no control=none run' not in out.stdout + out.stderr
    rows = list(csv.DictReader(open(tmp_path / 'analysis' / 'control_dose.csv')))
    assert [(r['arm'], r['n'], r['verdict']) for r in rows] == [
        ('clip0.7-k', '2', 'no claim on this kind: no verdict')]


def test_a_kind_that_is_not_a_pr_schedule_is_one_entry_a_cap_on_the_top_singular_value(
        monkeypatch):
    def cap(s, s0, cfg, step):   # s ascending: the top value is the last
        return torch.minimum(s, cfg['cap_to'] * s0[:, -1:])
    reads = ('control_target', 'control_scope', 'control_layers', 'control_interval', 'cap_to')
    cap_kind = control.Kind(reads, 'cap_to', spectrum=cap)   # it keeps no norm: no control_keep
    monkeypatch.setitem(control.KINDS, 'cap', cap_kind)
    torch.manual_seed(0)
    weights = [(torch.randn(16, 16), torch.randn(16, 16)) for _ in range(2)]
    cfg = dict(control='cap', cap_to=0.5, control_target='k', control_scope='head',
               control_keep='fro', control_layers='', control_interval=1, n_head=4)
    top0 = torch.linalg.matrix_norm(weights[0][1].view(4, 4, 16).double(), ord=2)
    state = control.record(cfg, weights)
    weights[0][1].mul_(1.5)   # an optimizer step that grows the keys
    control.apply(state, cfg, weights, 1)
    top = torch.linalg.matrix_norm(weights[0][1].view(4, 4, 16).double(), ord=2)
    assert torch.allclose(top, 0.5 * top0, rtol=1e-5)
    row = control.report(state)[0]
    reached = geometry.matrix_pr(weights[0][1].view(4, 4, 16)).mean().item()
    assert row['ctl_pr'] == pytest.approx(reached, rel=1e-5)
    assert control.label(dict(cfg, control_keep='spec')) == 'cap0.5-k'   # named by what it reads
