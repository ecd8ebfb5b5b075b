"""One reward-model factory: a spec in, a `RewardModel` out.

The in-process ensemble (`reward.config.build_reward_models`, the testbeds' `reward_ensemble`) and every
Serve reward deployment (`services.serving`) build their models here, from the same specs, so a
model scores the same whether it runs in a benchmark or behind REST. A spec's `kind` picks the model:

    classifier   a digits classifier trained and cached by config (reward/classifiers.py)
    jpeg         JPEG compressibility, -(size in kB) (reward/jpeg.py)
    verifier     an exact arith verifier over text or token ids (reward/verifiers.py)
    clip_score   image-prompt agreement, scale * cos(CLIP image, CLIP text) (reward/clip_score.py)
    aesthetic    LAION's aesthetic predictor, an MLP on CLIP image embeddings (reward/aesthetic.py)
    preference   human preference in PickScore's form, exp(logit_scale) * cos (reward/preference.py)
    python       a user's function or class by import path, called on uint8 images and prompts
                 (reward/python_reward.py)
    ocr          text rendering, 1 - min(edit distance, |t|) / |t| between the prompt's quoted text t and the
                 text OCR reads (Flow-GRPO's; reward/ocr_reward.py, the `ocr` extra)
    http         a remote scorer: a steadyrl reward service, a flow_grpo reward server or an OpenAI-compatible
                 judge (reward/http_reward.py)
    <plug-in>    a kind an installed package adds (entry point group `steadyrl.rewards`, rollout/plugins.py): its
                 spec class is in the union below and its `build()` returns the model

The image-text kinds load a transformers CLIPModel by hub id or local directory (`model`) and score
images [B,3,H,W] in [-1, 1] against a list of B prompts (reward/clip_models.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Iterable, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Discriminator, Field, Tag, TypeAdapter

from steadyrl.reward.base import RewardModel
from steadyrl.reward.classifiers import ClassifierSpec
from steadyrl.reward.clip_models import DType
from steadyrl.reward.http_reward import HttpRewardSpec
from steadyrl.reward.ocr_reward import OcrSpec
from steadyrl.reward.python_reward import PythonRewardSpec
from steadyrl.reward.verifiers import VerifierSpec
from steadyrl.rollout.plugins import describe, load_plugins
from steadyrl.rollout.settings_base import StrictModel


class JpegSpec(StrictModel):
    kind: Literal["jpeg"] = "jpeg"
    name: str = "jpeg_compressibility"
    quality: int = Field(95, ge=1, le=100)
    upscale: int = Field(8, ge=1, description="nearest-neighbour upscale before encoding: 8 for the 8x8 digits "
                         "(so JPEG's 8x8 blocks see more than one pixel), 1 for real images")


_MODEL = ("hub id or local directory of a transformers CLIPModel; loaded with `from_pretrained`, so a "
          "directory works offline (HF_HUB_OFFLINE=1)")
_DEVICE = "where the model runs ('cpu', 'cuda', 'cuda:1'); images are moved there, scores come back on CPU"
_DTYPE = ("the CLIP weights' dtype: float16/bfloat16 halve memory and time on a GPU; similarities are "
          "computed in float32 from the embeddings")
_MAX_BATCH = "images per forward pass inside `score`: bounds peak memory on `device`; does not change the scores"


class ClipRunSettings(StrictModel):
    """Where and how a CLIP-based reward model runs (shared by the CLIP kinds)."""

    device: str = Field("cpu", description=_DEVICE)
    dtype: DType = Field("float32", description=_DTYPE)
    max_batch: int = Field(32, ge=1, description=_MAX_BATCH)


class PromptReadingSettings(ClipRunSettings):
    """Settings of the CLIP kinds that read the prompt (clip_score, preference)."""

    normalize_prompts: bool = Field(False, description="normalise each prompt before the text encoder reads it "
                                    "(reward/prompt_text.py: trademark signs, emoji and invisible characters out, "
                                    "NFKC): web-scraped prompts' rare tokens move the score without changing what "
                                    "the prompt asks for")


class ClipScoreSpec(PromptReadingSettings):
    """CLIP score: scale * cos(image embedding, prompt embedding) (reward/clip_score.py)."""

    kind: Literal["clip_score"] = "clip_score"
    name: str = "clip_score"
    model: str = Field("openai/clip-vit-large-patch14", description=_MODEL)
    scale: float = Field(1.0, gt=0, description="r = scale * cos; Hessel et al.'s CLIPScore is 2.5 * max(cos, 0), "
                         "so 2.5 gives its scale (the max at 0 is left out: it would flatten the reward below 0)")


class AestheticSpec(ClipRunSettings):
    """LAION's improved aesthetic predictor: an MLP head on CLIP image embeddings (reward/aesthetic.py)."""

    kind: Literal["aesthetic"] = "aesthetic"
    name: str = "aesthetic"
    head: str = Field(description="the MLP head's weights: LAION's .pth state dict (keys layers.{0,2,4,6,7}.*, "
                      "e.g. sac+logos+ava1-l14-linearMSE.pth) or a .safetensors with the same keys; its input "
                      "width must equal the CLIP model's projection_dim (768 for ViT-L/14)")
    model: str = Field("openai/clip-vit-large-patch14",
                       description=_MODEL + "; must be the CLIP the head was trained on (LAION's: ViT-L/14)")


