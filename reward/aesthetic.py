"""Aesthetic score: LAION's improved-aesthetic-predictor, an MLP on normalised CLIP image embeddings

    r(x) = MLP(e_img(x)),   e_img: L2-normalised CLIP image embedding [D] (reward/clip_models.py)
    MLP  = Linear(D,1024) Dropout Linear(1024,128) Dropout Linear(128,64) Dropout Linear(64,16) Linear(16,1)

(eval mode, so the dropouts are identities: a purely affine map of e_img, as LAION trained it). The prompt
is not used. The head's weights are LAION's file (e.g. sac+logos+ava1-l14-linearMSE.pth for CLIP ViT-L/14),
keys layers.{0,2,4,6,7}.{weight,bias}; a .safetensors file with the same keys also loads.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch import Tensor

from steadyrl.reward.clip_models import ClipBackbone, ClipReward, load_clip

if TYPE_CHECKING:
    from steadyrl.reward.factory import AestheticSpec


class AestheticHead(nn.Module):
    """LAION's MLP; `layers` matches the keys of its state dict."""

    def __init__(self, dim: int):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, embeds: Tensor) -> Tensor:
        return self.layers(embeds)


def read_head_state(path: str | Path) -> dict[str, Tensor]:
    """The state dict at `path` (.safetensors, or a torch state dict .pth/.pt) with keys `layers.N.*`
    (LAION's; a bare Sequential's `N.*` are prefixed). Errors name the spec field `head`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"head={str(path)!r}: no aesthetic-head weights file there")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt or foreign file: say which field to fix
        raise ValueError(f"head={str(path)!r}: cannot read aesthetic-head weights "
                         f"({type(err).__name__}: {err})") from err
    if not isinstance(state, dict):
        raise ValueError(f"head={str(path)!r}: expected a state dict, got {type(state).__name__}")
    return {k if k.startswith("layers.") else f"layers.{k}": v for k, v in state.items()}


def load_aesthetic_head(path: str | Path, dim: int, state: dict[str, Tensor] | None = None) -> AestheticHead:
    """The head at `path` for `dim`-dim embeddings, in eval mode (`state`: already read from `path`)."""
    state = read_head_state(path) if state is None else state
    head = AestheticHead(dim)
    try:
        head.load_state_dict(state)
    except RuntimeError as err:  # missing/unexpected keys or shapes (e.g. a head for another CLIP width)
        raise ValueError(f"head={str(path)!r} does not fit LAION's aesthetic MLP on {dim}-dim CLIP "
                         f"embeddings: {err}") from err
    return head.eval().requires_grad_(False)


class AestheticReward(ClipReward):
    """`score(images [B,3,H,W] in [-1, 1], cond) -> MLP(normalised CLIP image embedding)` as float32 [B] on
    CPU; `cond` (prompts or class ids) is ignored."""

    needs_prompts = False

    def __init__(self, clip: ClipBackbone, head: nn.Module, name: str = "aesthetic", max_batch: int = 32):
        super().__init__(clip, name, max_batch)
        self.head = head.to(clip.device, torch.float32).eval()

    @classmethod
    def from_spec(cls, spec: "AestheticSpec") -> "AestheticReward":
        state = read_head_state(spec.head)  # a missing head fails before the CLIP model loads
        clip = load_clip(spec.model, device=spec.device, dtype=spec.dtype)
        head = load_aesthetic_head(spec.head, clip.projection_dim, state)
        return cls(clip, head, name=spec.name, max_batch=spec.max_batch)

    def _score(self, samples: Tensor, prompts: list[str]) -> Tensor:
        return self.head(self.clip.image_embeds(samples)).squeeze(-1)
