"""A CLIP model loaded by hub id or local directory, with image preprocessing written in torch.

Images arrive in model space, [B,3,H,W] (or [B,1,H,W]) in [-1, 1], any H and W. Preprocessing follows
CLIPImageProcessor, as differentiable torch ops:
    x = clamp((samples + 1) / 2, 0, 1)                 (grey images repeated to RGB)
    resize the shorter side to S = image_size           (bicubic, antialiased; the longer side to
                                                         int(S * long / short)); skipped when it is S already
    center crop S x S,  x = (x - mean) / std            (mean/std from the saved processor config, else
                                                         OpenAI CLIP's)
Embeddings are L2-normalised and returned in float32:
    e_img = normalize(visual_projection(vision_model(x).pooler_output))
    e_txt = normalize(text_projection(text_model(tokens).pooler_output))
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from steadyrl.reward.prompt_text import normalize_prompt

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEALTH_PROMPT = "health check"  # the prompt of `ClipReward.health_probe`
DType = Literal["float32", "float16", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_unit_pixels(samples: Tensor) -> Tensor:
    """[-1, 1] model space -> [0, 1] RGB (float32), clamped as an 8-bit image would be; grey -> RGB."""
    if samples.ndim != 4 or samples.shape[1] not in (1, 3):
        raise ValueError(f"samples must be images [B,3,H,W] (or [B,1,H,W]), got shape {tuple(samples.shape)}")
    x = ((samples.float() + 1) / 2).clamp(0, 1)
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x


def resize_shortest_edge(x: Tensor, size: int) -> Tensor:
    """Bicubic, antialiased resize so the shorter side is `size` (the longer one as CLIPImageProcessor
    rounds it: int(size * long / short)); values clamped to [0, 1] as an 8-bit resize would clip them."""
    h, w = x.shape[-2:]
    if min(h, w) == size:
        return x
    new = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    return F.interpolate(x, size=new, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


def center_crop(x: Tensor, size: int) -> Tensor:
    """The central size x size window (top/left offsets rounded down, as CLIPImageProcessor does)."""
    h, w = x.shape[-2:]
    top, left = (h - size) // 2, (w - size) // 2
    return x[..., top:top + size, left:left + size]


def preprocess_images(samples: Tensor, image_size: int, mean: Tensor, std: Tensor) -> Tensor:
    """CLIP pixel values [B,3,S,S] from model-space images [B,C,H,W] in [-1, 1]; differentiable."""
    x = center_crop(resize_shortest_edge(to_unit_pixels(samples), image_size), image_size)
    return (x - mean.to(x.device).view(1, 3, 1, 1)) / std.to(x.device).view(1, 3, 1, 1)


def check_prompts(name: str, cond: Any, batch: int) -> list[str]:
    """`cond` as a list of `batch` prompt strings, or a ValueError naming `cond` and the model."""
    if isinstance(cond, str) or not isinstance(cond, Sequence) or not all(isinstance(c, str) for c in cond):
        raise ValueError(f"reward model {name!r}: cond must be a list of {batch} prompt strings, "
                         f"got {type(cond).__name__}")
    if len(cond) != batch:
        raise ValueError(f"reward model {name!r}: cond has {len(cond)} prompts for {batch} images")
    return list(cond)


def chunks(batch: int, max_batch: int) -> Iterator[slice]:
    """Consecutive slices of at most `max_batch` rows covering range(batch)."""
    for start in range(0, batch, max_batch):
        yield slice(start, min(start + max_batch, batch))


def _load_error(field: str, source: str, what: str, err: Exception) -> ValueError:
    return ValueError(f"{field}={source!r}: cannot load a {what} from this hub id or directory "
                      f"({type(err).__name__}: {err})")


def image_mean_std(source: str, field: str = "model") -> tuple[Tensor, Tensor]:
    """image_mean/image_std of the CLIPImageProcessor saved at `source`; OpenAI CLIP's when none is saved."""
    from transformers import CLIPImageProcessor

    try:
        proc = CLIPImageProcessor.from_pretrained(source)
        mean, std = proc.image_mean, proc.image_std
    except OSError:  # no preprocessor_config.json there: the checkpoint uses CLIP's defaults
        mean, std = CLIP_MEAN, CLIP_STD
    except ValueError as err:
        raise _load_error(field, source, "CLIPImageProcessor config", err) from err
    mean_t, std_t = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    if mean_t.shape != (3,) or std_t.shape != (3,):
        raise ValueError(f"{field}={source!r}: image_mean/image_std must have 3 entries, got {mean} and {std}")
    return mean_t, std_t


