"""Bayesian suggestions for the warm-up sweep: pure math, stdlib only.

Points live in the unit cube [0, 1]^d, log dimensions in log space. Round 0 is an
initial design: evenly spaced in one dimension (the sweep's original points), Halton
points (Halton 1960) in more. Later rounds fit a Gaussian process — Matérn-5/2 kernel on
the unit cube, standardised losses, a small noise term, the length scale by maximum
marginal likelihood (times a weak prior) over a fixed grid, the signal variance profiled
out (Rasmussen & Williams 2006, §4.2, §5.4) — and take the candidate with the largest
Expected Improvement (Jones, Schonlau & Welch 1998, "Efficient Global Optimization of
Expensive Black-Box Functions"). A round of `q` parallel trials comes from the kriging
believer (Ginsbourger, Le Riche & Carraro 2010, "Kriging is well-suited to parallelize
optimization"): each pick joins the data with its predicted mean before the next pick.

Deterministic given (space, observations, seed). No numpy: the workflow package imports
this module, and the sandbox must stay light (DESIGN §5); the suggester itself runs in a
local activity, so its CPU time never lands in workflow code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from spec import SweepConfig

Params = dict[str, float]
Vector = list[float]
Matrix = list[list[float]]


@dataclass(frozen=True)
class Dim:
    """One swept hyperparameter."""

    name: str
    low: float
    high: float
    log: bool = False  # searched in log space (low > 0)
    integer: bool = False  # rounded to a whole number (warmup_steps)


# Length scales tried by maximum marginal likelihood, in unit-cube units: from a tenth of
# a 1-D range (wiggly) to longer than the cube's diagonal (almost linear).
LENGTH_SCALES = (0.05, 0.08, 0.12, 0.2, 0.3, 0.5, 0.8, 1.3, 2.0)
# A weak Gamma(3, 6) prior on the length scale (mode 1/3; BoTorch's SingleTaskGP default
# before v0.12). Why: with the 2-3 points of an early round the likelihood alone prefers
# the shortest scale (two points: profile log-likelihood ½·log((1-ρ)/(1+ρ)), largest at
# correlation ρ = 0), and EI then creeps around the best point instead of looking between.
LENGTH_PRIOR = (3.0, 6.0)  # (shape, rate)
NOISE = 1e-3  # noise variance relative to the signal's: short trials' losses are noisy
JITTERS = (1e-10, 1e-8, 1e-6)  # added to the diagonal, in turn, until Cholesky succeeds
CANDIDATES = 256  # Halton points over the whole cube
LOCAL_CANDIDATES = 64  # Gaussian perturbations of the best point: EI peaks near it
LOCAL_WIDTHS = (0.02, 0.1)
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29)


def sweep_space(cfg: SweepConfig) -> list[Dim]:
    """The swept dimensions in name order; warmup_steps moves in whole steps."""
    return [Dim(name, d.low, d.high, d.log, integer=name == "warmup_steps")
            for name, d in sorted(cfg.space.items())]


# ---- the unit cube ----------------------------------------------------------------------
def to_unit(space: Sequence[Dim], params: Params) -> Vector:
    """Params -> a point of [0, 1]^d (clipped), one coordinate per dimension of `space`."""
    u = []
    for d in space:
        v = params[d.name]
        if d.log:
            frac = math.log(v / d.low) / math.log(d.high / d.low)
        else:
            frac = (v - d.low) / (d.high - d.low)
        u.append(min(1.0, max(0.0, frac)))
    return u


def from_unit(space: Sequence[Dim], u: Sequence[float]) -> Params:
    """A point of [0, 1]^d -> params (integer dimensions rounded)."""
    params = {}
    for d, x in zip(space, u):
        x = min(1.0, max(0.0, x))
        v = d.low * (d.high / d.low) ** x if d.log else d.low + (d.high - d.low) * x
        params[d.name] = float(round(v)) if d.integer else v
    return params


def snap(space: Sequence[Dim], u: Sequence[float]) -> Vector:
    """The unit point of the params `u` really maps to (integer dimensions land on a step)."""
    return to_unit(space, from_unit(space, u))


def halton(index: int, dims: int) -> Vector:
    """Point `index` (>= 1) of the Halton sequence: radical inverses in the first primes."""
    point = []
    for base in PRIMES[:dims]:
        frac, value, i = 1.0, 0.0, index
        while i > 0:
            frac /= base
            value += frac * (i % base)
            i //= base
        point.append(value)
    return point


def initial_design(space: Sequence[Dim], n: int) -> list[Params]:
    """Round 0. One dimension: `n` evenly spaced points including both ends (log-spaced
    where log), exactly the sweep's original points. More: the first `n` Halton points,
    which spread over every dimension at once instead of along the diagonal."""
    if len(space) == 1:
        return [from_unit(space, [i / (n - 1) if n > 1 else 0.5]) for i in range(n)]
    return [from_unit(space, halton(i + 1, len(space))) for i in range(n)]


# ---- the Gaussian process ---------------------------------------------------------------
@dataclass(frozen=True)
class Gp:
    """A GP conditioned on standardised losses; predictions are in those units."""

    x: list[Vector]
    chol: Matrix  # lower Cholesky factor of R + noise*I (R: kernel correlations)
    alpha: Vector  # (R + noise*I)^-1 y
    length: float
    scale: float  # signal variance
    log_likelihood: float


def matern52(a: Sequence[float], b: Sequence[float], length: float) -> float:
    s = math.sqrt(5.0) * math.dist(a, b) / length
    return (1.0 + s + s * s / 3.0) * math.exp(-s)


def cholesky(a: Matrix) -> Matrix | None:
    """Lower factor L with L L^T = a, or None when `a` is not (numerically) positive definite."""
    n = len(a)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if s <= 0.0:
                    return None
                low[i][i] = math.sqrt(s)
            else:
                low[i][j] = s / low[j][j]
    return low


def solve_lower(low: Matrix, b: Sequence[float]) -> Vector:
    """x with L x = b (forward substitution)."""
    x: Vector = []
    for i, row in enumerate(low):
        x.append((b[i] - sum(row[k] * x[k] for k in range(i))) / row[i])
    return x


def solve_upper(low: Matrix, b: Sequence[float]) -> Vector:
    """x with L^T x = b (back substitution)."""
    n = len(low)
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x


def fit(x: list[Vector], y: Vector, length: float, noise: float = NOISE,
        scale: float | None = None) -> Gp:
    """Condition on (x, y). `scale` None: the signal variance maximising the likelihood
    (y^T R^-1 y / n); given: kept, as the kriging believer does between picks."""
    n = len(x)
    for jitter in JITTERS:
        corr = [[matern52(a, b, length) + (noise + jitter if i == j else 0.0)
                 for j, b in enumerate(x)] for i, a in enumerate(x)]
        low = cholesky(corr)
        if low is not None:
            break
    else:
        raise ValueError(f"kernel matrix not positive definite at length scale {length}")
    v = solve_lower(low, y)
    quad = sum(t * t for t in v)
    if scale is None:
        scale = max(quad / n, 1e-6)  # floor: all-equal losses still leave room to explore
    log_det = 2.0 * sum(math.log(low[i][i]) for i in range(n)) + n * math.log(scale)
    loglik = -0.5 * (quad / scale + log_det + n * math.log(2.0 * math.pi))
    return Gp(x=x, chol=low, alpha=solve_upper(low, v), length=length, scale=scale,
              log_likelihood=loglik)


def log_length_prior(length: float) -> float:
    shape, rate = LENGTH_PRIOR
    return (shape - 1.0) * math.log(length) - rate * length  # up to a constant


def fit_best(x: list[Vector], y: Vector, noise: float = NOISE) -> Gp:
    """The GP whose length scale (from LENGTH_SCALES) maximises the marginal likelihood
    times the length-scale prior."""
    fits = [fit(x, y, length, noise) for length in LENGTH_SCALES]
    # ties: the shorter scale, first
    return max(fits, key=lambda g: g.log_likelihood + log_length_prior(g.length))


def predict(gp: Gp, u: Sequence[float]) -> tuple[float, float]:
    """Posterior mean and standard deviation of the latent loss at `u`."""
    k = [matern52(u, xi, gp.length) for xi in gp.x]
    mean = sum(ki * ai for ki, ai in zip(k, gp.alpha))
    v = solve_lower(gp.chol, k)
    return mean, math.sqrt(gp.scale * max(0.0, 1.0 - sum(t * t for t in v)))


def expected_improvement(mean: float, sd: float, best: float) -> float:
    """E[max(best - f, 0)] for f ~ N(mean, sd^2), minimising (Jones et al. 1998, eq. 15)."""
    gain = best - mean
    if sd <= 1e-12:
        return max(gain, 0.0)
    z = gain / sd
    cdf = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    pdf = math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return gain * cdf + sd * pdf


# ---- suggestions ------------------------------------------------------------------------
def standardise(losses: Sequence[float | None]) -> Vector:
    """Zero mean, unit variance. A diverged trial (None, inf, nan) counts as the worst
    finite loss seen, so it steers the search away without breaking the GP."""
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    worst = max(finite) if finite else 0.0
    ys = [v if v is not None and math.isfinite(v) else worst for v in losses]
    mean = sum(ys) / len(ys)
    sd = math.sqrt(sum((v - mean) ** 2 for v in ys) / len(ys))
    return [(v - mean) / sd if sd > 0 else 0.0 for v in ys]


def candidates(space: Sequence[Dim], best: Vector, rng: random.Random) -> list[Vector]:
    """Where EI is evaluated: Halton points over the cube plus perturbations of `best`."""
    dims = len(space)
    pool = [halton(i, dims) for i in range(1, CANDIDATES + 1)]
    for i in range(LOCAL_CANDIDATES):
        width = LOCAL_WIDTHS[i % len(LOCAL_WIDTHS)]
        pool.append([rng.gauss(x, width) for x in best])
    return [snap(space, u) for u in pool]


def _key(u: Sequence[float]) -> tuple[float, ...]:
    return tuple(round(x, 9) for x in u)


def suggest(space: Sequence[Dim], observed: Sequence[tuple[Params, float | None]], count: int,
            seed: int, noise: float = NOISE) -> list[Params]:
    """`count` new, distinct points by GP Expected Improvement and the kriging believer."""
    x = [snap(space, to_unit(space, p)) for p, _ in observed]
    y = standardise([v for _, v in observed])
    gp = fit_best(x, y, noise)
    rng = random.Random(seed * 1_000_003 + len(observed))  # a new stream every round
    pool = candidates(space, x[y.index(min(y))], rng)
    taken = {_key(u) for u in x}
    picks: list[Vector] = []
    for _ in range(count):
        fresh = [u for u in pool if _key(u) not in taken] or pool  # a tiny integer space
        best = min(y)
        pick = max(fresh, key=lambda u: expected_improvement(*predict(gp, u), best))
        believed, _ = predict(gp, pick)
        taken.add(_key(pick))
        picks.append(pick)
        x, y = x + [pick], y + [believed]
        gp = fit(x, y, gp.length, noise, scale=gp.scale)
    return [from_unit(space, u) for u in picks]