class PreferenceSpec(PromptReadingSettings):
    """A human-preference model in PickScore's form: exp(logit_scale) * cos (reward/preference.py)."""

    kind: Literal["preference"] = "preference"
    name: str = "pickscore"
    model: str = Field("yuvalkirstain/PickScore_v1", description=_MODEL)
    processor: str | None = Field(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", description="hub id or directory of the tokenizer and image "
        "processor config: PickScore_v1 ships only the model and uses the LAION CLIP-H repo it was fine-tuned "
        "from; None: take them from `model`")


BUILT_IN_SPECS = (ClassifierSpec, JpegSpec, VerifierSpec, ClipScoreSpec, AestheticSpec, PreferenceSpec,
                  PythonRewardSpec, HttpRewardSpec, OcrSpec)


def spec_kind(spec: type[BaseModel]) -> str:
    """The `kind` a spec class is picked by: its `kind` field's default."""
    return spec.model_fields["kind"].default


def _not_a_reward_spec(kind: str, obj: Any) -> str | None:
    """Why an entry point of `steadyrl.rewards` cannot be reward kind `kind` (None: it can)."""
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        return f"{describe(obj)} is not a reward spec (a pydantic model class with `kind`, `name` and `build()`)"
    kind_field, name_field = obj.model_fields.get("kind"), obj.model_fields.get("name")
    if kind_field is None or get_origin(kind_field.annotation) is not Literal or get_args(kind_field.annotation) != (
            kind,) or kind_field.default != kind:
        return f"{obj.__name__} must declare `kind: Literal[{kind!r}] = {kind!r}` (the entry point's name)"
    if name_field is None:
        return f"{obj.__name__} has no `name` field (the reward's column in the ensemble and the metrics)"
    if not callable(getattr(obj, "build", None)):
        return f"{obj.__name__} has no `build()` method returning its reward model"
    return None


# Reward kinds of installed plug-in packages (rollout/plugins.py): spec classes whose `build()` returns the model.
PLUGIN_SPECS: dict[str, type[BaseModel]] = load_plugins(
    "steadyrl.rewards", "reward kind", map(spec_kind, BUILT_IN_SPECS), _not_a_reward_spec)


def tagged_union(specs: Iterable[type[BaseModel]]) -> Any:
    """Union[Annotated[spec, Tag(kind)], ...]: the members of a union discriminated by `kind`."""
    return Union[tuple(Annotated[s, Tag(spec_kind(s))] for s in specs)]  # type: ignore[return-value]


RewardSpec = Annotated[tagged_union([*BUILT_IN_SPECS, *PLUGIN_SPECS.values()]),  # type: ignore[valid-type]
                       Discriminator("kind")]
_SPEC = TypeAdapter(RewardSpec)


def parse_reward_spec(data: dict[str, Any] | RewardSpec) -> RewardSpec:
    """A spec from its JSON form (as it travels to a Serve deployment); errors name the field."""
    return _SPEC.validate_python(data)


def build_reward_model(spec: RewardSpec | dict[str, Any]) -> RewardModel:
    """The reward model a spec describes (classifiers are trained and cached on first use; CLIP models are
    loaded from their hub id or directory)."""
    spec = parse_reward_spec(spec) if isinstance(spec, dict) else spec
    if isinstance(spec, ClassifierSpec):
        from steadyrl.reward.classifiers import load_classifier

        return load_classifier(spec)
    if isinstance(spec, JpegSpec):
        from steadyrl.reward.jpeg import JpegCompressibilityReward

        return JpegCompressibilityReward(quality=spec.quality, upscale=spec.upscale, name=spec.name)
    if isinstance(spec, VerifierSpec):
        from steadyrl.reward.verifiers import VerifierReward

        return VerifierReward.from_spec(spec)
    if isinstance(spec, ClipScoreSpec):
        from steadyrl.reward.clip_score import ClipScoreReward

        return ClipScoreReward.from_spec(spec)
    if isinstance(spec, AestheticSpec):
        from steadyrl.reward.aesthetic import AestheticReward

        return AestheticReward.from_spec(spec)
    if isinstance(spec, PreferenceSpec):
        from steadyrl.reward.preference import PreferenceReward

        return PreferenceReward.from_spec(spec)
    if isinstance(spec, PythonRewardSpec):
        from steadyrl.reward.python_reward import PythonReward

        return PythonReward.from_spec(spec)
    if isinstance(spec, HttpRewardSpec):
        from steadyrl.reward.http_reward import HttpReward

        return HttpReward.from_spec(spec)
    if isinstance(spec, OcrSpec):
        from steadyrl.reward.ocr_reward import OcrReward

        return OcrReward.from_spec(spec)
    if spec.kind in PLUGIN_SPECS:
        model = spec.build()
        if not isinstance(model, RewardModel):
            raise TypeError(f"plug-in reward kind {spec.kind!r}: {type(spec).__name__}.build() returned "
                            f"{type(model).__name__}, which lacks the RewardModel interface (`name`, `score`, "
                            "`health_probe`; reward/base.py)")
        return model
    raise ValueError(f"unknown reward model spec {spec!r}")
