"""
The statistics: pure functions of numpy arrays. Every interval is at LEVEL over independent units
and inverts a test whose two-sided p (p_value) goes into holm(). A mean's interval is Student's t:
over 3 to 5 units a percentile bootstrap is their min and max, and covers far less than its level.
A share of trajectories is taken per seed first, since the layers of a run share its seed (share).
A row-wise correlation is NaN for a row with a NaN, under 3 values (4 for a partial) or no spread.
"""
import functools
import math

import numpy as np

LEVEL = 0.95
ALPHA = 0.05
NORMAL_975 = 1.959963984540054   # the 0.975 quantile of the standard normal, for trend's rho
FLOOR_SHARE = 0.8                # seeds spread at least as binomial sampling at this share
PAIRWISE = 64                    # ranks: up to this many values, one pairwise comparison
TREND = ('slope', 'lo', 'hi', 'lof_p', 'rho', 'rho_lo', 'rho_hi')   # trend's results but n, points
TINY = 1e-300                    # betainc: Lentz's stand-in for a zero divisor


def betainc(a, b, x):
    """I_x(a, b), the regularized incomplete beta function, by Lentz's method on its continued
    fraction: terms 1, then m (b - m) x / ((a + 2m - 1)(a + 2m)) at step 2m and
    -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)) at step 2m + 1."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):   # the fraction converges fast on this side only
        return 1 - betainc(b, a, 1 - x)
    log_beta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(log_beta + a * math.log(x) + b * math.log1p(-x)) / a
    fraction, lentz_c, lentz_d = 2.0, 2.0, 1.0   # the fraction, C and D after its first term, 1
    for step in range(1, 400):
        m = step // 2
        if step % 2 == 0:
            term = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            term = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        lentz_d = 1 + term * lentz_d
        lentz_d = 1 / (lentz_d if abs(lentz_d) > TINY else TINY)
        lentz_c = 1 + term / (lentz_c if abs(lentz_c) > TINY else TINY)
        fraction *= lentz_c * lentz_d
        if abs(1 - lentz_c * lentz_d) < 1e-14:
            break
    return front * (fraction - 1)


def t_sf(t, df):
    """P(T > t) for Student's t with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2) / 2."""
    upper_tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return upper_tail if t > 0 else 1 - upper_tail


@functools.lru_cache(maxsize=None)
def t_quantile(probability, df):
    """The probability-quantile (probability > 0.5) of Student's t: bisection of t_sf."""
    low, high = 0.0, 1e4
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if 1 - t_sf(middle, df) < probability else (low, middle)
    return (low + high) / 2


def critical(df):
    """The half-width of a LEVEL interval in standard errors: t(df)'s (1 + LEVEL) / 2 quantile."""
    return t_quantile(0.5 + LEVEL / 2, df)


def f_sf(f, d1, d2):
    """P(F > f) for the F distribution with d1, d2 degrees of freedom."""
    return betainc(d2 / 2, d1 / 2, d2 / (d2 + d1 * f)) if f > 0 else 1.0


def nanmean(values, axis=None):
    """The mean of the finite values (along axis); NaN where there are none."""
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    with np.errstate(invalid='ignore', divide='ignore'):   # 0 / 0 is the NaN of no finite value
        mean = np.where(finite, values, 0).sum(axis) / finite.sum(axis)
    return float(mean) if np.ndim(mean) == 0 else mean


def t_interval(values):
    """(mean, lo, hi, n) of the finite values, Student-t; no interval below 2 units."""
    values = np.asarray(values, dtype=float)
    finite, mean = values[np.isfinite(values)], nanmean(values)
    if len(finite) < 2:
        return mean, math.nan, math.nan, len(finite)
    half_width = critical(len(finite) - 1) * float(finite.std(ddof=1)) / math.sqrt(len(finite))
    return mean, mean - half_width, mean + half_width, len(finite)


def share(hits, counts):
    """(share, lo, hi, se_lo, se_hi, df) of hits out of counts trajectories per seed: the mean m of
    the n seeds' shares, m -/+ t(n - 1) max(sd, floor) / sqrt(n) clipped to [0, 1]; se_lo, se_hi
    are its half-widths over t, for p_value. The floor sqrt(a (1 - a) / c), for c trajectories per
    seed and a = FLOOR_SHARE, is the spread of sampling alone: seeds agreeing by chance (4/4 in each
    of 3) would read as certain. One more hit must never lower the interval, yet it can raise the
    sd more than the mean, so lo is the lowest over every split with at least as many hits in every
    seed (lowest), hi the highest over every split with at most as many. On planted draws (a seed
    effect on the logit scale, 3 to 49 seeds, shares 0.5 to 0.98) it covered 0.92 or more wherever
    checked, and 0.97 or more at 3 seeds x 4 with a seed effect of sd 2. Only 12/12 holds above 1/2
    at 3 x 4; at 4 x 4, 14/16 does as (4, 4, 3, 3).
    """
    hits, counts = np.asarray(hits, dtype=float), np.asarray(counts, dtype=float)
    per_seed = hits[counts > 0] / counts[counts > 0]
    seeds = len(per_seed)
    mean = float(per_seed.mean()) if seeds else math.nan
    if seeds < 2:
        return mean, math.nan, math.nan, math.nan, math.nan, seeds - 1
    t = critical(seeds - 1)
    floor = math.sqrt(FLOOR_SHARE * (1 - FLOOR_SHARE) / counts[counts > 0].mean())
    low, high = lowest(per_seed, t, floor), 1 - lowest(1 - per_seed, t, floor)
    return mean, max(0.0, low), min(1.0, high), (mean - low) / t, (high - mean) / t, seeds - 1


