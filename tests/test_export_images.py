"""`steadyrl export` of image runs, proved by round trip: a short real run (the local runtime) on a tiny pipeline
written to disk (tests/tiny_models.py) or on digits, exported with `export_run`, then loaded back as a user loads it
(diffusers' `load_lora_weights` into a fresh base pipeline, `from_pretrained` of a pipeline folder,
`UNet2DModel.from_pretrained`) and sampled:

- steadyrl's own sampler (the run's evaluation sampler, seeded) with the loaded network in place of the
  checkpoint's samples the same trajectories and log-probs bitwise, where the computation is the same (LoRA
  adapters loaded by diffusers: the same peft layers; a whole network saved and loaded);
- a merged export (the adapters fused into the weights) within a tolerance: W + s B A is rounded once more than
  W x + s B (A x); measured worst |difference| of the latents after 4 stochastic steps 1.2e-5 (SD) and 1.7e-6 (SD3),
  of the log-probs 2.4e-7 (both), against MERGED_TOLERANCE 1e-4;
- the exported folder's own sampling (the pipeline's `__call__`, DDIM eta = 0 or the flow's Euler step; digits: the
  model card's snippet, run as printed) makes the images steadyrl's sampler makes with its noise off from the same
  x_T (with the merge's rounding on top for pipelines): measured worst 7.7e-7 (SD) and 1.0e-6 (SD3) in [0, 1]
  against CALL_TOLERANCE 2e-5, and 0 for digits (DDIM and flow alike: the same float32 arithmetic).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from steadyrl.services.config import load_config
from steadyrl.services.driver.evaluate import checkpoint_policy
from steadyrl.services.driver.export import ExportError, export_run
from steadyrl.services.testbeds import build_testbed
from tests.helpers import noise_off, train_local
from tests.tiny_models import (save_tiny_flux_pipeline, save_tiny_sd3_pipeline, save_tiny_sd_pipeline,
                               save_tiny_sdxl_pipeline)

ROOT = Path(__file__).resolve().parents[1]
BUILDERS = {"sd": save_tiny_sd_pipeline, "sdxl": save_tiny_sdxl_pipeline, "sd3": save_tiny_sd3_pipeline,
            "flux": save_tiny_flux_pipeline}
FLOW = ("sd3", "flux")
MERGED_TOLERANCE = 1e-4  # latents of 4 stochastic steps, fused against unfused adapters
CALL_TOLERANCE = 2e-5  # images (or digits) in [0, 1]: diffusers' float32 step coefficients against steadyrl's float64
DIGITS = {"ddim": None, "flow": ROOT / "configs" / "digits-flow-grpo.yaml"}


class Runs:
    """Tiny pipelines and short runs on them, made on first use and shared by the module's tests."""

    def __init__(self, root: Path):
        self.root, self.made = root, {}

    def pipeline(self, family: str) -> Path:
        if family not in self.made:
            self.made[family] = BUILDERS[family](self.root / family)
        return self.made[family]

    def t2i(self, family: str, lora: bool = True) -> Path:
        key = (family, lora)
        if key not in self.made:
            sampler = ["sampler.kind=flow_sde", "sampler.shift=3.0"] if family in FLOW else ["sampler.kind=ddim"]
            extra = (["testbed.max_sequence_length=16", "testbed.guidance_scale=3.5"] if family == "flux" else
                     ["testbed.guidance_scale=3.0", "testbed.negative_prompt=blurry"])
            result, _ = train_local(None, self.root / f"run-{family}-{lora}", [
                "testbed.name=text_to_image", f"testbed.pretrained={self.pipeline(family)}",
                "testbed.prompts.train=tiny", "testbed.prompts.prompts_per_step=2",
                "testbed.eval_samples_per_prompt=1", "sampler.num_steps=4", "sampler.group_size=4",
                "objective.train_min_std=0.0", "learner.micro_batch_size=8", "learner.lr=1e-3", "run.steps=2",
                "run.eval_every=2", "run.checkpoint_every=2", *sampler, *extra,
                *([] if lora else ["testbed.lora=null"])])
            self.made[key] = result.run_dir
        return self.made[key]

    def digits(self, kind: str) -> Path:
        if kind not in self.made:
            result, _ = train_local(DIGITS[kind], self.root / f"run-digits-{kind}", [
                "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "testbed.eval_samples_per_class=2",
                "sampler.group_size=4", "learner.lr=1e-3"])
            self.made[kind] = result.run_dir
        return self.made[kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("export_images"))


def run_policy(run: Path, *overrides: str):
    """(testbed, the policy of the run's last checkpoint), the run's config with `overrides`."""
    tb = build_testbed(load_config(run / "config.yaml", list(overrides)))
    return tb, checkpoint_policy(tb, run / "checkpoints" / "step_2")


