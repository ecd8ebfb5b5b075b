"""The tiny text-to-image pipelines of tests/tiny_models.py: they load back by path as a hub id would, the
diffusers pipelines run on them end to end, encode_prompt gives the shapes recorded here, and the same seed
gives bitwise-identical weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import save_tiny_sd3_pipeline, save_tiny_sd_pipeline

diffusers = pytest.importorskip("diffusers")

# drop T5 when loading, as with the real SD3 hub id: diffusers 0.42 will not load a directory whose model_index.json
# holds `text_encoder_3: [null, null]` unless these are passed (they are not among SD3's _optional_components)
NO_T5 = dict(text_encoder_3=None, tokenizer_3=None)


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> Path:
    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("tiny_sd"))


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> Path:
    return save_tiny_sd3_pipeline(tmp_path_factory.mktemp("tiny_sd3"))


def _load(path: Path, **kwargs):
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every component, keyed by `component/file:tensor`."""
    out = {}
    for f in sorted(Path(path).glob("*/*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[f"{f.parent.name}/{f.name}:{k}"] = v
    assert out
    return out


def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _generate(pipe) -> torch.Tensor:
    out = pipe("a cat", num_inference_steps=2, guidance_scale=2.0, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    return out.images


# ---------------------------------------------------------------- Stable Diffusion 1.5 layout

def test_sd_loads_by_path_with_each_component(sd_dir):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    pipe = _load(sd_dir)
    assert type(pipe) is StableDiffusionPipeline
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    assert pipe.vae_scale_factor == 2
    unet = UNet2DConditionModel.from_pretrained(sd_dir, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(sd_dir, subfolder="vae")
    text_encoder = CLIPTextModel.from_pretrained(sd_dir, subfolder="text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(sd_dir, subfolder="tokenizer")
    scheduler = DDIMScheduler.from_pretrained(sd_dir, subfolder="scheduler")
    assert (unet.config.in_channels, unet.config.out_channels, unet.config.sample_size) == (4, 4, 8)
    assert unet.config.cross_attention_dim == text_encoder.config.hidden_size == 32
    assert vae.config.latent_channels == 4 and vae.config.scaling_factor == 0.18215
    assert len(tokenizer) == text_encoder.config.vocab_size and tokenizer.model_max_length == 77
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        text_encoder.config.bos_token_id, text_encoder.config.eos_token_id, text_encoder.config.pad_token_id)
    sc = scheduler.config
    assert (sc.beta_start, sc.beta_end, sc.beta_schedule, sc.steps_offset, sc.clip_sample, sc.set_alpha_to_one,
            sc.prediction_type) == (0.00085, 0.012, "scaled_linear", 1, False, False, "epsilon")
    for module in (unet, vae, text_encoder):
        assert _n_params(module) < 1_000_000


def test_sd_pipeline_generates(sd_dir):
    pipe = _load(sd_dir)
    images = _generate(pipe)
    assert images.shape == (1, 3, 16, 16)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, _generate(pipe))  # seeded generator: same images


def test_sd_encode_prompt_shapes(sd_dir):
    pipe = _load(sd_dir)
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt("a cat", "cpu", 1, True)
        cond_n, uncond_n = pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="blurry")
        cond_only, none = pipe.encode_prompt(["a cat", "a dog"], "cpu", 2, False)
    for t in (cond, uncond, cond_n, uncond_n):
        assert t.shape == (1, 77, 32)
    assert torch.equal(cond, cond_n) and not torch.equal(uncond, uncond_n)
    assert cond_only.shape == (4, 77, 32) and none is None


# ---------------------------------------------------------------- Stable Diffusion 3 without T5

def test_sd3_loads_by_path_with_each_component(sd3_dir):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    with pytest.raises(ValueError, match="expected"):  # see NO_T5
        diffusers.DiffusionPipeline.from_pretrained(sd3_dir)
    pipe = _load(sd3_dir, **NO_T5)
    assert type(pipe) is StableDiffusion3Pipeline
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    assert type(StableDiffusion3Pipeline.from_pretrained(sd3_dir, **NO_T5)) is StableDiffusion3Pipeline
    assert pipe.vae_scale_factor == 2
    transformer = SD3Transformer2DModel.from_pretrained(sd3_dir, subfolder="transformer")
    vae = AutoencoderKL.from_pretrained(sd3_dir, subfolder="vae")
    te1 = CLIPTextModelWithProjection.from_pretrained(sd3_dir, subfolder="text_encoder")
    te2 = CLIPTextModelWithProjection.from_pretrained(sd3_dir, subfolder="text_encoder_2")
    for sub in ("tokenizer", "tokenizer_2"):
        tokenizer = CLIPTokenizer.from_pretrained(sd3_dir, subfolder=sub)
        assert len(tokenizer) == te1.config.vocab_size == te2.config.vocab_size
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(sd3_dir, subfolder="scheduler")
    tc = transformer.config
    assert tc.in_channels == tc.out_channels == vae.config.latent_channels == 16
    assert (tc.sample_size, tc.patch_size) == (8, 2)
    assert tc.pooled_projection_dim == te1.config.projection_dim + te2.config.projection_dim == 48
    assert tc.joint_attention_dim == 64 >= te1.config.hidden_size + te2.config.hidden_size
    assert tc.caption_projection_dim == tc.num_attention_heads * tc.attention_head_dim
    vc = vae.config
    assert (vc.scaling_factor, vc.shift_factor, vc.use_quant_conv, vc.use_post_quant_conv) == (
        1.5305, 0.0609, False, False)
    assert (scheduler.config.num_train_timesteps, scheduler.config.shift) == (1000, 3.0)
    for module in (transformer, vae, te1, te2):
        assert _n_params(module) < 1_000_000


def test_sd3_pipeline_generates(sd3_dir):
    pipe = _load(sd3_dir, **NO_T5)
    images = _generate(pipe)
    assert images.shape == (1, 3, 16, 16)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, _generate(pipe))


def test_sd3_encode_prompt_shapes(sd3_dir):
    pipe = _load(sd3_dir, **NO_T5)
    with torch.no_grad():
        emb, neg, pooled, neg_pooled = pipe.encode_prompt("a cat", None, None, device="cpu")
        emb_n, neg_n, pooled_n, neg_pooled_n = pipe.encode_prompt("a cat", None, None, device="cpu",
                                                                  negative_prompt="blurry")
        short, none, short_pooled, none_pooled = pipe.encode_prompt(
            "a cat", None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=8)
    # 77 CLIP rows (16 + 32 features, zero-padded to joint_attention_dim 64) then 256 zero "T5" rows
    for t in (emb, neg, emb_n, neg_n):
        assert t.shape == (1, 77 + 256, 64)
        assert not t[:, :77, :48].eq(0).all() and t[:, :77, 48:].eq(0).all() and t[:, 77:].eq(0).all()
    for t in (pooled, neg_pooled, pooled_n, neg_pooled_n):
        assert t.shape == (1, 48)
    assert torch.equal(emb, emb_n) and torch.equal(pooled, pooled_n)
    assert not torch.equal(neg, neg_n) and not torch.equal(neg_pooled, neg_pooled_n)
    assert short.shape == (1, 77 + 8, 64) and short_pooled.shape == (1, 48)
    assert none is None and none_pooled is None


def test_sd3_one_step_matches_transformer_forward(sd3_dir):
    """The pipeline's single Euler step is x0 + (sigma_1 - sigma_0) * v with v the CFG-combined transformer
    output on the encoded prompts: recompute it from the components."""
    pipe = _load(sd3_dir, **NO_T5)
    guidance = 2.0
    got = pipe("a cat", num_inference_steps=1, guidance_scale=guidance, output_type="latent",
               generator=torch.Generator().manual_seed(0)).images
    with torch.no_grad():
        emb, neg, pooled, neg_pooled = pipe.encode_prompt("a cat", None, None, device="cpu")
        x = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
        pipe.scheduler.set_timesteps(1)
        t, (s0, s1) = pipe.scheduler.timesteps[0], pipe.scheduler.sigmas[:2]
        v = pipe.transformer(hidden_states=torch.cat([x, x]), timestep=t.expand(2),
                             encoder_hidden_states=torch.cat([neg, emb]),
                             pooled_projections=torch.cat([neg_pooled, pooled]), return_dict=False)[0]
        v_uncond, v_text = v.chunk(2)
        want = x + (s1 - s0) * (v_uncond + guidance * (v_text - v_uncond))
    assert got.shape == (1, 16, 8, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("build", [save_tiny_sd_pipeline, save_tiny_sd3_pipeline], ids=["sd", "sd3"])
def test_same_seed_same_weights(build, tmp_path):
    a, b = _weights(build(tmp_path / "a", seed=3)), _weights(build(tmp_path / "b", seed=3))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _weights(build(tmp_path / "c", seed=4))
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1 and a[k].std() > 0)


# ---------------------------------------------------------------- FLUX.1 (dev: guidance embedding; schnell: none)

import numpy as np

from tests.tiny_models import (
    TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_T5_HIDDEN, save_tiny_flux_pipeline, save_tiny_t5_tokenizer)

FLUX_SEQ = 16  # max_sequence_length passed in these tests (the pipeline's default, 512, works too)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux"))


@pytest.fixture(scope="module")
def flux_schnell_dir(tmp_path_factory) -> Path:
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux_schnell"), guidance_embeds=False)


def _flux_generate(pipe, guidance_scale: float = 3.5, **kwargs) -> torch.Tensor:
    kwargs = {"num_inference_steps": 2, "height": 16, "width": 16, "max_sequence_length": FLUX_SEQ,
              "output_type": "pt", **kwargs}
    return pipe("a cat", guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0), **kwargs).images


