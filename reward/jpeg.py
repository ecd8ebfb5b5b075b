"""DDPO's classic JPEG-compressibility reward: r = -(JPEG size in kB)."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from steadyrl.rollout.digits import to_unit_range


class JpegCompressibilityReward:
    """Smaller JPEG files score higher. Images are upscaled (nearest) by `upscale` before encoding."""

    def __init__(self, quality: int = 95, upscale: int = 8, name: str = "jpeg_compressibility"):
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        self.name, self.quality, self.upscale = name, quality, upscale

    def size_kb(self, samples: Tensor) -> Tensor:
        pixels = (to_unit_range(samples) * 255).round().to(torch.uint8).cpu().numpy()
        sizes = []
        for img in pixels:
            arr = np.transpose(img, (1, 2, 0))
            arr = arr[..., 0] if arr.shape[-1] == 1 else arr
            pil = Image.fromarray(arr)
            pil = pil.resize((pil.width * self.upscale, pil.height * self.upscale), Image.NEAREST)
            buf = io.BytesIO()
            pil.save(buf, format="JPEG", quality=self.quality)
            sizes.append(buf.tell() / 1000.0)
        return torch.tensor(sizes, dtype=torch.float32)

    def score(self, samples: Tensor, cond: Tensor) -> Tensor:
        return -self.size_kb(samples)

    def health_probe(self) -> tuple[Tensor, Tensor]:
        """A grey RGB image (JPEG reads no conditioning: class 0)."""
        return torch.zeros(1, 3, 32, 32), torch.zeros(1, dtype=torch.long)
