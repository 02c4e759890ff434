"""
The geometry of queries and keys: participation ratios, spectra, interaction (QK^T) spectra,
token-level PR, attention entropy, the learned part of a weight and the partial correlation that
holds the logit scale fixed. Pure functions, no I/O; the one place the math lives.

Notation: W_Q, W_K are nn.Linear weights, shape (C, C) = (out, in). Head h owns rows
h*d:(h+1)*d, d = C / n_head, giving W^h of shape (d, C).

    PR(lam)    = (sum lam)^2 / sum lam^2            participation ratio of eigenvalues lam >= 0
    PR(M)      = (sum s^2)^2 / sum s^4              s = singular values of M (lam = s^2)
               = tr(G)^2 / ||G||_F^2                G = M M^T or M^T M: no SVD needed
    W_QK^h     = (W_Q^h)^T W_K^h                    (C, C), rank <= d: the bilinear form behind q.k
    PR_tok(X)  = PR(eigenvalues of cov(X))          cov of the centred rows of X (tokens, dims)
    tok_pr_qk  = PR(Q_h K_h^T / sqrt(d))            T x T logits before the mask
    H_i        = -sum_{j<=i} a_ij log a_ij          nats, 0 log 0 = 0, rows i >= 1 (not row 0)
    H_i norm   = H_i / log(i+1)                     1 = uniform over the allowed keys, 0 = one-hot
    l_ij       = q_i.k_j / sqrt(d)                  the scaled logits of head h, keys j <= i
    sigma_i    = sqrt(mean_j (l_ij - mean_j l_ij)^2)  logit spread of row i >= 1 over its i+1 keys
    logit_std  = mean of sigma_i over rows i >= 1 and windows (population std: a row of two keys
                 with logits a, b has sigma = |a - b| / 2)
    logit_margin   = mean of (max_j l_ij - mean_j l_ij) / sigma_i   the top-1 margin in spreads
    logit_kurtosis = mean of mean_j (l_ij - mean_j l_ij)^4 / sigma_i^4 - 3   excess kurtosis
                 (both over the same rows; 0 for a row whose logits are all equal, sigma_i = 0)
    self_top   = the share of those rows whose own key holds the largest logit, l_ii = max_j l_ij
    qk_eig_mean = tr(W_QK^h) / C                    the mean eigenvalue of W_QK^h
    qk_eig_std = sqrt(||S_h||_F^2 / C - qk_eig_mean^2)   S_h = (W_QK^h + W_QK^h^T) / 2: the spread
                 of the eigenvalues of the symmetric part, which alone sets a self-match logit
                 x^T W_QK^h x (Bao, Hataya and Karakida 2024 relate both to how local attention is)
    erank(s)   = exp(-sum p log p), p = s / sum s   effective rank (Roy and Vetterli)
    srank(M)   = ||M||_F^2 / ||M||_2^2              stable rank

The learned part of a weight is W - W(0), its change since initialisation (learned_geometry):
    pr_dq      = PR(W_Q - W_Q(0)), pr_dk the same for W_K   whole (C, C) matrix
    pr_dq_head = mean over heads h of PR(W_Q^h - W_Q^h(0))  per head: pr_dq_heads (pr_dk_* for W_K)
    dq_rel     = ||W_Q - W_Q(0)||_F / ||W_Q(0)||_F          how far training moved W_Q (dk_rel: W_K)
A random init has PR near C/2, so the PR of W itself can only fall early in training; the PR of the
learned part shows which directions training opens, whatever the init.

The Q/K imbalance of head h (layer_geometry), the null model of the study:
    D_h        = W_Q^h W_Q^h^T - W_K^h W_K^h^T      (d, d)
    qk_imbalance = ||D_h||_F / qk_gram,  qk_gram = mean(||W_Q^h W_Q^h^T||_F, ||W_K^h W_K^h^T||_F)
    qk_drift   = ||D_h - D_h(0)||_F / qk_gram        (learned_geometry)
The logits depend on W_Q^h, W_K^h only through M = W_QK^h, so with G = dL/dM the gradients are
dL/dW_Q^h = W_K^h G^T and dL/dW_K^h = W_Q^h G. Under gradient flow
    d/dt (W_Q^h W_Q^h^T) = -(W_K^h G^T W_Q^h^T + W_Q^h G W_K^h^T) = d/dt (W_K^h W_K^h^T):
D_h is conserved, and qk_drift stays 0. The squared singular values of W_Q^h and W_K^h are the
eigenvalues of the two Gram matrices, so the per-head Q and K spectra can differ only by D_h(0) and
by the optimizer's departures from gradient flow: finite steps (O(lr^2) each), momentum, Adam's
per-coordinate scaling; decoupled weight decay shrinks D_h. A tied init has D_h(0) = 0.
q_spec_norm, k_spec_norm = ||W_Q^h||_2, ||W_K^h||_2 (mean over heads; *_heads per head).
Each record also keeps the spectra whole, so any other spectral statistic can be computed from a
log: sv_q_heads, sv_k_heads, sv_qk_heads = the d singular values of W_Q^h, W_K^h, W_QK^h per head,
descending (lists of n_head lists of d).

The logit scale is qk_spec_norm = ||W_QK^h||_2 (per head; layer_geometry). Entropy falls as the
logits grow whatever the spectrum's shape (sigma-Reparam, Zhai et al. 2023); what a row's entropy
depends on directly is how far its logits spread over its keys, logit_std (token_geometry), which
the weights' spectrum sets only together with the activations it meets. So every link between a
PR and entropy is also measured with the logit scale held fixed (partial_correlation):
    r(x, y | z) = corr(x - x_hat, y - y_hat)   x_hat, y_hat: least-squares fits of x, y on [1, z]
                = (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2))   for a single z
With ranks for x, y, z (for example entropy, PR_K_head, log qk_spec_norm over (layer, head) pairs)
it is the partial Spearman correlation.

Conventions. Inputs are torch tensors (any device, any dtype) or numpy arrays. Everything is
computed in float64 where the first input is (numpy: the CPU; MPS, which has neither float64 nor
these linalg kernels: the CPU), so a metric logged during a GPU run and the same metric recomputed
later from a saved float32 snapshot agree to float64 round-off. Scalars come back as Python floats,
per-head lists as Python lists, batched results as float64 tensors. A training record uses
record_tensors and host_values instead: the same math on trusted inputs, no checks, one copy to the
host per record. An all-zero spectrum (a zero matrix, constant activations) has PR, effective rank
and stable rank 0.0, never NaN. So has the learned part of an unchanged weight (W == W(0): PR 0.0,
rel 0.0), and a zero W(0) has rel 0.0 (no scale to compare with). The one exception is a correlation
with nothing to correlate (fewer than 3 + k points for k controls, or a series constant once z is
taken out): NaN, as a table should show "not measurable" there, not "no link".
NaN or Inf in any input, or a shape that does not fit, is a ValueError that says what was expected.

A library with no command line; `python bench.py --geometry` measures its speed.
"""
import numpy as np
import torch

