"""
Key-spectrum control: after each optimizer step, reshape the singular-value spectrum of W_K
(or of W_Q, the mirror experiment) towards a target participation ratio, keeping its singular
vectors and, at that step, one measure of its scale (control_keep).

    W = U diag(s) V^T   ->   W' = U diag(s') V^T,   s' = c * s^alpha
    alpha  by a search on log alpha, so that PR(s') = (sum s'^2)^2 / sum s'^4 hits the target
    c      what the reshaping holds fixed (control_keep):
           fro  (default) sum s'^2 = sum s^2: the Frobenius norm is kept, only the dispersion
                changes, so a narrower spectrum has a larger top singular value (larger logits)
           spec max(s') = max(s): the top singular value that the optimizer step just set is
                kept, so the reshaping changes only the shape of the spectrum. It does not hold
                the logit scale over training: later steps move max(s) as training would, and
                W_Q keeps learning, so ||W_QK^h||_2 still drifts (analyze.py reports how far,
                against the baseline)
           Comparing the two separates shape from scale at each control step; over training, the
           analysis accounts for the scale change that remains. PR is scale-free, so both reach the
           same PR with the same alpha; spec costs no more than fro (c = max(s)).

PR(s^alpha) falls as alpha grows: alpha = 0 makes every nonzero value equal (PR = rank, the most
reachable), alpha = 1 is the spectrum as it is, alpha -> inf keeps only the top value (PR -> how
many values tie for the top, usually 1). U and V are untouched, and so is the optimizer state.

Schedules (pr0 = the step-0 PR of each controlled head, or layer with control_scope=layer):
    shrink  target = pr0 * (1 - (1 - shrink_to) * min(step / shrink_iters, 1)), then constant;
            an upper bound: a spectrum already at or below it is left alone
    freeze  target = pr0 at every step, enforced both ways
    none    the baseline: the same calls, the weights untouched

The transform runs on the weights' device (on the CPU for MPS, which has no float64), in float64
whatever the weights' dtype, in a fixed number of batched tensor operations with no data-dependent
branch. U and s come from one eigh of every block's Gram matrix W W^T, not an SVD, and then
W' = U diag(s'/s) U^T W. Nothing is read on the host during training: the state holds tensors,
and report() reads them once per record. On CUDA the eigh still waits once for the device,
for cuSOLVER's convergence check, which every torch eigensolver and SVD makes.

Edge cases. Singular values below sqrt(max(m, n) * eps(float64)) * s_max (3e-7 s_max at 64 x 384,
the round-off of a zero eigenvalue of the float64 Gram matrix) count as zero and stay as they are,
so the most reachable PR is the rank. A target outside the reachable range is clamped to it, with
one warning per run (at the next record). A flat spectrum (every nonzero value equal) and an
all-zero block are left as they are, since no alpha changes their PR.

train.py checks the settings with control.check_settings(cfg, n_layer) before training.
It then calls this module in two places (the state is a plain dict, saved in checkpoints):
    state = control.record(cfg, model.qk_weights())        # at step 0
    control.apply(state, cfg, model.qk_weights(), step)    # after each optimizer step, step >= 1
and merges control.report(state)[layer] into each layer's record in metrics.jsonl.

A library with no command line; `python bench.py --control` measures its speed, and `--overhead`
counts its operations (kernels on a GPU) against a training step's.
"""
import math
import warnings
from dataclasses import dataclass

import torch

import geometry

# alpha runs from e^-30 to e^30 (~1e-13 to 1e13): at those ends, PR(s^alpha) equals its limits,
# the rank and the top value's multiplicity, to float64 precision.
LOG_ALPHA_MIN, LOG_ALPHA_MAX = -30.0, 30.0
# ROUNDS rounds narrow log alpha to 60 / GRID^ROUNDS ~ 3e-12, as 44 halvings would (162^6 > 2^44),
# far inside the 1e-6 the PR must reach, in 60 tensor operations where a bisection takes 44 x 17.
GRID, ROUNDS = 162, 6
# a target out of reach by more than this (relative) is worth a warning; round-off is not
REACH_RTOL = 1e-9


# ----------------------------------------------------------------------------- the transform

