"""Tiny, offline stand-ins for hub models, written to a directory and loaded back by path (no network).

    save_tiny_clip_tokenizer   a working byte-level CLIP BPE tokenizer (the tokenizer of CLIP and of
                               Stable Diffusion's text encoder): every byte, every byte at a word's end
                               ("</w>"), a few merges, then <|startoftext|> and <|endoftext|> last, as in
                               OpenAI's vocabulary (so the end-of-text id is the largest id)
    save_tiny_clip             a random CLIPModel (hidden 32, 2 layers, 2 heads) + that tokenizer + a
                               CLIPImageProcessor sized to the model's image_size
    save_tiny_aesthetic_head   a random LAION improved-aesthetic-predictor MLP head (keys layers.{0,2,4,6,7})
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

CLIP_MAX_LENGTH = 77

# (first, second) pairs: each merge's result is added to the vocabulary after the single symbols
_MERGES = [("t", "h"), ("th", "e</w>"), ("a", "t"), ("o", "f</w>"), ("a", "n"), ("an", "d</w>")]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def tiny_clip_vocab() -> dict[str, int]:
    """The vocabulary in OpenAI's order: bytes, bytes + "</w>", merge results, then the two special tokens."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + [a + b for a, b in _MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}


def save_tiny_clip_tokenizer(path: str | Path) -> Path:
    """Write a CLIPTokenizer to `path` (vocab.json, merges.txt, and the config files `save_pretrained`
    adds, so `AutoTokenizer.from_pretrained(path)` and `CLIPTokenizer.from_pretrained(path)` both load it).

    Any text tokenises without unknown tokens: every byte is in the vocabulary. `model_max_length` is 77,
    CLIP's context, which Stable Diffusion pipelines pad prompts to."""
    from transformers import AutoTokenizer, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(tiny_clip_vocab(), ensure_ascii=False), encoding="utf-8")
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _MERGES)
    (path / "merges.txt").write_text(merges, encoding="utf-8")
    tok = CLIPTokenizer.from_pretrained(path, model_max_length=CLIP_MAX_LENGTH)
    tok.save_pretrained(path)
    AutoTokenizer.from_pretrained(path)  # fail here, not in a test far away, if the files do not load
    return path


def save_tiny_clip(path: str | Path, projection_dim: int = 16, image_size: int = 32, seed: int = 0) -> Path:
    """Write a random tiny CLIPModel with its tokenizer and a CLIPImageProcessor (resize the shortest edge
    and crop to `image_size`, OpenAI's mean/std) to `path`; `from_pretrained(path)` loads each."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    path = save_tiny_clip_tokenizer(path)
    vocab = tiny_clip_vocab()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  projection_dim=projection_dim)
    text = dict(common, vocab_size=len(vocab), max_position_embeddings=CLIP_MAX_LENGTH,
                bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"])
    vision = dict(common, image_size=image_size, patch_size=8, num_channels=3)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    torch.manual_seed(seed)
    CLIPModel(config).eval().save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(path)
    return path


class LaionAestheticMLP(nn.Module):
    """LAION's improved-aesthetic-predictor MLP, as its repository defines it (`layers` gives the keys)."""

    def __init__(self, dim: int):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def tiny_aesthetic_head(dim: int, seed: int = 0) -> LaionAestheticMLP:
    """A random head (eval mode) for `dim`-dimensional embeddings; the same seed gives the same weights."""
    torch.manual_seed(seed)
    return LaionAestheticMLP(dim).eval()


