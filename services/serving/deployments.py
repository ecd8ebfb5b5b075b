"""The reward ensemble's Serve deployments: one `RewardModelDeployment` per reward model (`@serve.batch` groups
concurrent calls into one forward pass unless `serve.batching` is off), composed by `RewardEnsembleIngress`,
which returns per-model scores, mean, spread, the training reward and a rank-disagreement uncertainty per
sample (`reward.ensemble.combine_scores`); with `serve.colocate_models` the ingress hosts the models itself
(`InProcessModel`). Training calls the ingress through a DeploymentHandle
(`score_tensors`); anything else over REST (`rest.build_rest_api`, built on each replica)."""

import asyncio
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from steadyrl.reward.base import GroupwiseRewardModel, TextItemsModel, check_scores, score_model
from steadyrl.reward.ensemble import EnsembleScores, combine_scores
from steadyrl.reward.factory import build_reward_model, parse_reward_spec
from steadyrl.reward.weighting import RewardWeighting
from steadyrl.services.serving.errors import HEALTH_TIMEOUT_S, ModelsNotAnswering
from steadyrl.services.serving.guard import RestSettings
from steadyrl.services.serving.rest import build_rest_api
from steadyrl.services.serving.schemas import SCORE_ROUTE, HealthResponse, ModelInfo, ModelsResponse, ScoreResponse
from steadyrl.services.testbeds.rest import Batch, RestProfile


async def _result(response: Any) -> Any:
    return await response


def _is_prompts(cond: Any) -> bool:
    return isinstance(cond, (list, tuple)) and all(isinstance(c, str) for c in cond)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