def lowest(per_seed, t, floor):
    """The least m - t max(sd, floor) / sqrt(n) of n shares over the splits with as many hits or
    more. For a fixed mean, filling the highest shares first spreads them most, and the bound is
    concave along that path: it is least at the top k shares raised to 1 for some k = 0..n."""
    seeds = len(per_seed)
    raised_top = np.arange(seeds) < np.arange(seeds + 1)[:, None]
    raised = np.where(raised_top, 1.0, np.sort(per_seed)[::-1])
    spread = np.maximum(raised.std(1, ddof=1), floor)
    return float((raised.mean(1) - t * spread / math.sqrt(seeds)).min())


def p_value(estimate, reference, std_error, df):
    """The two-sided p of an interval's test: (estimate - reference) / std_error against t(df)."""
    if not std_error > 0:
        return 0.0 if estimate != reference else 1.0
    return min(1.0, 2 * t_sf(abs(estimate - reference) / std_error, df))


def holm(p_values):
    """Holm's step-down adjusted p-values, in the given order."""
    adjusted, running_max = [1.0] * len(p_values), 0.0
    for position, index in enumerate(np.argsort(p_values, kind='stable')):
        running_max = max(running_max, min(1.0, (len(p_values) - position) * p_values[index]))
        adjusted[index] = running_max
    return adjusted


def verdict(low, high, sign, reference, margin, count, mirror=None):
    """(verdict, why) of an interval (and a share claim's mirror interval) against a claim."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return 'undecided', f'n = {count}: no interval'
    if margin and reference - margin <= low and high <= reference + margin:
        return 'no effect', ''
    if sign * (low - reference) > 0 and sign * (high - reference) > 0:
        return 'holds', ''
    if mirror is not None:
        if mirror[0] > reference:
            return 'reversed', ''
        if high < reference and mirror[1] < reference:
            return 'fails', ''
        return 'undecided', f'n = {count}: an interval spans {reference:g}'
    if sign * (low - reference) < 0 and sign * (high - reference) < 0:
        return 'reversed', ''
    wider = f' and is wider than +/-{margin:g}' if margin else ''
    return 'undecided', f'n = {count}: the interval spans {reference:g}{wider}'


def ranks(values):
    """Ranks 1..n along the last axis, ties at their average; a NaN ranks 0.5 and is not counted.
    A series longer than PAIRWISE (a run's records) is sorted rather than compared pairwise."""
    values = np.asarray(values, dtype=float)
    if values.shape[-1] <= PAIRWISE:
        this_value, other_value = values[..., :, None], values[..., None, :]
        return (other_value < this_value).sum(-1) + ((other_value == this_value).sum(-1) + 1) / 2
    ranked = np.empty(values.shape)
    for index in np.ndindex(values.shape[:-1]):
        series = values[index]
        ordered = np.sort(series)   # NaN last: counted neither below nor equal
        below = np.searchsorted(ordered, series, 'left')
        up_to = np.searchsorted(ordered, series, 'right')
        ranked[index] = np.where(np.isnan(series), 0.5, below + (up_to - below + 1) / 2)
    return ranked


def pearson_rows(x, y):
    """Pearson's r of x and y along the last axis."""
    x, y = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    if x.shape[-1] < 3:
        return np.full(x.shape[:-1], np.nan)
    x_centred, y_centred = x - x.mean(-1, keepdims=True), y - y.mean(-1, keepdims=True)
    x_square, y_square = (x_centred * x_centred).sum(-1), (y_centred * y_centred).sum(-1)
    with np.errstate(invalid='ignore', divide='ignore'):
        pearson = (x_centred * y_centred).sum(-1) / np.sqrt(x_square * y_square)
    constant = ((x_square <= 1e-24 * np.maximum(1, (x * x).sum(-1)))
                | (y_square <= 1e-24 * np.maximum(1, (y * y).sum(-1))))
    return np.where(constant, np.nan, np.clip(pearson, -1, 1))


def spearman_rows(x, y):
    """Spearman's rho of x and y along the last axis."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    with_nan = ~(np.isfinite(x).all(-1) & np.isfinite(y).all(-1))
    return np.where(with_nan, np.nan, pearson_rows(ranks(x), ranks(y)))


def partial_rows(x, y, z):
    """The partial correlation of x and y given z along the last axis,
    (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2))."""
    r_xy, r_xz, r_yz = pearson_rows(x, y), pearson_rows(x, z), pearson_rows(y, z)
    with np.errstate(invalid='ignore', divide='ignore'):
        partial = (r_xy - r_xz * r_yz) / np.sqrt((1 - r_xz ** 2) * (1 - r_yz ** 2))
    collinear = (np.abs(r_xz) > 1 - 1e-12) | (np.abs(r_yz) > 1 - 1e-12)
    degenerate = (np.asarray(x).shape[-1] < 4) | collinear
    return np.where(degenerate, np.nan, np.clip(partial, -1, 1))


def spearman(x, y):
    """Spearman's rho of two series, pairs with a NaN dropped."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    paired = np.isfinite(x) & np.isfinite(y)
    return float(spearman_rows(x[paired], y[paired]))


