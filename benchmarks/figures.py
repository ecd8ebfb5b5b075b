"""What the benchmarks share for their figures: a measured series as its median and min..max, an interval for its
median, and a results file written with its summary printed."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


def spread(values: list[float]) -> dict[str, float]:
    """Median and min..max of a measured series (the machine is shared and noisy: never a single run)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median of a series: the order statistics (x_(k), x_(n+1-k)) with the
    largest k such that P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2; the whole range when n is too small
    (n < 6 at 95 %). Unlike min..max it narrows as repeats are added."""
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n and tail + math.comb(n, k) / 2 ** n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return (xs[0], xs[-1]) if k == 0 else (xs[k - 1], xs[n - k])


def write_json(result: dict[str, Any], out: str | Path, leave_out_of_summary: tuple[str, ...] = ("runs",)) -> Path:
    """Write `result` to `out` (folders made) and print it without the bulky keys."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in leave_out_of_summary}, indent=2))
    return out
