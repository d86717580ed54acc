"""What a comparison over seeds supports: per-seed figures, their 95 % intervals, three verdicts.

A claim sets a scheme against a baseline seed by seed (the same seed: the same initial
weights, data order and cluster draw, each scheme at its own chosen rate). Per seed:

- **speedup**: the baseline's virtual time to the target over the scheme's (:func:`seed_speedup`,
  the one place that says what a seed that never reaches the target counts as);
- **gap**: the scheme's final metric minus the baseline's (:func:`seed_gap`);
- any other per-seed ratio the caller forms (bytes against the baseline's).

Over the seeds, each figure is summarised by its **lower median** and a **95 % interval: the
percentile bootstrap of that median over seeds, computed exactly** (:func:`median_interval`).
The median, because a seed may count as an infinite or a zero speedup and a mean cannot hold
those; the lower one, so that the estimate is always a seed's own figure; exact (from the
binomial law of a resample's order statistics, no random resampling), so that the table
rebuilds byte for byte. With 5 seeds the interval is the seeds' range: a claim holds only if
every seed clears its bound. More seeds narrow it (10 seeds: the 2nd to the 9th).

A criterion's **verdict** (:func:`judge`) is one of :data:`VERDICTS`: it *holds* when the
whole interval clears the claim's bound (strictly: a claim says "faster", "under", "less"),
*does not hold* when the whole interval lies on the other side (the bound included), and is
*inconclusive* otherwise, or when fewer than :data:`MIN_SEEDS` seeds were
compared (whatever their interval says). A claim's verdict (:func:`combine`) does not hold if
one criterion does not, holds if every criterion holds, and is inconclusive otherwise.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Iterable, Mapping, Sequence

LEVEL = 0.95
MIN_SEEDS = 5   # compared seeds a verdict other than "inconclusive" needs
HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
VERDICTS = (HOLDS, FAILS, UNSURE)
INF = float("inf")

# The rule of :func:`seed_speedup`, in words (the claims table's footer quotes it).
NEVER_REACHED = (
    "a seed on which a run never reaches the target counts as infinitely slow there (a speedup "
    "of 0 for the scheme, of inf for it over a baseline that missed) when that run collapsed, "
    "diverged, or ran healthy past the other's time to the target; a healthy run that ended "
    "before the other's time without reaching the target, and a seed on which neither reached "
    "it, are not compared")


@dataclasses.dataclass(frozen=True)
class Seed:
  """One trial's figures on one seed.

  Attributes:
    time: virtual seconds to the target; None if it never reached it (or broke).
    end: virtual seconds at its last evaluation; None if unknown.
    final: its final metric; None if it has none.
    broken: it collapsed or diverged.
  """
  time: float | None
  end: float | None
  final: float | None
  broken: bool = False


def seed_speedup(mine: Seed, base: Seed) -> float | None:
  """``base``'s time to the target over ``mine``'s on one seed; None where the seed does not
  compare (:data:`NEVER_REACHED`)."""
  if mine.time and base.time:
    return base.time / mine.time
  if mine.time:
    return INF if _behind(base, mine.time) else None
  if base.time:
    return 0.0 if _behind(mine, base.time) else None
  return None


def _behind(run: Seed, other_time: float) -> bool:
  """Whether ``run``, which never reached the target, lost to a run there at ``other_time``."""
  return run.broken or (run.end is not None and run.end >= other_time)


def seed_gap(mine: Seed, base: Seed, scale: float = 1.0) -> float | None:
  """``mine``'s final metric minus ``base``'s, times ``scale`` (100: accuracy in points); a
  broken run without a finite final metric counts as the worst (``-inf`` for ``mine``,
  ``+inf`` for ``base``); None where a healthy run has none."""
  a, b = _final(mine, -INF), _final(base, INF)
  if a is None or b is None or (math.isinf(a) and math.isinf(b)):
    return None
  return scale * (a - b)


def _final(run: Seed, worst: float) -> float | None:
  if run.final is not None and math.isfinite(run.final):
    return float(run.final)
  return worst if run.broken else None


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A figure over seeds: its lower median, the 95 % interval ``[lo, hi]``, ``n`` seeds."""
  median: float
  lo: float
  hi: float
  n: int

  def text(self, fmt: str = "{:.2f}", unit: str = "") -> str:
    """``1.52x [1.31, 1.80]``: the median and its interval."""
    f = lambda v: ("inf" if v == INF else "-inf" if v == -INF else fmt.format(v)) + unit
    return f"{f(self.median)} [{f(self.lo)}, {f(self.hi)}]"

  def as_dict(self) -> dict:
    """JSON-safe (an infinity as the string ``"inf"``/``"-inf"``)."""
    f = lambda v: ("inf" if v == INF else "-inf" if v == -INF else v)
    return {"median": f(self.median), "lo": f(self.lo), "hi": f(self.hi), "n": self.n}