def _reach(s, rtol):
    """What the search needs of spectra s (..., n): the mask of kept (nonzero) values, x^2 on them
    (x = s / s_max, 0 elsewhere), and the reachable PR range (PR at the largest alpha, rank)."""
    s_max = s.amax(-1, keepdim=True)
    keep = s > rtol * s_max   # smaller values are round-off of zero ones: they stay as they are
    # x = s / s_max is in (0, 1], so x^alpha neither overflows nor loses the top value
    x2 = torch.where(keep, s / s_max.clamp(min=torch.finfo(s.dtype).tiny), 0.0) ** 2
    lam = x2 ** math.exp(LOG_ALPHA_MAX)
    pr_min = lam.sum(-1) ** 2 / (lam * lam).sum(-1).clamp(min=torch.finfo(s.dtype).tiny)
    return keep, x2, pr_min, keep.sum(-1, dtype=s.dtype)


def _log_alpha(x2, goal):
    """log alpha with PR(x^alpha) = goal (...) for all spectra at once, in a fixed number of steps.
    PR is written out as in geometry.participation_ratio on lam = x^(2 alpha): it is above the goal
    where sum lam > sqrt(goal) * |lam|, and falls as alpha grows. Each round evaluates it at the
    GRID - 1 points inside the cell and keeps the part where it crosses the goal."""
    lo = torch.full_like(goal, LOG_ALPHA_MIN)
    cell = LOG_ALPHA_MAX - LOG_ALPHA_MIN
    points = torch.arange(1, GRID, dtype=x2.dtype, device=x2.device)
    # a value that is not kept has log x2 = -inf, so lam = 0 there
    root_goal, log_x2 = goal.sqrt()[..., None], x2.log()[..., None, :]
    for _ in range(ROUNDS):
        cell /= GRID
        alpha = torch.add(lo[..., None], points, alpha=cell).exp()      # (..., GRID - 1)
        lam = torch.exp(alpha[..., None] * log_x2)                      # (..., GRID - 1, n)
        # PR falls as alpha grows, so the points above the goal are a prefix
        above = lam.sum(-1) > root_goal * torch.linalg.vector_norm(lam, dim=-1)
        # The next cell starts at the last point above the goal. A goal out of reach is above all
        # the points or none, so the search ends at that end of the range, the nearest reachable PR.
        lo = torch.add(lo, above.sum(-1), alpha=cell)
    return lo + cell / 2


def _control(s, target, rtol, control_keep='fro'):
    """The transform of the module docstring, batched on float64 spectra s (..., n) >= 0:
    s' = c * s^alpha with PR(s') = target (...), the target clamped to the reachable range.
    Values <= rtol * max(s) count as zero and stay as they are; a flat spectrum comes back
    unchanged with alpha = 1. Returns (s', alpha, pr_min, pr_max)."""
    keep, x2, pr_min, pr_max = _reach(s, rtol)
    # a flat spectrum (every kept value the top one) or a zero one: no alpha changes its PR
    leave = pr_min == pr_max
    alpha = torch.where(leave, 1.0, _log_alpha(x2, target).exp())
    xa = x2 ** (alpha[..., None] / 2)
    # spec: x = s / s_max has its top value at exactly 1, and so has x^alpha
    c = s.amax(-1, keepdim=True)
    if control_keep == 'fro':   # sum s'^2 = sum s^2 over the kept values
        reshaped_norm = torch.linalg.vector_norm(xa, dim=-1, keepdim=True)
        c = c * (x2.sum(-1, keepdim=True).sqrt() / reshaped_norm)
    s_new = torch.where(keep & ~leave[..., None], c * xa, s)
    return s_new, alpha, pr_min, pr_max


# ----------------------------------------------------------------------------- the schedules

def shrink_fraction(cfg, step):
    """shrink: falls linearly to shrink_to over shrink_iters steps, then stays there."""
    done = min(step / cfg['shrink_iters'], 1.0) if cfg['shrink_iters'] > 0 else 1.0
    return 1.0 - (1.0 - cfg['shrink_to']) * done


def freeze_fraction(cfg, step):
    """freeze: the step-0 PR at every step."""
    return 1.0


@dataclass(frozen=True)
class Kind:
    """A control kind. One that is not a PR schedule gives `spectrum` instead of `fraction`:
    s' from each block's singular values now and at step 0, s and s0 (N, m), ascending. A cap on
    the top one, for example: torch.minimum(s, cfg['cap_to'] * s0[:, -1:])."""
    reads: tuple = ()          # the settings it reads beyond `control`
    dose: str = ''             # the one of them in its label and run name (shrink_to: shrink0.1)
    fraction: object = None    # fraction(cfg, step): the target after a step, over the step-0 PR
    upper_bound: bool = False  # True: a PR below the target is left alone; False: both ways
    spectrum: object = None    # spectrum(s, s0, cfg, step) -> s'