# The range of every value a record logs per layer, by the definitions above: (low, high) of a
# layer's value and of its per-head list (*_heads: the row of its *_head mean where there is one).
# A high that is a string is a size (C = n_embd, d = C / n_head, T = block_size, the most keys a
# row attends to), another logged value of the same layer (head by head for a list), or 'drift'.
# Exactly 0.0 is in every range: an all-zero spectrum has PR, effective rank and stable rank 0.0,
# and so has the learned part of an unchanged weight.
BOUNDS = {
    **dict.fromkeys(('pr_q', 'pr_k', 'pr_dq', 'pr_dk', 'erank_q', 'erank_k', 'srank_q',
                     'srank_k', 'tok_pr_q', 'tok_pr_k', 'ctl_pr'), (1, 'C')),
    # ctl_*: the PR control.py reaches and aims at, of a head's block or of the whole matrix.
    # A scheduled target is a fraction of the step-0 PR and may lie below 1 (control.py clamps it).
    'ctl_target_pr': (0, 'C'),
    # a head's block is (d, C), and W_QK^h and the logits Q_h K_h^T have rank <= d
    **dict.fromkeys(('pr_q_head', 'pr_k_head', 'pr_dq_head', 'pr_dk_head', 'pr_qk', 'erank_qk',
                     'tok_pr_q_head', 'tok_pr_k_head', 'tok_pr_qk'), (1, 'd')),
    'entropy': (0, 'log T'), 'entropy_norm': (0, 1),
    **dict.fromkeys(('sv_q', 'sv_k', 'sv_qk', 'logit_std', 'logit_margin', 'qk_eig_std'),
                    (0, float('inf'))),
    'logit_kurtosis': (-2, float('inf')), 'self_top': (0, 1),   # any distribution's excess >= -2
    'qk_eig_mean': (-float('inf'), float('inf')),   # a trace: any sign
    'qk_spec_norm': (0, 'qk_fro_norm'),   # ||M||_2 <= ||M||_F
    # ||A - B||_F <= ||A||_F + ||B||_F, and D_h(0) adds its own norm to the drift's bound:
    # 'drift' is 2 + 2 qk_gram(0) / qk_gram, read from the record of step 0
    'qk_imbalance': (0, 2), 'qk_drift': (0, 'drift'),
    **dict.fromkeys(('qk_fro_norm', 'q_spec_norm', 'k_spec_norm', 'qk_gram', 'dq_rel', 'dk_rel'),
                    (0, float('inf'))),
}

# A softmax in bf16 rounds each probability to 8 significant bits, so its rows can miss 1 by up to
# 2^-8 (~4e-3; 3e-3 seen at T=256). 1e-2 accepts that, and still rejects logits, rows scaled by
# dropout and masks that are not normalised.
ROW_SUM_ATOL = 1e-2


# ----------------------------------------------------------------------------------------------
# plumbing: conversion, checks, safe division

def _first(mask):
    """Index tuple of the first True entry of mask."""
    return tuple(mask.nonzero()[0].tolist())


def _home(x):
    """Where x is computed: its device, or the CPU for numpy and MPS (no float64 or eigvalsh)."""
    if not isinstance(x, torch.Tensor) or x.device.type == "mps":
        return torch.device("cpu")
    return x.device


