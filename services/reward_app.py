"""The reward ensemble as a Ray Serve application.

One deployment per reward model (`@serve.batch` groups concurrent requests into one forward pass),
composed by an ingress deployment that returns per-model scores, mean, spread, the training reward
and a rank-disagreement uncertainty per sample (`reward.ensemble.combine_scores`). The ingress is a
FastAPI app (OpenAPI at /docs) used over REST from outside and through a DeploymentHandle
(`score_tensors`) inside the cluster. (No `from __future__ import annotations` here: FastAPI must
see real types on the routes that Serve's ingress wraps.)

One app serves one testbed, on its route (another route answers 400):
    digits         POST /score         8x8 digit images and class ids; gold classifier monitor (+ `gold_correct`)
    arith          POST /score_text    prompt/completion text or token ids; exact-match verifier monitor
    text_to_image  POST /score_images  base64 PNGs and their prompts; `ImageRewardConfig.monitor_only` monitors
"""

import asyncio
import base64
import binascii
import io
from typing import Annotated, Any, Sequence

import numpy as np
import torch
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from steadyrl.reward.base import check_scores
from steadyrl.reward.config import FEATURE_KINDS, ImageRewardConfig, RewardConfig
from steadyrl.reward.ensemble import EnsembleScores, combine_scores
from steadyrl.reward.factory import build_reward_model, parse_reward_spec
from steadyrl.reward.verifiers import VerifierReward, VerifierSpec
from steadyrl.rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from steadyrl.services.config import ServeConfig

APP_NAME = "reward"
ROUTE_PREFIX = "/reward"
TESTBED_ROUTES = {"digits": "/score", "arith": "/score_text", "text_to_image": "/score_images"}
MAX_IMAGE_SIDE = 2048  # /score_images refuses larger images (before decoding their pixels)
HEALTH_PROMPT = "health check"

