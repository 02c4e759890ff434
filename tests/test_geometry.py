"""Tests of geometry.py against closed forms and independent numpy computations
(python -m pytest -q)."""
import math

import numpy as np
import pytest
import torch

import geometry as g

RTOL = 1e-9  # float64 throughout; eigvalsh/QR/SVD paths differ from numpy's SVD only by round-off


@pytest.fixture(autouse=True)
def seed():
    np.random.seed(0)
    torch.manual_seed(0)


# ---- independent numpy references -----------------------------------------------------------

def np_pr(lam):
    lam = np.asarray(lam, dtype=np.float64)
    return lam.sum() ** 2 / (lam ** 2).sum()


def np_svals(M):
    return np.linalg.svd(M, compute_uv=False)


def np_erank(s):
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(-(p * np.log(p)).sum())


def np_cov_pr(X):
    return np_pr(np.linalg.eigvalsh(np.cov(X, rowvar=False)))


def random_orthogonal(n):
    Q, R = np.linalg.qr(np.random.randn(n, n))
    return Q * np.sign(np.diag(R))


def causal_softmax(B, H, T, scale=2.0):
    logits = scale * np.random.randn(B, H, T, T)
    logits[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def uniform_causal(T):
    return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]


def np_entropies(att):
    """H_i = -sum_j a_ij log a_ij of every row i >= 1 of att (..., T, T), one row at a time."""
    T = att.shape[-1]
    H = np.zeros(att.shape[:-2] + (T - 1,))
    for idx in np.ndindex(att.shape[:-2]):
        for i in range(1, T):
            H[idx][i - 1] = -sum(a * math.log(a) for a in att[idx][i, :i + 1] if a > 0)
    return H


def np_grams(W, n_head):
    """W^h W^h^T for each head's rows W^h of W."""
    return [w @ w.T for w in np.split(W, n_head)]


# ---- participation ratio: closed forms --------------------------------------------------------

RANK_ONE = np.outer(np.random.RandomState(3).randn(40), np.random.RandomState(4).randn(30))


# identity: PR = d; rank one: 1; diag(1, 2, 3) has s = 1, 2, 3, so PR = (1 + 4 + 9)^2
# / (1 + 16 + 81) = 196 / 98, and eigenvalues 1, 2, 3 give (1 + 2 + 3)^2 / (1 + 4 + 9) = 36 / 14
@pytest.mark.parametrize("M,lam,pr_M,pr_lam", [(np.eye(d), np.ones(d), d, d)
                                              for d in (1, 5, 64)] + [
    (RANK_ONE, [3.0, 0.0, 0.0], 1.0, 1.0),
    (np.diag([1.0, 2.0, 3.0]), [1.0, 2.0, 3.0], 196 / 98, 36 / 14)])
def test_pr_closed_forms(M, lam, pr_M, pr_lam):
    assert g.matrix_pr(M) == pytest.approx(pr_M, rel=1e-12)
    assert g.participation_ratio(lam) == pytest.approx(pr_lam, rel=1e-12)


@pytest.mark.parametrize("scale", [1e-150, 1e-3, 3.7, 1e120])
def test_pr_scale_invariant(scale):
    M = np.random.randn(20, 30)
    assert g.matrix_pr(scale * M) == pytest.approx(g.matrix_pr(M), rel=1e-12)


def test_pr_square_gaussian_near_half_C():
    # Marchenko-Pastur, aspect ratio 1: the moments of s^2/C are the Catalan numbers 1, 2, so
    # PR = C * 1^2 / 2 = C / 2 (exactly C^2 / (2C + 1) in expectation). At C = 512 the finite-size
    # offset is 0.05% and sample fluctuations are ~0.1%, so 5% is a wide, seed-proof margin.
    C = 512
    assert g.matrix_pr(np.random.randn(C, C)) == pytest.approx(C / 2, rel=0.05)