def _as_f64(x, name, ndim=None, min_ndim=0, shape_hint="", dtype=torch.float64, device=None):
    """x as a float64 tensor on device, by default _home(x); dtype=None keeps its own float
    precision, float32 at least. A ValueError on the wrong number of dims or on NaN/Inf."""
    device = device or _home(x)
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(np.array(x))  # a copy: from_numpy rejects negative strides
    x = x.detach().to(device=device, dtype=dtype or torch.promote_types(x.dtype, torch.float32))
    if (ndim is not None and x.ndim != ndim) or x.ndim < min_ndim:
        want = f"{ndim}-D" if ndim is not None else f"at least {min_ndim}-D"
        raise ValueError(f"{name} must be {want}{shape_hint}, got shape {tuple(x.shape)}")
    bad = ~torch.isfinite(x)
    if bad.any():
        idx = _first(bad)
        raise ValueError(f"{name} has {int(bad.sum())} NaN or Inf value(s); "
                         f"the first is {x[idx].item()} at index {idx}")
    return x


def _as_probs(att, **shape):
    """Attention probabilities stay in their float precision (float32 at least): rows of a softmax
    sum to 1 to ~1e-7 in float32, and a float64 copy of a (B, n_head, T, T) tensor would cost more
    than every other metric together. Only the per-row entropies are taken on in float64."""
    return _as_f64(att, "att", dtype=None, **shape)


def _nonneg(x, name):
    """x with round-off negatives (down to -1e-12 * max|x| along the last dim) clamped to 0."""
    bad = x < -1e-12 * x.abs().amax(-1, keepdim=True)
    if bad.any():
        idx = _first(bad)
        raise ValueError(f"{name} must be nonnegative: got {x[idx].item():.6g} at index {idx}, "
                         f"beyond round-off (1e-12 * max|{name}|); "
                         "clamp low-precision round-off first")
    return x.clamp(min=0)


def _div(a, b):
    """a / b, and 0.0 where b == 0 (an all-zero spectrum), never NaN."""
    return torch.where(b > 0, a / torch.where(b > 0, b, 1.0), 0.0)


def _unit_scale(x, dims):
    """x divided by its largest |entry| over dims: every ratio here is scale-free, and this keeps
    s^4 inside float64 range however small or large the weights are."""
    m = x.abs().amax(dim=dims, keepdim=True)
    return x / torch.where(m > 0, m, 1.0)


def _ret(t):
    """A 0-D result as a Python float, a batched one as a tensor."""
    return t.item() if t.ndim == 0 else t


def _head_dim(C, n_head):
    """d = C / n_head, with a clear error when it is not a whole number."""
    if isinstance(n_head, bool) or int(n_head) != n_head or n_head < 1:
        raise ValueError(f"n_head must be a positive integer, got {n_head!r}")
    if C % int(n_head):
        raise ValueError(f"C={C} is not divisible by n_head={n_head}: "
                         "each head owns d = C / n_head rows")
    return C // int(n_head)


# ----------------------------------------------------------------------------------------------
# the math on validated float64 tensors (private; the public functions below wrap them)

def _gram(M):
    """The smaller Gram matrix, M M^T or M^T M: its eigenvalues are the squared singular values."""
    return M @ M.mT if M.shape[-2] <= M.shape[-1] else M.mT @ M


def _pr(lam):
    lam = _unit_scale(lam, -1)
    return _div(lam.sum(-1) ** 2, (lam ** 2).sum(-1))


def _matrix_pr(M):
    G = _gram(_unit_scale(M, (-2, -1)))
    return _div(G.diagonal(dim1=-2, dim2=-1).sum(-1) ** 2, (G ** 2).sum((-2, -1)))


def _activation_pr(X):
    # PR is scale-free, so the 1/(n-1) of the covariance drops out: PR(cov) = PR(Xc).
    return _matrix_pr(X - X.mean(-2, keepdim=True))


def _singular_values(M):
    return torch.linalg.eigvalsh(_gram(M)).clamp(min=0).sqrt().flip(-1)


def _erank(s):
    total = s.sum(-1, keepdim=True)
    p = _div(s, total)
    return torch.where(total.squeeze(-1) > 0, torch.exp(-torch.special.xlogy(p, p).sum(-1)), 0.0)


def _srank(s):
    return _div((s ** 2).sum(-1), s[..., 0] ** 2)


def _interaction_sv(Wq_h, Wk_h):
    # (W_Q^h)^T W_K^h = Q_q R_q R_k^T Q_k^T, Q_q and Q_k orthonormal (C, d): its singular values
    # are those of the d x d core R_q R_k^T. Householder QR keeps Q orthonormal,
    # so this holds for rank-deficient heads too.
    R_q = torch.linalg.qr(Wq_h.mT, mode="r").R
    R_k = torch.linalg.qr(Wk_h.mT, mode="r").R
    return torch.linalg.svdvals(R_q @ R_k.mT)


def _imbalance(Wq_h, Wk_h):
    """D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T (n_head, d, d), and the Grams' mean Frobenius norm."""
    Gq, Gk = Wq_h @ Wq_h.mT, Wk_h @ Wk_h.mT
    return Gq - Gk, (Gq.norm(dim=(-2, -1)) + Gk.norm(dim=(-2, -1))) / 2