def eval_samples(tb, policy, seed: int = 5):
    """Two samples of each of the first two held-out prompts (digits: classes) from the evaluation sampler."""
    return tb.sample(tb.eval_sampler(), policy, tb.eval_prompts()[:2], 2, torch.Generator().manual_seed(seed))


def same_rollouts(a, b) -> bool:
    return torch.equal(a.traj, b.traj) and torch.equal(a.old_logp, b.old_logp)


def differs_from_base(tb, policy) -> bool:
    """The run trained the whole network: some tensor of the checkpoint's differs from the base's."""
    from safetensors.torch import load_file

    base = load_file(str(tb.base_weights(progress=False)))
    return any(not torch.equal(v, base[k]) for k, v in policy.trainable_state_dict().items())


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def card(folder: Path) -> dict:
    """The YAML front matter of the export's model card."""
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def load_pipeline(folder, tb, **kwargs):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), **{k: None for k in tb.info.absent}, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def swapped_in(pipe, tb):
    """steadyrl's text-to-image policy around the loaded pipeline's denoiser."""
    from steadyrl.rollout.text_to_image import TextToImagePolicy

    net = pipe.unet if tb.info.family in ("sd", "sdxl") else pipe.transformer
    return TextToImagePolicy(net, tb.info.family, tb.settings.guidance_scale).eval()


