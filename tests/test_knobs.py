"""Schedules and knobs (issue 20, "Training health" item 4): the entropy bonus of language models, the linear-schedule
seam (BGPO's module-scaling strength, GRPO-Guard's clip range and thresholds) and GRPO-Guard's seed-form monitoring
interval and per-block (down/mid/up) spectral guard. Each checked against an independent re-computation."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.models import build_class_policy
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.balanced_gradient import BalancedGradientConfig, scale_module_gradients
from steadyrl.trainer.linear_schedule import LinearSchedule, linear_value
from steadyrl.trainer.objectives import TermInputs, UpdateSchedule, build_objective
from steadyrl.trainer.objectives.grpo import GRPOSettings
from steadyrl.trainer.objectives.grpo_guard import GRPOGuardPaperSettings
from steadyrl.trainer.objectives.reward_backprop import GRPOGuardSeedSettings
from tests.helpers import TINY_UNET, arith_prompts, masked_sampler, tiny_lm

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


# ---------------------------------------------------------------------------------------------- entropy bonus
def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H per position by torch.distributions (not the project's entropy_of)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def independent_masked_entropy(model, batch, j: int, estimator: str) -> torch.Tensor:
    """Each row's mean entropy over the positions MC sample j scores, one unbatched forward per masked input:
    elbo scores M & V; coupled scores V, each position in the pass (M or its complement) where it was masked."""
    eos, mask_id = TOKENIZER.eos_id, TOKENIZER.mask_token_id
    out = []
    for i in range(len(batch)):
        prompt, y = batch.cond[i], batch.samples[i]
        L = len(y)
        ends = (y == eos).nonzero()
        lv = int(ends[0]) + 1 if len(ends) else L  # positions up to and including the first EOS
        valid = torch.arange(L) < lv
        m = batch.extras["mc_masks"][i, j] & valid
        passes = [m]
        if estimator == "coupled":
            passes.append(m if bool((m == valid).all()) else ~m & valid)
        total, count = 0.0, 0
        for mask in passes:
            x = torch.cat([prompt, y.masked_fill(mask | ~valid, mask_id)])
            h = categorical_entropy(model(x[None]).logits[0, len(prompt):].double())
            total, count = total + h[mask].sum(), count + int(mask.sum())
        out.append(total / max(count, 1))
    return torch.stack(out)


@pytest.mark.parametrize("estimator", ["elbo", "coupled"])
def test_masked_diffusion_entropy_is_the_mean_token_entropy_of_the_scored_positions_in_value_and_gradient(estimator):
    model = tiny_lm()
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4, estimator=estimator)
    batch = s.sample(model, arith_prompts(3), 2, torch.Generator().manual_seed(0))
    for j in range(2):
        got = s.log_prob(model, batch, j, entropy=True)
        assert s.log_prob(model, batch, j).entropy is None  # not asked: not computed
        want = independent_masked_entropy(model, batch, j, estimator)
        assert torch.allclose(got.entropy, want, rtol=1e-10, atol=1e-12)
        assert float(want.detach().min()) > 0
        g_got, g_want = param_grad(got.entropy.sum(), model), param_grad(want.sum(), model)
        assert float(g_want.abs().max()) > 0
        assert torch.allclose(g_got, g_want, rtol=1e-8, atol=1e-12)


def param_grad(value: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """d value / d parameters, flat (zeros for parameters it does not use)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])


def test_autoregressive_entropy_is_the_mean_entropy_of_the_tempered_distribution_up_to_the_eos():
    from steadyrl.rollout.autoregressive import AutoregressiveSampler
    from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm
    from steadyrl.rollout.config import AutoregressiveSamplerConfig

    eos, pad, T = TOKENIZER.eos_id, TOKENIZER.pad_id, 0.7
    torch.manual_seed(0)
    model = build_causal_lm(CausalLMConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                           max_positions=32), len(TOKENIZER), pad, eos).double().eval()
    s = AutoregressiveSampler(AutoregressiveSamplerConfig(gen_length=6, temperature=T), eos, pad)
    batch = s.sample(model, arith_prompts(3), 2, torch.Generator().manual_seed(0))
    got = s.log_prob(model, batch, 0, entropy=True).entropy.detach()
    for i in range(len(batch)):
        y = batch.samples[i]
        ends = (y == eos).nonzero()
        lv = int(ends[0]) + 1 if len(ends) else len(y)
        x = torch.cat([batch.cond[i], y[:lv]])
        logits = model(x[None]).logits[0, len(batch.cond[i]) - 1:-1]  # the distribution of each completion token
        want = categorical_entropy(logits.double() / T).mean()
        assert float(got[i]) == pytest.approx(float(want.detach()), rel=1e-9)