def test_t5_tokenizer_loads_offline(tmp_path):
    from transformers import AutoTokenizer, T5TokenizerFast

    path = save_tiny_t5_tokenizer(tmp_path / "t5")
    for tok in (T5TokenizerFast.from_pretrained(path), AutoTokenizer.from_pretrained(path)):
        assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
        assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
        assert tok.model_max_length == 512
        assert tok.tokenize("a photo of a cat") == ["▁a", "▁photo", "▁of", "▁a", "▁cat"]
        for text in ("a photo of a cat", "A Zebra, 42 stripes!  (x2)"):
            ids = tok(text).input_ids
            assert tok.unk_token_id not in ids and ids[-1] == tok.eos_token_id
            assert tok.decode(ids, skip_special_tokens=True) == " ".join(text.split())
        padded = tok(["a cat"], padding="max_length", max_length=8, truncation=True).input_ids[0]
        assert padded[:3] == tok("a cat").input_ids and padded[3:] == [0] * 5


def test_flux_loads_by_path_with_each_component(flux_dir):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    pipe = _load(flux_dir)
    assert type(pipe) is FluxPipeline and type(FluxPipeline.from_pretrained(flux_dir)) is FluxPipeline
    assert pipe.image_encoder is None and pipe.feature_extractor is None
    assert pipe.vae_scale_factor == 2
    transformer = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
    vae = AutoencoderKL.from_pretrained(flux_dir, subfolder="vae")
    te1 = CLIPTextModel.from_pretrained(flux_dir, subfolder="text_encoder")
    te2 = T5EncoderModel.from_pretrained(flux_dir, subfolder="text_encoder_2")
    tok1 = CLIPTokenizer.from_pretrained(flux_dir, subfolder="tokenizer")
    tok2 = T5TokenizerFast.from_pretrained(flux_dir, subfolder="tokenizer_2")
    assert len(AutoTokenizer.from_pretrained(flux_dir, subfolder="tokenizer_2")) == len(tok2)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(flux_dir, subfolder="scheduler")
    tc, vc = transformer.config, vae.config
    assert tc.in_channels == 4 * vc.latent_channels == 64 and tc.out_channels is None and tc.patch_size == 1
    assert (tc.num_layers, tc.num_single_layers, tc.num_attention_heads, tc.attention_head_dim) == (1, 1, 2, 16)
    assert sum(tc.axes_dims_rope) == tc.attention_head_dim and tc.guidance_embeds is True
    assert tc.joint_attention_dim == te2.config.d_model == TINY_FLUX_T5_HIDDEN
    assert tc.pooled_projection_dim == te1.config.hidden_size == TINY_FLUX_CLIP_HIDDEN
    assert (vc.scaling_factor, vc.shift_factor, vc.use_quant_conv, vc.use_post_quant_conv) == (
        0.3611, 0.1159, False, False)
    assert len(tok1) == te1.config.vocab_size and tok1.model_max_length == 77
    assert len(tok2) == te2.config.vocab_size and tok2.model_max_length == 512
    assert (tok2.pad_token_id, tok2.eos_token_id) == (te2.config.pad_token_id, te2.config.eos_token_id) == (0, 1)
    assert te2.config.is_gated_act and te2.config.dense_act_fn == "gelu_new"  # T5 v1.1's gated-gelu
    sc = scheduler.config
    assert (sc.num_train_timesteps, sc.shift, sc.use_dynamic_shifting, sc.base_shift, sc.max_shift,
            sc.base_image_seq_len, sc.max_image_seq_len) == (1000, 3.0, True, 0.5, 1.15, 256, 4096)
    for module in (transformer, vae, te1, te2):
        assert _n_params(module) < 1_000_000


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_flux_pipeline_generates(variant, request):
    pipe = _load(request.getfixturevalue("flux_dir" if variant == "dev" else "flux_schnell_dir"))
    assert pipe.transformer.config.guidance_embeds is (variant == "dev")
    images = _flux_generate(pipe)
    assert images.shape == (1, 3, 16, 16)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, _flux_generate(pipe))  # seeded generator: same images
    # the guidance scale is an input of dev's transformer (no CFG pass); schnell ignores it
    assert torch.equal(images, _flux_generate(pipe, guidance_scale=1.0)) is (variant == "schnell")
    assert _flux_generate(pipe, height=32, width=24).shape == (1, 3, 32, 24)


