"""PNG images over REST: base64 PNG <-> RGB uint8 pixels [H,W,3], and decoded pixels as model-space images."""

import base64
import binascii
import io
from typing import Any, Sequence

import numpy as np
import torch

MAX_IMAGE_SIDE = 2048  # PNG sides above this are refused from the header, before the pixels are decoded


def decode_png(data: Any) -> np.ndarray:
    """A base64 PNG (optionally a `data:image/png;base64,` URL) as RGB uint8 pixels [H,W,3]; grey and
    palette images are converted to RGB, an alpha channel is dropped. Sides above MAX_IMAGE_SIDE are refused
    from the header, before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str):
        raise ValueError(f"expected a base64 PNG string, got {type(data).__name__}")
    if data.startswith("data:"):
        head, _, data = data.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not valid base64 ({err})") from err
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        w, h = img.size
        if max(w, h) > MAX_IMAGE_SIDE or min(w, h) < 1:
            raise ValueError(f"image is {w}x{h}; each side must be between 1 and {MAX_IMAGE_SIDE} pixels")
        pixels = np.array(img.convert("RGB"), dtype=np.uint8)  # writable (torch.from_numpy)
    except ValueError:
        raise
    except UnidentifiedImageError as err:
        raise ValueError(f"not a PNG image ({len(raw)} bytes that PIL does not read as PNG)") from err
    except Exception as err:  # PIL raises several types for data that is not a (whole) PNG
        raise ValueError(f"not a decodable PNG image ({type(err).__name__}: {err})") from err
    return pixels


def encode_png(pixels: np.ndarray | torch.Tensor) -> str:
    """RGB uint8 pixels [H,W,3] (or a model-space image [3,H,W] in [-1, 1]) as a base64 PNG string."""
    from PIL import Image

    if isinstance(pixels, torch.Tensor):
        pixels = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        pixels = pixels.permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def check_one_size(images: Sequence[np.ndarray], field: str) -> None:
    """Raise (naming `field`) unless all decoded images [H,W,3] have the same size."""
    sizes = sorted({f"{a.shape[1]}x{a.shape[0]}" for a in images})
    if len(sizes) > 1:
        raise ValueError(f"{field}: all images in one request must have the same size (WxH), got {sizes}")


def rgb_images(images: Sequence[np.ndarray]) -> torch.Tensor:
    """Pixels [H,W,3] uint8 -> model space [B,3,H,W] float32 in [-1, 1]."""
    return (torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1).contiguous()
