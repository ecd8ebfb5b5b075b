"""The benchmarks' interval for a median: the order statistics a distribution-free 95 % interval takes, checked against
the published table values, and its coverage checked by drawing series."""
from __future__ import annotations

import importlib.util
import random
import statistics
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("figures", Path(__file__).parents[1] / "benchmarks" / "figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (15, (4, 12)), (20, (6, 15)), (31, (10, 22)),
                                      (50, (18, 33))])
def test_the_interval_takes_the_tabled_order_statistics(n: int, ranks: tuple[int, int]):
    """Ranks (1-based) of the 95 % interval for the median in the standard binomial table."""
    values = [float(i) for i in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert figures.median_interval(values) == ranks


def test_too_few_values_give_the_whole_range():
    assert figures.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


def test_the_interval_holds_the_true_median_at_least_as_often_as_stated():
    """Series of 15 drawn from a skewed distribution whose median is 1 (lognormal(0, 1)): the interval holds 1 in at
    least 95 % of 4000 draws (exactly 96.5 % in expectation for n = 15), and is narrower than min..max."""
    rng = random.Random(0)
    hits, narrower = 0, 0
    for _ in range(4000):
        xs = [rng.lognormvariate(0.0, 1.0) for _ in range(15)]
        lo, hi = figures.median_interval(xs)
        hits += lo <= 1.0 <= hi
        narrower += (hi - lo) < (max(xs) - min(xs))
        assert lo <= statistics.median(xs) <= hi
    assert hits / 4000 >= 0.95
    assert narrower == 4000
