"""Text-to-image reward models (clip_score, aesthetic, preference) on tiny random CLIPs loaded by path.

Each score is checked against an independent computation: transformers' own CLIPProcessor on PIL images of
the same pixels, `get_image_features`/`get_text_features`, and the formula in the module's docstring.
"""
from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from steadyrl.reward.base import RewardModel
from steadyrl.reward.factory import (AestheticSpec, ClipScoreSpec, JpegSpec, PreferenceSpec, build_reward_model,
                            parse_reward_spec)
from tests.tiny_models import save_tiny_aesthetic_head, save_tiny_clip, save_tiny_clip_tokenizer, tiny_aesthetic_head

DIM, SIZE = 16, 32
PROMPTS = ["a photo of a cat", "the dog and a ball", "a red car", "an apple on a table", "abstract art, 4k!"]
PICK_MEAN, PICK_STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)  # not CLIP's: shows the processor's are used


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Directories of a tiny CLIP, a second one standing in for PickScore with its processor repo apart,
    and aesthetic heads in both of LAION's file layouts."""
    from transformers import CLIPImageProcessor

    root = tmp_path_factory.mktemp("tiny-clip")
    proc = save_tiny_clip_tokenizer(root / "processor")
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE},
                       image_mean=list(PICK_MEAN), image_std=list(PICK_STD)).save_pretrained(proc)
    return {
        "clip": save_tiny_clip(root / "clip", projection_dim=DIM, image_size=SIZE, seed=0),
        "pick": save_tiny_clip(root / "pick", projection_dim=DIM, image_size=SIZE, seed=1),
        "processor": proc,
        "head_pth": save_tiny_aesthetic_head(root / "head.pth", DIM, seed=2),
        "head_st": save_tiny_aesthetic_head(root / "head.safetensors", DIM, seed=2),
        "root": root,
    }


def specs(tiny) -> list:
    return [ClipScoreSpec(model=str(tiny["clip"])),
            AestheticSpec(model=str(tiny["clip"]), head=str(tiny["head_pth"])),
            PreferenceSpec(model=str(tiny["pick"]), processor=str(tiny["processor"]))]


@pytest.fixture(scope="module")
def models(tiny):
    return {s.kind: build_reward_model(s) for s in specs(tiny)}


def pixels(batch: int, h: int = SIZE, w: int = SIZE, seed: int = 0) -> torch.Tensor:
    """8-bit images [B,3,H,W] (uint8 values as int64): their model-space form is exact in a PIL image."""
    return torch.randint(0, 256, (batch, 3, h, w), generator=torch.Generator().manual_seed(seed))