def _check_probs(att):
    """ValueError unless att (..., T, T) holds causal attention probabilities."""
    if (att < 0).any():
        idx = _first(att < 0)
        raise ValueError(f"att has a negative probability {att[idx].item():.6g} at index {idx}; "
                         "pass softmax outputs, not logits")
    sums = att.sum(-1)
    if ((sums - 1).abs() > ROW_SUM_ATOL).any():
        idx = _first((sums - 1).abs() > ROW_SUM_ATOL)
        raise ValueError(f"att row {idx} sums to {sums[idx].item():.6g}, not 1 "
                         f"(tolerance {ROW_SUM_ATOL}); pass softmax probabilities after the causal "
                         "mask and before dropout")
    above = torch.triu(att, diagonal=1).sum(-1)
    if (above > ROW_SUM_ATOL).any():
        idx = _first(above > ROW_SUM_ATOL)
        raise ValueError(f"att row {idx} puts mass {above[idx].item():.6g} on keys j > i: "
                         "attention must be causal (row i nonzero only for j <= i)")


def _check_att(att):
    T = att.shape[-1]
    if att.shape[-2] != T:
        raise ValueError("att must be square in its last two dims (..., T, T), "
                         f"got shape {tuple(att.shape)}")
    if T < 2:
        raise ValueError(f"att needs T >= 2 (row 0 has a single key and is left out), "
                         f"got shape {tuple(att.shape)}")
    _check_probs(att)


def _entropy(att, normalized):
    _check_att(att)
    H = _entropies(att)
    return H / _log_keys(H) if normalized else H


def _entropies(att):
    return -torch.special.xlogy(att, att).sum(-1)[..., 1:].double()


def _row_statistics(Qh, Kh):
    """Of every row i >= 1 (..., T-1) of the scaled logits over the keys j <= i, from per-head
    queries and keys (..., T, d): sigma_i, the top-1 margin, the excess kurtosis and whether the
    query's own key holds the largest logit (1.0 or 0.0)."""
    T, d = Qh.shape[-2:]
    allowed = torch.ones(T, T, dtype=torch.bool, device=Qh.device).tril()
    n_keys = torch.arange(1, T + 1, dtype=Qh.dtype, device=Qh.device)
    logits = (Qh @ Kh.mT / d ** 0.5).masked_fill_(~allowed, 0.0)
    mean = logits.sum(-1) / n_keys
    square = (logits - mean[..., None]).masked_fill_(~allowed, 0.0).square_()
    variance = square.sum(-1) / n_keys
    top = logits.masked_fill(~allowed, -torch.inf).amax(-1)
    own = (logits.diagonal(dim1=-2, dim2=-1) >= top).to(Qh.dtype)
    sigma = variance.sqrt()
    margin = _div(top - mean, sigma)
    fourth_moment = square.square().sum(-1) / n_keys
    kurtosis = torch.where(variance > 0, _div(fourth_moment, variance ** 2) - 3, 0.0)
    return (x[..., 1:] for x in (sigma, margin, kurtosis, own))


def _log_keys(H):
    """log(i + 1) for rows i = 1..T-1: the entropy of a uniform row, where H is."""
    return torch.log(torch.arange(2, H.shape[-1] + 2, dtype=torch.float64, device=H.device))


# ----------------------------------------------------------------------------------------------
# public API

def participation_ratio(lam):
    """PR = (sum lam)^2 / sum lam^2 of nonnegative eigenvalues over the last dim.

    lam: (n,) -> float, or (..., n) -> tensor (...). Between 1 and the number of nonzero values;
    all zeros -> 0.0. Negatives beyond round-off (-1e-12 * max|lam|) are a ValueError.
    """
    return _ret(_pr(_nonneg(_as_f64(lam, "lam", min_ndim=1), "lam")))


def singular_values(M):
    """Singular values of M (..., m, n), float64, descending, min(m, n) of them.

    Computed as sqrt(eigvalsh(G)) of the smaller Gram matrix G (eigenvalues clamped at 0), much
    faster than an SVD; values below ~1e-8 * s_max are round-off. Zero matrix -> zeros.
    """
    return _singular_values(_as_f64(M, "M", min_ndim=2))


def matrix_pr(M, checked=True):
    """PR(M) = (sum s^2)^2 / sum s^4 over the singular values s of M (..., m, n).

    No SVD: with G the smaller Gram matrix, sum s^2 = tr(G) and sum s^4 = ||G||_F^2.
    2-D -> float, batched -> tensor. Scale-invariant. Zero matrix -> 0.0. checked=False: M is a
    trusted float64 tensor (as_float64) and the result a tensor where M is, with no check and no
    copy to the host.
    """
    return _ret(_matrix_pr(_as_f64(M, "M", min_ndim=2))) if checked else _matrix_pr(M)


def split_heads(W, n_head):
    """(C_out, C_in) projection weight (out, in) -> (n_head, d, C_in), head h = rows h*d:(h+1)*d."""
    W = _as_f64(W, "W", ndim=2, shape_hint=" (out, in)")
    return W.reshape(-1, _head_dim(W.shape[0], n_head), W.shape[1])


