"""A trained diffusion network written as diffusers loads it (`steadyrl export`; the digits and text-to-image
testbeds' `export`). The formats, each from diffusers' or peft's own writer:

    LoRA adapters   OUT/pytorch_lora_weights.safetensors   the pipeline class's `save_lora_weights`: keys
                    `unet.<module>.lora_A.weight` (SD 1.x/2.x, SDXL) or `transformer.<module>.lora_B.weight` (SD3,
                    FLUX), peft's names (`get_peft_model_state_dict`), float32 as trained; the adapters' peft
                    `LoraConfig` (rank, alpha, targets) in the file's header (`lora_adapter_metadata`): alpha / r kept
                    OUT/adapter_config.json   the same `LoraConfig` as peft saves it, `base_model_name_or_path` the base
        pipe = <Pipeline>.from_pretrained(BASE); pipe.load_lora_weights(OUT)
    pipeline        OUT/model_index.json, unet/ or transformer/, vae/, text_encoder*/, tokenizer*/, scheduler/: the
                    pipeline's `save_pretrained`, its denoiser the trained one (whole-network training) or the base's
                    with the adapters fused (`merge`: load_lora_weights, fuse_lora, unload_lora_weights); SD and SDXL
                    get the DDIM scheduler they were trained with, in place of the base's
        pipe = <Pipeline>.from_pretrained(OUT)
    class UNet      OUT/config.json, diffusion_pytorch_model.safetensors (`UNet2DModel.save_pretrained`), OUT/scheduler/
                    (the noise schedule's `save_pretrained`), OUT/sampling.json (how the class enters, what the network
                    predicts, the sample shape and range, the sampler it was trained with)
        unet = UNet2DModel.from_pretrained(OUT); scheduler = <Scheduler>.from_pretrained(OUT, subfolder="scheduler")
"""
from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

from torch import nn

from steadyrl.rollout.diffusers_pipelines import DENOISER, DTYPES, PIPELINE_FAMILIES, PipelineInfo
from steadyrl.rollout.text_to_image import Family

#: the pipeline class of each family (what `from_pretrained` and `save_lora_weights` are called on)
PIPELINE_CLASS: dict[str, str] = {family: name for name, family in PIPELINE_FAMILIES.items()}
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE


def diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def pipeline_class(family: Family) -> Any:
    import diffusers

    return getattr(diffusers, PIPELINE_CLASS[family])


def save_lora(net: nn.Module, family: Family, out: Path, base: str) -> Path:
    """The peft adapters injected into `net` (`rollout.lora.add_lora`) written into `out` (see the module docstring)."""
    from peft.utils import get_peft_model_state_dict

    cls, part = pipeline_class(family), DENOISER[family]
    if f"{part}_lora_adapter_metadata" not in inspect.signature(cls.save_lora_weights).parameters:
        raise NotImplementedError(f"exporting LoRA adapters needs diffusers >= 0.34 (here {diffusers_version()}): "
                                  "older ones write no LoraConfig with the weights, and their loader takes alpha = r")
    config = copy.deepcopy(net.peft_config["default"])
    config.base_model_name_or_path = base
    layers = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(net).items()}
    cls.save_lora_weights(out, **{f"{part}_lora_layers": layers, f"{part}_lora_adapter_metadata": config.to_dict()})
    config.save_pretrained(str(out))
    return out / LORA_WEIGHTS


def load_base_pipeline(info: PipelineInfo, dtype: str, **parts: Any) -> Any:
    """The base pipeline (components saved as None passed as None), `parts` in place of its own."""
    from diffusers import DiffusionPipeline

    parts = {**{name: None for name in info.absent}, **parts}
    pipe = DiffusionPipeline.from_pretrained(info.source, torch_dtype=DTYPES[dtype], **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(pipe: Any, family: Family, out: Path) -> Path:
    """`pipe.save_pretrained(out)`, SD and SDXL with the DDIM scheduler of their training sampler (the base's
    config, x0 unclipped as rollout/ddim.py samples)."""
    if family in ("sd", "sdxl"):
        from diffusers import DDIMScheduler

        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)  # x0 unclipped
    pipe.save_pretrained(str(out))
    return out