def smooth_pixels(batch: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Smooth 8-bit images (upsampled noise), where resize implementations agree closely."""
    low = torch.rand((batch, 3, 4, 4), generator=torch.Generator().manual_seed(seed))
    return (F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False) * 255).round().long()


def model_space(px: torch.Tensor) -> torch.Tensor:
    return px.float() / 255 * 2 - 1


def features_of(out) -> torch.Tensor:
    """get_*_features returns a tensor (transformers 4) or an output whose pooler_output is it (5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def reference_embeddings(model_dir, px: torch.Tensor, prompts: list[str] | None, processor_dir=None):
    """Normalised (image, text) embeddings computed the transformers way: CLIPProcessor on PIL images."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    proc = CLIPProcessor.from_pretrained(processor_dir or model_dir)
    images = [Image.fromarray(p.permute(1, 2, 0).numpy().astype(np.uint8)) for p in px]
    with torch.no_grad():
        pv = proc(images=images, return_tensors="pt")["pixel_values"]
        img = F.normalize(features_of(model.get_image_features(pixel_values=pv)), dim=-1)
        if prompts is None:
            return img, None, model
        tok = proc(text=prompts, return_tensors="pt", padding=True)
        txt = F.normalize(features_of(model.get_text_features(input_ids=tok["input_ids"],
                                                               attention_mask=tok["attention_mask"])), dim=-1)
    return img, txt, model


def test_every_kind_builds_from_its_spec_and_its_json_form_and_scores_the_same(tiny, models):
    x, prompts = model_space(pixels(3)), PROMPTS[:3]
    for spec in specs(tiny):
        a = models[spec.kind]
        b = build_reward_model(parse_reward_spec(spec.model_dump()))
        c = build_reward_model(spec.model_dump(mode="json"))
        assert type(a) is type(b) is type(c) and a.name == b.name == c.name == spec.name
        assert isinstance(a, RewardModel)
        sa = a.score(x, prompts)
        assert sa.dtype == torch.float32 and sa.shape == (3,) and sa.device.type == "cpu"
        assert torch.equal(sa, b.score(x, prompts)) and torch.equal(sa, c.score(x, prompts))
    assert [s.name for s in specs(tiny)] == ["clip_score", "aesthetic", "pickscore"]


def test_spec_defaults_name_the_published_models():
    assert ClipScoreSpec().model == AestheticSpec(head="h.pth").model == "openai/clip-vit-large-patch14"
    assert PreferenceSpec().model == "yuvalkirstain/PickScore_v1"
    assert PreferenceSpec().processor == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    with pytest.raises(pydantic.ValidationError, match="head"):
        parse_reward_spec({"kind": "aesthetic"})
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        parse_reward_spec({"kind": "clip_score", "dtype": "float64"})


def test_clip_score_is_the_cosine_transformers_computes_from_the_same_pixels(tiny, models):
    px = pixels(4, seed=1)  # already image_size: the resize is the identity on both sides
    img, txt, _ = reference_embeddings(tiny["clip"], px, PROMPTS[:4])
    expected = (img * txt).sum(-1)
    got = models["clip_score"].score(model_space(px), PROMPTS[:4])
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    assert float(expected.std()) > 1e-3  # the prompts and images do give different scores
    scaled = build_reward_model(ClipScoreSpec(model=str(tiny["clip"]), scale=2.5))
    assert torch.allclose(scaled.score(model_space(px), PROMPTS[:4]), 2.5 * expected, atol=1e-5)


def test_aesthetic_is_laions_mlp_on_normalised_image_embeddings(tiny, models):
    px = pixels(4, seed=2)
    img, _, _ = reference_embeddings(tiny["clip"], px, None)
    with torch.no_grad():
        expected = tiny_aesthetic_head(DIM, seed=2)(img).flatten()  # eval: dropouts are identities
    x = model_space(px)
    got = models["aesthetic"].score(x, PROMPTS[:4])
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    from_st = build_reward_model(AestheticSpec(model=str(tiny["clip"]), head=str(tiny["head_st"])))
    assert torch.equal(from_st.score(x, PROMPTS[:4]), got)
    # the prompt is not used: class ids, or other prompts, give the same scores
    assert torch.equal(models["aesthetic"].score(x, torch.arange(4)), got)


def test_preference_is_exp_logit_scale_times_cosine_with_the_processor_repos_normalisation(tiny, models):
    px = pixels(4, seed=3)
    img, txt, ref = reference_embeddings(tiny["pick"], px, PROMPTS[:4], processor_dir=tiny["processor"])
    expected = ref.logit_scale.exp().detach() * (img * txt).sum(-1)
    got = models["preference"].score(model_space(px), PROMPTS[:4])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)
    # without the processor repo, CLIP's default mean/std are used: a different score
    own = build_reward_model(PreferenceSpec(model=str(tiny["pick"]), processor=None))
    assert not torch.allclose(own.score(model_space(px), PROMPTS[:4]), expected, atol=1e-3)


def test_scoring_in_chunks_equals_scoring_all_at_once(tiny, models):
    x = model_space(pixels(5, seed=4))
    for spec in specs(tiny):
        chunked = build_reward_model(spec.model_copy(update={"max_batch": 2}))
        whole = models[spec.kind].score(x, PROMPTS)
        assert torch.allclose(chunked.score(x, PROMPTS), whole, atol=1e-6), spec.kind
        assert torch.allclose(chunked.features(x), models[spec.kind].features(x), atol=1e-6)


def test_wrong_prompts_missing_files_and_unknown_models_are_errors_naming_the_field(tiny, models):
    x = model_space(pixels(3))
    for kind in ("clip_score", "preference"):
        with pytest.raises(ValueError, match="cond has 2 prompts for 3 images"):
            models[kind].score(x, PROMPTS[:2])
        with pytest.raises(ValueError, match="cond must be a list of 3 prompt strings"):
            models[kind].score(x, torch.arange(3))
    with pytest.raises(ValueError, match="head='.*missing.pth'"):
        build_reward_model(AestheticSpec(model=str(tiny["clip"]), head=str(tiny["root"] / "missing.pth")))
    wrong_width = save_tiny_aesthetic_head(tiny["root"] / "head8.pth", 8)
    with pytest.raises(ValueError, match="head=.*16-dim"):
        build_reward_model(AestheticSpec(model=str(tiny["clip"]), head=str(wrong_width)))
    nowhere = str(tiny["root"] / "no-such-model")
    with pytest.raises(ValueError, match="model='.*no-such-model'"):
        build_reward_model(ClipScoreSpec(model=nowhere))
    with pytest.raises(ValueError, match="model='.*no-such-model'"):
        build_reward_model({"kind": "aesthetic", "model": nowhere, "head": str(tiny["head_pth"])})
    with pytest.raises(ValueError, match="processor='.*no-such-model'"):
        build_reward_model(PreferenceSpec(model=str(tiny["pick"]), processor=nowhere))
    with pytest.raises(ValueError, match=r"samples must be images \[B,3,H,W\]"):
        models["clip_score"].score(torch.zeros(3, 4, SIZE, SIZE), PROMPTS[:3])


def test_images_of_another_resolution_are_resized_and_center_cropped(tiny, models):
    for h, w in [(48, 80), (100, 64)]:  # shorter side -> 32, then a 32x32 center crop (landscape, portrait)
        px = smooth_pixels(3, h, w, seed=5)
        x = model_space(px)
        for m in models.values():
            s = m.score(x, PROMPTS[:3])
            assert s.shape == (3,) and bool(s.isfinite().all())
            assert m.features(x).shape == (3, DIM)
        # as transformers' PIL pipeline does it, up to the two bicubic implementations' differences (~1e-3)
        img, txt, _ = reference_embeddings(tiny["clip"], px, PROMPTS[:3])
        assert torch.allclose(models["clip_score"].score(x, PROMPTS[:3]), (img * txt).sum(-1), atol=2e-3)
        assert torch.allclose(models["clip_score"].features(x), img, atol=2e-3)
    # grey images are read as RGB with equal channels
    grey = model_space(smooth_pixels(2, SIZE, SIZE, seed=6)[:, :1])
    assert torch.equal(models["clip_score"].score(grey, PROMPTS[:2]),
                       models["clip_score"].score(grey.expand(-1, 3, -1, -1), PROMPTS[:2]))


def test_features_are_unit_norm_clip_image_embeddings(tiny, models):
    px = pixels(5, seed=7)
    img, _, _ = reference_embeddings(tiny["clip"], px, None)
    for kind, m in models.items():
        f = m.features(model_space(px))
        assert f.shape == (5, DIM) and f.dtype == torch.float32 and f.device.type == "cpu"
        assert torch.allclose(f.norm(dim=-1), torch.ones(5), atol=1e-5)
        if kind != "preference":
            assert torch.allclose(f, img, atol=1e-5)


def test_half_precision_weights_score_close_to_float32(tiny, models):
    x = model_space(pixels(3, seed=8))
    bf16 = build_reward_model(ClipScoreSpec(model=str(tiny["clip"]), dtype="bfloat16"))
    s = bf16.score(x, PROMPTS[:3])
    assert s.dtype == torch.float32 and torch.allclose(s, models["clip_score"].score(x, PROMPTS[:3]), atol=5e-2)


def test_jpeg_upscale_travels_through_the_factory():
    assert build_reward_model(JpegSpec()).upscale == 8
    one = build_reward_model(parse_reward_spec(JpegSpec(upscale=1).model_dump()))
    assert one.upscale == 1
    x = torch.rand((2, 3, 16, 16), generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert not torch.equal(one.score(x, torch.zeros(2)), build_reward_model(JpegSpec()).score(x, torch.zeros(2)))
    with pytest.raises(pydantic.ValidationError, match="upscale"):
        JpegSpec(upscale=0)


def test_normalized_prompts_score_as_their_clean_text_and_unnormalized_ones_do_not(tiny, models):
    """normalize_prompts: a prompt with a trademark sign, an emoji, a zero-width space and full-width letters scores
    exactly as its clean text (CLIP score and preference); without it the same prompt scores differently."""
    noisy = ["a red\u200b apple\u2122 \U0001F34E", "\uff21 dog on grass\u00ae", "a tiny house \u2192 at dusk",
             "two cats\ufe0f"]
    clean = ["a red apple", "A dog on grass", "a tiny house at dusk", "two cats"]
    px = model_space(pixels(4, seed=5))
    for spec in (ClipScoreSpec(model=str(tiny["clip"]), normalize_prompts=True),
                 PreferenceSpec(model=str(tiny["pick"]), processor=str(tiny["processor"]), normalize_prompts=True)):
        model = build_reward_model(spec)
        assert torch.equal(model.score(px, noisy), model.score(px, clean))
        raw = models[spec.kind]
        assert not torch.equal(raw.score(px, noisy), raw.score(px, clean))


@pytest.mark.parametrize("text,expected", [
    ("Coca-Cola\u2122 can \u00a9 2024 \u00ae", "Coca-Cola can 2024"),
    ("\uff35\uff2c\uff34\uff32\uff21 \ufb01ne", "ULTRA fine"),  # full-width letters, a ligature
    ("sun\u200b set \u200e\u2066x\u2069", "sun set x"),  # zero-width space, direction marks
    ("beach \U0001F3D6\ufe0f  \u2192 4k\u2120\t\n", "beach 4k"),  # emoji + selector, arrow, service mark
    ("caf\u00e9 na\u00efve, 3 < 5!", "caf\u00e9 na\u00efve, 3 5!"),  # letters and punctuation kept, math out
])
def test_prompt_normalisation_keeps_the_words_and_drops_marks_symbols_and_invisible_characters(text, expected):
    from steadyrl.reward.prompt_text import normalize_prompt

    assert normalize_prompt(text) == expected
