"""The text-to-image testbed: a diffusers pipeline (SD / SDXL / SD3-style) by name or path, text prompts
from a prompt set, image reward models (CLIP score, aesthetic, PickScore-like, JPEG) behind Serve.

Prompt ids are global: train-split prompts are 0..n_train-1, held-out prompts follow. A rollout worker
encodes each step's prompts once (text encoders), samples latents (the trajectory holds latents, never
pixels), and decodes only the final latents with the VAE for the reward models. The learner loads the
denoiser alone: the embeddings it needs travel in the batch.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.reward.config import ImageRewardConfig
from steadyrl.reward.ensemble import EnsembleScores, finite_mean
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.reward.http_reward import HttpRewardSpec
from steadyrl.reward.python_reward import PythonRewardSpec
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.lora import LoRAConfig
from steadyrl.rollout.prompts import PromptsConfig
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.rest import RestProfile
from steadyrl.services.testbeds.settings import TestbedSettings
from steadyrl.services.testbeds.text_to_image.rest import ImageScoreRequest, TextToImageRequest


class TextToImageSettings(TestbedSettings):
    """The text-to-image testbed: a diffusers pipeline by name or path, text prompts, image reward models."""

    name: Literal["text_to_image"] = "text_to_image"
    pretrained: str = Field(
        description="hub id (already in the local Hugging Face cache) or directory of a diffusers pipeline: "
        "SD 1.x/2.x-style (UNet, sampler.kind=ddim), SDXL-style (ddim) or SD3-style (transformer, flow_sde)")
    resolution: int | None = Field(None, ge=8, description="image side in pixels; None: the model's native one")
    guidance_scale: float = Field(4.5, ge=1.0, description="classifier-free guidance w, identical in sampling and "
                                  "the log-prob recompute (1 = off: one forward instead of two); Flow-GRPO: 4.5")
    negative_prompt: str = Field("", description="the unconditional branch's prompt (the same in recompute)")
    max_sequence_length: int | None = Field(
        None, ge=1, le=512, description="T5 prompt tokens (SD3, FLUX); None: the pipeline's default (SD3 256, "
        "FLUX 512). Shorter saves the embeddings' memory in every batch")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights of the denoiser, text encoders and VAE; bf16 halves memory on GPU (the "
        "sampler's Gaussian stays float32: docs/testbeds.md, text_to_image, says what recompute gap that implies)")
    autocast: Literal["off", "bfloat16", "float16"] = Field(
        "off", description="mixed precision for the denoiser's forward (torch.autocast; weights stay in `dtype`): "
        "bf16 is the usual choice on GPUs; the sampler's Gaussian stays float32 and the recompute gap it causes is "
        "logged as policy/rollout_logp_absdiff_max (docs/testbeds.md, text_to_image, says what to watch)")
    lora: LoRAConfig | None = Field(default_factory=LoRAConfig, description="adapters to train (None: the whole "
                                    "denoiser, whose full weights then go through the object store each step)")
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    reward: ImageRewardConfig = Field(default_factory=ImageRewardConfig)
    eval_samples_per_prompt: int = Field(2, ge=1, description="images per held-out prompt per evaluation")
    decode_batch: int = Field(8, ge=1, description="latents per VAE decode call (bounds decode memory)")

    sampler_kinds: ClassVar[tuple[str, ...]] = ("ddim", "flow_sde")
    no_reward_backprop: ClassVar[str | None] = ("its image rewards are scored on decoded images behind Serve, "
                                                "without a gradient: use a policy-gradient objective")

    def max_workers(self) -> int:
        """One prompt per worker at most."""
        return self.prompts.prompts_per_step


class TextToImageTestbed(Testbed):
    """Text prompts -> latents -> decoded images -> image reward models; monitor-only rewards are held out."""

    name = "text_to_image"
    Settings = TextToImageSettings
    rest = RestProfile("text_to_image", TextToImageRequest, legacy_route="/score_images",
                       legacy_request=ImageScoreRequest)
    settings: TextToImageSettings
    labels = ("reward", "held-out")
    headline_format = ".3f"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._info = None
        self._splits = None
        self._tools = None
        self.last_images: Tensor | None = None  # the images of the last `reward_inputs` call (eval pictures)
        self._written: list[str] = []  # prompts from `prompts_from_text` in neither split: ids after both

    # ------------------------------------------------------------------ the model
    @property
    def info(self):
        """Family, latent shape and scheduler of the pipeline (configs only; read once)."""
        if self._info is None:
            from steadyrl.rollout.diffusers_pipelines import describe_pipeline

            self._info = describe_pipeline(self.settings.pretrained)
        return self._info

    def _fresh_policy(self):
        from steadyrl.rollout.diffusers_pipelines import load_denoiser
        from steadyrl.rollout.lora import add_lora
        from steadyrl.rollout.text_to_image import DEFAULT_LORA_TARGETS, TextToImagePolicy

        family = self.info.family
        policy = TextToImagePolicy(load_denoiser(self.settings.pretrained, family, self.settings.dtype), family,
                                   self.settings.guidance_scale)
        if self.settings.lora is not None:
            add_lora(policy, self.settings.lora, self.settings.lora.target_modules or DEFAULT_LORA_TARGETS[family])
        if self.settings.autocast != "off":
            policy.autocast = getattr(torch, self.settings.autocast)
        return policy

    def base_weights(self, progress: bool = True) -> Path:
        """The policy's initial trained tensors (LoRA: the adapters, B = 0; else the whole denoiser), written
        once into the cache; only these go through the object store, each actor loads the base by path."""
        from safetensors.torch import save_file

        from steadyrl.rollout.cache import build_dir_atomically, cache_root, config_key

        def build(tmp: Path) -> None:
            state = self._fresh_policy().trainable_state_dict()
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "trainable.safetensors"))

        key = config_key({"pretrained": self.settings.pretrained, "stamp": _weights_stamp(self.settings.pretrained),
                          "lora": None if self.settings.lora is None else self.settings.lora.model_dump(), "dtype": self.settings.dtype})
        return build_dir_atomically(cache_root() / "models" / f"t2i-{key}", build) / "trainable.safetensors"

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        policy = self._fresh_policy()
        policy.load_trainable_state_dict(weights)
        return policy.eval()

    def build_sampler(self):
        from diffusers import DDIMScheduler

        from steadyrl.rollout.config import SchedulerConfig
        from steadyrl.rollout.ddim import DDIMLogProbSampler
        from steadyrl.rollout.flow_sde import FlowSDESampler

        family, sched, kind = self.info.family, self.info.scheduler, self.cfg.sampler.kind
        wants = "flow_sde" if family in ("sd3", "flux") else "ddim"
        if kind != wants:
            raise ValueError(f"sampler.kind={kind!r} does not fit {self.settings.pretrained!r} (a {family} model): "
                             f"use sampler.kind={wants}")
        if family == "flux":  # FLUX's grid: linspace(1, 1/N, N), shifted by mu(image size) when dynamic
            return FlowSDESampler(self.cfg.sampler, SchedulerConfig(num_train_timesteps=sched["num_train_timesteps"]),
                                  model_scheduler=sched, image_seq_len=self.info.image_seq_len(self.settings.resolution))
        if family == "sd3":
            shift = float(sched.get("shift", 1.0))
            if abs(self.cfg.sampler.shift - shift) > 1e-9:
                raise ValueError(f"sampler.shift={self.cfg.sampler.shift} differs from the model's scheduler "
                                 f"(shift={shift}): set sampler.shift={shift}")
            return FlowSDESampler(self.cfg.sampler, SchedulerConfig(num_train_timesteps=sched["num_train_timesteps"]))
        if sched.get("prediction_type", "epsilon") != "epsilon":
            raise ValueError(f"{self.settings.pretrained!r} predicts {sched['prediction_type']!r}; the DDIM log-prob "
                             "sampler needs an epsilon-prediction model")
        return DDIMLogProbSampler(self.cfg.sampler, DDIMScheduler.from_config(sched))

    # ------------------------------------------------------------------ export
    def export_sources(self) -> list[tuple[str, str]]:
        """The pipeline: the policy is rebuilt on it, and a merge fuses the adapters into it."""
        return [("testbed.pretrained", self.settings.pretrained)]

    def export(self, policy: nn.Module, out: Path, merge: bool = False):
        """LoRA: the adapters as `pipe.load_lora_weights` reads them, the base named (`merge`: a whole pipeline with
        them fused in); whole-denoiser training: a whole pipeline (rollout/diffusers_export.py gives each format)."""
        from steadyrl.rollout import diffusers_export as dx
        from steadyrl.services.run_folder.model_card import ExportInfo

        s, info, family = self.settings, self.info, self.info.family
        part, name = ("UNet" if family in ("sd", "sdxl") else "transformer"), dx.PIPELINE_CLASS[family]
        call = {"num_inference_steps": self.cfg.sampler.num_steps, "guidance_scale": s.guidance_scale,
                **({"negative_prompt": s.negative_prompt} if s.negative_prompt and family != "flux" else {}),
                **({"height": s.resolution, "width": s.resolution} if s.resolution else {})}
        tags = ("text-to-image", "diffusers", f"diffusers:{name}")
        if s.lora is not None and not merge:
            dx.save_lora(policy.net, family, out, s.pretrained)
            return ExportInfo(
                format=f"LoRA adapters (rank {s.lora.rank}, alpha {s.lora.alpha:g}) on the {part} of {name}, in "
                "diffusers' format for `load_lora_weights` (pytorch_lora_weights.safetensors, peft's key names and "
                "LoraConfig) with peft's adapter_config.json", library="diffusers",
                load=dx.pipeline_snippet(info, s.pretrained, s.dtype, "{path}", call),
                base_model=s.pretrained, tags=(*tags, "lora"))
        if s.lora is not None:
            dx.save_merged_pipeline(info, dx.save_lora(policy.net, family, out / ".adapters", s.pretrained).parent,
                                    out, s.dtype)
            what = f"the LoRA adapters (rank {s.lora.rank}, alpha {s.lora.alpha:g}) fused into its {part}"
        else:
            dx.save_full_pipeline(info, policy.net, out, s.dtype)
            what = f"its {part} trained whole"
        return ExportInfo(format=f"A whole {name} folder (`save_pretrained`), {what}", library="diffusers",
                          load=dx.pipeline_snippet(info, "{path}", s.dtype, None, call), base_model=s.pretrained,
                          tags=tags)

    # ------------------------------------------------------------------ prompts
    @property
    def splits(self):
        if self._splits is None:
            from steadyrl.rollout.prompts import build_splits

            self._splits = build_splits(self.settings.prompts)
        return self._splits

    def prompt_texts(self, ids: Tensor) -> list[str]:
        """Prompt strings of global ids (train split first, then held-out)."""
        every = self.splits.train.prompts + self.splits.eval.prompts + tuple(self._written)
        return [every[int(i)] for i in ids]

    def prompt_metadata(self, ids: Tensor) -> list[dict[str, Any]]:
        every = self.splits.train.metadata + self.splits.eval.metadata + tuple({} for _ in self._written)
        return [every[int(i)] for i in ids]

    def prompts_from_text(self, texts: list[str]) -> Tensor:
        """Ids of prompt strings: a prompt of either split keeps its id; another gets an id after both splits."""
        from steadyrl.services.testbeds.base import PromptError

        every = list(self.splits.train.prompts + self.splits.eval.prompts)
        ids = []
        for text in texts:
            if not text.strip():
                raise PromptError("an empty prompt: a text-to-image prompt is a non-empty string")
            if text not in every + self._written:
                self._written.append(text)
            ids.append((every + self._written).index(text))
        return torch.tensor(ids, dtype=torch.long)

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        from steadyrl.rollout.prompts import step_prompts

        return step_prompts(self.settings.prompts, len(self.splits.train), step, worker, n_workers)

    def eval_prompts(self) -> Tensor:
        return len(self.splits.train) + torch.arange(len(self.splits.eval))

    @property
    def eval_per_prompt(self) -> int:
        return self.settings.eval_samples_per_prompt

    # ------------------------------------------------------------------ encoding and decoding (rollout side)
    def tools(self, policy: nn.Module):
        """The pipeline's text encoders and VAE around `policy`'s denoiser, on its device (loaded on first use)."""
        if self._tools is None:
            from steadyrl.rollout.diffusers_pipelines import PipelineTools

            self._tools = PipelineTools(self.info, policy.net, self.settings.dtype, self.settings.resolution,
                                        self.settings.max_sequence_length)
        return self._tools

    def sample_options(self, policy: nn.Module, prompts: Tensor) -> dict[str, Any]:
        """The prompts' embeddings (text encoders run once per prompt batch) and the latent shape."""
        tools = self.tools(policy)
        return {"cond_inputs": tools.encode(self.prompt_texts(prompts), self.settings.negative_prompt, policy.guided),
                "sample_shape": self.info.latent_shape(self.settings.resolution)}

    def reward_inputs(self, policy: nn.Module, batch: RolloutBatch) -> tuple[Tensor, list[str]]:
        """(VAE-decoded images [B,3,H,W] in [-1, 1], the B prompt strings)."""
        images = self.tools(policy).decode(batch.samples, self.settings.decode_batch)
        self.last_images = images
        return images, self.prompt_texts(batch.cond)

    # ------------------------------------------------------------------ scoring
    def prepare_rewards(self, console=None) -> None:
        """Reward models load inside their Serve replicas (by name or path); nothing to build here."""

    def reward_spec(self) -> EnsembleSpec:
        """The reward models; a function that asks for prompt metadata gets the prompt sets' (by prompt text)."""
        spec = self.settings.reward.ensemble_spec()

        def asks(s: Any) -> bool:
            return isinstance(s, (PythonRewardSpec, HttpRewardSpec)) and s.metadata

        if not any(asks(s) for s in [*spec.members, *spec.monitors]):
            return spec
        train, held_out = self.splits.train, self.splits.eval
        table = {p: m for p, m in zip(train.prompts + held_out.prompts, train.metadata + held_out.metadata) if m}

        def filled(specs: list) -> list:
            return [s.model_copy(update={"prompt_metadata": table}) if asks(s) else s for s in specs]
        return spec.model_copy(update={"members": filled(spec.members), "monitors": filled(spec.monitors)})

    def model_sources(self) -> list[tuple[str, str]]:
        """The pipeline, then the reward models."""
        return [("testbed.pretrained", self.settings.pretrained), *self.reward_model_sources()]

    def reward_model_sources(self) -> list[tuple[str, str]]:
        """Each CLIP-based reward model's `model` and `processor` (hub ids or directories; None: none)."""
        return [(f"testbed.reward.models[{i}].{field}", getattr(spec, field))
                for i, spec in enumerate(self.settings.reward.models) for field in ("model", "processor")
                if isinstance(getattr(spec, field, None), str)]

    @property
    def gold_name(self) -> str | None:
        """The first monitor-only reward: the held-out figure (None: the training reward itself)."""
        return next(iter(self.settings.reward.monitor_only), None)

    def _held_out(self, scores: EnsembleScores) -> Tensor:
        return scores.reward if self.gold_name is None else scores.monitors[self.gold_name]

    def held_out(self, scores: EnsembleScores) -> tuple[Tensor, Tensor]:
        """The held-out reward is both the gold score and the headline (a mean score here, not a rate)."""
        score = self._held_out(scores)
        return score, score

    def rollout_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, float]:
        """The base summary plus every monitor-only reward's mean (`monitor/<name>`)."""
        out = super().rollout_summary(batch, scores)
        for name, col in scores.monitors.items():
            out[f"monitor/{name}"] = finite_mean(col)
        return out

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        """Held-out prompts: the held-out reward (`held_out`, a mean score), per prompt tag; the training
        reward; diversity; and the images for the picture."""
        from steadyrl.reward.diversity import nearest_neighbour_distance

        held_out = self._held_out(scores)
        by_tag: dict[str, list[float]] = defaultdict(list)
        for meta, value in zip(self.prompt_metadata(batch.cond), held_out.tolist()):
            by_tag[str(meta.get("tag", "all prompts"))].append(value)
        texts = self.prompt_texts(batch.cond)
        return {
            "held_out": float(held_out.mean()),
            "proxy_mean": finite_mean(scores.reward),
            "diversity_nn": (0.0 if scores.features is None else
                             float(nearest_neighbour_distance(scores.features, batch.group).mean())),
            "breakdown": {k: sum(v) / len(v) for k, v in sorted(by_tag.items())},
            "n_samples": len(batch),
            "monitors": {k: finite_mean(v) for k, v in scores.monitors.items()},
            "images": self.last_images,
            "captions": [f"{t[:28]} ({float(r):.2f})" for t, r in zip(texts, scores.reward)],
        }

    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        from steadyrl.services.run_folder.figures import save_image_grid

        images, captions = result.pop("images"), result.pop("captions")
        if images is not None:
            save_image_grid(images, captions, path_stem.with_suffix(".png"), title)


def _weights_stamp(source: str) -> list[Any]:
    """Sizes and modification times of a local pipeline's files (a rebuilt directory is a new cache key)."""
    root = Path(source)
    if not root.is_dir():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
                  if p.is_file())