def _qk_heads(W_Q, W_K, n_head):
    W_Q = _as_f64(W_Q, "W_Q", ndim=2, shape_hint=" (C, C) = (out, in)")
    W_K = _as_f64(W_K, "W_K", ndim=2, shape_hint=" (C, C) = (out, in)", device=W_Q.device)
    if W_Q.shape != W_K.shape:
        raise ValueError(f"W_Q and W_K must have the same shape, "
                         f"got {tuple(W_Q.shape)} and {tuple(W_K.shape)}")
    d = _head_dim(W_Q.shape[0], n_head)
    return W_Q, W_K, W_Q.reshape(-1, d, W_Q.shape[1]), W_K.reshape(-1, d, W_K.shape[1])


def interaction_singular_values(W_Q, W_K, n_head):
    """Per head, the singular values of W_QK^h = (W_Q^h)^T W_K^h (C x C, rank <= d).

    Returns (n_head, d), descending. From the d x d core R_q R_k^T, where (W^h)^T = Q R is a QR
    factorisation, instead of a C x C SVD. Zero weights -> zeros.
    """
    return _interaction_sv(*_qk_heads(W_Q, W_K, n_head)[2:])


def activation_pr(X):
    """Token-level PR of X (..., tokens, dims): PR of the eigenvalues of S = Xc^T Xc / (n-1),
    Xc the centred rows, as tr(S)^2 / ||S||_F^2 (no eigendecomposition).

    Invariant to adding one vector to every row and to scaling. 2-D -> float, batched -> tensor.
    Constant rows (zero covariance) -> 0.0. Needs at least 2 tokens.
    """
    X = _as_f64(X, "X", min_ndim=2, shape_hint=" (..., tokens, dims)")
    if X.shape[-2] < 2:
        raise ValueError("X needs at least 2 tokens (rows) for a covariance, "
                         f"got shape {tuple(X.shape)}")
    return _ret(_activation_pr(X))


def attention_entropy(att, normalized=False):
    """Per-row entropies H_i = -sum_j a_ij log a_ij (nats, 0 log 0 = 0) of causal attention
    att (..., T, T); returns (..., T-1) for rows i = 1..T-1 (row 0 has one key and is left out).

    normalized=True divides by log(i+1): 1 = uniform over keys j <= i, 0 = one-hot.
    ValueError unless rows are nonnegative, causal and sum to 1 within ROW_SUM_ATOL (1e-2, bf16).
    """
    return _entropy(_as_probs(att, min_ndim=2, shape_hint=" (..., T, T)"), normalized)


def mean_attention_entropy(att, normalized=False):
    """Mean of attention_entropy(att, normalized) over rows i >= 1 and all leading dims (float)."""
    return attention_entropy(att, normalized).mean().item()