# Every control kind, in one place. train.py checks `control` against it; the run name and the
# analysis' arm label come from label(); the analysis pairs runs by KEYS and ignores what a kind
# does not read. A new kind is an entry here (and its settings in train.py's config block).
EVERY_KIND_READS = ('control_target', 'control_scope', 'control_keep', 'control_layers',
                    'control_interval')
KINDS = {
    'none': Kind(),   # the baseline: the same calls, the weights untouched
    'shrink': Kind(EVERY_KIND_READS + ('shrink_to', 'shrink_iters'), 'shrink_to', shrink_fraction,
                   upper_bound=True),
    'freeze': Kind(EVERY_KIND_READS, '', freeze_fraction),
}
# control_keep: what the reshaping holds fixed (the module docstring says why)
KEEPS = ('fro', 'spec')
# the control's settings: `control`, then every key a kind reads, in a fixed order
KEYS = ('control',) + tuple(dict.fromkeys(key for kind in KINDS.values() for key in kind.reads))
DOSES = tuple(kind.dose for kind in KINDS.values() if kind.dose)


def ignored(kind):
    """The control settings a kind does not read (every one for an unknown kind)."""
    reads = KINDS[kind].reads if kind in KINDS else ()
    return tuple(key for key in KEYS[1:] if key not in reads)


def label(cfg, extra=()):
    """The run name's control part and the analysis' arm label: 'shrink0.1-k-spec', 'freeze-k'
    ('shrink-k' without a dose in cfg), then ' key=value' per key of extra in cfg; '' for none."""
    kind = cfg.get('control', 'none')
    if kind == 'none':
        return ''
    reads = KINDS[kind].reads if kind in KINDS else EVERY_KIND_READS
    dose_key = KINDS[kind].dose if kind in KINDS else ''
    dose = f"{cfg[dose_key]:g}" if dose_key and dose_key in cfg else ''
    target = f"-{cfg.get('control_target')}" if 'control_target' in reads else ''
    keep = cfg.get('control_keep', 'fro') if 'control_keep' in reads else 'fro'
    keep = '' if keep == 'fro' else f'-{keep}'
    named = ''.join(f' {key}={cfg[key]}' for key in extra if key in cfg and key in reads)
    return f"{kind}{dose}{target}{keep}{named}"


def target_pr(initial, cfg, step):
    """The target PR after `step` optimizer steps, from the step-0 PR: its kind's fraction of it.

    initial: a state from record (-> a list per controlled layer of lists per head),
    or a float, a list or a tensor of step-0 PRs (-> the same structure).
    """
    kind = KINDS.get(cfg['control'])
    if kind is None or kind.fraction is None:
        raise ValueError(f"control={cfg['control']!r} has no target PR")
    pr0 = initial['pr0'] if isinstance(initial, dict) else initial
    return _scaled(pr0, kind.fraction(cfg, step))


def _scaled(x, frac):
    return [_scaled(v, frac) for v in x] if isinstance(x, (list, tuple)) else x * frac


# ------------------------------------------------------------------------- the hooks train.py calls

def parse_layers(text, n_layer):
    """control_layers, '' (all) or comma-separated indices such as '0,2' -> the sorted layers."""
    if not str(text).strip():
        return list(range(n_layer))
    try:
        layers = sorted({int(t) for t in str(text).split(',') if t.strip()})
    except ValueError:
        raise ValueError(f"control_layers={text!r}: expected comma-separated layer indices"
                         " such as '0,2', or '' for all layers") from None
    bad = [i for i in layers if not 0 <= i < n_layer]
    if bad:
        raise ValueError(f'control_layers={text!r}: layer {bad[0]} does not exist '
                         f'(n_layer={n_layer}: indices 0..{n_layer - 1})')
    return layers


