"""
The statistics of the analysis: pure functions on numpy arrays, no I/O (analyze.py, regime.py, report.py and
tokens.py call them; the geometry itself is geometry.py's). Every random draw comes from a fixed seed, so a report
is reproducible to the last digit.

- Spearman correlation: the Pearson correlation of the ranks, ties given their average rank.
- Pearson correlation, and the partial correlation of x and y given z: geometry.partial_correlation (the one place
  the formula lives), the Pearson correlation of what is left of x and y once a linear fit on z is taken out of
  each. Used on the values with z = log ||W_QK||_2, and set beside the Pearson correlation without z (one family):
  a partial Spearman (on ranks) is biased upward (about +0.08 at 16 heads, +0.05 at 32) when x and y both depend
  linearly on z, which would read as shape beyond scale where there is none.
- Percentile bootstrap interval of a mean (N_BOOT resamples), exact one-sided sign test, one-sided permutation
  test of a positive Spearman correlation (N_PERM shuffles).
- Least-squares fit of y on [1, X] with jackknife-t intervals over groups (seeds): the arms of one seed share its
  baseline run and are not independent, so a seed is left out whole.
"""
import functools
import math

import numpy as np

import geometry

N_BOOT = 10000             # bootstrap resamples
BOOT_SEED = 0              # every bootstrap and permutation draws from this seed: the report is reproducible
LEVEL = 0.95               # interval level
N_PERM = 2000              # shuffles of the one-sided permutation test


def rankdata(x):
    """Ranks 1..n of x; tied values get the average of the ranks they span."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind='mergesort')
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + 1 + ends) / 2, ends - starts)
    return ranks


def spearman(x, y):
    """Spearman rank correlation: the Pearson correlation of the (average-tied) ranks. Pairs with a NaN
    are dropped; NaN with fewer than 3 pairs or a constant series."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return float('nan')
    rx, ry = rankdata(x[ok]), rankdata(y[ok])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float('nan')


def pearson(x, y):
    """Pearson correlation (geometry.partial_correlation without a control); pairs with a NaN are dropped; NaN with
    fewer than 3 pairs or a constant series."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    return geometry.partial_correlation(x[ok], y[ok]) if ok.sum() >= 3 else float('nan')


def partial(x, y, z):
    """Partial correlation of x and y given z (geometry.partial_correlation); triples with a NaN are dropped;
    NaN with fewer than 4 triples or when nothing is left to correlate."""
    x, y, z = (np.asarray(v, dtype=float) for v in (x, y, z))
    ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
    return geometry.partial_correlation(x[ok], y[ok], z[ok]) if ok.sum() >= 4 else float('nan')


# ---- across the (layer, head) pairs of one run, per record: claims (c) and (c2), and the regime's by layer position

# claim (c): name -> (x, y), Spearman of per-head values; the claim is judged on its two links, PR_K with entropy and
# with PR_QK (report.C_LINKS); PR_QK with entropy is shown beside them
HEAD_LINKS = {'pr_k~entropy': ('k', 'entropy'), 'pr_k~pr_qk': ('k', 'qk'), 'pr_qk~entropy': ('qk', 'entropy')}
# scale against shape (c2): the statistics of shape_stats (Pearson), across heads and within runs
SHAPE_STATS = ('pr_k~entropy', 'pr_k~entropy|scale', 'pr_qk~entropy', 'pr_qk~entropy|scale', 'scale~entropy')


def by_record(a):
    """An array of shape (records, pairs...) as (records, pairs)."""
    return np.asarray(a, dtype=float).reshape(len(a), -1)


def head_links(entropy, k, qk):
    """Arrays of shape (records, pairs...): per record, the Spearman correlation across its pairs of each of
    HEAD_LINKS; and per step between consecutive records, the same of the changes over that step.
    ({link: per-record values}, {link: per-step values})."""
    v = {'entropy': by_record(entropy), 'k': by_record(k), 'qk': by_record(qk)}
    d = {role: np.diff(a, axis=0) for role, a in v.items()}
    corr = lambda m, x, y: [spearman(a, b) for a, b in zip(m[x], m[y])]
    return ({name: corr(v, x, y) for name, (x, y) in HEAD_LINKS.items()},
            {name: corr(d, x, y) for name, (x, y) in HEAD_LINKS.items()})


def head_shapes(entropy, scale, k, qk):
    """Arrays of shape (records, pairs...), scale the log logit scale: per record, shape_stats across its pairs."""
    return [shape_stats(*row) for row in zip(*map(by_record, (entropy, scale, k, qk)))]


def shape_stats(entropy, scale, pr_k, pr_qk):
    """Pearson throughout (one family with the partials): entropy with PR_K and PR_QK, without and with the log
    scale held fixed, and entropy with the log scale."""
    return {'pr_k~entropy': pearson(pr_k, entropy), 'pr_k~entropy|scale': partial(pr_k, entropy, scale),
            'pr_qk~entropy': pearson(pr_qk, entropy), 'pr_qk~entropy|scale': partial(pr_qk, entropy, scale),
            'scale~entropy': pearson(scale, entropy)}


def bootstrap_means(x, n_boot=N_BOOT, seed=BOOT_SEED):
    """Means of n_boot resamples (with replacement) of x, from a fixed seed."""
    x = np.asarray(x, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    return x[idx].mean(1)


def bootstrap_ci(x, level=LEVEL, n_boot=N_BOOT, seed=BOOT_SEED):
    """Percentile bootstrap interval of the mean of x (NaNs dropped); (nan, nan) for fewer than 2 values,
    where resampling says nothing."""
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float('nan'), float('nan')
    lo, hi = np.percentile(bootstrap_means(x, n_boot, seed), [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def sign_test_p(n_predicted, n):
    """Exact one-sided sign test: P(X >= n_predicted) for X ~ Binomial(n, 1/2); NaN when n = 0."""
    if n == 0:
        return float('nan')
    return sum(math.comb(n, i) for i in range(n_predicted, n + 1)) / 2 ** n


def paired_effect(diffs, sign=None):
    """Mean paired difference with its bootstrap interval; with a predicted sign (+1 or -1) also the
    count with that sign, the sign test (exact zeros dropped) and the directional confidence: the share
    of bootstrap means with the predicted sign."""
    d = np.asarray([v for v in diffs if np.isfinite(v)], dtype=float)
    out = {'n': len(d), 'mean': float(d.mean()) if len(d) else float('nan')}
    out['ci_lo'], out['ci_hi'] = bootstrap_ci(d)
    out.update(predicted='' if sign is None else '+' if sign > 0 else '-', n_predicted=None, sign_p=None,
               confidence=None)
    if sign is not None and len(d):
        nonzero = d[d != 0]
        out['n_predicted'] = int((sign * nonzero > 0).sum())
        out['sign_p'] = sign_test_p(out['n_predicted'], len(nonzero))
        out['confidence'] = float((sign * bootstrap_means(d) > 0).mean())
    return out


def mean_ci(values):
    """{'mean', 'lo', 'hi', 'n'} of the finite values: mean and bootstrap interval."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    lo, hi = bootstrap_ci(v)
    return {'mean': float(v.mean()) if len(v) else float('nan'), 'lo': lo, 'hi': hi, 'n': len(v)}


