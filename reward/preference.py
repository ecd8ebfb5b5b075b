"""Human-preference reward in PickScore's form (Kirstain et al., 2023): a CLIP model fine-tuned on Pick-a-Pic
preferences, scored as its contrastive logit

    r(x, c) = exp(logit_scale) * cos(e_img(x), e_txt(c))     (e_*: CLIP embeddings, reward/clip_models.py)

PickScore_v1 ships only the model; its tokenizer and image normalisation come from the LAION CLIP-H repo
it was trained from (`processor`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from steadyrl.reward.clip_models import ClipBackbone, ClipReward, load_clip

if TYPE_CHECKING:
    from steadyrl.reward.factory import PreferenceSpec


class PreferenceReward(ClipReward):
    """`score(images [B,3,H,W] in [-1, 1], prompts [B]) -> exp(logit_scale) * cos` as float32 [B] on CPU."""

    def __init__(self, clip: ClipBackbone, name: str = "pickscore", max_batch: int = 32,
                 normalize_prompts: bool = False):
        super().__init__(clip, name, max_batch, normalize_prompts)

    @classmethod
    def from_spec(cls, spec: "PreferenceSpec") -> "PreferenceReward":
        clip = load_clip(spec.model, processor=spec.processor, device=spec.device, dtype=spec.dtype)
        return cls(clip, name=spec.name, max_batch=spec.max_batch, normalize_prompts=spec.normalize_prompts)

    def _score(self, samples: Tensor, prompts: list[str]) -> Tensor:
        return self.clip.model.logit_scale.float().exp() * self.clip.cosine(samples, prompts)