class RewardModelDeployment:
    """Hosts one reward model; batches concurrent `score` calls into one forward pass (unless `batching` is
    off: then each call is scored on its own)."""

    def __init__(self, spec: dict[str, Any], max_batch_size: int = 256, batch_wait_timeout_s: float = 0.005,
                 batching: bool = True):
        torch.set_num_threads(1)
        parsed = parse_reward_spec(spec)
        self.kind = parsed.kind
        self.model = build_reward_model(parsed)  # the same factory as the in-process ensemble
        self.name = self.model.name
        self.batching = batching
        self._score_batch.set_max_batch_size(max_batch_size)
        self._score_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def score(self, samples: torch.Tensor, cond: torch.Tensor | Sequence[str],
                    group: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [B] of one call: `cond` is class ids / prompt token ids [B,...] or a list of B prompt strings.
        Checked per call (an error fails only this call), then batched with concurrent calls; a groupwise model
        scores the call's prompt groups (`group`) and is never batched with other calls."""
        n = len(cond)
        if n != samples.shape[0]:
            raise ValueError(f"reward model {self.name!r}: cond has {n} entries for {samples.shape[0]} samples")
        cond = list(cond) if _is_prompts(cond) else cond
        if isinstance(self.model, GroupwiseRewardModel):
            return score_model(self.model, samples, cond, group)
        if not self.batching:
            return check_scores(self.model, self.model.score(samples, cond), n)
        return await self._score_batch(samples, cond)

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005)
    async def _score_batch(self, samples: list[torch.Tensor], cond: list[Any]) -> list[torch.Tensor]:
        """One forward pass over the calls when their samples share a shape and their conds join: prompt lists
        by concatenation, tensors (same width) by torch.cat. Otherwise (other image sizes, prompts padded to
        other widths) each call is scored on its own."""
        sizes = [s.shape[0] for s in samples]
        same = len({(tuple(s.shape[1:]), s.dtype) for s in samples}) == 1
        if same and all(_is_prompts(c) for c in cond):
            out = self.model.score(torch.cat(samples), [p for c in cond for p in c])
        elif same and all(isinstance(c, torch.Tensor) for c in cond) and len({c.shape[1:] for c in cond}) == 1:
            out = self.model.score(torch.cat(samples), torch.cat(cond))
        else:
            return [check_scores(self.model, self.model.score(s, c), n) for s, c, n in zip(samples, cond, sizes)]
        return list(check_scores(self.model, out, sum(sizes)).split(sizes))

    async def score_items(self, prompts: list[Any], completions: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifiers: (scores, exact 0/1) of text or token-id items (REST, arith)."""
        if not isinstance(self.model, TextItemsModel):
            raise ValueError(f"reward model {self.name!r} scores images, not text")
        return self.model.score_items(prompts, completions)

    async def correct(self, samples: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.model.correct(samples, cond)

    async def features(self, samples: torch.Tensor) -> torch.Tensor:
        return self.model.features(samples)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "test_accuracy": getattr(self.model, "accuracy", None)}

    def check_health(self) -> None:
        """Serve calls this periodically; a broken model raises and the replica is replaced. The model names its
        own probe input (`RewardModel.health_probe`; None: nothing to probe)."""
        probe = self.model.health_probe()
        if probe is None:
            return
        out = self.model.score(*probe)
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"reward model {self.name} returns non-finite scores")


class InProcessModel:
    """A reward model hosted in the ingress's own process (`serve.colocate_models`), called as a DeploymentHandle
    is: `model.score.remote(...)` returns an awaitable of the result (errors are raised when it is awaited)."""

    def __init__(self, spec: dict[str, Any]):
        self.model = RewardModelDeployment.func_or_class(spec, batching=False)  # one caller: nothing to batch

    def __getattr__(self, method: str) -> Any:
        call = getattr(self.model, method)

        def remote(*args: Any, **kwargs: Any) -> Any:
            async def result() -> Any:
                out = call(*args, **kwargs)
                return await out if inspect.isawaitable(out) else out
            return result()

        return SimpleNamespace(remote=remote)


def _handle(model: DeploymentHandle | dict[str, Any]) -> DeploymentHandle | InProcessModel:
    """A member's handle as bound: a deployment's handle, or a model spec the ingress hosts itself."""
    return InProcessModel(model) if isinstance(model, dict) else model


@dataclass(frozen=True)
class IngressSettings:
    """What `RewardEnsembleIngress` is built with besides its model handles.

    `profile`: the testbed's REST profile (request model, items or tensors, legacy route); `train_on`: the member
    the training reward is, or 'mean'; `feature_model`: a member whose `features` come back with `score_tensors`
    (None: no features); `correct`: monitors that also report `<name>_correct` (the rule of
    `reward.ensemble.monitor_scores`); `rest`: the REST API's limits and token digest; `digest`: what the app
    was built from (`app.app_digest`); `weighting`: the members' weights when `train_on` is 'weighted'."""

    profile: RestProfile
    train_on: str
    feature_model: str | None = None
    correct: tuple[str, ...] = ()
    rest: RestSettings = field(default_factory=RestSettings)
    digest: str = ""
    weighting: RewardWeighting | None = None


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
@serve.ingress()
class RewardEnsembleIngress:
    """Composes member deployments; monitors (digits' gold classifier, arith's exact-match verifier, the
    text-to-image `monitor_only` models) are scored too but never become the reward."""

    def __init__(self, members: dict[str, DeploymentHandle | dict[str, Any]],
                 monitors: dict[str, DeploymentHandle | dict[str, Any]], settings: IngressSettings):
        """`members` and `monitors`: each model's handle by its name, in column order; a model spec (a dict)
        instead of a handle is built here and called in this process (`serve.colocate_models`)."""
        if settings.feature_model is not None and settings.feature_model not in members:
            raise ValueError(f"feature_model={settings.feature_model!r} must be one of the members {list(members)}")
        self.profile = settings.profile
        self.testbed = settings.profile.testbed
        self.members, self.member_names = [_handle(m) for m in members.values()], list(members)
        self.monitors, self.monitor_names = [_handle(m) for m in monitors.values()], list(monitors)
        self.correct = set(settings.correct)
        self.train_on, self.feature_model = settings.train_on, settings.feature_model
        self.weighting = settings.weighting
        self.rest = settings.rest
        self.digest = settings.digest

    def check_health(self) -> None:
        """Serve calls this periodically: models hosted here are checked as their own replicas would be."""
        for m in self.members + self.monitors:
            if isinstance(m, InProcessModel):
                m.model.check_health()

    def app_digest(self) -> str:
        """The digest of the models and settings this app was built from: a run finding the same one reuses it."""
        return self.digest

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this on each replica, after __init__: the REST app of this testbed and these limits."""
        return build_rest_api(self)

    async def score_tensors(self, samples: torch.Tensor, cond: torch.Tensor | Sequence[str],
                            group: torch.Tensor | Sequence[int] | None = None,
                            with_features: bool = True) -> EnsembleScores:
        """In-cluster entry point (DeploymentHandle): samples [B,...] with class ids [B] (digits) or B prompt
        strings (text-to-image images [B,3,H,W] in [-1, 1]); `EnsembleScores` out."""
        if len(cond) != samples.shape[0]:
            raise ValueError(f"cond has {len(cond)} entries for {samples.shape[0]} samples")
        if not isinstance(cond, torch.Tensor):
            if not _is_prompts(cond):
                raise ValueError("cond must be a tensor of class ids or a list of prompt strings")
            cond = list(cond)
        if group is not None and not isinstance(group, torch.Tensor):
            group = torch.as_tensor(list(group), dtype=torch.long)
        calls = [m.score.remote(samples, cond, group) for m in self.members]
        mon = [(name, m.score.remote(samples, cond, group), m.correct.remote(samples, cond) if name in self.correct
                else None) for name, m in zip(self.monitor_names, self.monitors)]
        feat = None
        if with_features and self.feature_model is not None:
            feat = self.members[self.member_names.index(self.feature_model)].features.remote(samples)
        cols = await asyncio.gather(*calls)
        out = combine_scores(self.member_names, torch.stack(cols, dim=1), group, self.train_on,
                             self.weighting)
        for name, score, correct in mon:
            out.monitors[name] = await score
            if correct is not None:
                out.monitors[f"{name}_correct"] = await correct
        out.features = None if feat is None else await feat
        return out

    async def score_items(self, prompts: list[Any], completions: list[Any],
                          group: torch.Tensor | None = None) -> EnsembleScores:
        """Verifier apps (arith): text or token-id prompt/completion pairs."""
        cols = await asyncio.gather(*[m.score_items.remote(prompts, completions) for m in self.members])
        mons = await asyncio.gather(*[m.score_items.remote(prompts, completions) for m in self.monitors])
        out = combine_scores(self.member_names, torch.stack([col[0] for col in cols], dim=1), group,
                             self.train_on, self.weighting)
        for name, (score, correct) in zip(self.monitor_names, mons):
            out.monitors[name] = score
            if name in self.correct:
                out.monitors[f"{name}_correct"] = correct
        return out

    async def score_request(self, batch: Batch) -> ScoreResponse:
        if self.profile.items:
            out = await self.score_items(batch.cond, batch.samples, batch.group)
        else:
            out = await self.score_tensors(batch.samples, batch.cond, batch.group, with_features=False)
        return ScoreResponse(
            names=out.names, scores=out.scores.tolist(), mean=out.mean.tolist(), std=out.std.tolist(),
            uncertainty=out.uncertainty.tolist(), reward=out.reward.tolist(), train_on=out.train_on,
            monitors={k: v.tolist() for k, v in out.monitors.items()},
        )

    async def model_infos(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every model's `info`, members then monitors; `ModelsNotAnswering` names those that fail or take over
        `timeout_s` (a replica being replaced)."""
        names = self.member_names + self.monitor_names
        calls = {name: asyncio.ensure_future(_result(m.info.remote()))
                 for name, m in zip(names, self.members + self.monitors)}
        await asyncio.wait(calls.values(), timeout=timeout_s)
        silent = [name for name, call in calls.items() if not call.done() or call.exception() is not None]
        for call in calls.values():
            call.cancel()
        if silent:
            raise ModelsNotAnswering(silent, timeout_s)
        return [call.result() for call in calls.values()]

    async def models(self) -> ModelsResponse:
        infos = await self.model_infos()
        roles = ["member"] * len(self.members) + ["monitor"] * len(self.monitors)
        return ModelsResponse(testbed=self.testbed, train_on=self.train_on, feature_model=self.feature_model, models=[
            ModelInfo(name=i["name"], kind=i["kind"], role=role, test_accuracy=i.get("test_accuracy"),
                      trained_on=role == "member" and self._trained_on(i["name"]))
            for i, role in zip(infos, roles)])

    def _trained_on(self, name: str) -> bool:
        """Whether the training reward comes from member `name` (train_on 'mean', itself, or a weight > 0)."""
        if self.weighting is not None:
            return self.weighting.weights.get(name, 0.0) > 0
        return self.train_on in ("mean", name)

    async def health(self) -> HealthResponse:
        return HealthResponse(status="ok", testbed=self.testbed, route=SCORE_ROUTE, members=self.member_names,
                              monitors=self.monitor_names, gold=self.monitor_names[0] if self.monitor_names else None,
                              train_on=self.train_on, feature_model=self.feature_model,
                              models=await self.model_infos(HEALTH_TIMEOUT_S))