def permutation_p(x, y, n_perm=N_PERM, seed=BOOT_SEED):
    """One-sided permutation test of a positive Spearman correlation: (1 + the shuffles of y whose correlation
    with x reaches the observed one) / (1 + n_perm), shuffles from a fixed seed; NaN where spearman is NaN."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    rho = spearman(x, y)
    if not np.isfinite(rho):
        return float('nan')
    ok = np.isfinite(x) & np.isfinite(y)
    rx, ry = rankdata(x[ok]), rankdata(y[ok])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    shuffled = np.random.default_rng(seed).permuted(np.tile(ry, (n_perm, 1)), axis=1)
    null = shuffled @ rx / math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((1 + (null >= rho - 1e-12).sum()) / (1 + n_perm))


def fit_groups(y, X, groups, level=LEVEL):
    """Least-squares fit of y (n,) on [1, X] (X (n,) or (n, k)) with an interval for each coefficient from a
    delete-one-group jackknife: the fit is repeated leaving out each group (a seed: its rows share a baseline run and
    go together), se^2 = (G - 1) / G * sum (coef_-g - their mean)^2, interval coef -/+ t * se with Student's t on
    G - 1 degrees of freedom. With a handful of seeds a percentile bootstrap of groups gives intervals narrower than
    their level (84% coverage at 95%, 5 seeds, in a planted check), the jackknife-t close to it (95%). Rows with a
    NaN are dropped. Returns {'coef', 'lo', 'hi'}, arrays of k + 1 (the intercept first): NaN coefficients when the
    design is rank-deficient, NaN intervals with fewer than 3 groups or a rank-deficient leave-one-out design."""
    y, X = np.asarray(y, dtype=float), np.asarray(X, dtype=float).reshape(len(y), -1)
    ok = np.isfinite(y) & np.isfinite(X).all(1)
    A, y, groups = np.column_stack([np.ones(ok.sum()), X[ok]]), y[ok], np.asarray(groups)[ok]
    coef, nan = least_squares(A, y), np.full(A.shape[1], np.nan)
    names = np.unique(groups)
    if len(names) < 3:
        return {'coef': coef, 'lo': nan, 'hi': nan}
    jack = np.array([least_squares(A[groups != g], y[groups != g]) for g in names])
    se = np.sqrt((len(names) - 1) / len(names) * ((jack - jack.mean(0)) ** 2).sum(0))
    t = t_quantile(0.5 + level / 2, len(names) - 1)
    return {'coef': coef, 'lo': coef - t * se, 'hi': coef + t * se}


def least_squares(A, y):
    """The least-squares coefficients of y on the columns of A; NaN when A is rank-deficient."""
    if np.linalg.matrix_rank(A) < A.shape[1]:
        return np.full(A.shape[1], np.nan)
    return np.linalg.lstsq(A, y, rcond=None)[0]


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The p-quantile (0.5 <= p < 1) of Student's t with df degrees of freedom: its density integrated on a fine
    grid (trapezoids; about 1e-6 off), then inverted by interpolation."""
    x = np.linspace(0, 100, 200001)
    pdf = np.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) * \
        (1 + x ** 2 / df) ** (-(df + 1) / 2)
    cdf = 0.5 + np.concatenate([[0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(p, cdf, x))


def mean_or_nan(values):
    """The mean of the finite values; NaN when there are none."""
    values = np.asarray(values, dtype=float)
    return float(np.nanmean(values)) if np.isfinite(values).any() else float('nan')
