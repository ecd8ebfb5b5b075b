"""Text-to-image policies on tiny random SD-, SDXL- and SD3-style pipelines, loaded by path through the same code
that loads a hub id: sampling equals the diffusers pipeline's own loop when the noise is off, the float64
log-prob recompute is exact under guidance, text encoders run once per prompt batch, only latents are in the
trajectory, and bad settings are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steadyrl.services.config import ConfigError, load_config
from steadyrl.services.testbeds import build_testbed
from tests.helpers import noise_off
from tests.tiny_models import (save_tiny_flux_pipeline, save_tiny_sd3_pipeline, save_tiny_sd_pipeline,
                               save_tiny_sdxl_pipeline)

FAMILIES = ("sd", "sdxl", "sd3", "flux")
FLOW = ("sd3", "flux")  # velocity models: the flow SDE


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {"sd": save_tiny_sd_pipeline(root / "sd"), "sdxl": save_tiny_sdxl_pipeline(root / "sdxl"),
            "sd3": save_tiny_sd3_pipeline(root / "sd3"), "flux": save_tiny_flux_pipeline(root / "flux")}


def t2i_overrides(path: Path, family: str, *extra: str) -> list[str]:
    sampler = ["sampler.kind=flow_sde", "sampler.shift=3.0"] if family in FLOW else ["sampler.kind=ddim"]
    if family == "flux":
        sampler.append("testbed.max_sequence_length=16")
    return ["testbed.name=text_to_image", f"testbed.pretrained={path}", "testbed.prompts.train=tiny",
            "testbed.prompts.prompts_per_step=2", "sampler.num_steps=4", "sampler.group_size=3",
            *sampler, *extra]


def t2i_config(path: Path, family: str, *extra: str):
    return load_config(None, t2i_overrides(path, family, *extra))


def t2i_policy(pipelines, family, *extra):
    from safetensors.torch import load_file

    tb = build_testbed(t2i_config(pipelines[family], family, *extra))
    return tb, tb.build_policy(load_file(str(tb.base_weights(progress=False))))


# (family, negative prompt); "" is no negative prompt: SDXL (force_zeros_for_empty_prompt) then zeroes the
# unconditional branch's embeddings instead of encoding ""
NOISE_OFF_CASES = [(family, "blurry") for family in FAMILIES if family != "flux"] + [("sdxl", ""), ("flux", "")]


@pytest.mark.parametrize("family,negative", NOISE_OFF_CASES)
def test_sampling_with_the_noise_off_is_the_diffusers_pipelines_own_loop(pipelines, family, negative):
    """eta / noise_level -> 0: every step is the deterministic DDIM / Euler step; the latents equal what
    StableDiffusion(XL|3)Pipeline produces from the same x_T, prompt, negative prompt and guidance scale (SDXL:
    the pipeline's own add_time_ids for its default size, no crop; pooled text embeddings of both prompts)."""
    from diffusers import DiffusionPipeline

    neg = [f"testbed.negative_prompt={negative}"] if negative else []
    tb, policy = t2i_policy(pipelines, family, *noise_off("flow" if family in FLOW else "ddim"),
                            "testbed.guidance_scale=3.0", *neg, "testbed.lora=null")
    sampler = tb.build_sampler()
    assert not bool(sampler.trainable.any())  # the noise is off: no stochastic step
    prompts = tb.eval_prompts()[:1]
    ours = tb.sample(sampler, policy, prompts, 2, torch.Generator().manual_seed(7))
    if family == "sdxl" and not negative:
        cond = tb.sample_options(policy, prompts)["cond_inputs"]
        assert not cond["negative_prompt_embeds"].any() and not cond["negative_pooled_prompt_embeds"].any()
    x_T = torch.randn((2, *tb.info.latent_shape(None)), generator=torch.Generator().manual_seed(7))
    extra = {"text_encoder_3": None, "tokenizer_3": None} if family == "sd3" else {}
    pipe = DiffusionPipeline.from_pretrained(str(pipelines[family]), **extra)
    pipe.set_progress_bar_config(disable=True)
    if family not in FLOW:
        from diffusers import DDIMScheduler

        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    kwargs = {"eta": 0.0} if family not in FLOW else {}
    if family == "flux":  # guidance-distilled: no negative prompt; FluxPipeline's own size default is 256 px
        side = tb.info.resolution
        kwargs = {"height": side, "width": side, "max_sequence_length": 16}
    else:
        kwargs["negative_prompt"] = [negative] * 2 if negative else None
    with torch.no_grad():
        theirs = pipe(tb.prompt_texts(prompts) * 2, latents=x_T.clone(), num_inference_steps=4, guidance_scale=3.0,
                      output_type="latent", **kwargs).images
    torch.testing.assert_close(ours.samples, theirs, rtol=0, atol=2e-5)
    assert ours.traj.shape[2:] == x_T.shape[1:]  # latents, not pixels, in the trajectory


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_recompute_under_guidance_is_exact_for_any_micro_batch(pipelines, family):
    tb, policy = t2i_policy(pipelines, family, "testbed.guidance_scale=4.5")
    policy = policy.double()
    sampler = tb.build_sampler()
    prompts, offset = tb.train_prompts(0, 1, 0)
    batch = sampler.sample(policy, prompts, 3, torch.Generator().manual_seed(0), dtype=torch.float64,
                           group_offset=offset, **tb.sample_options(policy, prompts))
    assert batch.extras["cond.prompt_embeds"].shape[0] == len(batch)  # embeddings travel per sample
    for size in (1, 2, len(batch)):
        for mb in batch.to(torch.float64).split(size):
            for step in sampler.trainable_steps.tolist():
                lp = sampler.log_prob(policy, mb, step).logp
                torch.testing.assert_close(lp, mb.old_logp[:, step], rtol=0, atol=1e-9)


def test_text_encoders_run_once_per_prompt_batch_not_per_sample(pipelines):
    tb, policy = t2i_policy(pipelines, "sd")
    calls = []
    encoder = tb.tools(policy).pipe.text_encoder
    hook = encoder.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    prompts, _ = tb.train_prompts(0, 1, 0)
    tb.sample(tb.build_sampler(), policy, prompts, 3, torch.Generator().manual_seed(0))
    hook.remove()
    assert calls == [len(prompts), len(prompts)]  # the prompts, then the negative prompt: once each, for 2 prompts


def test_guidance_is_u_plus_w_times_c_minus_u(pipelines):
    """predict(x, t, cond) = u + w (c - u) with u, c the network's unconditional and conditional outputs."""
    tb, policy = t2i_policy(pipelines, "sd", "testbed.guidance_scale=5.0")
    opts = tb.sample_options(policy, torch.tensor([0, 1]))
    policy = policy.double()  # float64: batching [u; c] in one forward changes float32 rounding only
    cond = {k: v.double() for k, v in opts["cond_inputs"].items()}
    x = torch.randn((2, *opts["sample_shape"]), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.tensor([500, 500])
    with torch.no_grad():
        c = policy.net(x, t, encoder_hidden_states=cond["prompt_embeds"]).sample
        u = policy.net(x, t, encoder_hidden_states=cond["negative_prompt_embeds"]).sample
        torch.testing.assert_close(policy(x, t, cond), u + 5.0 * (c - u), rtol=0, atol=1e-12)


def test_lora_is_the_default_and_only_adapters_are_trained_and_synced(pipelines):
    tb, policy = t2i_policy(pipelines, "sd3")
    trained = policy.trainable_state_dict()
    assert trained and all("lora_" in k for k in trained)
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.net.named_parameters())
    lora_bytes = sum(v.numel() * v.element_size() for v in trained.values())
    full_bytes = sum(v.numel() * v.element_size() for v in policy.net.state_dict().values())
    assert lora_bytes < 0.5 * full_bytes  # tiny models: ~15% here; on SD3.5-medium ~1% (README)


def test_bad_settings_are_refused_by_name(pipelines, tmp_path):
    with pytest.raises(ConfigError, match="testbed.pretrained"):
        load_config(None, ["testbed.name=text_to_image"])
    tb = build_testbed(t2i_config(pipelines["sd3"], "sd3", "sampler.shift=1.0"))
    with pytest.raises(ValueError, match="sampler.shift"):
        tb.build_sampler()
    tb = build_testbed(load_config(None, ["testbed.name=text_to_image", f"testbed.pretrained={pipelines['sd']}",
                                          "sampler.kind=flow_sde"]))
    with pytest.raises(ValueError, match="sampler.kind"):
        tb.build_sampler()
    tb = build_testbed(t2i_config(tmp_path / "nowhere", "sd"))
    with pytest.raises(ValueError, match="pretrained="):
        tb.info
    tb = build_testbed(t2i_config(pipelines["sd"], "sd", "testbed.lora.target_modules=[nonexistent]"))
    with pytest.raises(ValueError, match="lora.target_modules"):
        tb.base_weights(progress=False)


def test_tiny_sdxl_has_sdxls_layout_and_is_deterministic(pipelines, tmp_path):
    """The tiny SDXL pipeline: text_time added embedding reading 6 size ids + text_encoder_2's pooled projection,
    cross-attention over both CLIPs' states, 16x16 images (sample_size 8, vae factor 2), SDXL's betas in a DDIM
    scheduler, force_zeros_for_empty_prompt; the same seed gives byte-identical weights."""
    from diffusers import DiffusionPipeline, StableDiffusionXLPipeline

    from steadyrl.rollout.diffusers_pipelines import describe_pipeline

    info = describe_pipeline(str(pipelines["sdxl"]))
    assert (info.family, info.resolution, info.latent_shape(None)) == ("sdxl", 16, (4, 8, 8))
    pipe = DiffusionPipeline.from_pretrained(str(pipelines["sdxl"]))
    assert type(pipe) is StableDiffusionXLPipeline and pipe.config.force_zeros_for_empty_prompt
    unet, te, te2 = pipe.unet.config, pipe.text_encoder.config, pipe.text_encoder_2.config
    assert unet.addition_embed_type == "text_time" and unet.cross_attention_dim == te.hidden_size + te2.hidden_size
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + te2.projection_dim
    sc = pipe.scheduler.config
    assert (type(pipe.scheduler).__name__, sc.beta_start, sc.beta_end, sc.beta_schedule, sc.steps_offset,
            sc.timestep_spacing, sc.set_alpha_to_one, sc.clip_sample, sc.prediction_type) == (
        "DDIMScheduler", 0.00085, 0.012, "scaled_linear", 1, "leading", False, False, "epsilon")
    again = save_tiny_sdxl_pipeline(tmp_path / "sdxl")
    files = sorted(p.relative_to(again) for p in again.glob("*/*.safetensors"))
    assert len(files) == 4  # unet, vae, text_encoder, text_encoder_2
    assert all((again / f).read_bytes() == (pipelines["sdxl"] / f).read_bytes() for f in files)


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_bf16_autocast_keeps_the_sampler_float32_and_its_recompute_close(pipelines, family):
    """Under `text_to_image.autocast=bfloat16` the network runs in bf16, its prediction comes back float32,
    and the learner's recompute (other micro-batches) stays within bf16 rounding of the rollout's log-probs."""
    tb, policy = t2i_policy(pipelines, family, "testbed.autocast=bfloat16")
    assert policy.autocast is torch.bfloat16
    sampler = tb.build_sampler()
    prompts, offset = tb.train_prompts(0, 1, 0)
    batch = tb.sample(sampler, policy, prompts, 3, torch.Generator().manual_seed(0), group_offset=offset)
    assert batch.traj.dtype == torch.float32 and torch.isfinite(batch.old_logp).all()
    gaps = [float((sampler.log_prob(policy, mb, s).logp - mb.old_logp[:, s]).abs().max())
            for mb in batch.split(1) for s in sampler.trainable_steps.tolist()]
    assert max(gaps) < 5e-2, max(gaps)  # measured on CPU: 0 (its bf16 kernels are batch-invariant; GPUs' are not)
    mb = batch.index([0, 1])
    x, t = mb.traj[:, 1], sampler.timesteps[1].expand(2)
    with torch.no_grad():
        mixed = policy(x, t, mb.model_cond)
        policy.autocast = None
        full = policy(x, t, mb.model_cond)
    assert mixed.dtype == full.dtype == torch.float32
    assert 0 < float((mixed - full).abs().max()) < 0.1  # the network really ran in bf16


def test_a_flux_lora_policy_trains_in_process_with_only_its_adapters_synced(pipelines, tmp_path):
    """FLUX (packed latents, distilled guidance, the dynamically shifted flow grid) through the same learner:
    two steps of the product loop in one process (the local runtime); each sync is the adapters; the recompute
    of the rollout's log-probs agrees."""
    from tests.helpers import train_local

    result, rows = train_local(None, tmp_path / "run", t2i_overrides(
        pipelines["flux"], "flux", "run.steps=2", "learner.micro_batch_size=6", "objective.train_min_std=0.0",
        "testbed.guidance_scale=3.5"))
    tb, policy = t2i_policy(pipelines, "flux")
    adapters = policy.trainable_state_dict()
    assert result.steps_done == 2 and len(rows) == 2
    assert all(r["sync/bytes"] == sum(v.numel() * v.element_size() for v in adapters.values()) for r in rows)
    assert max(r["policy/rollout_logp_absdiff_max"] for r in rows) < 1e-4
    # what each update does to the adapters: the next test (the exact policy gradient of the first step)


def test_a_flux_lora_learner_step_follows_the_exact_policy_gradient(pipelines):
    """On-policy (rho = 1, inside the clip range) the first optimiser step of GRPO has the gradient
    -(1/n_terms) sum_i A_i sum_t grad log pi(x_{t-1}|x_t) over every trained (sample, step) term, A_i the
    group-normalised reward (population std). The learner (LoRA adapters on FLUX, its micro-batching and per-step
    back-propagation) hands its optimiser exactly that gradient: computed here in one graph on a copy of the policy,
    with the advantages written out from the rewards."""
    import copy

    from steadyrl.services.runtime.builders import build_learner
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env

    extra = ("testbed.guidance_scale=3.5", "objective.train_min_std=0.0", "objective.timestep_fraction=1.0",
             "learner.inner_epochs=1", "learner.micro_batch_size=6", "learner.grad_clip=1e9")
    cfg = t2i_config(pipelines["flux"], "flux", *extra)
    tb, policy = t2i_policy(pipelines, "flux", *extra)
    sampler = tb.build_sampler()
    prompts, offset = tb.train_prompts(0, 1, 0)
    batch = tb.sample(sampler, policy, prompts, 3, torch.Generator().manual_seed(0), group_offset=offset)
    assert len(batch) == 6 and len(batch.group.unique()) == 2  # 2 prompts x 3 samples
    rewards = torch.tensor([1.0, 0.0, -2.0, 0.5, 3.0, 0.5])
    batch = batch.replace(rewards=rewards[:, None], reward_names=["r"], reward_key="r")

    adv = torch.zeros(len(batch))
    for g in batch.group.unique().tolist():
        idx = (batch.group == g).nonzero().flatten()
        r = rewards[idx].double().numpy()
        adv[idx] = torch.tensor((r - r.mean()) / (r.std() + cfg.objective.eps_std), dtype=torch.float32)
    steps = sampler.train_steps(0.0).tolist()
    reference = copy.deepcopy(policy).train()
    params = [p for p in reference.parameters() if p.requires_grad]
    logp = torch.stack([sampler.log_prob(reference, batch, t).logp for t in steps], 1)  # [B, T]
    loss = -(adv[:, None] * logp).sum() / (len(batch) * len(steps))
    want = torch.autograd.grad(loss, params)

    set_rank_env(free_port())
    learner = build_learner(cfg, copy.deepcopy(policy).train(), tb.build_sampler())
    seen: list[list[torch.Tensor]] = []
    learner.engine.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.detach().clone() for g in opt.param_groups for p in g["params"]]))
    m = learner.update(batch)
    assert m["policy/optimizer_steps"] == 1 and len(seen) == 1
    got = seen[0]
    assert [g.shape for g in got] == [w.shape for w in want]
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0  # LoRA starts at B = 0: A's gradient is exactly 0, B's is not
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)
    assert learner._pre_clip_norm == pytest.approx(float(torch.cat([w.flatten() for w in want]).norm()), rel=1e-4)