def test_block_diffusion_entropy_is_the_mean_entropy_over_the_masked_positions_of_each_block():
    from steadyrl.rollout.block_diffusion import BlockDiffusionSampler
    from steadyrl.rollout.block_diffusion_lm import (IMAGE_TOKENS, BlockDiffusionLMConfig, block_logits,
                                                     build_block_diffusion_lm)
    from steadyrl.rollout.config import BlockDiffusionSamplerConfig

    eos, pad = TOKENIZER.eos_id, TOKENIZER.pad_id
    torch.manual_seed(0)
    cfg = BlockDiffusionLMConfig(hidden_size=32, num_layers=2, num_heads=2, head_dim=16, intermediate_size=64,
                                 max_positions=32)
    model = build_block_diffusion_lm(cfg, len(TOKENIZER), pad, eos, 2).double().eval()
    s = BlockDiffusionSampler(BlockDiffusionSamplerConfig(gen_length=4, canvas_length=2, mc_samples=2, num_steps=3,
                                                          self_conditioning=False),
                              len(TOKENIZER) + IMAGE_TOKENS, eos, pad)
    batch = s.sample(model, arith_prompts(3), 2, torch.Generator().manual_seed(1))
    got = s.log_prob(model, batch, 1, entropy=True).entropy.detach()
    assert float(got.max()) > 0
    for i in range(len(batch)):
        prompt, y = batch.cond[i], batch.samples[i]
        m, noise = batch.extras["mc_masks"][i, 1], batch.extras["mc_noise"][i, 1]
        ends = (y == eos).nonzero()
        valid = torch.arange(4) < (int(ends[0]) + 1 if len(ends) else 4)
        hs = []
        for start in (0, 2):  # each block scored against the clean prefix, its masked positions noised
            canvas = torch.where(m[start:start + 2] | ~valid[start:start + 2], noise[start:start + 2],
                                 y[start:start + 2])
            prefix = torch.cat([prompt, y[:start]])
            logits = block_logits(model, prefix[None], None, canvas[None])[0]  # the model call, as the sampler's
            h = categorical_entropy(logits.double())
            hs += [h[k] for k in range(2) if bool(m[start + k] & valid[start + k])]
        want = torch.stack(hs).mean() if hs else torch.zeros((), dtype=F64)
        assert float(got[i]) == pytest.approx(float(want), rel=1e-6)


def accumulate_only(learner) -> None:
    """Make the learner's `_backward` accumulate gradients and never step (to read a step's gradient)."""
    def backward(loss, last):
        learner.engine.set_gradient_accumulation_boundary(False)
        learner.engine.backward(loss, scale_wrt_gas=False)
    learner._backward = backward


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in model.parameters()])