def logit_spread(q, k, n_head):
    """Per-row logit spreads sigma_i of causal attention from q, k (B, T, C), all heads
    concatenated: for each head and row i = 1..T-1, the population std of q_i.k_j / sqrt(d) over
    the keys j <= i. Returns (B, n_head, T-1), float64. Needs T >= 2.
    """
    q = _as_f64(q, "q", ndim=3, shape_hint=" (B, T, C)")
    k = _as_f64(k, "k", ndim=3, shape_hint=" (B, T, C)", device=q.device)
    if q.shape != k.shape or q.shape[1] < 2:
        raise ValueError("q and k must share one shape (B, T, C) with T >= 2, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, C = q.shape
    d = _head_dim(C, n_head)
    heads = (x.view(B, T, -1, d).transpose(1, 2) for x in (q, k))
    return next(_row_statistics(*heads))


def effective_rank(s):
    """Roy and Vetterli effective rank exp(-sum p log p), p = s / sum s, over the last dim.

    s: singular values, (n,) -> float or (..., n) -> tensor.
    Between 1 and the number of nonzero values; all zeros -> 0.0.
    """
    return _ret(_erank(_nonneg(_as_f64(s, "s", min_ndim=1), "s")))


def stable_rank(M):
    """Stable rank ||M||_F^2 / ||M||_2^2 = sum s^2 / max s^2 of M (..., m, n).
    Singular values as in singular_values; 2-D -> float, batched -> tensor. Zero matrix -> 0.0."""
    return _ret(_srank(_singular_values(_as_f64(M, "M", min_ndim=2))))


def layer_geometry(W_Q, W_K, n_head):
    """Weight geometry of one attention layer from W_Q, W_K (C, C) = (out, in).

    Returns floats (lists of length n_head for *_heads):
      pr_q, pr_k                    PR of the full C x C matrices
      pr_q_head, pr_k_head          mean over heads of PR(W^h), W^h (d, C); *_heads per head
      pr_qk                         mean over heads of PR(W_QK^h); pr_qk_heads per head
      qk_spec_norm, qk_fro_norm     mean over heads of ||W_QK^h||_2, ||W_QK^h||_F; *_heads per head
      erank_q, erank_k              effective rank of W_Q, W_K
      srank_q, srank_k              stable rank of W_Q, W_K
      erank_qk                      mean over heads of the effective rank of W_QK^h
      q_spec_norm, k_spec_norm      mean over heads of ||W_Q^h||_2, ||W_K^h||_2; *_heads per head
      qk_imbalance, qk_gram         mean over heads of ||D_h||_F / qk_gram and of qk_gram;
                                    *_heads per head
      sv_q_heads, sv_k_heads,       per head, the d singular values of W_Q^h, W_K^h and W_QK^h,
      sv_qk_heads                   descending (n_head lists of d)
      qk_eig_mean, qk_eig_std       mean over heads of the mean and the spread of the eigenvalues
                                    of W_QK^h (its symmetric part's); *_heads per head
    """
    return host_values([_layer(*_qk_heads(W_Q, W_K, n_head)[:2], n_head)])[0]


def _layer(W_Q, W_K, n_head):
    d = W_Q.shape[0] // n_head
    Wq_h, Wk_h = W_Q.reshape(-1, d, W_Q.shape[1]), W_K.reshape(-1, d, W_K.shape[1])
    sv_q, sv_k = _singular_values(Wq_h), _singular_values(Wk_h)   # (n_head, d)
    sq_h, sk_h = sv_q[:, 0], sv_k[:, 0]
    D, gram = _imbalance(Wq_h, Wk_h)
    rel = _div(D.norm(dim=(-2, -1)), gram)
    hq, hk = _matrix_pr(Wq_h), _matrix_pr(Wk_h)
    sq, sk = _singular_values(W_Q), _singular_values(W_K)
    s_qk = _interaction_sv(Wq_h, Wk_h)
    pr_qk = _pr(s_qk ** 2)
    spec, fro = s_qk[:, 0], s_qk.norm(dim=-1)   # rank <= d: the d values hold all of ||.||_F
    eig_mean, eig_std = _interaction_eigenvalues(Wq_h, Wk_h, fro)
    return {
        "pr_q": _matrix_pr(W_Q), "pr_k": _matrix_pr(W_K),
        "pr_q_head": hq.mean(), "pr_k_head": hk.mean(), "pr_q_heads": hq, "pr_k_heads": hk,
        "pr_qk": pr_qk.mean(), "pr_qk_heads": pr_qk,
        "qk_spec_norm": spec.mean(), "qk_fro_norm": fro.mean(),
        "qk_spec_norm_heads": spec, "qk_fro_norm_heads": fro,
        "erank_q": _erank(sq), "erank_k": _erank(sk), "srank_q": _srank(sq), "srank_k": _srank(sk),
        "erank_qk": _erank(s_qk).mean(),
        "q_spec_norm": sq_h.mean(), "k_spec_norm": sk_h.mean(),
        "q_spec_norm_heads": sq_h, "k_spec_norm_heads": sk_h,
        "qk_imbalance": rel.mean(), "qk_imbalance_heads": rel,
        "qk_gram": gram.mean(), "qk_gram_heads": gram,
        "sv_q_heads": sv_q, "sv_k_heads": sv_k, "sv_qk_heads": s_qk,
        "qk_eig_mean": eig_mean.mean(), "qk_eig_mean_heads": eig_mean,
        "qk_eig_std": eig_std.mean(), "qk_eig_std_heads": eig_std,
    }


def _interaction_eigenvalues(Wq_h, Wk_h, fro):
    """qk_eig_mean, qk_eig_std per head from the (d, C) blocks, with d x d products only:
    tr(W_QK^h) = sum(W_Q^h * W_K^h), and with M = W_K^h W_Q^h^T,
    ||S_h||_F^2 = (||W_QK^h||_F^2 + tr(M M)) / 2."""
    C = Wq_h.shape[-1]
    mean = (Wq_h * Wk_h).sum((-2, -1)) / C
    M = Wk_h @ Wq_h.mT
    symmetric = (fro ** 2 + (M * M.mT).sum((-2, -1))) / 2
    return mean, (symmetric / C - mean ** 2).clamp(min=0).sqrt()


def learned_geometry(W_Q, W_K, W_Q0, W_K0, n_head):
    """Geometry of the learned part W - W(0) of one layer's W_Q, W_K, all (C, C) = (out, in).

    Returns floats (lists of length n_head for *_heads):
      pr_dq, pr_dk                  PR of W_Q - W_Q(0), W_K - W_K(0), whole matrix
      pr_dq_head, pr_dk_head        mean over heads of PR of the head's (d, C) block of the change;
                                    per head: pr_dq_heads, pr_dk_heads
      dq_rel, dk_rel                ||W - W(0)||_F / ||W(0)||_F
      qk_drift                      mean over heads of ||D_h - D_h(0)||_F / qk_gram; qk_drift_heads
    W == W(0) gives PR 0.0 and rel 0.0; a zero W(0) gives rel 0.0. W - W(0) is taken in float64.
    """
    W_Q, W_K, _, _ = _qk_heads(W_Q, W_K, n_head)
    W_Q0 = _as_f64(W_Q0, "W_Q0", ndim=2, shape_hint=" (C, C) = (out, in)", device=W_Q.device)
    W_K0 = _as_f64(W_K0, "W_K0", ndim=2, shape_hint=" (C, C) = (out, in)", device=W_Q.device)
    if W_Q0.shape != W_Q.shape or W_K0.shape != W_K.shape:
        raise ValueError(f"W_Q0 and W_K0 must have the shape of W_Q and W_K {tuple(W_Q.shape)}, "
                         f"got {tuple(W_Q0.shape)} and {tuple(W_K0.shape)}")
    return host_values([_learned(W_Q, W_K, W_Q0, W_K0, n_head)])[0]


def _learned(W_Q, W_K, W_Q0, W_K0, n_head):
    d = W_Q.shape[0] // n_head
    D, gram = _imbalance(W_Q.reshape(-1, d, W_Q.shape[1]), W_K.reshape(-1, d, W_K.shape[1]))
    D0, _ = _imbalance(W_Q0.reshape(-1, d, W_Q.shape[1]), W_K0.reshape(-1, d, W_K.shape[1]))
    drift = _div((D - D0).norm(dim=(-2, -1)), gram)
    out = {"qk_drift": drift.mean(), "qk_drift_heads": drift}
    for name, W, W0 in (("q", W_Q, W_Q0), ("k", W_K, W_K0)):
        dW = W - W0
        heads = _matrix_pr(dW.reshape(-1, d, W.shape[1]))
        out |= {f"pr_d{name}": _matrix_pr(dW), f"pr_d{name}_head": heads.mean(),
                f"pr_d{name}_heads": heads, f"d{name}_rel": _div(dW.norm(), W0.norm())}
    return out


def partial_correlation(x, y, z=None):
    """Pearson correlation of x and y (n,) with z held fixed: of the residuals of least-squares fits
    of x and y on [1, z], z (n,) or (n, k) (k controls); z=None is the plain correlation.

    Pass ranks for the partial Spearman correlation. A float in [-1, 1]; NaN when there is nothing
    to correlate (n < 3 + k, or x or y constant once z is taken out).
    """
    x = _as_f64(x, "x", ndim=1, shape_hint=" (n,)")
    y = _as_f64(y, "y", ndim=1, shape_hint=" (n,)")
    n = x.shape[0]
    if z is None:
        z = torch.zeros(n, 0, dtype=torch.float64)
    else:
        z = _as_f64(z, "z", min_ndim=1, device="cpu")
    z = z[:, None] if z.ndim == 1 else z
    if y.shape[0] != n or z.ndim != 2 or z.shape[0] != n:
        raise ValueError("x (n,), y (n,) and z (n,) or (n, k) must share n, "
                         f"got shapes {tuple(x.shape)}, {tuple(y.shape)} and {tuple(z.shape)}")
    if n < 3 + z.shape[1]:
        return float("nan")
    A = torch.cat([torch.ones(n, 1, dtype=torch.float64), _unit_scale(z - z.mean(0), (0,))], 1)
    xy = _unit_scale(torch.stack([x, y], 1), (0,))
    # The residuals project out the column space of A, taken from its SVD, so that a constant or
    # collinear control (a rank-deficient A) takes out only the directions it has.
    U, S, _ = torch.linalg.svd(A, full_matrices=False)
    U = U[:, S > S[0] * n * torch.finfo(torch.float64).eps]
    res = xy - U @ (U.mT @ xy)
    norms = res.norm(dim=0)
    # a residual at the data's round-off: z explains that series fully, nothing is left to correlate
    if (norms <= 1e-12 * xy.norm(dim=0).clamp(min=1e-300)).any():
        return float("nan")
    return (res[:, 0] @ res[:, 1] / (norms[0] * norms[1])).clamp(-1, 1).item()


def model_ckpt_iters(cfg):
    """The iterations of the model checkpoints, whose records carry the token-level values:
    0, then model_ckpts - 1 iterations log-spaced from max_iters down to the end of warm-up.
    train.py saves there and the analysis reads there, both from this one schedule."""
    n, m = cfg['model_ckpts'], cfg['max_iters']
    if n < 2 or m < 1:
        return {0} if n else set()
    lo = min(max(1, cfg['warmup_iters']), m)
    return {0} | set(np.geomspace(m, lo, n - 1).round().astype(int).tolist())


def token_geometry(q, k, att, n_head):
    """Token-level geometry of one attention layer on a batch.

    q, k: (B, T, C) query and key vectors, all heads concatenated (head h = channels h*d:(h+1)*d);
    att: (B, n_head, T, T) causal attention probabilities.
    Returns floats (lists over heads for *_heads):
      tok_pr_q, tok_pr_k            activation_pr over all B*T tokens pooled, all C dims
      tok_pr_q_head, tok_pr_k_head  mean over heads of activation_pr of the head's d dims;
                                    *_heads per head
      tok_pr_qk                     PR of Q_h K_h^T / sqrt(d) (T x T, before the mask),
                                    mean over heads and sequences; tok_pr_qk_heads per head
      entropy, entropy_norm         mean_attention_entropy (plain, normalized); *_heads per head
      logit_std                     mean of logit_spread over heads, rows and sequences;
                                    logit_std_heads per head
      logit_margin, logit_kurtosis, the same means of each row's top-1 margin, excess kurtosis and
      self_top                      own-key top; *_heads per head
    tok_pr_qk uses d x d Grams, Gq = Q_h^T Q_h, Gk = K_h^T K_h, P = Gq Gk: sum s^2 = tr(P),
    sum s^4 = tr(P P) (the 1/sqrt(d) cancels), so there is no T x T SVD.
    """
    q = _as_f64(q, "q", ndim=3, shape_hint=" (B, T, C)")
    k = _as_f64(k, "k", ndim=3, shape_hint=" (B, T, C)", device=q.device)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape (B, T, C), "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, C = q.shape
    d = _head_dim(C, n_head)
    nh = C // d
    att = _as_probs(att, ndim=4, shape_hint=" (B, n_head, T, T)", device=q.device)
    if att.shape != (B, nh, T, T):
        raise ValueError(f"att must have shape (B, n_head, T, T) = {(B, nh, T, T)} to match q, k "
                         f"of shape {(B, T, C)} and n_head={nh}, got {tuple(att.shape)}")
    if B * T < 2:
        raise ValueError("q, k need at least 2 tokens for a covariance, "
                         f"got shape {tuple(q.shape)}")
    _check_att(att)
    return host_values([_token(q, k, att, n_head)])[0]


def _token(q, k, att, n_head):
    B, T, C = q.shape
    nh = n_head
    d = C // nh
    # (B, nh, T, d)
    Qh, Kh = q.view(B, T, nh, d).transpose(1, 2), k.view(B, T, nh, d).transpose(1, 2)
    hq = _activation_pr(Qh.transpose(0, 1).reshape(nh, B * T, d))
    hk = _activation_pr(Kh.transpose(0, 1).reshape(nh, B * T, d))
    Qs, Ks = _unit_scale(Qh, (-2, -1)), _unit_scale(Kh, (-2, -1))
    P = (Qs.mT @ Qs) @ (Ks.mT @ Ks)   # (B, nh, d, d)
    pr_qk = _div(P.diagonal(dim1=-2, dim2=-1).sum(-1) ** 2, (P * P.mT).sum((-2, -1)))   # (B, nh)
    H = _entropies(att)   # (B, nh, T-1)
    Hn = H / _log_keys(H)
    spread, margin, kurtosis, own = _row_statistics(Qh, Kh)
    return {
        "tok_pr_q": _activation_pr(q.reshape(B * T, C)),
        "tok_pr_k": _activation_pr(k.reshape(B * T, C)),
        "tok_pr_q_head": hq.mean(), "tok_pr_k_head": hk.mean(),
        "tok_pr_q_heads": hq, "tok_pr_k_heads": hk,
        "tok_pr_qk": pr_qk.mean(), "tok_pr_qk_heads": pr_qk.mean(0),
        "entropy": H.mean(), "entropy_norm": Hn.mean(), "entropy_heads": H.mean((0, 2)),
        "entropy_norm_heads": Hn.mean((0, 2)),
        "logit_std": spread.mean(), "logit_std_heads": spread.mean((0, 2)),
        "logit_margin": margin.mean(), "logit_margin_heads": margin.mean((0, 2)),
        "logit_kurtosis": kurtosis.mean(), "logit_kurtosis_heads": kurtosis.mean((0, 2)),
        "self_top": own.mean(), "self_top_heads": own.mean((0, 2)),
    }


# ----------------------------------------------------------------------------------------------
# the training path: the same math on trusted tensors where the model is, one host copy at the end

def as_float64(x):
    """A tensor as float64 where it is (MPS: on the CPU), unchecked, unlike the functions above."""
    return x.detach().to(device=_home(x), dtype=torch.float64)


def record_tensors(W_Q, W_K, W_Q0, W_K0, q, k, att, n_head):
    """layer_geometry, learned_geometry and token_geometry of one layer as float64 tensors where the
    inputs are, unchecked (each check reads a value on the host), for host_values to copy."""
    W_Q, W_K, W_Q0, W_K0, q, k = map(as_float64, (W_Q, W_K, W_Q0, W_K0, q, k))
    att = att.detach().to(device=q.device, dtype=torch.promote_types(att.dtype, torch.float32))
    return {**_layer(W_Q, W_K, n_head), **_learned(W_Q, W_K, W_Q0, W_K0, n_head),
            **_token(q, k, att, n_head)}


def record(qk, qk0, probe, loss, n_head):
    """A training record, computed where the inputs are and copied to the host at once: (loss, one
    dict per layer of layer_geometry, learned_geometry and token_geometry), from the weights and
    W(0) (a (W_Q, W_K) pair per layer), each layer's (q, k, att) on the evaluation batch and its
    loss. The layers are None if any input is not finite."""
    inputs = [(*w, *w0, *acts) for w, w0, acts in zip(qk, qk0, probe)]
    checks = [torch.isfinite(t).all() for layer in inputs for t in layer]
    finite = torch.stack([loss.isfinite()] + checks).all()
    # zeros in place of a record that is not finite keep the linear algebra from failing on it
    layers = [record_tensors(*(torch.where(finite, t, 0.0) for t in layer), n_head)
              for layer in inputs]
    head, *layers = host_values([{"loss": loss, "finite": finite}, *layers])
    return head["loss"], layers if head["finite"] else None


def host_values(rows):
    """Dicts of 0-D, 1-D and 2-D tensors (on one device) -> the same dicts of floats, lists and
    lists of lists, in one copy to the host."""
    flat = [v.detach().reshape(-1) for row in rows for v in row.values()]
    values = torch.cat([v.to(_home(v)).double() for v in flat]).tolist() if flat else []
    out, i = [], 0
    for row in rows:
        out.append({})
        for key, v in row.items():
            part = values[i:i + v.numel()]
            if v.ndim == 0:
                part = part[0]
            elif v.ndim == 2:   # a spectrum per head: a list of lists
                part = [part[j:j + v.shape[1]] for j in range(0, len(part), v.shape[1])]
            out[-1][key] = part
            i += v.numel()
    return out
