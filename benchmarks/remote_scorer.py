"""The scorer of benchmarks/remote_reward.py in process: the digits CNN classifier as a reward function
(`kind: python`), P(requested digit) of the uint8 images mapped back to model space (p / 127.5 - 1)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch


@lru_cache(maxsize=1)
def _cnn() -> Any:
    from steadyrl.reward.classifiers import load_classifier
    from steadyrl.services.config import CONFIG_DIR, load_config

    members = load_config(CONFIG_DIR / "smoke.yaml").testbed.reward.members
    return load_classifier(next(m for m in members if m.name == "cnn"))


def cnn_probability(images: list[np.ndarray], prompts: list[int]) -> torch.Tensor:
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return _cnn().score(x, torch.tensor(prompts))