def save_tiny_aesthetic_head(path: str | Path, dim: int, seed: int = 0) -> Path:
    """Write a random aesthetic head for `dim`-dimensional CLIP embeddings: safetensors if `path` ends in
    .safetensors, else a torch state dict (LAION ships `.pth`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in tiny_aesthetic_head(dim, seed).state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


# --------------------------------------------------------------------------------------------------------------
# Tiny text-to-image pipelines of the real architectures (random weights), saved with `save_pretrained` so that
# production code loads them by path exactly as it loads a hub id:
#
#   save_tiny_sd_pipeline    StableDiffusionPipeline, SD1.5's layout: UNet2DConditionModel (4 latent channels),
#                            AutoencoderKL (vae_scale_factor 2, scaling 0.18215), CLIPTextModel (hidden 32),
#                            the tiny CLIP tokenizer, SD1.5's DDIMScheduler; no safety checker
#   save_tiny_sd3_pipeline   StableDiffusion3Pipeline without T5: SD3Transformer2DModel (16 latent channels,
#                            patch 2), AutoencoderKL (SD3's scaling/shift, no quant convs), two
#                            CLIPTextModelWithProjection (hidden 16 and 32, like CLIP-L and CLIP-G at 1/48 and
#                            1/40 size), two tiny CLIP tokenizers, FlowMatchEulerDiscreteScheduler(shift=3.0)
#
# Both make images of (2 * sample_size) pixels a side (default 16x16). Every component is built right after
# `torch.manual_seed(seed + k)` (k fixed per component), so the same seed gives bitwise-identical weights.
# --------------------------------------------------------------------------------------------------------------

TINY_SD_CROSS_ATTENTION_DIM = 32   # = the SD text encoder's hidden size
TINY_SD3_CLIP_HIDDEN = (16, 32)    # text_encoder (CLIP-L's role), text_encoder_2 (CLIP-G's role)
TINY_SD3_JOINT_ATTENTION_DIM = 64  # > 16 + 32: concatenated CLIP states are zero-padded to it, as 2048 -> 4096
TINY_SD3_LATENT_CHANNELS = 16


def _tiny_clip_text_kwargs(hidden: int, hidden_act: str = "quick_gelu") -> dict:
    """CLIPTextConfig kwargs matching the tiny tokenizer's vocabulary and special ids (pad = eos, as OpenAI's)."""
    vocab = tiny_clip_vocab()
    return dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, hidden_act=hidden_act,
                projection_dim=hidden, bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"])


def _tiny_vae(latent_channels: int, sample_size: int, **kwargs):
    """A 2-block AutoencoderKL (so the pipelines' vae_scale_factor is 2) for `sample_size`-pixel images."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
                         norm_num_groups=8, latent_channels=latent_channels, sample_size=sample_size,
                         **kwargs).eval()


def save_tiny_sd_pipeline(path: str | Path, seed: int = 0, sample_size: int = 8) -> Path:
    """Write a random tiny `StableDiffusionPipeline` (SD1.5's layout) to `path`; `DiffusionPipeline.
    from_pretrained(path)` and `UNet2DConditionModel.from_pretrained(path, subfolder="unet")` etc. load it.

    Latents are 4 x sample_size x sample_size; images 3 x (2 * sample_size) x (2 * sample_size). encode_prompt
    gives [batch, 77, 32] embeddings."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer"))
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=8, cross_attention_dim=TINY_SD_CROSS_ATTENTION_DIM, attention_head_dim=2).eval()
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(4, 2 * sample_size, scaling_factor=0.18215)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_SD_CROSS_ATTENTION_DIM))).eval()
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", steps_offset=1, clip_sample=False,
                              set_alpha_to_one=False, prediction_type="epsilon")
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(path)
    return path


def save_tiny_sd3_pipeline(path: str | Path, seed: int = 0, sample_size: int = 8) -> Path:
    """Write a random tiny `StableDiffusion3Pipeline` without T5 (text_encoder_3 = tokenizer_3 = None) to
    `path`; `DiffusionPipeline.from_pretrained(path)` and `SD3Transformer2DModel.from_pretrained(path,
    subfolder="transformer")` etc. load it.

    Latents are 16 x sample_size x sample_size (patch 2); images 3 x (2 * sample_size) x (2 * sample_size).
    encode_prompt (default max_sequence_length 256) gives prompt embeddings [batch, 77 + 256, 64] (the two CLIPs'
    penultimate states, 16 + 32 wide, zero-padded to 64, then 256 zero rows standing in for T5) and pooled
    embeddings [batch, 16 + 32]."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer"))
    tokenizer_2 = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer_2"))
    heads, head_dim = 2, 8
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=TINY_SD3_LATENT_CHANNELS, num_layers=2,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=TINY_SD3_JOINT_ATTENTION_DIM,
        caption_projection_dim=heads * head_dim, pooled_projection_dim=sum(TINY_SD3_CLIP_HIDDEN),
        out_channels=TINY_SD3_LATENT_CHANNELS, pos_embed_max_size=max(16, sample_size)).eval()
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(TINY_SD3_LATENT_CHANNELS, 2 * sample_size, scaling_factor=1.5305, shift_factor=0.0609,
                    use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_SD3_CLIP_HIDDEN[0], "quick_gelu"))).eval()
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(
        CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_SD3_CLIP_HIDDEN[1], "gelu"))).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                                    text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                    tokenizer_2=tokenizer_2, text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------
