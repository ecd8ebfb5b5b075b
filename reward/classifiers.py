"""Digit classifiers: the proxy rewards, the ensemble's other members and the gold judge.

Each is trained by the project on its own split of scikit-learn's digits and cached by config.
The gold classifier trains on data disjoint from every proxy's and is never a training reward.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from safetensors.torch import load_file, save_file
from torch import Tensor

from steadyrl.rollout.cache import build_dir_atomically, build_key, cache_root, reproducible_build
from steadyrl.rollout.digits import IMAGE_SHAPE, NUM_CLASSES, digit_splits, load_digits_tensors
from steadyrl.rollout.settings_base import StrictModel

Arch = Literal["cnn", "mlp", "linear", "wide_cnn"]


class ClassifierSpec(StrictModel):
    """One classifier: architecture, which data it trains on, and how."""

    kind: Literal["classifier"] = "classifier"
    name: str
    arch: Arch
    split: Literal["proxy", "gold"] = "proxy"
    subset_fraction: float = Field(0.8, gt=0, le=1, description="random share of the split used")
    seed: int = 0
    epochs: int = Field(60, ge=1)
    lr: float = Field(3e-3, gt=0)
    augment: bool = False
    output: Literal["probability", "log_odds"] = Field(
        "probability", description="reward = p(requested digit), or its log-odds log p - log(1 - p): unbounded "
        "above, so a policy can keep raising it long after the digit is recognisable (a hackable proxy)")


def _net(arch: Arch) -> tuple[nn.Module, nn.Module]:
    """(feature extractor, head)."""
    if arch == "cnn":
        body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(),
        )
        return body, nn.Linear(64, NUM_CLASSES)
    if arch == "wide_cnn":
        body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(128 * 4, 128), nn.ReLU(),
        )
        return body, nn.Linear(128, NUM_CLASSES)
    if arch == "mlp":
        body = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        return body, nn.Linear(64, NUM_CLASSES)
    if arch == "linear":
        return nn.Flatten(), nn.Linear(64, NUM_CLASSES)
    raise ValueError(f"unknown classifier arch {arch!r}")


class DigitClassifier(nn.Module):
    def __init__(self, arch: Arch):
        super().__init__()
        self.body, self.head = _net(arch)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def _shift(x: Tensor, gen: torch.Generator) -> Tensor:
    """Random translation by up to one pixel (zero fill)."""
    padded = F.pad(x, (1, 1, 1, 1), value=-1.0)
    i, j = torch.randint(0, 3, (2,), generator=gen).tolist()
    return padded[:, :, i : i + 8, j : j + 8]


def train_classifier(spec: ClassifierSpec) -> tuple[DigitClassifier, float]:
    """Train on the spec's split; returns the model and its accuracy on the held-out test split."""
    with reproducible_build(spec.seed) as gen:
        images, labels = load_digits_tensors()
        splits = digit_splits()
        pool = splits.proxy if spec.split == "proxy" else splits.gold
        rng = np.random.default_rng(spec.seed)
        idx = rng.choice(pool, size=max(1, int(round(spec.subset_fraction * len(pool)))), replace=False)
        x, y = images[idx], labels[idx]
        model = DigitClassifier(spec.arch)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=1e-4)
        for _ in range(spec.epochs):
            model.train()
            perm = torch.randperm(len(x), generator=gen)
            for start in range(0, len(x), 64):
                b = perm[start : start + 64]
                xb = _shift(x[b], gen) if spec.augment else x[b]
                loss = F.cross_entropy(model(xb), y[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        model.eval()
        test = torch.as_tensor(splits.test)
        with torch.no_grad():
            acc = (model(images[test]).argmax(-1) == labels[test]).float().mean().item()
        return model, acc


class DigitClassifierReward:
    """Reward = p_classifier(requested digit | sample); features = the penultimate layer."""

    def __init__(self, name: str, model: DigitClassifier, accuracy: float | None = None,
                 output: str = "probability"):
        self.name = name
        self.model = model.eval()
        self.accuracy = accuracy
        self.output = output

    @torch.no_grad()
    def probs(self, samples: Tensor) -> Tensor:
        return self.model(samples.float().clamp(-1, 1)).softmax(-1)

    @torch.no_grad()
    def score(self, samples: Tensor, cond: Tensor) -> Tensor:
        return self.differentiable_score(samples.float(), cond)

    def differentiable_score(self, samples: Tensor, cond: Tensor) -> Tensor:
        """The reward with gradients w.r.t. the samples (reward back-propagation):
        p_y, or log-odds log p_y - log(1 - p_y) = logit_y - logsumexp_{k != y} logit_k."""
        logits = self.model(samples.clamp(-1, 1).to(next(self.model.parameters()).dtype))
        y = cond.long().view(-1, 1)
        if self.output == "probability":
            return logits.softmax(-1).gather(1, y).squeeze(1).to(samples.dtype)
        others = logits.scatter(1, y, float("-inf")).logsumexp(-1)
        return (logits.gather(1, y).squeeze(1) - others).to(samples.dtype)

    def correct(self, samples: Tensor, cond: Tensor) -> Tensor:
        """1.0 where the classifier's top class is the requested one."""
        return (self.probs(samples).argmax(-1) == cond.long()).float()

    @torch.no_grad()
    def features(self, samples: Tensor) -> Tensor:
        return self.model.body(samples.float().clamp(-1, 1)).flatten(1)

    def health_probe(self) -> tuple[Tensor, Tensor]:
        """A blank digit image and class 0."""
        return torch.zeros(1, *IMAGE_SHAPE), torch.zeros(1, dtype=torch.long)


def ensure_classifier(spec: ClassifierSpec) -> Path:
    """Cached folder with `model.safetensors` and `meta.json` (accuracy); trains it if missing."""
    key = build_key(spec.model_dump(exclude={"output", "kind"}))  # neither changes what is trained
    target = cache_root() / "classifiers" / f"{spec.name}-{key}"

    def build(tmp: Path) -> None:
        model, acc = train_classifier(spec)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        (tmp / "meta.json").write_text(json.dumps({"spec": spec.model_dump(), "test_accuracy": acc}, indent=2))

    return build_dir_atomically(target, build)


def load_classifier(spec: ClassifierSpec) -> DigitClassifierReward:
    folder = ensure_classifier(spec)
    model = DigitClassifier(spec.arch)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    acc = json.loads((folder / "meta.json").read_text())["test_accuracy"]
    return DigitClassifierReward(spec.name, model, acc, spec.output)