def check_settings(cfg, n_layer):
    """The controlled layers of an n_layer model, or a ValueError naming the control setting that
    cannot work (train.py checks with this before training and shows it as a config error)."""
    for key, valid in (('control', KINDS), ('control_keep', KEEPS)):
        if cfg[key] not in valid:
            raise ValueError(f"{key}={cfg[key]!r} is not one of {', '.join(valid)}")
    if cfg['control_target'] not in ('k', 'q') or cfg['control_scope'] not in ('head', 'layer'):
        raise ValueError('control_target must be k or q, and control_scope head or layer')
    if cfg['control'] == 'shrink' and (cfg['shrink_to'] <= 0 or cfg['shrink_iters'] < 0):
        raise ValueError("control=shrink needs shrink_to > 0 and shrink_iters >= 0 "
                         f"(got shrink_to={cfg['shrink_to']}, shrink_iters={cfg['shrink_iters']})")
    return parse_layers(cfg['control_layers'], n_layer)


def _blocks(W, scope, n_head):
    """The controlled blocks of weights W (..., C, C) in float64, where they are: the heads
    (..., n_head, d, C), or the whole matrix (..., 1, C, C)."""
    W = geometry.as_float64(W)
    return W.unflatten(-2, (n_head, -1)) if scope == 'head' else W.unsqueeze(-3)


def _reshaped(W, target, control_keep):
    """Blocks W (N, m, n), m <= n, float64, moved to target PRs (N,): (W', pr_min, pr_max)."""
    # Below rtol * s_max, a singular value is the round-off of a zero eigenvalue of W W^T in
    # float64 (~eps * s_max^2), whatever the weight's dtype.
    rtol = math.sqrt(max(W.shape[-2:]) * torch.finfo(torch.float64).eps)
    def to_target(s):
        s_new, _, pr_min, pr_max = _control(s, target, rtol, control_keep)
        return s_new, pr_min, pr_max
    return _respectrum(W, to_target)


def _singular_values(W):
    """The singular values of blocks W (N, m, n), ascending, and the eigenvectors U of W W^T."""
    # eigh fails on a block that is not finite: it goes through as zeros, and apply leaves it
    lam, U = torch.linalg.eigh((W @ W.mT).nan_to_num(0.0, 0.0, 0.0))
    return lam.clamp(min=0).sqrt(), U


def _respectrum(W, new_values):
    """Blocks W with their singular values s replaced by new_values(s) -> (s', *more).
    Returns (W', *more), from one batched eigh of the Gram matrices, no SVD:
    W = U diag(s) V^T and G = W W^T = U diag(s^2) U^T, so W' = U diag(s' / s) U^T W."""
    s, U = _singular_values(W)
    s_new, *more = new_values(s)
    scale = (s_new / s).nan_to_num(1.0)   # 0 / 0 where s = 0: those directions stay as they are
    return (U * scale[:, None, :]) @ (U.mT @ W), *more


def record(cfg, qk_weights):
    """The control state at step 0: which layers, and the step-0 PR per controlled head (or layer).

    qk_weights: a list per layer of (W_Q, W_K) pairs. The state is a dict of Python values and
    float64 tensors (L, B) over the controlled layers and their blocks: it goes into a checkpoint
    and comes back with torch.load(weights_only=True). apply moves them to the weights' device.
    """
    layers = check_settings(cfg, len(qk_weights))
    if cfg['control'] == 'none':
        layers = []   # the baseline controls nothing and reports nothing
    side, kind = 1 if cfg['control_target'] == 'k' else 0, KINDS[cfg['control']]
    blocks = [_blocks(qk_weights[i][side], cfg['control_scope'], cfg['n_head']) for i in layers]
    pr0 = (torch.stack([geometry.matrix_pr(b, checked=False) for b in blocks]) if layers
           else torch.zeros(0, 0))
    scheduled = layers and kind.spectrum is None
    state = {'control': cfg['control'], 'target': cfg['control_target'],
             'scope': cfg['control_scope'],
             'keep': cfg['control_keep'], 'n_head': cfg['n_head'], 'n_layer': len(qk_weights),
             'layers': layers,
             'pr0': pr0, 'target_pr': target_pr(pr0, cfg, 0) if scheduled else pr0.clone(),
             'pr': pr0.clone(),
             'out_of_reach': torch.zeros(pr0.shape, dtype=torch.bool, device=pr0.device),
             'step': 0, 'warned': False}
    if layers and kind.spectrum is not None:   # what a spectrum kind reads beside s
        state['s0'] = torch.stack([_singular_values(b)[0] for b in blocks])
    return state


