"""The step-time model of benchmarks/scaling.py, fitted to its measurements, and projected to an 8-GPU SD3.5-Medium
run at Flow-GRPO's settings.

    T = T_rollout(B / n) + T_reward + T_update(B / r) + T_allreduce(bytes, r) + T_sync(bytes) + T_sched

with B samples per step, n rollout actors, r learner ranks and

    T_rollout = ceil(B / n) * sample_s          T_reward = ceil(B / n) * reward_s
    T_update  = ceil(B / r) * update_s          T_allreduce = k * 2 (r - 1) / r * grad_bytes / allreduce_bw  (ring)
    T_sync    = sync_bytes / sync_bw            T_sched = fixed per step (Ray calls, launch) + batch_bytes / batch_bw

(k optimiser steps per update). Pipelined (learner.max_staleness=1) the slower of rollout+reward and update sets
the pace: T = max(T_rollout + T_reward, T_update + T_allreduce) + T_sync + T_sched.

On the GPU the per-sample costs are FLOPs over an achieved throughput: the FLOPs are counted (torch's
FlopCounterMode) on the real architectures built on the `meta` device from their published configs; the achieved
fraction of the GPU's peak, the bandwidths and the batch's dtype are assumptions, and marked so in the JSON.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lora_sync_bytes beside it


@dataclass(frozen=True)
class PhaseCosts:
    """Per-component costs of one step: seconds per sample on one rollout actor (`sample_s`, `reward_s`) or one
    learner rank (`update_s`), bytes and bytes/s of the all-reduce and the weight sync, fixed seconds per step."""

    sample_s: float
    reward_s: float
    update_s: float
    sched_s: float
    grad_bytes: float = 0.0
    optim_steps: int = 1
    allreduce_bw: float = math.inf
    sync_bytes: float = 0.0
    sync_bw: float = math.inf
    batch_bytes_per_sample: float = 0.0
    batch_bw: float = math.inf


def step_time(c: PhaseCosts, batch: int, n_actors: int, ranks: int) -> dict[str, float]:
    """Seconds per term of T (module docstring) for `batch` samples on `n_actors` actors and `ranks` ranks, their
    sum `step_s`, and `pipelined_s` (learner.max_staleness=1)."""
    per_actor, per_rank = math.ceil(batch / n_actors), math.ceil(batch / ranks)
    terms = {
        "rollout_s": per_actor * c.sample_s,
        "reward_s": per_actor * c.reward_s,
        "update_s": per_rank * c.update_s,
        "allreduce_s": c.optim_steps * 2 * (ranks - 1) / ranks * c.grad_bytes / c.allreduce_bw,
        "sync_s": c.sync_bytes / c.sync_bw,
        "sched_s": c.sched_s + batch * c.batch_bytes_per_sample / c.batch_bw,
    }
    terms["step_s"] = sum(terms.values())
    terms["pipelined_s"] = (max(terms["rollout_s"] + terms["reward_s"], terms["update_s"] + terms["allreduce_s"])
                            + terms["sync_s"] + terms["sched_s"])
    return terms


def finite(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with infinite bandwidths as None (JSON has no infinity): the term costs nothing."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in d.items()}


# ---------------------------------------------------------------------------------------------- the local fit
def local_fit(result: dict[str, Any]) -> dict[str, Any]:
    """Costs from the 1x2 runs' medians (1 actor, 1 rank, 2 threads each), the model's 2x1 prediction under
    perfect thread scaling (an actor on 1 thread takes twice as long per sample as on 2: then the 2x1 step equals
    the 1x2 step), and the 2x1 medians measured, so measured / predicted is how much better (> 1: slower) two
    1-thread processes do than one 2-thread process."""
    med = {k: v["median"] for k, v in result["per_variant"]["1x2"].items()}
    med2 = {k: v["median"] for k, v in result["per_variant"]["2x1"].items()}
    batch = round(med["samples_per_step"])
    other = med["step_s"] - med["rollout_s"] - med["reward_s"] - med["update_s"] - med["sync_s"]
    costs = PhaseCosts(sample_s=med["rollout_s"] / batch, reward_s=med["reward_s"] / batch,
                       update_s=med["update_s"] / batch, sched_s=other, sync_bytes=1.0, sync_bw=1.0 / med["sync_s"])
    fitted = step_time(costs, batch, 1, 1)
    one_thread = PhaseCosts(**{**asdict(costs), "sample_s": 2 * costs.sample_s, "reward_s": 2 * costs.reward_s,
                               "update_s": 2 * costs.update_s})
    predicted = step_time(one_thread, batch, 2, 2)
    measured = {"rollout_s": med2["rollout_s"], "reward_s": med2["reward_s"], "update_s": med2["update_s"],
                "sync_s": med2["sync_s"], "step_s": med2["step_s"]}
    return {"batch": batch, "costs_1x2": finite(asdict(costs)), "fitted_1x2": fitted, "predicted_2x1": predicted,
            "measured_2x1": measured,
            "measured_over_predicted_2x1": {k: measured[k] / predicted[k] for k in measured if predicted[k] > 0}}


# --------------------------------------------------------------------------------- SD3.5-Medium, 8 GPUs
FLOW_GRPO = "yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd"
# Flow-GRPO's PickScore run on SD3.5-M, each setting with where it is set
SD35_SETTING = {
    "resolution": (512, f"{FLOW_GRPO} config/grpo.py L117 (pickscore_sd3)"),
    "num_steps": (10, f"{FLOW_GRPO} config/grpo.py L113"),
    "guidance_scale": (4.5, f"{FLOW_GRPO} config/grpo.py L115; classifier-free guidance in training too "
                       "(config/base.py L82 train.cfg=True): 2 transformer passes per step"),
    "group_size": (24, f"{FLOW_GRPO} config/grpo.py L119 (num_image_per_prompt)"),
    "prompts_per_epoch": (48, f"{FLOW_GRPO} config/grpo.py L120 and README.md L126 (group_number=48)"),
    "batch_per_gpu": (9, f"{FLOW_GRPO} config/grpo.py L118 (train_batch_size), on gpu_number=32 (L107)"),
    "optim_steps_per_epoch": (2, f"{FLOW_GRPO} config/grpo.py L121-125 (gradient_accumulation_steps = "
                              "num_batches_per_epoch // 2: two optimiser steps per epoch)"),
    "trained_steps": (9, f"{FLOW_GRPO} scripts/train_sd3.py L345: int(num_steps * timestep_fraction 0.99, L127)"),
    "kl_beta": (0.01, f"{FLOW_GRPO} config/grpo.py L128: a reference forward per trained step"),
    "text_tokens": (77 + 128, f"{FLOW_GRPO} scripts/train_sd3.py L625 max_sequence_length=128 (T5) + 77 (CLIP)"),
    "lora": ("r=32, alpha=64 on the attention projections",
             f"{FLOW_GRPO} scripts/train_sd3.py L419-434"),
}
H100_BF16_PEAK = 989e12  # dense BF16 FLOP/s of an H100 SXM (NVIDIA H100 datasheet; the H200 has the same compute)
ASSUMPTIONS = {
    "achieved_fraction_of_peak": (0.40, "ASSUMPTION: model FLOP utilisation of the transformer, VAE and reward "
                                  "passes (not measured here: this task had no GPU); the JSON also gives 0.3 and 0.5"),
    "allreduce_bw": (100e9, "ASSUMPTION: NCCL ring bus bandwidth between 8 GPUs of one NVLink node, bytes/s"),
    "sync_bw": (100e9, "ASSUMPTION: ray.weight_sync=collective, an NCCL broadcast within the node, bytes/s"),
    "batch_bw": (5e9, "ASSUMPTION: object-store throughput moving the rollout batches to the learner, bytes/s"),
    "batch_bytes_per_sample": (11 * 16 * 64 * 64 * 4, "ASSUMPTION: the 11 float32 latents [16, 64, 64] of a "
                               "10-step trajectory per sample (log-probs and rewards are small)"),
    "sched_s": (None, "MEASURED: the Ray overhead per step of the local 1x2 runs (step minus its timed phases)"),
}


def sd35_flops() -> dict[str, float]:
    """FLOPs per image of SD3.5-Medium's transformer (one forward; forward+backward with the LoRA r=32 adapters
    training and the base frozen), its VAE decoder at 512 px, and PickScore's ViT-H/14 image tower, counted on the
    meta device (no weights, no compute)."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from lora_sync_bytes import SD35_MEDIUM_TRANSFORMER
    from steadyrl.rollout.lora import LoRAConfig, add_lora
    from steadyrl.rollout.text_to_image import DEFAULT_LORA_TARGETS, TextToImagePolicy

    def flops(fn: Any) -> float:
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    with torch.device("meta"):
        net = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER)
        inputs = dict(hidden_states=torch.randn(1, 16, 64, 64), timestep=torch.ones(1),
                      encoder_hidden_states=torch.randn(1, SD35_SETTING["text_tokens"][0], 4096),
                      pooled_projections=torch.randn(1, 2048))
        forward = flops(lambda: net(**inputs))
        add_lora(TextToImagePolicy(net, "sd3"), LoRAConfig(rank=32, alpha=64), DEFAULT_LORA_TARGETS["sd3"])
        train = flops(lambda: net(**inputs).sample.float().sum().backward())
        # SD3.5's VAE (stabilityai/stable-diffusion-3.5-medium vae/config.json)
        vae = AutoencoderKL(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            use_quant_conv=False, use_post_quant_conv=False)
        decode = flops(lambda: vae.decode(torch.randn(1, 16, 64, 64)))
        # PickScore = CLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K config.json, vision tower)
        vit = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120,
                                                             num_hidden_layers=32, num_attention_heads=16,
                                                             image_size=224, patch_size=14, projection_dim=1024))
        score = flops(lambda: vit(pixel_values=torch.randn(1, 3, 224, 224)))
    return {"transformer_forward": forward, "transformer_forward_backward_lora": train, "vae_decode": decode,
            "pickscore_image_tower": score}


