"""Building the policy network and its noise schedule."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers import DDIMScheduler

from steadyrl.rollout.config import SchedulerConfig, UNetConfig
from steadyrl.rollout.policy import ClassConditionalPolicy

if TYPE_CHECKING:
    from diffusers import UNet2DModel


def build_unet(cfg: UNetConfig) -> UNet2DModel:
    """A class-conditional UNet2DModel predicting epsilon; random initialisation."""
    from diffusers import UNet2DModel  # its module loads all of diffusers' transformers (~3 s): only when built

    n = len(cfg.block_out_channels)
    down = ["DownBlock2D"] * n
    up = ["UpBlock2D"] * n
    if cfg.attention:
        down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
    return UNet2DModel(
        sample_size=cfg.sample_size,
        in_channels=cfg.channels,
        out_channels=cfg.channels,
        block_out_channels=tuple(cfg.block_out_channels),
        layers_per_block=cfg.layers_per_block,
        down_block_types=tuple(down),
        up_block_types=tuple(up),
        norm_num_groups=cfg.norm_num_groups,
        num_class_embeds=cfg.num_classes,
    )


def build_class_policy(cfg: UNetConfig) -> ClassConditionalPolicy:
    """The policy of a randomly initialised class-conditional UNet (what the samplers call)."""
    return ClassConditionalPolicy(build_unet(cfg))


def build_scheduler(cfg: SchedulerConfig) -> DDIMScheduler:
    """DDIM schedule with clipping off (the log-prob recompute must match sampling exactly)."""
    return DDIMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_schedule=cfg.beta_schedule,
        clip_sample=False,
        set_alpha_to_one=True,
        prediction_type="epsilon",
        timestep_spacing=cfg.timestep_spacing,
    )


def unet_from_weights(cfg: UNetConfig, weights: dict[str, torch.Tensor]) -> UNet2DModel:
    """A UNet of architecture `cfg` holding `weights` (e.g. a state dict passed through Ray's object store)."""
    model = build_unet(cfg)
    model.load_state_dict(weights)
    return model.eval()


def class_policy_from_weights(cfg: UNetConfig, weights: dict[str, torch.Tensor]) -> ClassConditionalPolicy:
    """The class-conditional policy over `unet_from_weights` (the digits testbed's policy)."""
    return ClassConditionalPolicy(unet_from_weights(cfg, weights)).eval()
