"""Statistics and number formats for interleaved rounds on a shared, noisy machine."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of ``xs`` (one value per round),
    or None when there are too few values for one at this ``confidence``.

    The rounds' order statistics: the true median lies below the k-th smallest
    value with probability P(Binomial(n, 1/2) < k), so [x(k), x(n+1-k)] with the
    largest k whose two tails together stay within 1 - ``confidence`` covers it
    at least that often. No assumption about how the noise is distributed,
    which on a shared machine is anything but normal.
    """
    n = len(xs)
    tail = (1.0 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2**n
        if nxt > tail:
            break
        k, below = k + 1, nxt
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def percentile(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt_rate(x: float) -> str:
    if x != x:
        return "n/a"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def fmt_ratio(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.2f}\u00d7"


def fmt_us(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    us = seconds * 1e6
    if us >= 10000:
        return f"{us / 1000:,.1f} ms"
    return f"{us:,.0f} µs"


def fmt_ms(seconds: float) -> str:
    if seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:,.2f} ms"


def interleave(
    contenders: Sequence[str],
    rounds: int,
    measure: Callable[[str, int], float | None],
) -> dict[str, list[float]]:
    """Run ``measure(name, round)`` for every contender in turn, ``rounds`` times:
    A, B, C, A, B, C, ... (the order rotates each round so no contender always
    follows the same one). Returns the samples per contender (None is skipped)."""
    samples: dict[str, list[float]] = {c: [] for c in contenders}
    n = len(contenders)
    for r in range(rounds):
        order = [contenders[(i + r) % n] for i in range(n)] if n else []
        for c in order:
            value = measure(c, r)
            if value is not None:
                samples[c].append(value)
    return samples


def paired_ratios(samples: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Median over rounds of (contender / baseline in the same round)."""
    base = samples.get(baseline, [])
    out: dict[str, float] = {}
    for c, xs in samples.items():
        pairs = [x / b for x, b in zip(xs, base) if b]
        out[c] = median(pairs) if pairs and len(xs) == len(base) else float("nan")
    return out