@pytest.mark.parametrize("objective", ["grpo", "bgpo.paper"])
def test_the_learners_entropy_bonus_adds_minus_coef_times_the_gradient_of_the_mean_entropy(objective):
    """Both language-model update paths (grpo: two-pass sequence pieces; bgpo.paper: per-MC-sample terms): the
    optimisation step's gradient with entropy_coef c minus the one without is -c grad mean_{i,j} H_ij over every
    sequence i and MC sample j, and `policy/entropy` is that mean."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.config import LearnerConfig
    from steadyrl.trainer.learner import MetricSums
    from steadyrl.trainer.objectives.bgpo import BGPOPaperSettings

    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    batch = s.sample(tiny_lm(dtype=torch.float32), arith_prompts(3), 4, torch.Generator().manual_seed(0))
    r = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1))
    batch = batch.replace(old_logp=batch.old_logp.float(), rewards=r, reward_names=["r"], reward_key="r")
    settings = GRPOSettings(eps_clip=0.5) if objective == "grpo" else BGPOPaperSettings()
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, settings,
                                      LearnerConfig(micro_batch_size=4, optim_batch_size=12, inner_epochs=1))
    accumulate_only(learner)
    prepared, _ = learner.objective.prepare_batch(batch)
    micro = prepared.split(4)
    olds, _ = learner._recompute_old(micro)

    def step(coef: float) -> tuple[torch.Tensor, dict[str, float]]:
        learner.objective.cfg.entropy_coef = coef
        learner.policy.zero_grad(set_to_none=True)
        sums = MetricSums()
        learner._optimisation_step(micro, olds, sums)
        return flat_grads(learner.policy), sums.result()

    g0, m0 = step(0.0)
    g1, m1 = step(0.03)
    plain = tiny_lm(dtype=torch.float32)  # the learner's initial weights, outside the engine
    assert all(torch.equal(a, b.cpu()) for a, b in zip(plain.parameters(), learner.policy.parameters()))
    H = torch.cat([s.log_prob(plain, mb.to(device="cpu"), j, entropy=True).entropy for mb in micro for j in range(2)])
    (-0.03 * H.mean()).backward()
    want = flat_grads(plain)
    assert "policy/entropy" not in m0 and m1["policy/entropy"] == pytest.approx(float(H.mean()), rel=1e-5)
    assert float(want.abs().max()) > 0
    assert torch.allclose(g1 - g0, want, rtol=1e-3, atol=1e-7)


def test_the_entropy_bonus_is_refused_by_name_for_image_objectives_and_image_samplers():
    from pydantic import ValidationError

    from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_scheduler
    from steadyrl.services.config import ConfigError, load_config
    from steadyrl.trainer.terms import term_producer

    for settings in (GRPOGuardSeedSettings, GRPOGuardPaperSettings):
        with pytest.raises(ValidationError, match=r"objective\.entropy_coef=0\.02: objective 'grpo_guard\.\w+' "
                                                  r"trains image models only"):
            settings(entropy_coef=0.02)
    with pytest.raises(ConfigError, match=r"objective\.entropy_coef"):
        load_config(None, ["objective.name=draft", "objective.entropy_coef=0.02"])
    with pytest.raises(ValidationError, match="entropy_coef"):
        GRPOSettings(entropy_coef=-0.01)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    with pytest.raises(ValueError, match=r"objective\.entropy_coef=0\.02: .* sampler\.kind='ddim' samples images"):
        term_producer(build_objective(GRPOSettings(entropy_coef=0.02)), sampler, None)


# ---------------------------------------------------------------------------------------------- linear schedules
def test_a_linear_schedule_takes_exact_values_at_chosen_updates_and_the_run_config_fills_its_span():
    from steadyrl.services.config import ConfigError, load_config

    sched = LinearSchedule(start=1.0, end=0.2, total_updates=8)
    assert [linear_value(sched, u) for u in (0, 2, 4, 8, 30)] == [1.0, 1.0 - 0.8 * 0.25, 1.0 - 0.8 * 0.5, 0.2, 0.2]
    assert linear_value(LinearSchedule(start=0.5, end=0.5), 99) == 0.5  # constant: no span needed
    with pytest.raises(ValueError, match=r"learner\.balanced\.scaling_strength\.total_updates is unset"):
        linear_value(LinearSchedule(start=1.0, end=0.0), 3, "learner.balanced.scaling_strength")
    cfg = load_config(None, ["run.steps=7", "learner.balanced.module_grad_scaling=true",
                             "learner.balanced.scaling_strength.end=0", "objective.name=grpo_guard.paper",
                             "objective.eps_clip_scale.end=0.5"])
    assert cfg.learner.balanced.scaling_strength.total_updates == 7
    assert cfg.objective.eps_clip_scale.total_updates == 7
    assert cfg.learner.kl_schedule.total_updates is None  # untouched: constant
    for override, field in [("learner.balanced.scaling_strength.end=1.5", r"scaling_strength\.end=1\.5 must be in"),
                            ("objective.eps_clip_scale.start=0", r"objective\.eps_clip_scale\.start=0\.0 must be in"),
                            ("objective.threshold_scale.end=0", r"objective\.threshold_scale\.end=0\.0 must be in"),
                            ("objective.block_thresholds.mid=-1", r"objective\.block_thresholds\.mid=-1\.0")]:
        name = "grpo_guard.paper" if "eps_clip" in override else "grpo_guard.seed"
        extra = ["learner.balanced.module_grad_scaling=true"] if "balanced" in override else []
        with pytest.raises(ConfigError, match=field):
            load_config(None, [f"objective.name={name}", override, *extra])
    with pytest.raises(ConfigError, match=r"scaling_strength is set but learner\.balanced\.module_grad_scaling is"):
        load_config(None, ["learner.balanced.scaling_strength.start=0.5", "learner.balanced.scaling_strength.end=0.5"])
    with pytest.raises(ConfigError, match=r"objective\.block_thresholds needs learner\.zero_stage=0"):
        load_config(None, ["objective.name=grpo_guard.seed", "objective.block_thresholds.up=1", "learner.zero_stage=1"])


@pytest.mark.parametrize("alpha", [0.0, 0.35, 1.0])
def test_module_gradient_scaling_with_strength_alpha_is_g_times_s_to_the_alpha(alpha):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 2)))
    for i, p in enumerate(net.parameters()):
        p.grad = (i + 1) * torch.randn_like(p, dtype=torch.float32)
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    factors = scale_module_gradients(net, depth=1, eps=1e-8, strength=alpha)
    for group in ("0", "1"):
        grads = [g for n, g in before.items() if n.split(".")[0] == group]
        flat = torch.cat([g.double().flatten() for g in grads])
        want = (flat.numel() ** 0.5 / (float(flat.norm()) + 1e-8)) ** alpha
        assert factors[group] == pytest.approx(want, rel=1e-6)  # per-tensor norms in float32
        for n, p in net.named_parameters():
            if n.split(".")[0] == group:
                assert torch.allclose(p.grad, before[n] * want, rtol=1e-6)


def test_the_learner_scales_module_gradients_with_the_strength_of_the_current_update():
    """strength 1 -> 0 over 2 updates: update 0 balances fully, update 1 with alpha = 1/2 (factor s_i**0.5, s_i from
    the step's norms the health panel recorded before scaling), update 2 on alpha = 0 (every factor 1)."""
    from tests.helpers import IMAGE_FAMILIES, brightness_batch, make_image_learner

    cfg = BalancedGradientConfig(module_grad_scaling=True, scaling_depth=1,
                                 scaling_strength=LinearSchedule(start=1.0, end=0.0, total_updates=2))
    learner = make_image_learner(IMAGE_FAMILIES["ddim"], GRPOSettings(eps_clip=0.2), balanced=cfg, micro_batch_size=12,
                                 optim_batch_size=12)
    sizes = {}
    for name, p in learner.network.named_parameters():
        sizes[name.split(".")[0]] = sizes.get(name.split(".")[0], 0) + p.numel()
    for u, alpha in enumerate([1.0, 0.5, 0.0]):
        learner.update(brightness_batch(learner, u, n_per_class=3))  # 12 samples: one optimisation step
        norms = learner._group_norms[-1]
        assert norms.keys() == learner._module_scales.keys()
        for group, norm in norms.items():
            want = (sizes[group] ** 0.5 / (norm + 1e-8)) ** alpha
            assert learner._module_scales[group] == pytest.approx(want, rel=1e-9), (u, group)


def test_grpo_guard_paper_clips_at_eps_clip_times_the_schedule_of_the_update():
    """The scheduled objective at update u gives exactly the loss of the constant one with eps_clip x f(u)."""
    from tests.test_grpo_guard import gaussian_steps, independent_logp

    mu_old, mu_new, s, z, x_next = gaussian_steps(b=6)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5], dtype=F64)
    step = torch.tensor([0, 0, 1, 1, 2, 2])

    def loss_of(obj):
        with torch.no_grad():
            mu = mu_old + 40 * (mu_new - mu_old)  # ratios far enough from 1 that the clip bites
        inputs = TermInputs(n_terms=6, new_logp=independent_logp(x_next, mu, s, "mean"),
                            old_logp=independent_logp(x_next, mu_old, s, "mean"), advantages=adv, step=step,
                            std=s, dt=torch.full((6,), 0.1, dtype=F64), new_mean=mu, old_mean=mu_old, reduce="mean")
        return obj.loss(inputs, {})

    sched = build_objective(GRPOGuardPaperSettings(eps_clip=1e-3, eps_clip_scale=LinearSchedule(
        start=1.0, end=0.1, total_updates=10)))
    losses = set()
    for u, f in [(0, 1.0), (5, 0.55), (10, 0.1), (15, 0.1)]:
        sched.begin_update(UpdateSchedule(index=u))
        assert sched.eps_clip == 1e-3 * (1.0 + (0.1 - 1.0) * u / 10 if u < 10 else 0.1)
        assert sched.eps_clip == pytest.approx(1e-3 * f, rel=1e-12)
        got, m = loss_of(sched)
        want, _ = loss_of(build_objective(GRPOGuardPaperSettings(eps_clip=sched.eps_clip)))
        assert float(got) == float(want) and m["guard/eps_clip"] == sched.eps_clip
        losses.add(float(got))
    assert len(losses) == 3  # the clip range moved the loss (u = 10 and 15 share the floor)


