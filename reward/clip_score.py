"""CLIP score: how well an image matches its prompt under a CLIP model.

    r(x, c) = scale * cos(e_img(x), e_txt(c))        (e_*: CLIP embeddings, reward/clip_models.py)

in [-scale, scale]. Hessel et al.'s CLIPScore is 2.5 * max(cos, 0): `scale=2.5` gives its scale without the
clip at 0, which would flatten the reward (no ranking) below 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from steadyrl.reward.clip_models import ClipBackbone, ClipReward, load_clip

if TYPE_CHECKING:
    from steadyrl.reward.factory import ClipScoreSpec


class ClipScoreReward(ClipReward):
    """`score(images [B,3,H,W] in [-1, 1], prompts [B]) -> scale * cos(image, prompt)` as float32 [B] on CPU."""

    def __init__(self, clip: ClipBackbone, name: str = "clip_score", scale: float = 1.0, max_batch: int = 32,
                 normalize_prompts: bool = False):
        super().__init__(clip, name, max_batch, normalize_prompts)
        self.scale = float(scale)

    @classmethod
    def from_spec(cls, spec: "ClipScoreSpec") -> "ClipScoreReward":
        clip = load_clip(spec.model, device=spec.device, dtype=spec.dtype)
        return cls(clip, name=spec.name, scale=spec.scale, max_batch=spec.max_batch,
                   normalize_prompts=spec.normalize_prompts)

    def _score(self, samples: Tensor, prompts: list[str]) -> Tensor:
        return self.scale * self.clip.cosine(samples, prompts)
