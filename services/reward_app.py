"""The reward ensemble as a Ray Serve application.

One deployment per reward model (`@serve.batch` groups concurrent requests into one forward pass),
composed by an ingress deployment that returns per-model scores, mean, spread, the training reward
and a rank-disagreement uncertainty per sample (`reward.ensemble.combine_scores`). The ingress is a
FastAPI app (OpenAPI at /docs) used over REST from outside and through a DeploymentHandle
(`score_tensors`) inside the cluster. (No `from __future__ import annotations` here: FastAPI must
see real types on the routes that Serve's ingress wraps.)
"""

import asyncio
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from reward.base import check_scores
from reward.config import RewardConfig
from reward.ensemble import EnsembleScores, combine_scores
from reward.factory import build_reward_model, parse_reward_spec
from reward.verifiers import VerifierReward, VerifierSpec
from rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from services.config import ServeConfig

APP_NAME = "reward"
ROUTE_PREFIX = "/reward"

api = FastAPI(
    title="steadyrl reward ensemble",
    description="Scores samples with every reward model; returns per-model scores, mean, spread, "
    "training reward and rank-disagreement uncertainty per sample. Digits images: POST /score; arith "
    "completions (text or token ids): POST /score_text.",
    version="1",
)


class ScoreRequest(BaseModel):
    """Samples in model space ([-1, 1]); shape [B,8,8] or [B,1,8,8]; one requested class per sample."""

    model_config = ConfigDict(extra="forbid")
    samples: list[Any] = Field(..., min_length=1, description="nested lists, shape [B,8,8] or [B,1,8,8]")
    cond: list[int] = Field(..., min_length=1, description="requested digit per sample, 0-9")
    group: list[int] | None = Field(None, description="group id per sample (ranks are taken within a group)")

    @field_validator("samples")
    @classmethod
    def _samples_shape(cls, v: list[Any]) -> list[Any]:
        try:
            arr = np.asarray(v, dtype=np.float64)
        except (ValueError, TypeError) as err:
            raise ValueError("samples must be a rectangular array of numbers") from err
        if arr.ndim == 3:
            arr = arr[:, None]
        if arr.shape[1:] != IMAGE_SHAPE:
            raise ValueError(f"samples must have shape [B,8,8] or [B,1,8,8], got {list(np.shape(v))}")
        if not np.isfinite(arr).all():
            raise ValueError("samples contain NaN or infinite values")
        return arr.tolist()

    @field_validator("cond")
    @classmethod
    def _cond_range(cls, v: list[int]) -> list[int]:
        bad = [c for c in v if not 0 <= c < NUM_CLASSES]
        if bad:
            raise ValueError(f"cond values must be in [0, {NUM_CLASSES - 1}], got {bad[:5]}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "ScoreRequest":
        if len(self.cond) != len(self.samples):
            raise ValueError(f"cond has {len(self.cond)} entries but samples has {len(self.samples)}")
        if self.group is not None and len(self.group) != len(self.samples):
            raise ValueError(f"group has {len(self.group)} entries but samples has {len(self.samples)}")
        return self

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = torch.tensor(self.samples, dtype=torch.float32).view(-1, *IMAGE_SHAPE)
        group = None if self.group is None else torch.tensor(self.group, dtype=torch.long)
        return x, torch.tensor(self.cond, dtype=torch.long), group


class TextScoreRequest(BaseModel):
    """Prompt/completion pairs of a dLLM testbed, as text ("07+45=", "52") or as token ids of the app's
    tokenizer. Any text can be scored: a malformed completion scores 0."""

    model_config = ConfigDict(extra="forbid")
    prompts: list[str | list[int]] = Field(..., min_length=1, description="text, or token ids, per prompt")
    completions: list[str | list[int]] = Field(..., min_length=1, description="text, or token ids (up to <eos>)")
    group: list[int] | None = Field(None, description="group id per sample (ranks are taken within a group)")

    @field_validator("prompts", "completions")
    @classmethod
    def _ids(cls, v: list[Any]) -> list[Any]:
        for i, item in enumerate(v):
            if not isinstance(item, str) and any(t < 0 for t in item):
                raise ValueError(f"item {i}: token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "TextScoreRequest":
        if len(self.prompts) != len(self.completions):
            raise ValueError(f"prompts has {len(self.prompts)} entries but completions has {len(self.completions)}")
        if self.group is not None and len(self.group) != len(self.prompts):
            raise ValueError(f"group has {len(self.group)} entries but there are {len(self.prompts)} samples")
        return self


class ScoreResponse(BaseModel):
    names: list[str] = Field(description="ensemble members, the columns of `scores`")
    scores: list[list[float]] = Field(description="[B][K] per-model scores")
    mean: list[float]
    std: list[float]
    uncertainty: list[float] = Field(description="rank disagreement between members, per sample")
    reward: list[float] = Field(description="the training reward")
    train_on: str
    monitors: dict[str, list[float]] = Field(description="watch-only models (gold), never trained on")


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
class RewardModelDeployment:
    """Hosts one reward model; batches concurrent `score` calls into one forward pass."""

    def __init__(self, spec: dict[str, Any], max_batch_size: int = 256, batch_wait_timeout_s: float = 0.005):
        torch.set_num_threads(1)
        self.model = build_reward_model(parse_reward_spec(spec))  # the same factory as the in-process ensemble
        self.name = self.model.name
        self.score.set_max_batch_size(max_batch_size)
        self.score.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005)
    async def score(self, samples: list[torch.Tensor], cond: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [len(c) for c in cond]
        if len({(s.shape[1:], c.shape[1:]) for s, c in zip(samples, cond)}) > 1:  # prompts padded to other widths
            return [check_scores(self.name, self.model.score(s, c), len(c)) for s, c in zip(samples, cond)]
        out = check_scores(self.name, self.model.score(torch.cat(samples), torch.cat(cond)), sum(sizes))
        return list(out.split(sizes))

    async def score_items(self, prompts: list[Any], completions: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifiers: (scores, exact 0/1) of text or token-id items (REST /score_text)."""
        if not isinstance(self.model, VerifierReward):
            raise ValueError(f"reward model {self.name!r} scores images, not text")
        return self.model.score_items(prompts, completions)

    async def correct(self, samples: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.model.correct(samples, cond)

    async def features(self, samples: torch.Tensor) -> torch.Tensor:
        return self.model.features(samples)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "test_accuracy": getattr(self.model, "accuracy", None)}

    def check_health(self) -> None:
        """Serve calls this periodically; a broken model raises and the replica is replaced."""
        if isinstance(self.model, VerifierReward):
            return  # a pure function of text: nothing to go stale
        out = self.model.score(torch.zeros(1, *IMAGE_SHAPE), torch.zeros(1, dtype=torch.long))
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"reward model {self.name} returns non-finite scores")


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
@serve.ingress(api)
class RewardEnsembleIngress:
    """Composes member deployments; the gold monitor is scored too but never becomes the reward."""

    def __init__(self, members: list[DeploymentHandle], member_names: list[str], gold: DeploymentHandle,
                 gold_name: str, train_on: str, feature_model: str, testbed: str = "digits"):
        self.testbed = testbed
        self.members, self.member_names = members, member_names
        self.gold, self.gold_name = gold, gold_name
        self.train_on, self.feature_model = train_on, feature_model

    async def score_tensors(self, samples: torch.Tensor, cond: torch.Tensor, group: torch.Tensor | None = None,
                            with_features: bool = True) -> EnsembleScores:
        """In-cluster entry point (DeploymentHandle); tensors in, `EnsembleScores` out."""
        calls = [m.score.remote(samples, cond) for m in self.members]
        gold_p, gold_c = self.gold.score.remote(samples, cond), self.gold.correct.remote(samples, cond)
        feat = None
        if with_features:
            feat = self.members[self.member_names.index(self.feature_model)].features.remote(samples)
        cols = await asyncio.gather(*calls)
        out = combine_scores(self.member_names, torch.stack(cols, dim=1), group, self.train_on)
        out.monitors = {self.gold_name: await gold_p, f"{self.gold_name}_correct": await gold_c}
        out.features = None if feat is None else await feat
        return out

    def _wrong_route(self, route: str, wants: str) -> None:
        if self.testbed != wants:
            from fastapi import HTTPException

            other = "/score_text" if route == "/score" else "/score"
            raise HTTPException(status_code=400, detail=f"this reward app scores the {self.testbed!r} testbed: "
                                f"POST {other}, not {route}")

    @api.post("/score", response_model=ScoreResponse)
    async def score_http(self, request: ScoreRequest) -> ScoreResponse:
        self._wrong_route("/score", "digits")
        return await self._respond(*request.tensors())

    @api.post("/score_text", response_model=ScoreResponse)
    async def score_text_http(self, request: TextScoreRequest) -> ScoreResponse:
        self._wrong_route("/score_text", "arith")
        p, c = request.prompts, request.completions
        cols = await asyncio.gather(*[m.score_items.remote(p, c) for m in self.members])
        gold_score, gold_correct = await self.gold.score_items.remote(p, c)
        group = None if request.group is None else torch.tensor(request.group, dtype=torch.long)
        out = combine_scores(self.member_names, torch.stack([col[0] for col in cols], dim=1), group, self.train_on)
        out.monitors = {self.gold_name: gold_score, f"{self.gold_name}_correct": gold_correct}
        return self._response(out)

    async def _respond(self, samples: torch.Tensor, cond: torch.Tensor, group: torch.Tensor | None) -> ScoreResponse:
        return self._response(await self.score_tensors(samples, cond, group, with_features=False))

    @staticmethod
    def _response(out: EnsembleScores) -> ScoreResponse:
        return ScoreResponse(
            names=out.names, scores=out.scores.tolist(), mean=out.mean.tolist(), std=out.std.tolist(),
            uncertainty=out.uncertainty.tolist(), reward=out.reward.tolist(), train_on=out.train_on,
            monitors={k: v.tolist() for k, v in out.monitors.items()},
        )

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        infos = await asyncio.gather(*[m.info.remote() for m in self.members + [self.gold]])
        return {"status": "ok", "members": self.member_names, "gold": self.gold_name, "train_on": self.train_on,
                "models": infos}


def build_reward_app(cfg: RewardConfig | VerifierSpec, serve_cfg: ServeConfig | None = None) -> serve.Application:
    """Bind one deployment per reward model and the ensemble ingress (a testbed's `reward_spec()`:
    the digits classifier ensemble, or the arith verifier with its exact-match monitor)."""
    serve_cfg = serve_cfg or ServeConfig()
    opts = {"ray_actor_options": {"num_cpus": serve_cfg.replica_cpus}}
    batching = {"max_batch_size": serve_cfg.max_batch_size, "batch_wait_timeout_s": serve_cfg.batch_wait_timeout_s}

    def model(name: str, spec: Any) -> serve.Application:
        return RewardModelDeployment.options(name=name, **opts).bind(spec.model_dump(), **batching)

    if isinstance(cfg, VerifierSpec):
        exact = cfg.model_copy(update={"partial_credit": False, "name": "exact"})
        return RewardEnsembleIngress.options(name="ensemble", **opts).bind(
            [model(f"reward_{cfg.name}", cfg)], [cfg.name], model("monitor_exact", exact), "exact", cfg.name,
            cfg.name, "arith")
    specs = cfg.member_specs()
    members = [model(f"reward_{s.name}", s) for s in specs]
    gold = model(f"monitor_{cfg.gold.name}", cfg.gold)
    return RewardEnsembleIngress.options(name="ensemble", **opts).bind(
        members, [s.name for s in specs], gold, cfg.gold.name, cfg.train_on, cfg.feature_model)


def deploy_reward_app(cfg: RewardConfig | VerifierSpec, serve_cfg: ServeConfig | None = None) -> None:
    """Deploy (or update) the ensemble as the Serve application `reward` under /reward."""
    serve.run(build_reward_app(cfg, serve_cfg), name=APP_NAME, route_prefix=ROUTE_PREFIX)