# ---------------------------------------------------------------------------------------------- GRPO-Guard seed form
def old_regulator(grads: list[torch.Tensor], decay: float = 0.9) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The regulator before the knobs (a copy of its code): (G', tau) per call."""
    tau, out = None, []
    for grad in grads:
        sigma1 = torch.linalg.matrix_norm(grad.detach().double(), ord=2)
        tau_prev = sigma1.clone() if tau is None else tau
        g = grad * (tau_prev / sigma1).to(grad.dtype) if bool(sigma1 > tau_prev) else grad
        tau = decay * tau_prev + (1 - decay) * sigma1
        out.append((g, tau))
    return out


SPIKES = [1.0, 1.0, 5.0, 0.2, 20.0, 1.0, 3.0, 0.5, 50.0, 1.0]


def spiky_grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(4, 32, generator=g) for scale in SPIKES]


def test_seed_regulator_with_every_step_monitored_is_the_old_regulator_bit_for_bit():
    obj = build_objective(GRPOGuardSeedSettings())
    net = nn.Linear(2, 2)  # no block guard: regulate_gradients only advances the step clock
    for grad, (want, tau) in zip(spiky_grads(), old_regulator(spiky_grads())):
        out, _ = obj.regulate(grad)
        obj.regulate_gradients(net)
        assert torch.equal(out, want) and torch.equal(obj.state["tau"], tau)


