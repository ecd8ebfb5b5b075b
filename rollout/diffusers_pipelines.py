"""Loading a diffusers text-to-image model by hub id or local directory (the same code for both).

`describe_pipeline` reads only configs (which family, latent shape, scheduler); `load_denoiser` loads the
network that trains (UNet or transformer); `PipelineTools` holds the frozen rest a rollout worker needs:
the text encoders with their tokenizers (through the pipeline's own `encode_prompt`) and the VAE.
A hub id must already be in the local Hugging Face cache (runs are offline, see README).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from steadyrl.rollout.text_to_image import Family

PIPELINE_FAMILIES: dict[str, Family] = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
}
DENOISER = {"sd": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PipelineInfo:
    """What the configs of a saved pipeline say (nothing is loaded)."""

    source: str
    family: Family
    latent_channels: int  # the denoiser's input channels (flux: of the packed 2x2 patches, 4x the VAE's)
    latent_size: int  # the denoiser's native latent side
    vae_scale_factor: int  # pixels per latent
    scheduler: dict[str, Any]
    absent: tuple[str, ...] = ()  # components saved as None (SD3 without T5), passed as None when loading

    @property
    def resolution(self) -> int:
        """The model's native image side in pixels."""
        return self.latent_size * self.vae_scale_factor

    @property
    def packed(self) -> bool:
        """The denoiser reads 2x2 latent patches as a sequence (FLUX)."""
        return self.family == "flux"

    def latent_shape(self, resolution: int | None) -> tuple[int, ...]:
        """What the sampler draws: [C, h, w] latents, or (flux) packed [seq, 4C] with seq = (h/2)(w/2)."""
        side = resolution or self.resolution
        factor = self.vae_scale_factor * (2 if self.packed else 1)
        if side % factor:
            raise ValueError(f"resolution={side} is not a multiple of {factor} (the VAE's factor"
                             f"{' times the 2x2 packing' if self.packed else ''})")
        if self.packed:
            return ((side // factor) ** 2, self.latent_channels)
        return (self.latent_channels, side // factor, side // factor)

    def image_seq_len(self, resolution: int | None) -> int:
        """Tokens of the packed latent (FLUX's dynamic shift of the flow grid depends on it)."""
        return self.latent_shape(resolution)[0]


def _load_config(source: str, part: str | None = None) -> dict[str, Any]:
    """model_index.json (part None) or one component's config ("unet", "transformer", "vae", "scheduler")."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiffusionPipeline, UNet2DConditionModel

    cls = {None: DiffusionPipeline, "vae": AutoencoderKL, "scheduler": DDIMScheduler}.get(part, UNet2DConditionModel)
    kwargs = {} if part is None else {"subfolder": part}
    try:
        return dict(cls.load_config(source, **kwargs))
    except (OSError, ValueError) as err:
        what = "model_index.json" if part is None else f"{part}/ config"
        raise ValueError(f"pretrained={source!r}: cannot read {what} (a diffusers pipeline directory, or a hub id "
                         f"already in the local cache): {err}") from None


def describe_pipeline(source: str) -> PipelineInfo:
    """Family, latent shape and scheduler config of the pipeline at `source` (hub id or directory)."""
    index = _load_config(source)
    name = index.get("_class_name", "?")
    if name not in PIPELINE_FAMILIES:
        raise ValueError(f"pretrained={source!r} is a {name}; supported: {sorted(PIPELINE_FAMILIES)}")
    family = PIPELINE_FAMILIES[name]
    net = _load_config(source, DENOISER[family])
    vae = _load_config(source, "vae")
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    # FLUX's transformer has no sample_size: its native side is the VAE's (1024 px for FLUX.1)
    latent_size = int(net["sample_size"]) if "sample_size" in net else int(vae.get("sample_size", 1024)) // factor
    absent = tuple(k for k, v in index.items() if not k.startswith("_") and isinstance(v, (list, tuple))
                   and all(part is None for part in v))
    return PipelineInfo(source=source, family=family, latent_channels=int(net["in_channels"]),
                        latent_size=latent_size, vae_scale_factor=factor,
                        scheduler=_load_config(source, "scheduler"), absent=absent)


def load_denoiser(source: str, family: Family, dtype: str = "float32") -> nn.Module:
    """The UNet (sd, sdxl) or transformer (sd3) of the pipeline at `source`, in eval mode."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    cls = {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel}.get(family, UNet2DConditionModel)
    return cls.from_pretrained(source, subfolder=DENOISER[family], torch_dtype=DTYPES[dtype]).eval()


class PipelineTools:
    """The frozen text encoders and VAE of a pipeline around the policy's own denoiser (no second copy: the
    pipeline's `encode_prompt` reads its config), on the denoiser's device.

    `encode(prompts)` -> per-prompt conditioning {name: [C,...]} on the CPU: the family's embeddings and, when
    guided, the negative prompt's (`negative_<name>`); `decode(latents)` -> images [B,3,H,W] in [-1, 1].
    """

    def __init__(self, info: PipelineInfo, denoiser: nn.Module, dtype: str = "float32",
                 resolution: int | None = None, max_sequence_length: int | None = None):
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        self.info = info
        self.device = next(denoiser.parameters()).device
        self.resolution = resolution or info.resolution
        self.max_sequence_length = max_sequence_length  # T5 tokens (sd3, flux); None: the pipeline's default
        parts = {name: None for name in info.absent}  # components saved as None (SD3 without T5)
        parts[DENOISER[info.family]] = denoiser
        diffusers_logging.disable_progress_bar()
        self.pipe = DiffusionPipeline.from_pretrained(info.source, torch_dtype=DTYPES[dtype], **parts)
        self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompt: str = "", guided: bool = True) -> dict[str, Tensor]:
        family, n = self.info.family, len(prompts)
        negative = [negative_prompt] * n if guided else None
        if family == "sd":
            pos, neg = self.pipe.encode_prompt(prompts, self.device, 1, guided, negative_prompt=negative)
            out = {"prompt_embeds": pos, "negative_prompt_embeds": neg}
        elif family == "sdxl":
            # an empty negative prompt is diffusers' "none given": with force_zeros_for_empty_prompt (SDXL's
            # default) the unconditional branch reads zero embeddings, as `pipe(prompt)` does
            if not negative_prompt and self.pipe.config.get("force_zeros_for_empty_prompt", False):
                negative = None
            pos, neg, pooled, neg_pooled = self.pipe.encode_prompt(prompts, device=self.device,
                                                                   do_classifier_free_guidance=guided,
                                                                   negative_prompt=negative)
            # the pipeline's own size/crop conditioning at our resolution: (original (H, W), crop top-left (0, 0),
            # target (H, W)), the same for the negative branch; dtype and projection width as `__call__` picks them
            side = self.resolution
            proj = (int(pooled.shape[-1]) if self.pipe.text_encoder_2 is None
                    else self.pipe.text_encoder_2.config.projection_dim)
            ids = self.pipe._get_add_time_ids((side, side), (0, 0), (side, side), dtype=pos.dtype,
                                              text_encoder_projection_dim=proj)
            ids = ids.to(self.device).repeat(n, 1)
            out = {"prompt_embeds": pos, "negative_prompt_embeds": neg, "pooled_prompt_embeds": pooled,
                   "negative_pooled_prompt_embeds": neg_pooled, "add_time_ids": ids,
                   "negative_add_time_ids": ids if guided else None}
        elif family == "sd3":
            pos, neg, pooled, neg_pooled = self.pipe.encode_prompt(prompts, None, None, device=self.device,
                                                                   do_classifier_free_guidance=guided,
                                                                   negative_prompt=negative, **self._t5_length())
            out = {"prompt_embeds": pos, "negative_prompt_embeds": neg, "pooled_prompt_embeds": pooled,
                   "negative_pooled_prompt_embeds": neg_pooled}
        else:  # flux: guidance-distilled, no negative branch; position ids of the text and of the latent patches
            pos, pooled, txt_ids = self.pipe.encode_prompt(prompts, None, device=self.device, **self._t5_length())
            side = self.resolution // self.info.vae_scale_factor // 2
            img_ids = self.pipe._prepare_latent_image_ids(n, side, side, self.device, pos.dtype)
            out = {"prompt_embeds": pos, "pooled_prompt_embeds": pooled,
                   "txt_ids": txt_ids.expand(n, -1, -1), "img_ids": img_ids.expand(n, -1, -1)}
        return {k: v.detach().cpu().contiguous() for k, v in out.items() if v is not None}

    def _t5_length(self) -> dict[str, int]:
        return {} if self.max_sequence_length is None else {"max_sequence_length": self.max_sequence_length}

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk: int = 8) -> Tensor:
        """VAE-decoded images in [-1, 1] (CPU float32): x = vae.decode(z / scaling_factor + shift_factor)."""
        vae = self.pipe.vae
        scale, shift = vae.config.scaling_factor, getattr(vae.config, "shift_factor", None) or 0.0
        images = []
        for z in latents.split(chunk):
            if self.info.packed:  # [b, seq, 4C] -> [b, C, h, w]
                z = self.pipe._unpack_latents(z, self.resolution, self.resolution, self.info.vae_scale_factor)
            z = z.to(device=self.device, dtype=vae.dtype) / scale + shift
            images.append(vae.decode(z, return_dict=False)[0].float().clamp(-1, 1).cpu())
        return torch.cat(images)
