"""The embedded digits testbed: scikit-learn's bundled 8x8 digits (no download)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)


def load_digits_tensors() -> tuple[Tensor, Tensor]:
    """All 1,797 digits as images in [-1, 1] of shape [N,1,8,8] and labels [N]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0 * 2 - 1
    return images, torch.tensor(data.target, dtype=torch.long)


@dataclass(frozen=True)
class DigitSplits:
    """Disjoint index sets: `test` is held out from everything, `gold` trains only the gold
    classifier, `proxy` is the pool the proxy classifiers (and the diffusion model) train on."""

    test: np.ndarray
    gold: np.ndarray
    proxy: np.ndarray


def digit_splits(seed: int = 0, n_test: int = 297, n_gold: int = 750) -> DigitSplits:
    """A fixed, seeded stratified-ish permutation split of the 1,797 digits."""
    perm = np.random.default_rng(seed).permutation(1797)
    return DigitSplits(test=perm[:n_test], gold=perm[n_test : n_test + n_gold], proxy=perm[n_test + n_gold :])


def to_unit_range(samples: Tensor) -> Tensor:
    """Model space [-1, 1] (unclipped) to pixel space [0, 1]."""
    return ((samples.clamp(-1, 1) + 1) / 2).float()