def test_seed_regulator_monitors_every_k_steps_and_reuses_the_last_scale_in_between():
    obj = build_objective(GRPOGuardSeedSettings(monitor_every=3, threshold_scale=LinearSchedule(start=0.8, end=0.8)))
    net = nn.Linear(2, 2)
    tau = scale = None
    for step, grad in enumerate(spiky_grads()):
        out, m = obj.regulate(grad)
        if step % 3 == 0:  # independent re-computation of a monitored call, threshold 0.8 tau_prev
            sigma = float(torch.linalg.svdvals(grad.double())[0])
            tau_prev = sigma if tau is None else tau
            scale = 0.8 * tau_prev / sigma if sigma > 0.8 * tau_prev else 1.0
            tau = 0.9 * tau_prev + 0.1 * sigma
            assert float(m["guard/monitored"]) == 1.0 and float(m["guard/sigma1"]) == pytest.approx(sigma, rel=1e-12)
        else:
            assert float(m["guard/monitored"]) == 0.0 and "guard/sigma1" not in m
        assert float(obj.state["tau"]) == pytest.approx(tau, rel=1e-12)  # moves only when monitored
        assert torch.allclose(out, grad * scale, rtol=1e-6)
        obj.regulate_gradients(net)
    assert int(obj.state["optim_steps"]) == 10


def unet_block_of(name: str) -> str | None:
    for block, module in (("down", "down_blocks"), ("mid", "mid_block"), ("up", "up_blocks")):
        if name.startswith(module + "."):
            return block
    return None