def test_flux_encode_prompt_shapes(flux_dir):
    pipe = _load(flux_dir)
    with torch.no_grad():
        emb, pooled, text_ids = pipe.encode_prompt(["a cat"], prompt_2=None, max_sequence_length=FLUX_SEQ)
        emb_2, pooled_2, _ = pipe.encode_prompt(["a cat"], prompt_2=["a dog"], max_sequence_length=FLUX_SEQ)
        emb_x2, pooled_x2, _ = pipe.encode_prompt("a cat", num_images_per_prompt=2, max_sequence_length=FLUX_SEQ)
        emb_full, _, ids_full = pipe.encode_prompt("a cat")
    assert emb.shape == (1, FLUX_SEQ, TINY_FLUX_T5_HIDDEN)      # T5 states, padded to max_sequence_length
    assert pooled.shape == (1, TINY_FLUX_CLIP_HIDDEN)           # CLIPTextModel's pooler output
    assert text_ids.shape == (FLUX_SEQ, 3) and text_ids.eq(0).all()
    assert emb_full.shape == (1, 512, TINY_FLUX_T5_HIDDEN) and ids_full.shape == (512, 3)
    # no attention mask reaches T5, so its states attend to the padding: the padded length changes the prompt rows
    assert not torch.allclose(emb_full[:, :FLUX_SEQ], emb)
    assert torch.equal(pooled, pooled_2) and not torch.equal(emb, emb_2)  # prompt_2 feeds T5 only
    assert emb_x2.shape == (2, FLUX_SEQ, TINY_FLUX_T5_HIDDEN) and torch.equal(emb_x2[1], emb[0])
    assert pooled_x2.shape == (2, TINY_FLUX_CLIP_HIDDEN)


