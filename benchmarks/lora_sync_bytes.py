"""Bytes one learner -> rollout weight sync moves, LoRA adapters vs the whole denoiser, for the real
architectures of the presets (no download: the networks are built on the `meta` device from their
published configs, so only shapes exist) and for the tiny test pipelines.

    python benchmarks/lora_sync_bytes.py        # -> benchmarks/results/lora_sync_bytes.json

The adapters are injected by the same `rollout.lora.add_lora` the text-to-image testbed uses, with each
preset's rank and default targets; adapters are float32, the frozen base is counted in the preset's dtype.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from steadyrl.rollout.lora import LoRAConfig, add_lora  # noqa: E402
from steadyrl.rollout.policy import state_bytes  # noqa: E402
from steadyrl.rollout.text_to_image import DEFAULT_LORA_TARGETS, TextToImagePolicy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lora_sync_bytes.json"

# Published denoiser configs (diffusers' config.json of each hub repo), as far as the shapes go.
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8)
SD35_MEDIUM_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                               num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                               pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                               dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
FLUX1_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                             guidance_embeds=True, axes_dims_rope=(16, 56, 56))


def measure(name: str, net: torch.nn.Module, family: str, lora: LoRAConfig, base_dtype: torch.dtype) -> dict:
    full_params = sum(p.numel() for p in net.parameters())
    policy = add_lora(TextToImagePolicy(net, family), lora, DEFAULT_LORA_TARGETS[family])
    adapters = policy.trainable_state_dict()
    adapter_bytes = state_bytes(adapters)
    full_bytes = full_params * torch.finfo(base_dtype).bits // 8
    return {"model": name, "family": family, "lora_rank": lora.rank, "denoiser_params": full_params,
            "adapter_params": sum(v.numel() for v in adapters.values()), "base_dtype": str(base_dtype),
            "full_sync_bytes": full_bytes, "lora_sync_bytes": adapter_bytes, "ratio": full_bytes / adapter_bytes}


def main() -> None:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    rows = []
    with torch.device("meta"):
        rows.append(measure("stable-diffusion-v1-5 (configs/sd15-*.yaml)", UNet2DConditionModel(**SD15_UNET), "sd",
                            LoRAConfig(rank=4, alpha=4), torch.bfloat16))
        rows.append(measure("stable-diffusion-3.5-medium (configs/sd35-*.yaml)",
                            SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER), "sd3", LoRAConfig(rank=32, alpha=64),
                            torch.bfloat16))
        rows.append(measure("FLUX.1-dev (configs/flux-grpo.yaml)", FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER),
                            "flux", LoRAConfig(rank=32, alpha=64), torch.bfloat16))
    from steadyrl.rollout.diffusers_pipelines import load_denoiser
    from tests.tiny_models import save_tiny_sd3_pipeline, save_tiny_sd_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        for family, build in (("sd", save_tiny_sd_pipeline), ("sd3", save_tiny_sd3_pipeline)):
            net = load_denoiser(str(build(Path(tmp) / family)), family)
            rows.append(measure(f"tiny random {family} (tests)", net, family, LoRAConfig(), torch.float32))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['model']}: {r['denoiser_params'] / 1e6:.1f} M params; sync {r['full_sync_bytes'] / 2**20:.1f} MiB "
              f"whole vs {r['lora_sync_bytes'] / 2**20:.2f} MiB LoRA r={r['lora_rank']} ({r['ratio']:.0f}x less)")


if __name__ == "__main__":
    main()