def test_the_block_guard_scales_each_unet_block_group_by_its_own_spectral_threshold():
    """On the digits UNet: sigma_b = max ||W||_2 (torch.linalg.matrix_norm, each >= 2-D gradient as [out, -1]) per
    block group; a group is scaled by c_b tau_b / sigma_b when sigma_b > c_b tau_b; other parameters untouched; with
    monitor_every 2 the odd steps reuse the last scale."""
    net = build_class_policy(TINY_UNET).net
    obj = build_objective(GRPOGuardSeedSettings(monitor_every=2, block_thresholds={"down": 1.0, "up": 0.5}))
    factors, taus, scales = {"down": 1.0, "up": 0.5}, {}, {}
    spikes = [{"down": 1.0, "up": 1.0}, {"down": 8.0, "up": 1.0}, {"down": 8.0, "up": 1.0}, {"down": 1.0, "up": 9.0},
              {"down": 1.0, "up": 9.0}, {"down": 0.5, "up": 0.5}]
    g = torch.Generator().manual_seed(0)
    scaled_any = {"down": False, "up": False}
    for step, spike in enumerate(spikes):
        for name, p in net.named_parameters():
            block = unet_block_of(name)
            p.grad = torch.randn(p.shape, generator=g) * (spike[block] if block in spike else 1.0)
        before = {n: p.grad.clone() for n, p in net.named_parameters()}
        obj.regulate_gradients(net)
        for block in ("down", "up"):
            if step % 2 == 0:
                sigma = max(float(torch.linalg.matrix_norm(g_.reshape(g_.shape[0], -1).double(), ord=2))
                            for n, g_ in before.items() if unet_block_of(n) == block and g_.dim() >= 2)
                tau_prev = taus.get(block, sigma)
                threshold = factors[block] * tau_prev
                scales[block] = threshold / sigma if sigma > threshold else 1.0
                taus[block] = 0.9 * tau_prev + 0.1 * sigma
            assert float(obj.state[f"tau_{block}"]) == pytest.approx(taus[block], rel=1e-9)
            scaled_any[block] |= scales[block] < 1
        for n, p in net.named_parameters():
            block = unet_block_of(n)
            want = before[n] * scales[block] if block in ("down", "up") else before[n]  # mid: not guarded
            assert torch.allclose(p.grad, want, rtol=1e-6, atol=0), (step, n)
    assert scaled_any == {"down": True, "up": True}


def test_the_block_guard_refuses_a_network_without_unet_blocks_by_name():
    obj = build_objective(GRPOGuardSeedSettings(block_thresholds={"mid": 1.0}))
    net = nn.Sequential(nn.Linear(3, 3))
    net(torch.ones(1, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"objective\.block_thresholds\.mid: .* no gradients under a module named "
                                         r"'mid_block'"):
        obj.regulate_gradients(net)


def test_the_block_guard_runs_in_the_learner_and_its_thresholds_survive_a_checkpoint(tmp_path):
    from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_scheduler
    from tests.test_grpo_guard import make_learner, scored, target_reward

    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    settings = GRPOGuardSeedSettings(backprop_steps=2, monitor_every=2,
                                     block_thresholds={"down": 1.0, "mid": 1.0, "up": 0.8})

    def batch(learner, seed):
        policy = copy.deepcopy(learner.policy).eval()
        return scored(sampler.sample(policy, torch.arange(2), 3, torch.Generator().manual_seed(seed)), target_reward)

    a = make_learner(sampler, settings, micro=3, reward_fn=target_reward)
    for i in range(3):
        m = a.update(batch(a, i))
    assert {f"guard/{b}_{k}" for b in ("down", "mid", "up") for k in ("sigma", "tau", "scale")} <= m.keys()
    assert int(a.objective.state["optim_steps"]) == 6  # 6 samples in micro-batches of 3, one per optimisation step
    a.save(tmp_path)
    b = make_learner(sampler, settings, micro=3, reward_fn=target_reward, seed=1)
    b.load(tmp_path)
    state = a.objective.state_dict()
    assert {"tau", "tau_down", "tau_mid", "tau_up", "scale_up", "optim_steps"} <= state.keys()
    assert all(torch.equal(b.objective.state[k], v) for k, v in state.items())
    nxt = batch(a, 10)
    ma, mb = a.update(nxt), b.update(nxt)
    for k in ("guard/up_tau", "guard/down_scale", "guard/tau"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-6), k