def test_flux_latents_and_sigmas(flux_dir):
    """16x16 images: latents [1, 16, 8, 8] packed 2x2 into 16 tokens of 64; FLUX.1's resolution-dependent shift
    mu = calculate_shift(16) = 0.5 + (16 - 256) * 0.65 / 3840 = 0.459375 (below base_shift: 16 < 256 tokens)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    pipe = _load(flux_dir)
    packed = _flux_generate(pipe, output_type="latent")
    assert packed.shape == (1, 16, 64)
    unpacked = pipe._unpack_latents(packed, 16, 16, pipe.vae_scale_factor)
    assert unpacked.shape == (1, 16, 8, 8)
    assert torch.equal(pipe._pack_latents(unpacked, 1, 16, 8, 8), packed)
    c = pipe.scheduler.config
    mu = calculate_shift(packed.shape[1], c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    assert mu == pytest.approx(0.459375)
    timesteps, n = retrieve_timesteps(pipe.scheduler, 4, "cpu", sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
    want = [1.0, 0.8260643, 0.6128659, 0.3454190]  # exp(mu) s / (1 + (exp(mu) - 1) s) for s = 1, .75, .5, .25
    assert n == 4
    torch.testing.assert_close(timesteps, torch.tensor(want) * 1000)
    torch.testing.assert_close(pipe.scheduler.sigmas, torch.tensor(want + [0.0]))


def test_flux_one_step_matches_transformer_forward(flux_dir):
    """One Euler step from sigma 1 to 0 is x - v, v the transformer's output at t = 1 with guidance 3.5 on the
    encoded prompt: recompute it from the components."""
    pipe = _load(flux_dir)
    got = _flux_generate(pipe, num_inference_steps=1, output_type="latent")
    with torch.no_grad():
        emb, pooled, text_ids = pipe.encode_prompt("a cat", max_sequence_length=FLUX_SEQ)
        x = torch.randn((1, 16, 8, 8), generator=torch.Generator().manual_seed(0))
        x = pipe._pack_latents(x, 1, 16, 8, 8)
        img_ids = pipe._prepare_latent_image_ids(1, 4, 4, "cpu", x.dtype)
        v = pipe.transformer(hidden_states=x, timestep=torch.ones(1), guidance=torch.full([1], 3.5),
                             pooled_projections=pooled, encoder_hidden_states=emb, txt_ids=text_ids, img_ids=img_ids,
                             return_dict=False)[0]
    assert img_ids.shape == (16, 3)
    torch.testing.assert_close(got, x - v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["dev", "schnell"])
def test_flux_same_seed_same_weights(guidance_embeds, tmp_path):
    def build(name, seed):
        return _weights(save_tiny_flux_pipeline(tmp_path / name, seed=seed, guidance_embeds=guidance_embeds))

    a, b = build("a", 3), build("b", 3)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("guidance_embedder" in k for k in a) is guidance_embeds
    c = build("c", 4)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1 and a[k].std() > 0)