@dataclass
class ClipBackbone:
    """A loaded CLIPModel (eval mode, on `device` in `dtype`), its tokenizer and image normalisation."""

    model: Any  # transformers.CLIPModel
    tokenizer: Any  # a CLIP tokenizer (AutoTokenizer)
    mean: Tensor  # [3]
    std: Tensor  # [3]
    device: torch.device
    dtype: torch.dtype

    @property
    def image_size(self) -> int:
        return int(self.model.config.vision_config.image_size)

    @property
    def projection_dim(self) -> int:
        return int(self.model.config.projection_dim)

    @property
    def max_length(self) -> int:
        """Prompts are truncated to the text model's context (77 for CLIP)."""
        ctx = int(self.model.config.text_config.max_position_embeddings)
        return min(ctx, int(self.tokenizer.model_max_length or ctx))

    def pixel_values(self, samples: Tensor) -> Tensor:
        """Model-space images -> normalised pixel values on the model's device, in its dtype."""
        x = preprocess_images(samples.to(self.device), self.image_size, self.mean, self.std)
        return x.to(self.dtype)

    def image_embeds(self, samples: Tensor) -> Tensor:
        """L2-normalised image embeddings [B,D] (float32, on the model's device)."""
        out = self.model.vision_model(pixel_values=self.pixel_values(samples))
        return F.normalize(self.model.visual_projection(out.pooler_output).float(), dim=-1)

    def text_embeds(self, prompts: list[str]) -> Tensor:
        """L2-normalised text embeddings [B,D] (float32, on the model's device); prompts padded and
        truncated to `max_length` tokens."""
        tok = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        out = self.model.text_model(input_ids=tok["input_ids"].to(self.device),
                                    attention_mask=tok["attention_mask"].to(self.device))
        return F.normalize(self.model.text_projection(out.pooler_output).float(), dim=-1)

    def cosine(self, samples: Tensor, prompts: list[str]) -> Tensor:
        """cos(image embedding, prompt embedding) per pair [B] (the embeddings are unit-norm)."""
        return (self.image_embeds(samples) * self.text_embeds(prompts)).sum(dim=-1)


def load_clip(model: str, processor: str | None = None, device: str = "cpu", dtype: DType = "float32",
              processor_field: str = "processor") -> ClipBackbone:
    """CLIPModel from `model`; tokenizer and image mean/std from `processor` (default: `model`).
    A source that does not load raises a ValueError naming its spec field (`model` or `processor_field`)."""
    from transformers import AutoTokenizer, CLIPModel

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    try:
        clip = CLIPModel.from_pretrained(model)
    except (OSError, ValueError, KeyError) as err:
        raise _load_error("model", model, "CLIPModel", err) from err
    source, field = (processor, processor_field) if processor is not None else (model, "model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as err:
        raise _load_error(field, source, "CLIP tokenizer", err) from err
    mean, std = image_mean_std(source, field)
    dev = torch.device(device)
    clip = clip.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    return ClipBackbone(model=clip, tokenizer=tokenizer, mean=mean.to(dev), std=std.to(dev), device=dev,
                        dtype=DTYPES[dtype])


class ClipReward(ABC):
    """Shared `score`/`features` for rewards on a CLIP backbone: checks the prompts, scores in chunks of
    `max_batch` images without gradients, and returns float32 [B] on CPU. Subclasses define `_score`."""

    needs_prompts = True

    def __init__(self, clip: ClipBackbone, name: str, max_batch: int = 32, normalize_prompts: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.clip, self.name, self.max_batch = clip, name, max_batch
        self.normalize_prompts = normalize_prompts  # reward/prompt_text.py, before the text encoder

    @abstractmethod
    def _score(self, samples: Tensor, prompts: list[str]) -> Tensor:
        """Scores [b] of one chunk of images and their prompts (no gradients)."""

    def score(self, samples: Tensor, cond: Sequence[str]) -> Tensor:
        """Scores [B] (float32, CPU) of images [B,3,H,W] in [-1, 1] for their B prompts; higher is better."""
        batch = samples.shape[0]
        prompts = check_prompts(self.name, cond, batch) if self.needs_prompts else [""] * batch
        if self.normalize_prompts:
            prompts = [normalize_prompt(p) for p in prompts]
        with torch.no_grad():
            parts = [self._score(samples[s], prompts[s]).float().cpu() for s in chunks(batch, self.max_batch)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def health_probe(self) -> tuple[Tensor, list[str]]:
        """A grey RGB image and a prompt."""
        return torch.zeros(1, 3, 32, 32), [HEALTH_PROMPT]

    def features(self, samples: Tensor) -> Tensor:
        """L2-normalised CLIP image embeddings [B,D] (float32, CPU), e.g. for a diversity metric."""
        with torch.no_grad():
            parts = [self.clip.image_embeds(samples[s]).cpu() for s in chunks(samples.shape[0], self.max_batch)]
        return torch.cat(parts) if parts else torch.zeros(0, self.clip.projection_dim)