def sd35_costs(fl: dict[str, float], sched_s: float, mfu: float) -> tuple[PhaseCosts, dict[str, float]]:
    """Per-sample seconds on one GPU at `mfu` of the H100 peak, and the per-GPU throughputs they mean."""
    steps, cfg, trained = SD35_SETTING["num_steps"][0], 2, SD35_SETTING["trained_steps"][0]
    rate = H100_BF16_PEAK * mfu
    sample_flops = steps * cfg * fl["transformer_forward"] + fl["vae_decode"]
    # each trained step: the policy's forward+backward and the reference's forward (KL), both under guidance
    update_flops = trained * cfg * (fl["transformer_forward_backward_lora"] + fl["transformer_forward"])
    lora_bytes = 95_551_488  # benchmarks/results/lora_sync_bytes.json: SD3.5-M r=32 adapters, float32
    costs = PhaseCosts(
        sample_s=sample_flops / rate, reward_s=fl["pickscore_image_tower"] / rate, update_s=update_flops / rate,
        sched_s=sched_s, grad_bytes=lora_bytes, optim_steps=SD35_SETTING["optim_steps_per_epoch"][0],
        allreduce_bw=ASSUMPTIONS["allreduce_bw"][0], sync_bytes=lora_bytes, sync_bw=ASSUMPTIONS["sync_bw"][0],
        batch_bytes_per_sample=ASSUMPTIONS["batch_bytes_per_sample"][0], batch_bw=ASSUMPTIONS["batch_bw"][0])
    per_gpu = {"sampling_images_per_s": 1 / costs.sample_s, "training_images_per_s": 1 / costs.update_s,
               "reward_images_per_s": 1 / costs.reward_s,
               "sample_flops_per_image": sample_flops, "update_flops_per_image": update_flops}
    return costs, per_gpu