@pytest.mark.parametrize("family", ["sd", "sd3", "sdxl", "flux"])
def test_lora_adapters_load_into_the_base_pipeline_and_sample_the_policys_rollouts_bitwise(runs, family, tmp_path):
    """The model card's own lines (`from_pretrained(base)`, `load_lora_weights(out)`, one image) run as printed; the
    pipeline's denoiser then samples exactly the checkpoint's trajectories and log-probs, which differ from the
    base's (the adapters trained)."""
    from safetensors import safe_open

    run = runs.t2i(family)
    out, info = export_run(run, tmp_path / "lora")
    tb, policy = run_policy(run)
    base = str(runs.pipeline(family))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json",
                                                     "pytorch_lora_weights.safetensors"]
    assert card(out)["base_model"] == base == info.base_model and card(out)["library_name"] == "diffusers"
    assert yaml.safe_load((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        prefix = "unet." if family in ("sd", "sdxl") else "transformer."
        assert f.keys() and all(k.startswith(prefix) and ".lora_" in k for k in f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])  # peft's LoraConfig: alpha / r = 2 travels
        assert (meta[f"{prefix}r"], meta[f"{prefix}lora_alpha"]) == (8, 16.0)
    namespace: dict = {}
    exec(info.load.replace("{path}", str(out)), namespace)  # the card's snippet, as a user pastes it
    pipe = namespace["pipe"]
    pipe.set_progress_bar_config(disable=True)
    ours, theirs = eval_samples(tb, policy), eval_samples(tb, swapped_in(pipe, tb))
    assert same_rollouts(ours, theirs)
    pipe.unload_lora_weights()  # the base alone
    assert not torch.equal(ours.samples, eval_samples(tb, swapped_in(pipe, tb)).samples)


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_a_merged_export_is_a_whole_pipeline_whose_own_call_makes_the_policys_images(runs, family, tmp_path):
    """`--merge`: a pipeline folder (no adapters left) from `save_pretrained`, the base's other components unchanged;
    steadyrl's sampler with its denoiser stays within MERGED_TOLERANCE of the checkpoint's (fused weights round once
    more), and the pipeline's own `__call__` from the same x_T makes the images steadyrl's noise-free sampler makes
    with the unmerged policy (DDIM eta = 0 / the flow's Euler step), within float32 rounding."""
    run = runs.t2i(family)
    out, info = export_run(run, tmp_path / "merged", merge=True)
    tb, policy = run_policy(run)
    assert (out / "model_index.json").exists() and not (out / "pytorch_lora_weights.safetensors").exists()
    assert card(out)["base_model"] == str(runs.pipeline(family)) and "load_lora_weights" not in info.load
    pipe = load_pipeline(out, tb)
    base = load_pipeline(runs.pipeline(family), tb)
    net = "unet" if family == "sd" else "transformer"
    assert not any("lora" in k for k in getattr(pipe, net).state_dict())
    for part in ("vae", "text_encoder"):
        exported, original = getattr(pipe, part).state_dict(), getattr(base, part).state_dict()
        assert exported.keys() == original.keys() and all(torch.equal(v, original[k]) for k, v in exported.items())
    ours, theirs = eval_samples(tb, policy), eval_samples(tb, swapped_in(pipe, tb))
    assert 0 < worst(ours.samples, theirs.samples) < MERGED_TOLERANCE
    assert worst(ours.old_logp, theirs.old_logp) < MERGED_TOLERANCE
    # the folder's own sampling loop, as `pipe(prompt)` runs it, from steadyrl's x_T
    tb0, policy0 = run_policy(run, *noise_off("flow" if family in FLOW else "ddim"))
    prompts = tb0.eval_prompts()[:1]
    batch = tb0.sample(tb0.build_sampler(), policy0, prompts, 2, torch.Generator().manual_seed(7))
    images = (tb0.reward_inputs(policy0, batch)[0] + 1) / 2
    x_T = batch.traj[:, 0]
    with torch.no_grad():
        made = pipe(tb0.prompt_texts(prompts) * 2, latents=x_T.clone(), num_inference_steps=4, guidance_scale=3.0,
                    negative_prompt=["blurry"] * 2, output_type="pt", **({} if family in FLOW else {"eta": 0.0})).images
    assert worst(images, made) < CALL_TOLERANCE


def test_a_wholly_trained_denoiser_exports_as_a_pipeline_that_samples_the_policys_rollouts_bitwise(runs, tmp_path):
    """`testbed.lora=null`: `from_pretrained(out)` holds the trained transformer; the rollouts are the checkpoint's."""
    run = runs.t2i("sd3", lora=False)
    out, info = export_run(run, tmp_path / "full")
    tb, policy = run_policy(run)
    assert card(out)["base_model"] == str(runs.pipeline("sd3")) and "lora" not in card(out)["tags"]
    assert differs_from_base(tb, policy)
    pipe = load_pipeline(out, tb)
    assert same_rollouts(eval_samples(tb, policy), eval_samples(tb, swapped_in(pipe, tb)))


@pytest.mark.parametrize("kind", ["ddim", "flow"])
def test_digits_export_as_a_unet_and_scheduler_that_diffusers_loads_and_samples_the_policys_images(runs, kind,
                                                                                                   tmp_path):
    """`UNet2DModel.from_pretrained(out)` in steadyrl's sampler gives the checkpoint's rollouts bitwise; the model
    card's snippet (its scheduler from `scheduler/`, the class as `class_labels`) makes the digits steadyrl's
    sampler makes with its noise off, from the same seed."""
    from diffusers import UNet2DModel

    from steadyrl.rollout.policy import ClassConditionalPolicy

    run = runs.digits(kind)
    out, info = export_run(run, tmp_path / "digits")
    tb, policy = run_policy(run)
    assert {"config.json", "diffusion_pytorch_model.safetensors", "scheduler", "sampling.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    sampling = json.loads((out / "sampling.json").read_text())
    assert sampling["prediction"] == ("velocity" if kind == "flow" else "epsilon")
    assert "library_name" in card(out) and info.base_model is None
    assert differs_from_base(tb, policy)
    loaded = ClassConditionalPolicy(UNet2DModel.from_pretrained(str(out))).eval()
    assert same_rollouts(eval_samples(tb, policy), eval_samples(tb, loaded))
    namespace: dict = {}
    exec(info.load.replace("{path}", str(out)), namespace)
    tb0, policy0 = run_policy(run, *noise_off(kind))
    ours = tb0.sample(tb0.build_sampler(), policy0, tb0.eval_prompts(), 1, torch.Generator().manual_seed(0))
    images = namespace["images"]
    assert images.shape == (10, 1, 8, 8) and bool(((images > 0.05) & (images < 0.95)).any())  # not all saturated
    assert worst((ours.samples.clamp(-1, 1) + 1) / 2, images) < CALL_TOLERANCE


def test_a_merge_of_a_base_that_is_not_here_is_refused_by_name_before_anything_is_written(runs, tmp_path):
    """The run folder moved to a machine without its base pipeline: an `ExportError` naming the setting and the
    path, and neither OUT nor a partial folder beside it."""
    run = tmp_path / "moved"
    shutil.copytree(runs.t2i("sd"), run)
    gone = tmp_path / "no-such-pipeline"
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(str(runs.pipeline("sd")), str(gone)))
    with pytest.raises(ExportError, match="testbed.pretrained") as err:
        export_run(run, tmp_path / "out" / "merged", merge=True)
    assert str(gone) in str(err.value)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["moved"]


def test_the_cli_exports_a_run_into_a_complete_folder(runs, tmp_path):
    """`steadyrl export RUN OUT` in its own process: exit 0, the adapters, their config and the card, and the load
    snippet printed with OUT in it."""
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "steadyrl.services.driver.cli", "export", str(runs.t2i("sd")),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"README.md", "adapter_config.json", "pytorch_lora_weights.safetensors"} == {p.name for p in out.iterdir()}
    assert f"pipe.load_lora_weights('{out}')" in proc.stdout