#   save_tiny_sdxl_pipeline  StableDiffusionXLPipeline, SDXL's layout: UNet2DConditionModel with
#                            addition_embed_type "text_time" (pooled CLIP-G embedding + 6 size/crop ids),
#                            linear projections, DownBlock2D first, more transformer layers deeper down;
#                            AutoencoderKL (SDXL's scaling 0.13025, vae_scale_factor 2); CLIPTextModel (hidden
#                            16, quick_gelu, CLIP-L's role) + CLIPTextModelWithProjection (hidden 32, gelu,
#                            CLIP-G's role), two tiny CLIP tokenizers; a DDIMScheduler with SDXL's betas
# --------------------------------------------------------------------------------------------------------------

TINY_SDXL_CLIP_HIDDEN = (16, 32)   # text_encoder (CLIP-L's role, 768 in SDXL), text_encoder_2 (CLIP-G's, 1280)
TINY_SDXL_CROSS_ATTENTION_DIM = sum(TINY_SDXL_CLIP_HIDDEN)  # penultimate states concatenated, as 768 + 1280 = 2048
TINY_SDXL_TIME_EMBED_DIM = 8       # addition_time_embed_dim (256 in SDXL), per each of the 6 add_time_ids


def save_tiny_sdxl_pipeline(path: str | Path, seed: int = 0, sample_size: int = 8) -> Path:
    """Write a random tiny `StableDiffusionXLPipeline` to `path`; `DiffusionPipeline.from_pretrained(path)` and
    `UNet2DConditionModel.from_pretrained(path, subfolder="unet")` etc. load it.

    Latents are 4 x sample_size x sample_size; images 3 x (2 * sample_size) x (2 * sample_size). encode_prompt
    gives prompt embeddings [batch, 77, 16 + 32] and pooled embeddings [batch, 32] (text_encoder_2's projection);
    the UNet's added embedding reads 6 * 8 + 32 = 80 features (6 add_time_ids, 8 each, plus the pooled one).
    The scheduler is a DDIMScheduler with SDXL's (EulerDiscreteScheduler's) betas and timestep spacing, since
    the log-prob sampler is DDIM; `force_zeros_for_empty_prompt` is SDXL's default, True."""
    from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer"))
    tokenizer_2 = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer_2"))
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), use_linear_projection=True,
        norm_num_groups=8, cross_attention_dim=TINY_SDXL_CROSS_ATTENTION_DIM, addition_embed_type="text_time",
        addition_time_embed_dim=TINY_SDXL_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * TINY_SDXL_TIME_EMBED_DIM + TINY_SDXL_CLIP_HIDDEN[1]).eval()
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(4, 2 * sample_size, scaling_factor=0.13025, force_upcast=True)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_SDXL_CLIP_HIDDEN[0]))).eval()
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(
        CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_SDXL_CLIP_HIDDEN[1], "gelu"))).eval()
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading",
                              clip_sample=False, set_alpha_to_one=False, prediction_type="epsilon")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler,
                                     force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------------------
#   save_tiny_t5_tokenizer    a working T5 tokenizer (a `tokenizers` Unigram model, SentencePiece-style "▁"
#                             word pieces, T5's <pad>=0, </s>=1, <unk>=2, no <extra_id_*> sentinels) that loads
#                             offline with T5TokenizerFast/T5Tokenizer/AutoTokenizer.from_pretrained
#   save_tiny_flux_pipeline   FluxPipeline, FLUX.1's layout: FluxTransformer2DModel (16 latent channels packed
#                             2x2 into 64, 1 double + 1 single stream block, 2 heads of 16, rope axes (4, 6, 6),
#                             guidance embedding as FLUX.1-dev's, or not as schnell's), AutoencoderKL (FLUX's
#                             scaling 0.3611 / shift 0.1159, no quant convs, vae_scale_factor 2), CLIPTextModel
#                             (hidden 16, its pooled output is the pooled projection) + the tiny CLIP tokenizer,
#                             T5EncoderModel (T5 v1.1's gated-gelu, d_model 32) + the tiny T5 tokenizer, and
#                             FLUX.1's FlowMatchEulerDiscreteScheduler (shift 3.0, resolution-dependent shifting)
# --------------------------------------------------------------------------------------------------------------

T5_MAX_LENGTH = 512                # FLUX.1-dev's T5 context (FluxPipeline's max_sequence_length default)
TINY_FLUX_CLIP_HIDDEN = 16         # pooled_projection_dim (CLIP-L's 768)
TINY_FLUX_T5_HIDDEN = 32           # joint_attention_dim (T5-XXL's 4096)
TINY_FLUX_LATENT_CHANNELS = 16     # FLUX's VAE; the transformer sees 4 * 16 = 64 channels per packed 2x2 patch
TINY_FLUX_HEADS, TINY_FLUX_HEAD_DIM = 2, 16
TINY_FLUX_AXES_DIMS_ROPE = (4, 6, 6)  # sums to the head dim, as (16, 56, 56) sums to 128
TINY_FLUX_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                       "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}  # FLUX.1's