def save_merged_pipeline(info: PipelineInfo, lora_dir: Path, out: Path, dtype: str) -> Path:
    """The base pipeline with the adapters of `lora_dir` (`save_lora`; removed once read) fused into its denoiser,
    as a user fuses them; loads a second copy of the base (the policy's own stays untouched)."""
    import shutil

    pipe = load_base_pipeline(info, dtype)
    pipe.load_lora_weights(str(lora_dir))
    shutil.rmtree(lora_dir)
    pipe.fuse_lora(components=[DENOISER[info.family]])
    pipe.unload_lora_weights()
    return save_pipeline(pipe, info.family, out)


def save_full_pipeline(info: PipelineInfo, net: nn.Module, out: Path, dtype: str) -> Path:
    """The base pipeline with the trained denoiser `net` in place of its own."""
    return save_pipeline(load_base_pipeline(info, dtype, **{DENOISER[info.family]: net}), info.family, out)


def pipeline_snippet(info: PipelineInfo, source: str, dtype: str, lora: str | None, call: dict[str, Any]) -> str:
    """Python that loads the pipeline at `source` (with `lora`: and those adapters; components the base saved as None
    passed as None, as diffusers asks) and makes one image with the keyword arguments `call`."""
    family = info.family
    name = PIPELINE_CLASS[family]
    optional = getattr(pipeline_class(family), "_optional_components", [])
    extra = "".join(f", {part}=None" for part in info.absent if part not in optional)
    extra += "" if dtype == "float32" else f", torch_dtype=torch.{dtype}"
    ddim = lora is not None and family in ("sd", "sdxl")  # an exported pipeline holds the DDIM scheduler already
    kwargs = "".join(f", {k}={v!r}" for k, v in call.items())
    return "\n".join([
        *([] if dtype == "float32" else ["import torch"]),
        f"from diffusers import {'DDIMScheduler, ' if ddim else ''}{name}", "",
        f"pipe = {name}.from_pretrained({source!r}{extra})",
        *([f"pipe.load_lora_weights({lora!r})"] if lora is not None else []),
        *(["# the sampler it was trained with: DDIM, x0 unclipped",
           "pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)"] if ddim else []),
        f'image = pipe("a photo of a cat"{kwargs}).images[0]',
    ])


def save_class_unet(net: nn.Module, scheduler: Any, out: Path, sampling: dict[str, Any]) -> Path:
    """A class-conditional `UNet2DModel` (`num_class_embeds`: class id c enters as `class_labels=c`) with its
    noise schedule and `sampling.json` (see the module docstring)."""
    net.save_pretrained(str(out))
    scheduler.save_pretrained(str(out / "scheduler"))
    (out / "sampling.json").write_text(json.dumps(sampling, indent=1))
    return out


def class_unet_snippet(scheduler: str, num_classes: int, shape: tuple[int, ...], num_steps: int) -> str:
    """Python that loads a `save_class_unet` folder and samples one image of each class with the scheduler's own
    (deterministic) step: DDIM with eta = 0, or the flow's Euler step."""
    dims = ", ".join(str(d) for d in shape)
    return "\n".join([
        "import torch", f"from diffusers import {scheduler}, UNet2DModel", "",
        'unet = UNet2DModel.from_pretrained("{path}")',
        f'scheduler = {scheduler}.from_pretrained("{{path}}", subfolder="scheduler")',
        f"scheduler.set_timesteps({num_steps})",
        f"labels = torch.arange({num_classes})  # the class ids (digits: the digit itself)",
        f"x = torch.randn({num_classes}, {dims}, generator=torch.Generator().manual_seed(0))",
        "with torch.no_grad():",
        "    for t in scheduler.timesteps:",
        "        x = scheduler.step(unet(x, t, class_labels=labels).sample, t, x).prev_sample",
        "images = (x.clamp(-1, 1) + 1) / 2  # pixels in [0, 1]",
    ])