def test_zero_input_gives_zero_not_nan():
    for value in (g.participation_ratio(np.zeros(4)), g.matrix_pr(np.zeros((4, 6))),
                  g.activation_pr(np.ones((10, 3))), g.effective_rank(np.zeros(4)),
                  g.stable_rank(np.zeros((4, 4)))):
        assert isinstance(value, float) and value == 0.0
    assert torch.equal(g.participation_ratio(np.zeros((2, 3))), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(g.singular_values(np.zeros((3, 5))), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(g.interaction_singular_values(np.zeros((8, 8)), np.zeros((8, 8)), 2),
                       torch.zeros(2, 4, dtype=torch.float64))


# ---- spectra against numpy's SVD --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(16, 16), (10, 30), (30, 10), (4, 7, 12)])
def test_matrix_pr_and_singular_values_match_numpy_svd(shape):
    M = np.random.randn(*shape)
    s_ref = np_svals(M)
    s = g.singular_values(M)
    assert s.dtype == torch.float64 and s.shape == s_ref.shape
    assert np.allclose(s.numpy(), s_ref, rtol=1e-9, atol=1e-9 * s_ref.max())
    assert np.all(np.diff(s.numpy(), axis=-1) <= 0)  # descending
    pr = g.matrix_pr(M)
    pr_ref = np_pr(s_ref ** 2) if M.ndim == 2 else [np_pr(x ** 2) for x in s_ref]
    assert np.allclose(pr if M.ndim == 2 else pr.numpy(), pr_ref, rtol=RTOL)


@pytest.mark.parametrize("C,n_head,rank", [(32, 1, None), (64, 4, None), (96, 3, None),
                                           (128, 8, None), (64, 4, 3), (96, 2, 10)])
def test_interaction_singular_values_match_explicit_svd(C, n_head, rank):
    d = C // n_head
    W_Q, W_K = np.random.randn(C, C), np.random.randn(C, C)
    # rank-deficient: every head has rank <= rank < d, and one head is all zero
    if rank is not None:
        W_Q = np.random.randn(C, rank) @ np.random.randn(rank, C)
        W_K[:d] = 0.0
    s = g.interaction_singular_values(W_Q, W_K, n_head)
    assert s.shape == (n_head, d)
    for h in range(n_head):
        A = W_Q[h * d:(h + 1) * d].T @ W_K[h * d:(h + 1) * d]  # C x C
        ref = np_svals(A)
        scale = max(ref.max(), 1.0)
        assert np.allclose(s[h].numpy(), ref[:d], rtol=1e-9, atol=1e-9 * scale)
        assert np.all(ref[d:] <= 1e-9 * scale)  # rank <= d: nothing is lost by keeping d values


# ---- token-level PR ---------------------------------------------------------------------------

def test_activation_pr_matches_numpy_cov():
    X = np.random.randn(200, 12) * np.linspace(0.2, 2.0, 12) + 5.0
    assert g.activation_pr(X) == pytest.approx(np_cov_pr(X), rel=RTOL)
    wide = np.random.randn(8, 40)  # fewer tokens than dims
    assert g.activation_pr(wide) == pytest.approx(np_cov_pr(wide), rel=1e-8)


# ---- attention entropy ------------------------------------------------------------------------

# uniform over the allowed keys: H_i = log(i + 1); one-hot (on the diagonal, or every row on key
# 0): 0
@pytest.mark.parametrize("att,plain,norm", [
    (np.broadcast_to(uniform_causal(16), (2, 3, 16, 16)), np.log(np.arange(2, 17)).mean(), 1.0),
    (np.eye(10), 0.0, 0.0), (np.tile(np.eye(10)[0], (10, 1)), 0.0, 0.0)])
def test_entropy_closed_forms(att, plain, norm):
    assert g.mean_attention_entropy(att) == pytest.approx(plain, rel=1e-12, abs=0)
    assert g.mean_attention_entropy(att, normalized=True) == pytest.approx(norm, rel=1e-12, abs=0)
    assert g.attention_entropy(att).shape == (*att.shape[:-2], att.shape[-1] - 1)


def test_entropy_matches_python_loop():
    att = causal_softmax(2, 3, 9)
    H = np_entropies(att)
    np.testing.assert_allclose(g.attention_entropy(att).numpy(), H, rtol=1e-12)
    H_norm = H / np.log(np.arange(2, 10))   # rows i = 1..8: log(i + 1)
    np.testing.assert_allclose(g.attention_entropy(att, normalized=True).numpy(), H_norm,
                               rtol=1e-12)
    assert g.mean_attention_entropy(att) == pytest.approx(H.mean(), rel=1e-12)


# ---- layer and token geometry against numpy ---------------------------------------------------

LAYER_KEYS = {"pr_q", "pr_k", "pr_q_head", "pr_k_head", "pr_q_heads", "pr_k_heads", "pr_qk",
              "pr_qk_heads",
              "qk_spec_norm", "qk_fro_norm", "qk_spec_norm_heads", "qk_fro_norm_heads",
              "erank_q", "erank_k", "srank_q", "srank_k", "erank_qk", "q_spec_norm", "k_spec_norm",
              "q_spec_norm_heads", "k_spec_norm_heads", "qk_imbalance", "qk_imbalance_heads",
              "qk_gram", "qk_gram_heads",
              "sv_q_heads", "sv_k_heads", "sv_qk_heads",
              "qk_eig_mean", "qk_eig_mean_heads", "qk_eig_std", "qk_eig_std_heads"}
TOKEN_KEYS = {"tok_pr_q", "tok_pr_k", "tok_pr_q_head", "tok_pr_k_head", "tok_pr_q_heads",
              "tok_pr_k_heads",
              "tok_pr_qk", "tok_pr_qk_heads",
              "entropy", "entropy_norm", "entropy_heads", "entropy_norm_heads", "logit_std",
              "logit_std_heads", "logit_margin", "logit_margin_heads", "logit_kurtosis",
              "logit_kurtosis_heads", "self_top", "self_top_heads"}


ROW_STATS = {   # a row's logits over its keys, the query's own last
    "logit_std": np.std,
    "logit_margin": lambda row: (row.max() - row.mean()) / np.std(row),
    "logit_kurtosis": lambda row: np.mean((row - row.mean()) ** 4) / np.var(row) ** 2 - 3,
    "self_top": lambda row: float(row[-1] == row.max()),
}


def np_layer_geometry(W_Q, W_K, n_head):
    ref = {}
    for name, W in (("q", W_Q), ("k", W_K)):
        s = np_svals(W)
        heads = [np_pr(np_svals(w) ** 2) for w in np.split(W, n_head)]
        ref |= {f"pr_{name}": np_pr(s ** 2), f"pr_{name}_heads": heads,
                f"pr_{name}_head": np.mean(heads),
                f"erank_{name}": np_erank(s), f"srank_{name}": (W ** 2).sum() / s[0] ** 2,
                f"{name}_spec_norm_heads": [np.linalg.norm(w, 2) for w in np.split(W, n_head)],
                f"sv_{name}_heads": [np.linalg.svd(w, compute_uv=False)
                                     for w in np.split(W, n_head)]}
    grams = list(zip(np_grams(W_Q, n_head), np_grams(W_K, n_head)))
    ref["qk_gram_heads"] = [(np.linalg.norm(Gq) + np.linalg.norm(Gk)) / 2 for Gq, Gk in grams]
    ref["qk_imbalance_heads"] = [np.linalg.norm(Gq - Gk) / n
                                 for (Gq, Gk), n in zip(grams, ref["qk_gram_heads"])]
    inter = [wq.T @ wk for wq, wk in zip(np.split(W_Q, n_head), np.split(W_K, n_head))]
    s_qk = [np_svals(A)[:W_Q.shape[0] // n_head] for A in inter]
    ref["sv_qk_heads"] = s_qk
    ref["pr_qk_heads"] = [np_pr(s ** 2) for s in s_qk]
    ref["qk_spec_norm_heads"] = [np.linalg.norm(A, 2) for A in inter]
    ref["qk_fro_norm_heads"] = [np.linalg.norm(A, "fro") for A in inter]
    symmetric = [np.linalg.eigvalsh((A + A.T) / 2) for A in inter]   # real: the symmetric part
    ref["qk_eig_mean_heads"] = [np.trace(A) / len(A) for A in inter]
    ref["qk_eig_std_heads"] = [np.std(eig) for eig in symmetric]
    for key in ("pr_qk", "qk_spec_norm", "qk_fro_norm", "q_spec_norm", "k_spec_norm",
                "qk_imbalance", "qk_gram", "qk_eig_mean", "qk_eig_std"):
        ref[key] = np.mean(ref[f"{key}_heads"])
    ref["erank_qk"] = np.mean([np_erank(s) for s in s_qk])
    return ref


def np_token_geometry(q, k, att, n_head):
    B, T, C = q.shape
    d = C // n_head
    ref = {}
    for name, X in (("q", q.reshape(B * T, C)), ("k", k.reshape(B * T, C))):
        heads = [np_cov_pr(X[:, h * d:(h + 1) * d]) for h in range(n_head)]
        ref |= {f"tok_pr_{name}": np_cov_pr(X), f"tok_pr_{name}_heads": heads,
                f"tok_pr_{name}_head": np.mean(heads)}
    pr_qk = np.zeros((B, n_head))
    rows = {name: np.zeros((B, n_head, T - 1)) for name in ROW_STATS}
    for b in range(B):
        for h in range(n_head):
            # T x T
            logits = q[b, :, h * d:(h + 1) * d] @ k[b, :, h * d:(h + 1) * d].T / math.sqrt(d)
            pr_qk[b, h] = np_pr(np_svals(logits) ** 2)
            for name, fn in ROW_STATS.items():
                rows[name][b, h] = [fn(logits[i, :i + 1]) for i in range(1, T)]
    ref |= {"tok_pr_qk": pr_qk.mean(), "tok_pr_qk_heads": list(pr_qk.mean(0))}
    for name, values in rows.items():
        ref |= {name: values.mean(), f"{name}_heads": list(values.mean((0, 2)))}
    H = np_entropies(att)
    Hn = H / np.log(np.arange(2, T + 1))
    ref |= {"entropy": H.mean(), "entropy_norm": Hn.mean(),
            "entropy_heads": list(H.mean((0, 2))), "entropy_norm_heads": list(Hn.mean((0, 2)))}
    return ref


def assert_matches(out, ref, keys, n_head):
    assert set(out) == keys
    for key in keys:
        if key.endswith("_heads"):
            assert isinstance(out[key], list) and len(out[key]) == n_head, key
            assert np.allclose(out[key], ref[key], rtol=RTOL), key
        else:
            assert isinstance(out[key], float), key
            assert out[key] == pytest.approx(ref[key], rel=RTOL), key


def test_logit_spread_closed_form():
    # head 0: keys k_j = j and queries sqrt(d) * c, so row i's logits are c * (0, 1, ..., i), whose
    # population std is c * sqrt(((i + 1)^2 - 1) / 12); head 1: every logit equal, spread 0
    B, T, d, c = 1, 9, 4, 0.5
    q, k = np.zeros((B, T, 2 * d)), np.zeros((B, T, 2 * d))
    q[0, :, 0], k[0, :, 0] = c * math.sqrt(d), np.arange(T)
    q[0, :, d:], k[0, :, d:] = 1.0, 2.0
    i = np.arange(1, T)
    want = c * np.sqrt(((i + 1) ** 2 - 1) / 12)
    got = g.logit_spread(q, k, 2)
    assert got.shape == (B, 2, T - 1)
    assert np.allclose(got[0, 0].numpy(), want, rtol=1e-12) and np.allclose(got[0, 1].numpy(), 0)
    out = g.token_geometry(q, k, causal_softmax(B, 2, T), 2)
    assert out["logit_std_heads"] == pytest.approx([want.mean(), 0.0], abs=1e-12)
    assert out["logit_std"] == pytest.approx(want.mean() / 2, rel=1e-12)
    # equally spaced logits: (max - mean) / sigma = sqrt(3 i / (i + 2)), the excess kurtosis of n
    # equally spaced points -6 (n^2 + 1) / (5 (n^2 - 1)), and the own key (the last) on top; equal
    # logits: margin and kurtosis 0 by convention, and the own key ties for the top
    n = i + 1
    margin, kurtosis = np.sqrt(3 * i / (i + 2)), -6 * (n ** 2 + 1) / (5 * (n ** 2 - 1))
    assert out["logit_margin_heads"] == pytest.approx([margin.mean(), 0.0], abs=1e-12)
    assert out["logit_kurtosis_heads"] == pytest.approx([kurtosis.mean(), 0.0], abs=1e-12)
    assert out["self_top_heads"] == [1.0, 1.0]
    q[0, :, 0] *= -1   # the order reversed: key 0 on top, the own key never (but in row 0)
    out = g.token_geometry(q, k, causal_softmax(B, 2, T), 2)
    assert out["logit_margin_heads"][0] == pytest.approx(margin.mean(), abs=1e-12)
    assert out["self_top_heads"][0] == 0.0


def test_a_symmetric_interaction_s_eigenvalues_are_its_mean_and_spread():
    # W_QK = W_Q^T W_K with W_Q = I (one head, d = C): W_QK = W_K, symmetric with eigenvalues lam
    lam = np.array([3.0, -1.0, 2.0, 0.5])
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(4, 4)))[0]
    out = g.layer_geometry(np.eye(4), basis @ np.diag(lam) @ basis.T, 1)
    assert out["qk_eig_mean"] == pytest.approx(lam.mean(), rel=1e-12)
    assert out["qk_eig_std"] == pytest.approx(lam.std(), rel=1e-12)


def test_spectra_in_a_record_are_numpys_singular_values():
    C, n_head = 12, 3
    W_Q, W_K = np.random.randn(C, C), np.random.randn(C, C)
    W_K[:4] = 0.0   # a zero head: its spectrum is all zeros
    out = g.layer_geometry(W_Q, W_K, n_head)
    for name, W in (("q", W_Q), ("k", W_K)):
        want = [np.linalg.svd(w, compute_uv=False) for w in np.split(W, n_head)]
        assert np.allclose(out[f"sv_{name}_heads"], want, atol=1e-10)
    pairs = zip(np.split(W_Q, n_head), np.split(W_K, n_head))
    want = [np.linalg.svd(wq.T @ wk, compute_uv=False)[:C // n_head] for wq, wk in pairs]
    assert np.allclose(out["sv_qk_heads"], want, atol=1e-10)
    assert out["sv_k_heads"][0] == [0.0] * (C // n_head)


def test_layer_geometry_matches_numpy():
    C, n_head = 48, 3
    W_Q = 0.02 * np.random.randn(C, C)
    W_K = 0.02 * np.random.randn(C, C) * np.linspace(0.1, 1.0, C)  # a less even key spectrum
    ref = np_layer_geometry(W_Q, W_K, n_head)
    assert_matches(g.layer_geometry(W_Q, W_K, n_head), ref, LAYER_KEYS, n_head)


def test_token_geometry_matches_numpy():
    B, T, C, n_head = 2, 12, 16, 2
    q, k = np.random.randn(B, T, C) + 1.0, np.random.randn(B, T, C)
    att = causal_softmax(B, n_head, T)
    ref = np_token_geometry(q, k, att, n_head)
    assert_matches(g.token_geometry(q, k, att, n_head), ref, TOKEN_KEYS, n_head)


# ---- effective and stable rank ----------------------------------------------------------------

def test_effective_and_stable_rank():
    d = 12
    assert g.effective_rank(g.singular_values(np.eye(d))) == pytest.approx(d, rel=1e-12)
    assert g.effective_rank(np.r_[2.0, np.zeros(d - 1)]) == pytest.approx(1.0, rel=1e-12)
    # through singular_values a rank-1 matrix has round-off values ~1e-8 * s_max (sqrt of eigvalsh)
    rank1 = np.outer(np.random.randn(d), np.random.randn(d))
    assert g.effective_rank(g.singular_values(rank1)) == pytest.approx(1.0, abs=1e-4)
    assert g.stable_rank(np.eye(d)) == pytest.approx(d, rel=1e-12)
    M = np.random.randn(3, 10, 14)
    ref = [(m ** 2).sum() / np_svals(m)[0] ** 2 for m in M]
    assert np.allclose(g.stable_rank(M).numpy(), ref, rtol=RTOL)
    s = np.abs(np.random.randn(4, 9))
    assert np.allclose(g.effective_rank(s).numpy(), [np_erank(x) for x in s], rtol=RTOL)


# ---- the learned part W - W(0) ----------------------------------------------------------------

LEARNED_KEYS = {"pr_dq", "pr_dk", "pr_dq_head", "pr_dk_head", "pr_dq_heads", "pr_dk_heads",
                "dq_rel", "dk_rel",
                "qk_drift", "qk_drift_heads"}


@pytest.mark.parametrize("r", [1, 3, 7])
def test_learned_part_of_rank_r_with_equal_singular_values_has_pr_r(r):
    C, n_head = 24, 3
    W0 = 0.02 * np.random.randn(C, C)
    U, V = random_orthogonal(C)[:, :r], random_orthogonal(C)[:, :r]
    W = W0 + 0.5 * U @ V.T            # singular values 0.5 (r times): PR exactly r
    out = g.learned_geometry(W, W0, W0, W0, n_head)
    assert set(out) == LEARNED_KEYS
    assert out["pr_dq"] == pytest.approx(r, rel=1e-9)
    assert out["dq_rel"] == pytest.approx(0.5 * math.sqrt(r) / np.linalg.norm(W0), rel=1e-9)
    assert (out["pr_dk"] == out["pr_dk_head"] == out["dk_rel"] == 0.0
            and out["pr_dk_heads"] == [0.0] * n_head)


def test_learned_part_per_head_by_hand():
    C, n_head = 24, 4
    W_Q0, W_K0 = np.random.randn(C, C), np.random.randn(C, C)
    W_Q = W_Q0 + np.random.randn(C, C) * np.linspace(0.1, 2.0, C)   # an uneven change
    W_K = W_K0 + np.outer(np.random.randn(C), np.random.randn(C)) + 0.1 * np.random.randn(C, C)
    out = g.learned_geometry(W_Q, W_K, W_Q0, W_K0, n_head)
    for name, dW, W0 in (("q", W_Q - W_Q0, W_Q0), ("k", W_K - W_K0, W_K0)):
        heads = [np_pr(np_svals(w) ** 2) for w in np.split(dW, n_head)]
        assert np.allclose(out[f"pr_d{name}_heads"], heads, rtol=RTOL)
        assert out[f"pr_d{name}_head"] == pytest.approx(np.mean(heads), rel=RTOL)
        assert out[f"pr_d{name}"] == pytest.approx(np_pr(np_svals(dW) ** 2), rel=RTOL)
        assert out[f"d{name}_rel"] == pytest.approx(np.linalg.norm(dW) / np.linalg.norm(W0),
                                                    rel=RTOL)
    D, D0 = (np.subtract(np_grams(A, n_head), np_grams(B, n_head))
             for A, B in ((W_Q, W_K), (W_Q0, W_K0)))
    gram = g.layer_geometry(W_Q, W_K, n_head)["qk_gram_heads"]
    assert np.allclose(out["qk_drift_heads"], np.linalg.norm(D - D0, axis=(1, 2)) / gram, rtol=RTOL)


def test_learned_part_of_an_unchanged_or_zero_init_weight_is_zero_not_nan():
    W0 = np.random.randn(8, 8).astype(np.float32)
    out = g.learned_geometry(W0, torch.from_numpy(W0), W0, W0, 2)
    assert out == {k: ([0.0, 0.0] if k.endswith("_heads") else 0.0) for k in LEARNED_KEYS}
    assert all(isinstance(out[k], float) for k in LEARNED_KEYS if not k.endswith("_heads"))
    zero = np.zeros((8, 8))
    assert g.learned_geometry(W0, W0, zero, zero, 2)["dq_rel"] == 0.0   # no scale to compare with


# ---- partial correlation: the logit scale held fixed ------------------------------------------

def np_partial(x, y, Z):
    """Residuals of least-squares fits on [1, Z] (numpy lstsq), then their correlation."""
    A = np.column_stack([np.ones(len(x)), Z])
    rx = x - A @ np.linalg.lstsq(A, x, rcond=None)[0]
    ry = y - A @ np.linalg.lstsq(A, y, rcond=None)[0]
    return rx @ ry / np.sqrt((rx @ rx) * (ry @ ry))


def test_partial_correlation_closed_forms():
    n = 40
    x, y, z = np.random.randn(n), np.random.randn(n), np.random.randn(n)
    y = y + 0.5 * x + 0.7 * z
    assert g.partial_correlation(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)
    r = np.corrcoef([x, y, z])
    first_order = (r[0, 1] - r[0, 2] * r[1, 2]) / math.sqrt((1 - r[0, 2] ** 2) * (1 - r[1, 2] ** 2))
    assert g.partial_correlation(x, y, z) == pytest.approx(first_order, rel=1e-10)
    Z = np.column_stack([z, np.random.randn(n)])
    assert g.partial_correlation(x, y, Z) == pytest.approx(np_partial(x, y, Z), rel=1e-10)
    # affine maps of x, y, z change nothing but the sign
    assert g.partial_correlation(3 * x + 1, -2 * y, 1e6 * z - 5) == pytest.approx(-first_order,
                                                                                  rel=1e-9)
    # a constant control or a repeated one is the same as none or one
    assert g.partial_correlation(x, y, np.full(n, 2.0)) == pytest.approx(np.corrcoef(x, y)[0, 1],
                                                                         rel=1e-10)
    assert g.partial_correlation(x, y, np.column_stack([z, 2 * z])) == pytest.approx(first_order,
                                                                                     rel=1e-9)


@pytest.mark.parametrize("effect", ["scale", "shape", "both"])
def test_partial_correlation_separates_planted_scale_from_shape(effect):
    """Entropy driven by the logit scale alone, by the spectrum's shape alone, or by both: the
    partial correlation given the scale is near 0 only in the first case."""
    n = 2000
    log_scale, shape = np.random.randn(n), np.random.randn(n)
    # PR_K drifts with the scale, or not
    pr_k = shape + (0.8 * log_scale if effect != "shape" else 0.0)
    entropy = ({"scale": -log_scale, "shape": shape, "both": shape - log_scale}[effect]
               + 0.3 * np.random.randn(n))
    raw, partial = (g.partial_correlation(entropy, pr_k),
                    g.partial_correlation(entropy, pr_k, log_scale))
    if effect == "scale":
        assert raw < -0.3 and abs(partial) < 0.1
    else:
        assert partial > 0.5


def test_partial_correlation_with_nothing_to_correlate_is_nan():
    x, z = np.random.randn(10), np.random.randn(10)
    assert math.isnan(g.partial_correlation(x, 2 * z + 1, z))   # y is all scale: nothing left
    assert math.isnan(g.partial_correlation(np.full(10, 3.0), x))
    assert math.isnan(g.partial_correlation(x[:3], x[:3] ** 2, z[:3]))   # 3 points, one control
    assert not math.isnan(g.partial_correlation(x[:4], x[:4] ** 2, z[:4]))


# ---- errors -----------------------------------------------------------------------------------

W8 = np.random.RandomState(1).randn(8, 8)
ATT = uniform_causal(4)[None, None].repeat(2, axis=1)  # (1, 2, 4, 4)
QK = np.random.RandomState(2).randn(1, 4, 8)


def with_value(x, index, value):
    x = x.copy()
    x[index] = value
    return x


@pytest.mark.parametrize("call,match", [
    (lambda: g.layer_geometry(W8, W8, 3), "not divisible by n_head"),
    (lambda: g.layer_geometry(with_value(W8, (2, 3), np.nan), W8, 2),
     "NaN or Inf.*index \\(2, 3\\)"),
    (lambda: g.attention_entropy(with_value(ATT, (0, 1, 2, 0), 0.9)), "sums to .* not 1"),
    (lambda: g.attention_entropy(np.full((4, 4), 0.25)), "causal"),
    (lambda: g.token_geometry(QK, QK, ATT[:, :1], 2), "att must have shape"),
    (lambda: g.learned_geometry(W8, W8, W8[:4], W8, 2),
     "W_Q0 and W_K0 must have the shape of W_Q and W_K"),
    (lambda: g.partial_correlation(W8[0], W8[1, :7], W8[2]), "must share n"),
    (lambda: g.partial_correlation(W8[0], with_value(W8[1], 2, np.nan)), "y has 1 NaN"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the conservation law of D_h: gradient flow keeps it, finite steps and Adam do not ---------

# the Q/K init: large enough that their gradients, each proportional to the other, are not tiny
STD = 0.3


def train_qk(optimizer, lr, steps, qk_init="normal", seed=0):
    """A one-layer model in float64 on a copy task (attention must learn it), trained with the
    project's optimizer with W_Q and W_K the only weights that learn. Returns W_Q, W_K before and
    after (numpy)."""
    import train
    torch.manual_seed(seed)
    model = train.GPT(train.GPTConfig(vocab_size=12, block_size=16, n_layer=1, n_head=2, n_embd=16),
                      qk_init).double()
    wq, wk = model.qk_weights()[0]
    with torch.no_grad():
        wq.normal_(0, STD)
        wk.copy_(wq) if qk_init == "tied" else wk.normal_(0, STD)
    for p in model.parameters():
        p.requires_grad_(any(p is w for w in (wq, wk)))
    before = [w.detach().numpy().copy() for w in (wq, wk)]
    cfg = train.get_config([f"--optimizer={optimizer}", f"--lr={lr}", "--momentum=0",
                            "--weight_decay=0"])
    opt = train.make_optimizer(model, cfg, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        half = torch.randint(12, (8, 8), generator=gen)
        x = torch.cat([half, half], 1)   # the second half repeats the first: attend 8 back
        model(x[:, :-1], x[:, 1:].contiguous())[1].backward()
        opt.step()
        opt.zero_grad()
    return before, [w.detach().numpy().copy() for w in (wq, wk)]


def drift(before, after, n_head=2):
    """||D_h(t) - D_h(0)||_F summed over heads, with D_h = W_Q^h W_Q^h^T - W_K^h W_K^h^T, and how
    far the Gram matrix W_Q^h W_Q^h^T itself moved."""
    D, D0 = (np.subtract(np_grams(wq, n_head), np_grams(wk, n_head)) for wq, wk in (after, before))
    moved = np.subtract(np_grams(after[0], n_head), np_grams(before[0], n_head))
    return np.linalg.norm(D - D0, axis=(1, 2)).sum(), np.linalg.norm(moved, axis=(1, 2)).sum()


def test_plain_sgd_drifts_d_h_in_proportion_to_lr_and_adamw_does_not():
    """Over a fixed training time (steps x lr) the Gram matrices move at first order, while each
    plain SGD step adds only O(lr^2) to D_h: halving lr halves its drift. AdamW's per-coordinate
    scaling breaks the law at first order: its drift is of the order of the Grams' move and does not
    halve with lr."""
    (sgd1, move1), (sgd2, move2) = (drift(*train_qk("sgd", lr, int(2000 / lr))) for lr in (16, 8))
    assert 1.85 < sgd1 / sgd2 < 2.15 and sgd2 < 0.1 * move2
    (adam1, _), (adam2, adam_move) = (drift(*train_qk("adamw", lr, int(0.4 / lr)))
                                      for lr in (4e-3, 2e-3))
    assert adam1 / adam2 < 1.75 and adam2 > 0.3 * adam_move


def test_a_tied_init_under_plain_sgd_keeps_equal_query_and_key_spectra():
    """D_h(0) = 0 and plain SGD adds only O(lr^2) per step: the per-head singular values of W_Q^h
    and W_K^h, the square roots of the two Grams' eigenvalues, stay equal to 1e-3 of the largest
    while W_Q moves by more than 8%; the same run from a normal init keeps them apart by more than
    3%."""
    for init, close in (("tied", True), ("normal", False)):
        before, (wq, wk) = train_qk("sgd", 8, 500, qk_init=init)
        assert np.linalg.norm(wq - before[0]) / np.linalg.norm(before[0]) > 0.08
        sq, sk = (g.singular_values(g.split_heads(w, 2)).numpy() for w in (wq, wk))
        assert (np.abs(sq - sk).max() / sq.max() < 1e-3 if close
                else np.abs(sq - sk).max() / sq.max() > 0.03)
