"""Text-to-image policies: a diffusers denoiser conditioned on prompt embeddings, with classifier-free guidance.

The embeddings are computed once per prompt batch by the pipeline's own `encode_prompt`
(`rollout.diffusers_pipelines.PipelineTools`) and travel in the batch (`cond.<name>` extras), so sampling
and the learner's log-prob recompute feed the network the same tensors, through this one function:

    guided = u + w (c - u)      c = net(x, t | prompt),  u = net(x, t | negative prompt),  w = guidance_scale

(diffusers' form and order: one forward over [negative; positive]; w = 1 is a single conditional pass).
Families: `sd` (SD 1.x/2.x: `UNet2DConditionModel`, epsilon, DDIM), `sdxl` (the same UNet with pooled
text embeddings and size ids), `sd3` (`SD3Transformer2DModel`, velocity, the flow SDE) and `flux`
(`FluxTransformer2DModel`, velocity, the flow SDE on packed 2x2-patch latents [B, seq, 4C]; FLUX.1 is
guidance-distilled: w enters as the network's guidance embedding, one forward, no negative branch).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from steadyrl.rollout.policy import Cond, Policy

Family = Literal["sd", "sdxl", "sd3", "flux"]

#: the conditioning each family's denoiser reads (each also has a `negative_<name>` twin for guidance)
COND_KEYS: dict[str, tuple[str, ...]] = {
    "sd": ("prompt_embeds",),
    "sdxl": ("prompt_embeds", "pooled_prompt_embeds", "add_time_ids"),
    "sd3": ("prompt_embeds", "pooled_prompt_embeds"),
    "flux": ("prompt_embeds", "pooled_prompt_embeds", "txt_ids", "img_ids"),
}
#: families whose guidance is an input of the network (distilled), not classifier-free
EMBEDDED_GUIDANCE = ("flux",)

#: LoRA targets when `lora.target_modules` is not given (DDPO / Flow-GRPO's choices)
DEFAULT_LORA_TARGETS: dict[str, list[str]] = {
    "sd": ["to_q", "to_k", "to_v", "to_out.0"],
    "sdxl": ["to_q", "to_k", "to_v", "to_out.0"],
    "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
}


class TextToImagePolicy(Policy):
    """`predict(x, t, cond)`: the guided epsilon (sd, sdxl) or velocity (sd3, flux) at latents x [B,C,h,w]
    (flux: packed [B, seq, 4C]).

    `cond` holds, per sample, the family's `COND_KEYS` and their `negative_` twins. Inputs are cast to the
    network's dtype and the prediction back to x's dtype (a bf16 network under a float32 sampler).
    """

    def __init__(self, net: nn.Module, family: Family, guidance_scale: float = 1.0):
        super().__init__()
        if family not in COND_KEYS:
            raise ValueError(f"unknown text-to-image family {family!r} (one of {sorted(COND_KEYS)})")
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1 = no guidance), got {guidance_scale}")
        self.net, self.family, self.guidance_scale = net, family, float(guidance_scale)

    @property
    def guided(self) -> bool:
        """Classifier-free guidance: a negative branch (never for guidance-distilled families)."""
        return self.guidance_scale != 1.0 and self.family not in EMBEDDED_GUIDANCE

    def _forward(self, x: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        dtype = next(self.net.parameters()).dtype
        x, cond = x.to(dtype), {k: v.to(device=x.device, dtype=dtype if v.is_floating_point() else v.dtype)
                                for k, v in cond.items()}
        if self.family == "sd3":
            return self.net(hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"],
                            pooled_projections=cond["pooled_prompt_embeds"]).sample
        if self.family == "flux":  # diffusers' FluxPipeline: timestep / 1000, ids shared by the batch
            guidance = (torch.full((len(x),), self.guidance_scale, device=x.device, dtype=torch.float32)
                        if self.net.config.guidance_embeds else None)
            return self.net(hidden_states=x, timestep=t.to(dtype) / 1000, guidance=guidance,
                            pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=cond["prompt_embeds"],
                            txt_ids=cond["txt_ids"][0], img_ids=cond["img_ids"][0]).sample
        added = None
        if self.family == "sdxl":
            added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": cond["add_time_ids"]}
        return self.net(x, t, encoder_hidden_states=cond["prompt_embeds"], added_cond_kwargs=added).sample

    def predict(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        if not isinstance(cond, dict):
            raise TypeError("a text-to-image policy is conditioned on prompt embeddings, not ids: sample with "
                            "the testbed's `cond_inputs`")
        keys = COND_KEYS[self.family]
        missing = [k for k in keys if k not in cond] + [f"negative_{k}" for k in keys
                                                       if self.guided and f"negative_{k}" not in cond]
        if missing:
            raise KeyError(f"conditioning lacks {missing} (family {self.family!r})")
        t = t.to(x.device).expand(len(x)) if t.dim() == 0 else t.to(x.device)
        if not self.guided:
            return self._forward(x, t, {k: cond[k] for k in keys}).to(x.dtype)
        both = {k: torch.cat([cond[f"negative_{k}"], cond[k]]) for k in keys}
        uncond, text = self._forward(torch.cat([x, x]), torch.cat([t, t]), both).to(x.dtype).chunk(2)
        return uncond + self.guidance_scale * (text - uncond)