def sd35_projection(sched_s: float) -> dict[str, Any]:
    """Seconds per Flow-GRPO epoch (48 prompts x 24 images) on 8 GPUs, per split of the GPUs between rollout
    actors and learner ranks, at the assumed utilisation (and the step time at 0.3 and 0.5)."""
    fl = sd35_flops()
    batch = SD35_SETTING["prompts_per_epoch"][0] * SD35_SETTING["group_size"][0]
    mfu = ASSUMPTIONS["achieved_fraction_of_peak"][0]
    costs, per_gpu = sd35_costs(fl, sched_s, mfu)
    splits = {f"{a} actors + {8 - a} ranks": (a, 8 - a) for a in range(1, 8)}
    splits["8 actors + 8 ranks, colocated (0.5 GPU each)"] = (8, 8)
    table = {name: step_time(costs, batch, a, r) for name, (a, r) in splits.items()}
    colocated = "8 actors + 8 ranks, colocated (0.5 GPU each)"
    table[colocated]["pipelined_s"] = None  # actors and ranks share the GPUs: nothing to overlap
    dedicated = [n for n in table if n != colocated]
    best_dedicated = min(dedicated, key=lambda n: table[n]["step_s"])
    best_pipelined = min(dedicated, key=lambda n: table[n]["pipelined_s"])
    sensitivity = {str(m): step_time(sd35_costs(fl, sched_s, m)[0], batch, 8, 8)["step_s"] for m in (0.3, 0.4, 0.5)}
    preset = step_time(costs, 4 * 24, 1, 1)  # configs/sd35-grpo.yaml: 4 prompts x 24, 1 rollout GPU + 1 learner
    flow_grpo_32 = step_time(costs, batch, 32, 32)  # their layout: every GPU samples, then trains
    flow_grpo_32["pipelined_s"] = None
    return {
        "setting": {k: {"value": v, "source": src} for k, (v, src) in SD35_SETTING.items()},
        "assumptions": {k: {"value": v if v is not None else sched_s, "source": src}
                        for k, (v, src) in ASSUMPTIONS.items()},
        "h100_bf16_peak_flops": {"value": H100_BF16_PEAK, "source": "NVIDIA H100 Tensor Core GPU datasheet (SXM)"},
        "flops_per_image": fl, "per_gpu_throughput_assumed": per_gpu,
        "batch_per_epoch": batch, "costs": finite(asdict(costs)), "epoch_s_by_split": table,
        "best_dedicated_split": best_dedicated, "best_pipelined_split": best_pipelined,
        "colocated_epoch_s_by_utilisation": sensitivity,
        "preset_sd35_grpo_step_s (96 images, 1 + 1 GPU)": preset,
        "flow_grpo_32_gpu_epoch_s (colocated, predicted)": flow_grpo_32,
        "published_check": (
            "No published step time to check against: yifan123/flow_grpo's README.md and config/grpo.py (at "
            f"{FLOW_GRPO.split('@')[1][:7]}) give reward curves per epoch as images, and no s/epoch, images/s or "
            "GPU-hours to a target; verl-omni's Flow-GRPO page (verl-omni.readthedocs.io/en/latest/algo/"
            "flowgrpo.html) gives none either. The projection is unchecked beyond its FLOP counts."),
    }


def model_section(result: dict[str, Any]) -> dict[str, Any]:
    """The `model` section of results/scaling.json: the local fit and check, and the SD3.5 projection."""
    local = local_fit(result)
    return {"formula": __doc__.split("\n\n")[1].strip(), "local": local,
            "sd35_8gpu": sd35_projection(local["costs_1x2"]["sched_s"])}
