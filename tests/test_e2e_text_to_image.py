"""Text-to-image through real Ray, Serve and DeepSpeed, for each family (SD-style UNet + DDIM, SD3-style
transformer + flow SDE): tiny random pipelines and a tiny CLIP reward, loaded by path as hub ids would be,
LoRA by default. Exact properties of the run, not learning (tiny random models have nothing to learn;
the algorithms' learning is shown on digits and arith)."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from steadyrl.services.driver.controller import train
from steadyrl.services.driver.evaluate import evaluate_checkpoint
from steadyrl.services.run_folder.metrics import read_metrics
from tests.tiny_models import save_tiny_clip, save_tiny_sd3_pipeline, save_tiny_sd_pipeline


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("t2i_assets")
    return {"sd": save_tiny_sd_pipeline(root / "sd"), "sd3": save_tiny_sd3_pipeline(root / "sd3"),
            "clip": save_tiny_clip(root / "clip")}


def overrides(assets, family: str, run_dir: Path) -> list[str]:
    sampler = ["sampler.kind=flow_sde", "sampler.shift=3.0"] if family == "sd3" else ["sampler.kind=ddim"]
    return ["testbed.name=text_to_image", f"testbed.pretrained={assets[family]}",
            "testbed.prompts.train=tiny", "testbed.prompts.prompts_per_step=2",
            "testbed.guidance_scale=3.0", "testbed.negative_prompt=blurry",
            f"testbed.reward.models=[{{kind: clip_score, model: {assets['clip']}}}, {{kind: jpeg, upscale: 1}}]",
            "testbed.reward.monitor_only=[jpeg_compressibility]",
            "sampler.num_steps=4", "sampler.group_size=4", "objective.train_min_std=0.0",
            "learner.micro_batch_size=8", "learner.lr=1e-3",
            f"ray.rollout_workers={2 if family == 'sd3' else 1}",  # two workers' batches join (once is enough)
            f"run.run_dir={run_dir}", "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2",
            "run.progress=false", "serve.port=0", *sampler]


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_a_lora_step_runs_through_ray_serve_and_deepspeed(family, assets, ray_cluster, serve_port, tmp_path):
    result = train(None, overrides(assets, family, tmp_path / "run"))
    assert not result.interrupted and result.steps_done == 2
    rows = read_metrics(result.run_dir)
    ckpt = result.run_dir / "checkpoints" / "step_2"
    adapters = load_file(str(ckpt / "policy.safetensors"))
    # only the adapters leave the learner: the checkpoint and each weight sync hold them and nothing else
    assert adapters and all("lora_" in k for k in adapters)
    assert set(load_file(str(ckpt / "reference.safetensors"))) == set(adapters)
    assert all(r["sync/bytes"] == sum(v.numel() * v.element_size() for v in adapters.values()) for r in rows)
    # step 2 sampled with the synced adapters and the same guidance/negative prompt: the learner's
    # recompute of the rollout's log-probs agrees (float32 numerics of two processes)
    assert max(r["policy/rollout_logp_absdiff_max"] for r in rows) < 1e-4
    # the monitor-only reward is scored and logged, never part of the training reward
    assert all("monitor/jpeg_compressibility" in r and "reward/jpeg_compressibility" not in r for r in rows)
    assert all(abs(r["reward/train_mean"] - r["reward/clip_score"]) < 1e-9 for r in rows)
    # held-out evaluation: a picture, and `steadyrl eval` of the checkpoint reproduces the run's own
    assert (result.run_dir / "samples_step_0002.png").exists()
    again = evaluate_checkpoint(result.run_dir)
    assert again["n_samples"] == result.final_eval["n_samples"]
    assert again["held_out"] == pytest.approx(result.final_eval["held_out"], abs=1e-3)
