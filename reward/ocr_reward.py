"""OCR reward for text rendering (`kind: ocr`): does the image show the text its prompt quotes?

Flow-GRPO's text-rendering reward (yifan123/flow_grpo, flow_grpo/ocr.py, `OcrScorer`), reimplemented here:

    target  t = the text between the first pair of double quotes in the prompt
                (`A sign that says "OPEN"` -> `OPEN`)
    read    s = the OCR's text lines (those read with confidence >= `min_confidence`), top to bottom and left
                to right, joined without a separator
    both lower-cased with spaces removed, then
    d = 0                          if t occurs in s (extra text around the target costs nothing)
        Levenshtein(s, t)          otherwise
    r = 1 - min(d, |t|) / |t|      in [0, 1]: 1 for the text exactly, 0 for nothing read or nothing alike

The OCR is RapidOCR (the `rapidocr-onnxruntime` package: PaddleOCR's PP-OCRv4 detector and recogniser, the
Chinese-and-English ones, converted to ONNX, with the model files inside the wheel, so nothing is downloaded), where
Flow-GRPO runs PaddleOCR 2.9 itself with its English models (`lang="en"`, downloaded on first use); like Flow-GRPO it
runs on the CPU, drops lines read with confidence below 0.5 (PaddleOCR's `drop_score`) and skips the text-angle
classifier; the detector reads the image at its own size (PaddleOCR's `det_limit_type: max`, though PaddleOCR scales a
side over 960 px down to 960, RapidOCR only one over 2000 px). The edit distance is rapidfuzz's Levenshtein (unit
costs, as python-Levenshtein's `distance` that Flow-GRPO calls). Both come with the optional extra
`pip install steadyrl[ocr]`; they are imported only when an OCR model is built.

Where this differs from Flow-GRPO, on purpose:
- A prompt without a quoted text (no pair of double quotes) or whose quoted text is empty once spaces are removed
  is an error naming the reward and the prompt (Flow-GRPO takes whatever follows a lone quote and divides by zero
  on an empty target): an OCR reward on such a prompt set is a config mistake, not a score of 0.
- An OCR failure raises (Flow-GRPO prints it and scores 0): a broken replica is then replaced, not trained on.
- Images reach the OCR as BGR, the channel order PaddleOCR's models were trained in (Flow-GRPO hands PaddleOCR
  RGB arrays, which it reads as BGR: its red and blue are swapped).
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from steadyrl.reward.python_reward import to_images
from steadyrl.rollout.settings_base import StrictModel

EXTRA = "ocr"
_QUOTED = re.compile(r'"([^"]*)"')


class OcrSpec(StrictModel):
    """Flow-GRPO's text-rendering reward: 1 - min(edit distance, |target|) / |target| between the prompt's quoted
    text and the text OCR reads in the image (module docstring of reward/ocr_reward.py)."""

    kind: Literal["ocr"] = "ocr"
    name: str = "ocr"
    min_confidence: float = Field(
        0.5, ge=0, le=1, description="text lines the recogniser reads with a lower confidence are dropped before "
        "scoring: 0.5 is PaddleOCR's `drop_score` default that Flow-GRPO's reward ran with (and RapidOCR's "
        "`text_score`); lower reads more of a blurry rendering but also more noise")
    angle_classifier: bool = Field(
        False, description="run the text-angle classifier (turns text upside down the right way round) before "
        "recognition; off as in Flow-GRPO (`use_angle_cls=False`): generated text is upright, and the classifier "
        "costs time per text line")
    threads: int = Field(
        1, ge=1, description="onnxruntime threads per OCR model: 1 as the Serve replicas give torch (more threads "
        "beside the rollout and learner processes oversubscribe the CPU); raise it where the OCR has cores to "
        "itself (a value above the machine's core count means onnxruntime's default, all cores)")


def _require(module: str) -> Any:
    """`module` imported, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"the OCR reward (kind: ocr) needs {module!r}, which is not installed: "
                          f"pip install steadyrl[{EXTRA}] (or `pip install -e '.[{EXTRA}]'` in a checkout)") from err