def apply(state, cfg, qk_weights, step):
    """After optimizer step number `step` (1, 2, ...): move each controlled spectrum to its target
    PR, in place under no_grad, when control is not none and step % control_interval == 0.
    Records in the state the target and the reached PR (of the weight as written, in its dtype)."""
    if not state['layers'] or step % cfg['control_interval']:
        return
    keep = state['keep']
    for name, was, now in (('control', state['control'], cfg['control']),
                           ('control_target', state['target'], cfg['control_target']),
                           ('control_scope', state['scope'], cfg['control_scope']),
                           ('control_keep', keep, cfg['control_keep'])):
        if was != now:
            raise ValueError(f"the control state was recorded with {name}={was!r}, not {now!r}")
    side = 1 if state['target'] == 'k' else 0
    params = [qk_weights[i][side] for i in state['layers']]
    blocks = _blocks(torch.stack([p.detach() for p in params]), state['scope'], state['n_head'])
    L, B, m, n = blocks.shape
    flat = blocks.reshape(L * B, m, n)
    for key in ('pr0', 'out_of_reach'):   # a state from a checkpoint is loaded on the CPU
        state[key] = state[key].to(flat.device)
    kind = KINDS[state['control']]
    if kind.spectrum is None:
        target = target_pr(state, cfg, step).view(L * B)
        new, pr_min, pr_max = _reshaped(flat, target, keep)
    else:   # no target PR: each block's spectrum as the kind sets it
        s0 = state['s0'].to(flat.device).view(L * B, -1)
        new, = _respectrum(flat, lambda s: (kind.spectrum(s, s0, cfg, step),))
    # rounded to the weight's dtype, so that the PR logged is that of the weight as stored
    new = new.to(params[0].dtype).to(torch.float64)
    pr, new_pr = geometry.matrix_pr(torch.cat([flat, new]), checked=False).chunk(2)
    if kind.spectrum is None:
        # An upper bound (shrink) only lowers a PR, and freeze moves it either way.
        # A zero block (PR 0) has no spectrum to move.
        act = (pr > 0) & ((pr > target) if kind.upper_bound else (pr != target))
        out = act & ((target > pr_max * (1 + REACH_RTOL)) | (target < pr_min * (1 - REACH_RTOL)))
        state['out_of_reach'] |= out.view(L, B)
        # the target as enforced: one out of reach (below 1 for a small head) is clamped
        target = torch.where(act, torch.minimum(torch.maximum(target, pr_min), pr_max), target)
    else:   # every block with a spectrum; the PR it reaches stands for a target
        act, target = pr > 0, new_pr
    flat = torch.where(act[:, None, None], new, flat)
    pr = torch.where(act, new_pr, pr)
    with torch.no_grad():   # blocks left alone go back bit for bit (float64 holds them exactly)
        for p, block in zip(params, flat.view(L, B, m, n)):
            p.copy_(block.reshape(p.shape))
    state['target_pr'], state['pr'], state['step'] = target.view(L, B), pr.view(L, B), step


def report(state):
    """One dict per layer for metrics.jsonl: ctl_target_pr, ctl_pr (mean over heads in head scope)
    and, in head scope, ctl_target_pr_heads, ctl_pr_heads; {} for a layer that is not controlled."""
    rows = [{} for _ in range(state['n_layer'])]
    if not state['layers']:
        return rows
    # the one read on the host, once per record
    targets, prs, out = (state[key].tolist() for key in ('target_pr', 'pr', 'out_of_reach'))
    if any(map(any, out)) and not state['warned']:
        i, j = next((i, j) for i, row in enumerate(out) for j, o in enumerate(row) if o)
        where = f"layer {state['layers'][i]}" + (f' head {j}' if state['scope'] == 'head' else '')
        warnings.warn(f"control: the target PR of {where} was out of reach by step {state['step']} "
                      f"(now {targets[i][j]:.6g}, reached {prs[i][j]:.6g}); "
                      'clamped to the nearest reachable PR. This warning is given once per run.',
                      RuntimeWarning, stacklevel=2)
        state['warned'] = True
    for layer, target, pr in zip(state['layers'], targets, prs):
        rows[layer] = {'ctl_target_pr': sum(target) / len(target), 'ctl_pr': sum(pr) / len(pr)}
        if state['scope'] == 'head':
            rows[layer].update(ctl_target_pr_heads=list(target), ctl_pr_heads=list(pr))
    return rows
