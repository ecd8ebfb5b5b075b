"""The SD3.5 and FLUX presets of DiffusionNFT, GARDO on NFT and the windowed-SDE samplers, run as written on tiny
random pipelines of the same architectures (the hub weights swapped for them, float32, CPU): each samples a batch and
takes one real DeepSpeed update that moves the LoRA adapters; a windowed preset trains only its window's steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.builders import build_deepspeed_learner
from steadyrl.trainer.config import LearnerConfig
from tests.tiny_models import save_tiny_flux_pipeline, save_tiny_sd3_pipeline

# preset: (objective, SDE window size or None)
PRESETS = {"sd35-nft": ("diffusion_nft.code", None), "sd35-gardo-nft": ("gardo.nft", None),
           "sd35-mixgrpo": ("grpo", 4), "sd35-grpo-fast": ("grpo", 3), "flux-nft": ("diffusion_nft.code", None),
           "flux-mixgrpo": ("grpo", 4), "flux-mixgrpo-flash": ("grpo", 4), "flux-mixgrpo-flash-star": ("grpo", 4)}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow_presets")
    return {"sd35": save_tiny_sd3_pipeline(root / "sd3"), "flux": save_tiny_flux_pipeline(root / "flux")}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_takes_one_update_on_a_tiny_pipeline_of_its_architecture(preset, pipelines):
    from safetensors.torch import load_file

    objective, window = PRESETS[preset]
    family = preset.split("-")[0]
    extra = ["testbed.max_sequence_length=16"] if family == "flux" else []
    cfg = load_config(CONFIG_DIR / f"{preset}.yaml", [
        f"testbed.pretrained={pipelines[family]}", "testbed.resolution=null", "testbed.dtype=float32",
        "testbed.prompts.train=tiny", "testbed.prompts.prompts_per_step=2", "sampler.group_size=3", *extra])
    assert cfg.objective.name == objective and cfg.testbed.lora is not None
    set_rank_env(free_port())
    tb = build_testbed(cfg)
    policy = tb.build_policy(load_file(str(tb.base_weights(progress=False))))
    sampler = tb.build_sampler()
    prompts, offset = tb.train_prompts(0, 2, 0)
    window_step = {"train_step": 0} if window is not None else {}  # a training rollout of a windowed sampler
    batch = tb.sample(sampler, policy, prompts, 3, torch.Generator().manual_seed(0), group_offset=offset,
                      **window_step)
    if window is not None:
        assert int(batch.trainable.sum()) == window  # only the window's SDE steps are trained
    flat = batch.samples.flatten(1)
    batch = batch.replace(rewards=torch.stack([flat.mean(1), flat.std(1)], 1), reward_names=["proxy", "aux"],
                          reward_key="proxy", features=flat)
    learner = build_deepspeed_learner(policy, sampler, cfg.objective,
                                      LearnerConfig(lr=1e-2, micro_batch_size=6, inner_epochs=1))
    before = learner.weights()
    metrics = learner.update(batch)
    after = learner.weights()
    assert all("lora" in k for k in after) and any(not torch.equal(before[k], after[k]) for k in after)
    assert np.isfinite(metrics["policy/grad_norm"]) and metrics["policy/grad_norm"] > 0