def target_text(prompt: str, name: str = "ocr") -> str:
    """The text the image should show: between the prompt's first pair of double quotes. A ValueError naming
    the reward `name` and the prompt where there is none (or it holds nothing but spaces)."""
    m = _QUOTED.search(prompt)
    if m is None:
        raise ValueError(f"reward {name!r} (kind ocr) scores the text between double quotes in the prompt, and "
                         f"prompt {prompt!r} has none: use a prompt set of quoted texts (e.g. `text_rendering`)")
    if not m.group(1).replace(" ", ""):
        raise ValueError(f"reward {name!r} (kind ocr): prompt {prompt!r} quotes an empty text; nothing to render")
    return m.group(1)


def normalise(text: str) -> str:
    """Flow-GRPO's comparison form: spaces removed, lower case."""
    return text.replace(" ", "").lower()


def text_reward(recognised: str, target: str) -> float:
    """r = 1 - min(d, |t|) / |t| with t, s the normalised target and recognised text, d = 0 when t occurs in s and
    Levenshtein(s, t) otherwise (module docstring). `target` must not be empty once normalised."""
    s, t = normalise(recognised), normalise(target)
    if not t:
        raise ValueError("the OCR reward's target text is empty once spaces are removed")
    if t in s:
        return 1.0
    d = _require("rapidfuzz.distance").Levenshtein.distance(s, t)
    return 1.0 - min(d, len(t)) / len(t)


class OcrReward:
    """`score(images [B,3,H,W] in [-1, 1], prompts [B]) -> r` as float32 [B] on CPU (module docstring)."""

    def __init__(self, name: str = "ocr", min_confidence: float = 0.5, angle_classifier: bool = False,
                 threads: int = 1):
        rapidocr = _require("rapidocr_onnxruntime")
        _require("rapidfuzz.distance")  # fail when built, not at the first score
        self.name = name
        # det_limit_type 'max' (PaddleOCR's default): the detector sees the image at its own size, only a side over
        # 2000 px scaled down (RapidOCR's rule for 'max'); RapidOCR's own default, 'min', scales the shorter side up
        # to 736 px, which costs 10-30x the time on small images and read the tests' images no better
        self.engine = rapidocr.RapidOCR(text_score=min_confidence, use_cls=angle_classifier,
                                        intra_op_num_threads=threads, inter_op_num_threads=threads,
                                        det_limit_type="max")

    @classmethod
    def from_spec(cls, spec: OcrSpec) -> "OcrReward":
        return cls(name=spec.name, min_confidence=spec.min_confidence, angle_classifier=spec.angle_classifier,
                   threads=spec.threads)

    def read(self, image: np.ndarray) -> str:
        """The text OCR reads in one uint8 image [H, W, C] (RGB or grey): its lines in reading order, joined."""
        if image.shape[-1] == 3:
            image = image[..., ::-1]  # RGB -> BGR, the order a numpy image is read in (module docstring)
        lines, _ = self.engine(np.ascontiguousarray(image))
        return "".join(line[1] for line in lines or [])

    def score(self, samples: Tensor, prompts: list[str]) -> Tensor:
        if isinstance(prompts, Tensor) or len(prompts) != samples.shape[0]:
            raise ValueError(f"reward {self.name!r} (kind ocr) needs {samples.shape[0]} prompt strings, got "
                             f"{type(prompts).__name__} of {len(prompts)}")
        targets = [target_text(p, self.name) for p in prompts]  # every prompt checked before any OCR runs
        images = to_images(samples, "uint8")  # exactly as a `kind: python` reward sees them
        return torch.tensor([text_reward(self.read(im), t) for im, t in zip(images, targets)], dtype=torch.float32)

    def health_probe(self) -> tuple[Tensor, list[str]]:
        """`OCR` in black on white, 48 x 128 px, with a prompt that quotes it (it reads as 1.0 on a sound model)."""
        return render_text("OCR", 128, 48), ['A sign that says "OCR"']


def render_text(text: str, width: int, height: int, size: int = 32) -> Tensor:
    """`text` centred in black on white with PIL's bundled font at `size` px, as one image [1, 3, H, W] in [-1, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(im)
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((width - right - left) / 2, (height - bottom - top) / 2), text, fill="black", font=font)
    return torch.from_numpy(np.array(im)).permute(2, 0, 1)[None].float() / 127.5 - 1