def trend(positions, units):
    """The least-squares line through each unit's (x, y), its position and value (units[i] holds
    the values at positions[i]), over P points and N units: the slope's t interval (N - 2 df),
    lack_of_fit of fit F = (SS_lof / (P - 2)) / (SS_pe / (N - P)) and Spearman's rho, its Fisher-z
    interval with se sqrt(1.06 / (N - 3)) (Fieller, Hartley and Pearson 1957). NaN where a part
    needs more points or units."""
    units = [np.asarray(unit, dtype=float) for unit in units]
    x = np.repeat(np.asarray(positions, dtype=float), [len(unit) for unit in units])
    y = np.concatenate(units)
    points, total = len(units), len(y)
    found = {**dict.fromkeys(TREND, math.nan), 'n': total, 'points': points}
    if points < 2 or np.ptp(x) == 0:
        return found
    x_centred = x - x.mean()
    slope = float(x_centred @ (y - y.mean()) / (x_centred @ x_centred))
    residual = y - y.mean() - slope * x_centred
    found['slope'] = slope
    if total > 2:
        spread = math.sqrt((residual @ residual) / (total - 2) / (x_centred @ x_centred))
        half_width = critical(total - 2) * spread
        found.update(lo=slope - half_width, hi=slope + half_width)
    pure_error = sum(float(((unit - unit.mean()) ** 2).sum()) for unit in units)
    lack_of_fit = float(residual @ residual) - pure_error
    lof_df, error_df = points - 2, total - points
    if lof_df > 0 and error_df > 0 and pure_error > 0:
        found['lof_p'] = f_sf((lack_of_fit / lof_df) / (pure_error / error_df), lof_df, error_df)
    elif lof_df > 0 and error_df > 0 and lack_of_fit > 1e-12 * float(y @ y):
        found['lof_p'] = 0.0   # no spread within the points: any lack of fit is certain
    rho = spearman(x, y)
    rho_half = NORMAL_975 * math.sqrt(1.06 / (total - 3)) if total > 3 else math.nan
    fisher = math.atanh(min(max(rho, -1 + 1e-12), 1 - 1e-12))
    found.update(rho=rho, rho_lo=math.tanh(fisher - rho_half), rho_hi=math.tanh(fisher + rho_half))
    return found


def solve(design, target):
    """Least squares of target on the columns of design; NaN when they are not independent."""
    if np.linalg.matrix_rank(design) < design.shape[1]:
        return np.full(design.shape[1], np.nan)
    return np.linalg.lstsq(design, target, rcond=None)[0]


def jackknife(estimate, groups):
    """(estimate(all), lo, hi) of estimate(keep), keep a mask of units: jackknife-t leaving out one
    group at a time, groups - 1 df, none below 3 groups; an array estimate, an interval per entry.
    """
    groups = np.asarray(groups)
    names = np.unique(groups)
    over_all = np.asarray(estimate(np.ones(len(groups), bool)), dtype=float)
    if len(names) < 3:
        return over_all, over_all * np.nan, over_all * np.nan
    left_out = np.array([estimate(groups != left) for left in names], dtype=float)
    with np.errstate(invalid='ignore'):   # an estimate that is not finite has no interval
        spread = ((left_out - left_out.mean(0)) ** 2).sum(0)
        half_width = critical(len(names) - 1) * np.sqrt((len(names) - 1) / len(names) * spread)
    return over_all, over_all - half_width, over_all + half_width


def fit_groups(target, predictors, groups):
    """Least squares of target on [1, predictors], intercept first, with jackknife-t intervals over
    groups (the rows of a seed share its baseline): (coefficients, lo, hi)."""
    target = np.asarray(target, dtype=float)
    predictors = np.asarray(predictors, dtype=float).reshape(len(target), -1)
    finite = np.isfinite(target) & np.isfinite(predictors).all(1)
    design = np.column_stack([np.ones(finite.sum()), predictors[finite]])
    target, groups = target[finite], np.asarray(groups)[finite]
    return jackknife(lambda keep: solve(design[keep], target[keep]), groups)