_T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5's SentencePiece model
_T5_WORDS = ("a", "an", "the", "of", "and", "in", "on", "with", "photo", "picture", "cat", "dog")


def tiny_t5_vocab() -> list[tuple[str, float]]:
    """(piece, log-probability) pairs: the specials, "▁", a few whole words, then "▁" + every printable ASCII
    character and every character alone; longer pieces score higher, so known words stay whole."""
    import string

    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    pieces = {t: 0.0 for t in _T5_SPECIALS}
    pieces["▁"] = -2.0
    pieces.update({"▁" + w: -1.0 for w in _T5_WORDS})
    for prefix, score in (("▁", -3.0), ("", -4.0)):
        for c in chars:
            pieces.setdefault(prefix + c, score)  # "▁a" is already a word
    return list(pieces.items())


def save_tiny_t5_tokenizer(path: str | Path) -> Path:
    """Write a T5 tokenizer (tokenizer.json + tokenizer_config.json) to `path`; `T5TokenizerFast`, `T5Tokenizer`
    and `AutoTokenizer.from_pretrained(path)` load it. The backend is built exactly as transformers' T5Tokenizer
    builds its own (Unigram, unk id 2, whitespace split + Metaspace "▁" with a prefix space, "</s>" appended), so it
    round-trips unchanged. Text of printable ASCII tokenises without unknowns; `model_max_length` is 512."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import Unigram
    from transformers import AutoTokenizer, T5TokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(Unigram(tiny_t5_vocab(), unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = T5TokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                          extra_ids=0, model_max_length=T5_MAX_LENGTH)
    tok.save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)  # fail here, not in a test far away, if the files do not load
    ids = loaded("a photo of a cat").input_ids
    if loaded.unk_token_id in ids or ids[-1] != loaded.eos_token_id or len(loaded) != len(tok):
        raise RuntimeError(f"tiny T5 tokenizer did not round-trip: {ids}, {len(loaded)} vs {len(tok)}")
    return path


def save_tiny_flux_pipeline(path: str | Path, seed: int = 0, sample_size: int = 8,
                            guidance_embeds: bool = True) -> Path:
    """Write a random tiny `FluxPipeline` (FLUX.1's layout; guidance_embeds=True as FLUX.1-dev, False as schnell)
    to `path`; `DiffusionPipeline.from_pretrained(path)` and `FluxTransformer2DModel.from_pretrained(path,
    subfolder="transformer")` etc. load it.

    For H x W images the latents are 16 x H/2 x W/2, packed into (H/4 * W/4) tokens of 64 features (16x16
    images: [1, 16, 8, 8] -> [1, 16, 64]); `sample_size` is only the VAE's config (FluxPipeline's default image
    size is fixed at 128 * vae_scale_factor = 256 pixels, so pass height and width). encode_prompt(prompt,
    max_sequence_length=L) gives T5 states [batch, L, 32], CLIP pooled output [batch, 16] and text_ids [L, 3]."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = CLIPTokenizer.from_pretrained(save_tiny_clip_tokenizer(path / "tokenizer"))
    tokenizer_2 = T5TokenizerFast.from_pretrained(save_tiny_t5_tokenizer(path / "tokenizer_2"))
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * TINY_FLUX_LATENT_CHANNELS, out_channels=None, num_layers=1, num_single_layers=1,
        attention_head_dim=TINY_FLUX_HEAD_DIM, num_attention_heads=TINY_FLUX_HEADS,
        joint_attention_dim=TINY_FLUX_T5_HIDDEN, pooled_projection_dim=TINY_FLUX_CLIP_HIDDEN,
        guidance_embeds=guidance_embeds, axes_dims_rope=TINY_FLUX_AXES_DIMS_ROPE).eval()
    torch.manual_seed(seed + 1)
    vae = _tiny_vae(TINY_FLUX_LATENT_CHANNELS, 2 * sample_size, scaling_factor=0.3611, shift_factor=0.1159,
                    use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**_tiny_clip_text_kwargs(TINY_FLUX_CLIP_HIDDEN))).eval()
    torch.manual_seed(seed + 3)
    t5_config = T5Config(vocab_size=len(tokenizer_2), d_model=TINY_FLUX_T5_HIDDEN, d_kv=8, d_ff=64, num_layers=2,
                         num_decoder_layers=2, num_heads=2, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                         pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
                         decoder_start_token_id=tokenizer_2.pad_token_id)
    text_encoder_2 = T5EncoderModel(t5_config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**TINY_FLUX_SCHEDULER)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(path)
    return path