def _binomial_tail(n: int, p: fractions.Fraction, k: int) -> fractions.Fraction:
  """P(Binomial(n, p) >= k), exactly."""
  return sum((math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)),
             fractions.Fraction(0))


def median_interval(values: Iterable[float], level: float = LEVEL) -> Estimate | None:
  """The lower median of ``values`` (one per seed) and its ``level`` percentile-bootstrap
  interval over seeds, exactly; None for no value.

  A bootstrap resample draws ``n`` seeds' values with replacement; its lower median is its
  ``k``-th smallest, ``k = (n + 1) // 2``, which is at most the ``j``-th smallest value when at
  least ``k`` of the ``n`` draws are among the ``j`` smallest: ``P = P(Binomial(n, j/n) >= k)``.
  The interval's ends are that distribution's ``(1 - level) / 2`` and ``(1 + level) / 2``
  quantiles (the smallest value whose probability reaches each).
  """
  x = sorted(values)
  n = len(x)
  if not n:
    return None
  if not 0 < level < 1:
    raise ValueError(f"level={level!r} is invalid; allowed: a number in (0, 1)")
  k = (n + 1) // 2
  tail = fractions.Fraction(1) - fractions.Fraction(level).limit_denominator(10 ** 6)
  cdf = [_binomial_tail(n, fractions.Fraction(j, n), k) for j in range(1, n + 1)]
  quantile = lambda q: x[next(j for j, c in enumerate(cdf) if c >= q)]
  return Estimate(median=x[k - 1], lo=quantile(tail / 2), hi=quantile(1 - tail / 2), n=n)


def judge(estimate: Estimate | None, bound: float, higher_is_better: bool = True,
          min_seeds: int = MIN_SEEDS) -> str:
  """One criterion's verdict: :data:`HOLDS` when the interval clears ``bound`` strictly
  (``lo > bound``, or ``hi < bound`` where lower is better: a claim says "faster", "under",
  "less"), :data:`FAILS` when it lies wholly on the other side (the bound itself included),
  else (or with fewer than ``min_seeds`` seeds, or none) :data:`UNSURE`."""
  if estimate is None or estimate.n < min_seeds:
    return UNSURE
  good, bad = ((estimate.lo > bound, estimate.hi <= bound) if higher_is_better
               else (estimate.hi < bound, estimate.lo >= bound))
  return HOLDS if good else FAILS if bad else UNSURE


def combine(verdicts: Sequence[str]) -> str:
  """A claim's verdict from its criteria's: one that does not hold decides; all holding
  holds; else inconclusive (also with no criterion)."""
  if FAILS in verdicts:
    return FAILS
  return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else UNSURE


def paired(mine: Mapping[int, Seed], base: Mapping[int, Seed], figure) -> tuple[list, int]:
  """``figure(mine[s], base[s])`` for every seed both ran, the None ones left out; returns the
  values and how many shared seeds were left out."""
  values = [figure(mine[s], base[s]) for s in sorted(mine) if s in base]
  kept = [v for v in values if v is not None]
  return kept, len(values) - len(kept)