api = FastAPI(
    title="steadyrl reward ensemble",
    description="Scores samples with every reward model; returns per-model scores, mean, spread, "
    "training reward and rank-disagreement uncertainty per sample. Digits images: POST /score; arith "
    "completions (text or token ids): POST /score_text; text-to-image samples (base64 PNGs and their prompts): "
    "POST /score_images.",
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


def decode_png(data: Any) -> np.ndarray:
    """A base64 PNG (optionally a `data:image/png;base64,` URL) as RGB uint8 pixels [H,W,3]; grey and
    palette images are converted to RGB, an alpha channel is dropped. Sides above MAX_IMAGE_SIDE are refused
    from the header, before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str):
        raise ValueError(f"expected a base64 PNG string, got {type(data).__name__}")
    if data.startswith("data:"):
        head, _, data = data.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not valid base64 ({err})") from err
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        w, h = img.size
        if max(w, h) > MAX_IMAGE_SIDE or min(w, h) < 1:
            raise ValueError(f"image is {w}x{h}; each side must be between 1 and {MAX_IMAGE_SIDE} pixels")
        pixels = np.array(img.convert("RGB"), dtype=np.uint8)  # writable (torch.from_numpy)
    except ValueError:
        raise
    except UnidentifiedImageError as err:
        raise ValueError(f"not a PNG image ({len(raw)} bytes that PIL does not read as PNG)") from err
    except Exception as err:  # PIL raises several types for data that is not a (whole) PNG
        raise ValueError(f"not a decodable PNG image ({type(err).__name__}: {err})") from err
    return pixels


def encode_png(pixels: np.ndarray | torch.Tensor) -> str:
    """RGB uint8 pixels [H,W,3] (or a model-space image [3,H,W] in [-1, 1]) as a base64 PNG string."""
    from PIL import Image

    if isinstance(pixels, torch.Tensor):
        pixels = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        pixels = pixels.permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


PngImage = Annotated[
    np.ndarray,
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png",
                    "description": f"a base64-encoded PNG (RGB, grey or palette; alpha is dropped); each side at "
                    f"most {MAX_IMAGE_SIDE} px"}),
]


class ImageScoreRequest(BaseModel):
    """Text-to-image samples: PNG images (all the same size) and the prompt each was generated from. Pixels
    p in 0..255 are scored in model space, p / 127.5 - 1 in [-1, 1], as images [B,3,H,W]. (Once validated,
    `images` holds the decoded RGB uint8 arrays [H,W,3].)"""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    images: list[PngImage] = Field(..., min_length=1, description="base64 PNG per sample, all of one size "
                                   f"(each side <= {MAX_IMAGE_SIDE} px)")
    prompts: list[str] = Field(..., min_length=1, description="the prompt of each image")
    group: list[int] | None = Field(None, description="group id per sample (ranks are taken within a group)")

    @field_validator("images", mode="before")
    @classmethod
    def _decode(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # pydantic's own error: images must be a list
        out, errors = [], []
        for i, item in enumerate(v):
            try:
                out.append(decode_png(item))
            except ValueError as err:
                errors.append(f"images[{i}]: {err}")
        if errors:
            more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
            raise ValueError("; ".join(errors[:5]) + more)
        return out

    @field_validator("images")
    @classmethod
    def _one_size(cls, v: list[np.ndarray]) -> list[np.ndarray]:
        sizes = sorted({f"{a.shape[1]}x{a.shape[0]}" for a in v})
        if len(sizes) > 1:
            raise ValueError(f"images: all images in one request must have the same size (WxH), got {sizes}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "ImageScoreRequest":
        if len(self.prompts) != len(self.images):
            raise ValueError(f"prompts has {len(self.prompts)} entries but images has {len(self.images)}")
        if self.group is not None and len(self.group) != len(self.images):
            raise ValueError(f"group has {len(self.group)} entries but images has {len(self.images)}")
        return self

    def tensors(self) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
        """(images [B,3,H,W] float32 in [-1, 1], prompts, group)."""
        x = torch.from_numpy(np.stack(self.images)).permute(0, 3, 1, 2).float() / 127.5 - 1
        group = None if self.group is None else torch.tensor(self.group, dtype=torch.long)
        return x.contiguous(), list(self.prompts), group


class ScoreResponse(BaseModel):
    names: list[str] = Field(description="ensemble members, the columns of `scores`")
    scores: list[list[float]] = Field(description="[B][K] per-model scores")
    mean: list[float]
    std: list[float]
    uncertainty: list[float] = Field(description="rank disagreement between members, per sample")
    reward: list[float] = Field(description="the training reward")
    train_on: str
    monitors: dict[str, list[float]] = Field(description="watch-only models (gold, monitor-only), never trained "
                                             "on; `<name>_correct` is a classifier/verifier monitor's 0/1 verdict")


def _is_prompts(cond: Any) -> bool:
    return isinstance(cond, (list, tuple)) and all(isinstance(c, str) for c in cond)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
class RewardModelDeployment:
    """Hosts one reward model; batches concurrent `score` calls into one forward pass."""

    def __init__(self, spec: dict[str, Any], max_batch_size: int = 256, batch_wait_timeout_s: float = 0.005):
        torch.set_num_threads(1)
        parsed = parse_reward_spec(spec)
        self.kind = parsed.kind
        self.model = build_reward_model(parsed)  # the same factory as the in-process ensemble
        self.name = self.model.name
        self._score_batch.set_max_batch_size(max_batch_size)
        self._score_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def score(self, samples: torch.Tensor, cond: torch.Tensor | Sequence[str]) -> torch.Tensor:
        """Scores [B] of one call: `cond` is class ids / prompt token ids [B,...] or a list of B prompt strings.
        Checked per call (an error fails only this call), then batched with concurrent calls."""
        n = len(cond)
        if n != samples.shape[0]:
            raise ValueError(f"reward model {self.name!r}: cond has {n} entries for {samples.shape[0]} samples")
        return await self._score_batch(samples, list(cond) if _is_prompts(cond) else cond)

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
            return [check_scores(self.name, self.model.score(s, c), n) for s, c, n in zip(samples, cond, sizes)]
        return list(check_scores(self.name, out, sum(sizes)).split(sizes))

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
        return {"name": self.name, "kind": self.kind, "test_accuracy": getattr(self.model, "accuracy", None)}

    def check_health(self) -> None:
        """Serve calls this periodically; a broken model raises and the replica is replaced."""
        if isinstance(self.model, VerifierReward):
            return  # a pure function of text: nothing to go stale
        if self.kind in FEATURE_KINDS:  # image-text (CLIP) models: one grey RGB image and a prompt
            out = self.model.score(torch.zeros(1, 3, 32, 32), [HEALTH_PROMPT])
        else:  # digits classifiers, JPEG
            out = self.model.score(torch.zeros(1, *IMAGE_SHAPE), torch.zeros(1, dtype=torch.long))
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"reward model {self.name} returns non-finite scores")


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
@serve.ingress(api)
class RewardEnsembleIngress:
    """Composes member deployments; monitors (digits' gold classifier, arith's exact-match verifier, the
    text-to-image `monitor_only` models) are scored too but never become the reward."""

    def __init__(self, members: list[DeploymentHandle], member_names: list[str], monitors: list[DeploymentHandle],
                 monitor_names: list[str], train_on: str, feature_model: str | None = None, testbed: str = "digits",
                 correct: Sequence[str] = ()):
        """`feature_model`: a member whose `features` come back with `score_tensors` (None: no features);
        `correct`: monitors that also report `<name>_correct` (digits' gold classifier, arith's exact verifier)."""
        if testbed not in TESTBED_ROUTES:
            raise ValueError(f"testbed={testbed!r} must be one of {sorted(TESTBED_ROUTES)}")
        if feature_model is not None and feature_model not in member_names:
            raise ValueError(f"feature_model={feature_model!r} must be one of the members {member_names}")
        self.testbed = testbed
        self.members, self.member_names = members, list(member_names)
        self.monitors, self.monitor_names = monitors, list(monitor_names)
        self.correct = set(correct)
        self.train_on, self.feature_model = train_on, feature_model

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
        calls = [m.score.remote(samples, cond) for m in self.members]
        mon = [(name, m.score.remote(samples, cond), m.correct.remote(samples, cond) if name in self.correct
                else None) for name, m in zip(self.monitor_names, self.monitors)]
        feat = None
        if with_features and self.feature_model is not None:
            feat = self.members[self.member_names.index(self.feature_model)].features.remote(samples)
        cols = await asyncio.gather(*calls)
        out = combine_scores(self.member_names, torch.stack(cols, dim=1), group, self.train_on)
        for name, score, correct in mon:
            out.monitors[name] = await score
            if correct is not None:
                out.monitors[f"{name}_correct"] = await correct
        out.features = None if feat is None else await feat
        return out

    def _wrong_route(self, route: str) -> None:
        if TESTBED_ROUTES[self.testbed] != route:
            from fastapi import HTTPException

            raise HTTPException(status_code=400, detail=f"this reward app scores the {self.testbed!r} testbed: "
                                f"POST {TESTBED_ROUTES[self.testbed]}, not {route}")

    @api.post("/score", response_model=ScoreResponse)
    async def score_http(self, request: ScoreRequest) -> ScoreResponse:
        self._wrong_route("/score")
        return await self._respond(*request.tensors())

    @api.post("/score_text", response_model=ScoreResponse)
    async def score_text_http(self, request: TextScoreRequest) -> ScoreResponse:
        self._wrong_route("/score_text")
        p, c = request.prompts, request.completions
        cols = await asyncio.gather(*[m.score_items.remote(p, c) for m in self.members])
        mons = await asyncio.gather(*[m.score_items.remote(p, c) for m in self.monitors])
        group = None if request.group is None else torch.tensor(request.group, dtype=torch.long)
        out = combine_scores(self.member_names, torch.stack([col[0] for col in cols], dim=1), group, self.train_on)
        for name, (score, correct) in zip(self.monitor_names, mons):
            out.monitors[name] = score
            out.monitors[f"{name}_correct"] = correct
        return self._response(out)

    @api.post("/score_images", response_model=ScoreResponse)
    async def score_images_http(self, request: ImageScoreRequest) -> ScoreResponse:
        """Text-to-image samples: base64 PNGs (one size per request) and their prompts."""
        self._wrong_route("/score_images")
        return await self._respond(*request.tensors())

    async def _respond(self, samples: torch.Tensor, cond: torch.Tensor | list[str],
                       group: torch.Tensor | None) -> ScoreResponse:
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
        infos = await asyncio.gather(*[m.info.remote() for m in self.members + self.monitors])
        return {"status": "ok", "testbed": self.testbed, "route": TESTBED_ROUTES[self.testbed],
                "members": self.member_names, "monitors": self.monitor_names,
                "gold": self.monitor_names[0] if self.monitor_names else None, "train_on": self.train_on,
                "feature_model": self.feature_model, "models": infos}


def build_reward_app(cfg: RewardConfig | VerifierSpec | ImageRewardConfig,
                     serve_cfg: ServeConfig | None = None) -> serve.Application:
    """Bind one deployment per reward model and the ensemble ingress (a testbed's `reward_spec()`: the digits
    classifier ensemble, the arith verifier with its exact-match monitor, or the text-to-image models).
    Deployments are named `reward_<name>` (trained on) and `monitor_<name>` (watch only)."""
    serve_cfg = serve_cfg or ServeConfig()
    opts = {"ray_actor_options": {"num_cpus": serve_cfg.replica_cpus}}
    batching = {"max_batch_size": serve_cfg.max_batch_size, "batch_wait_timeout_s": serve_cfg.batch_wait_timeout_s}

    def model(name: str, spec: Any) -> serve.Application:
        model_opts = opts
        if getattr(spec, "device", "cpu").startswith("cuda"):  # a model on cuda reserves its share of a GPU
            model_opts = {"ray_actor_options": {**opts["ray_actor_options"], "num_gpus": serve_cfg.replica_gpus}}
        return RewardModelDeployment.options(name=name, **model_opts).bind(spec.model_dump(), **batching)

    ingress = RewardEnsembleIngress.options(name="ensemble", **opts)
    if isinstance(cfg, VerifierSpec):
        exact = cfg.model_copy(update={"partial_credit": False, "name": "exact"})
        return ingress.bind([model(f"reward_{cfg.name}", cfg)], [cfg.name], [model("monitor_exact", exact)],
                            ["exact"], cfg.name, cfg.name, "arith", ["exact"])
    if isinstance(cfg, ImageRewardConfig):
        trained, monitors = cfg.trained_specs(), cfg.monitor_specs()
        return ingress.bind([model(f"reward_{s.name}", s) for s in trained], [s.name for s in trained],
                            [model(f"monitor_{s.name}", s) for s in monitors], [s.name for s in monitors],
                            cfg.train_on, cfg.feature_model_name(), "text_to_image")
    specs = cfg.member_specs()
    members = [model(f"reward_{s.name}", s) for s in specs]
    gold = model(f"monitor_{cfg.gold.name}", cfg.gold)
    return ingress.bind(members, [s.name for s in specs], [gold], [cfg.gold.name], cfg.train_on, cfg.feature_model,
                        "digits", [cfg.gold.name])


def deploy_reward_app(cfg: RewardConfig | VerifierSpec | ImageRewardConfig, serve_cfg: ServeConfig | None = None,
                      name: str = APP_NAME, route_prefix: str = ROUTE_PREFIX) -> None:
    """Deploy (or update) the ensemble as the Serve application `name` (default `reward`) under `route_prefix`
    (default /reward)."""
    serve.run(build_reward_app(cfg, serve_cfg), name=name, route_prefix=route_prefix)
