"""Flow-GRPO-Fast fidelity (flow_grpo, zhtmike/flow_grpo@9745241): the random SDE window's start has flow_grpo's
support (`random.randint(lo, hi - size)` over `sde_window_range = (0, num_steps // 2)`), and the CPS step
(`sde_step_with_logprob`'s `sde_type == "cps"` branch) is theirs: mean, std and their constant-free log-prob, the
same in the rollout and in the learner's recompute. References below are transcribed from their lines."""
from __future__ import annotations

import math
import random

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from pydantic import ValidationError

from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig, SDEWindowConfig
from steadyrl.rollout.flow_sde import FlowSDESampler, cps_logp, cps_step
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.sampler import gaussian_logp
from steadyrl.rollout.sde_window import window_seed, window_start
from tests.helpers import TINY_UNET

F64 = torch.float64
COND = torch.tensor([1, 4, 8])


def flow_grpo_sigmas(num_steps: int, shift: float) -> list[float]:
    """The grid their pipeline steps on: the scheduler's sigmas after set_timesteps (retrieve_timesteps)."""
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(num_steps)
    return [float(s) for s in sched.sigmas]


def flow_grpo_cps_step(sigmas: list[float], step_index: list[int], model_output: torch.Tensor,
                       sample: torch.Tensor, noise_level: float, prev_sample: torch.Tensor):
    """flow_grpo's `sde_step_with_logprob`, sde_type == "cps" (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py),
    line for line in float64: returns (log_prob [B], prev_sample_mean, std_dev_t [B,1,1,1])."""
    shape = (-1, *([1] * (len(sample.shape) - 1)))
    sigma = torch.tensor([sigmas[i] for i in step_index], dtype=F64).view(shape)
    sigma_prev = torch.tensor([sigmas[i + 1] for i in step_index], dtype=F64).view(shape)
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)  # sigma_t in paper
    pred_original_sample = sample - sigma * model_output  # predicted x_0 in paper
    noise_estimate = sample + model_output * (1 - sigma)  # predicted x_1 in paper
    prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(
        sigma_prev**2 - std_dev_t**2)
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2)  # remove all constants
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # mean along all but batch dimension
    return log_prob, prev_sample_mean, std_dev_t


class FixedVelocity(torch.nn.Module):
    """A policy whose output is a given tensor (the reference then sees exactly the model output the sampler saw)."""

    def __init__(self, v: torch.Tensor):
        super().__init__()
        self.v = v

    def forward(self, x, t, cond=None):
        return self.v


def cps_sampler(num_steps: int = 10, shift: float = 1.0, noise_level: float = 0.8, **window) -> FlowSDESampler:
    cfg = FlowSDESamplerConfig(num_steps=num_steps, shift=shift, noise_level=noise_level, sde_type="cps",
                               sde_window=SDEWindowConfig(**window) if window else None)
    return FlowSDESampler(cfg, SchedulerConfig())


def tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_class_policy(TINY_UNET).to(F64).eval()


# ------------------------------------------------------------------------------------------- the window's start
def flow_grpo_fast_starts(num_steps: int, size: int, draws: int = 3000) -> set[int]:
    """Their draw (sd3_pipeline_with_logprob_fast.py): random.randint(range[0], range[1] - size), the range being
    their Fast presets' sde_window_range = (0, num_steps // 2); randint includes both ends."""
    lo, hi = 0, num_steps // 2
    rng = random.Random(0)
    return {rng.randint(lo, hi - size) for _ in range(draws)}


@pytest.mark.parametrize("num_steps, size", [(10, 3), (10, 2), (12, 3)])
def test_random_window_starts_have_flow_grpo_fasts_support_and_uniform_law(num_steps, size):
    theirs = flow_grpo_fast_starts(num_steps, size)
    cfg = SDEWindowConfig(size=size, start=0, start_max=num_steps // 2 - size, random=True)
    sampler = cps_sampler(num_steps=num_steps, **cfg.model_dump(exclude_unset=True))
    n_stochastic = len(sampler.trainable_steps)
    starts = [window_start(cfg, n_stochastic, k, seed=3) for k in range(1500)]
    assert set(starts) == theirs
    for s in theirs:  # uniform on the support: each start's share within 0.05 of 1 / |support|
        assert abs(starts.count(s) / len(starts) - 1 / len(theirs)) < 0.05, (s, starts.count(s))
    # on the sampler: every training step's trained steps are flow_grpo's window (start, start + size) inside the
    # range (0, num_steps // 2)
    for k in range(40):
        steps = torch.nonzero(sampler.sde_steps(k, window_seed=3)).flatten().tolist()
        assert steps == list(range(steps[0], steps[0] + size)) and steps[0] in theirs and steps[-1] < num_steps // 2


def test_a_random_window_without_start_max_draws_what_it_drew_before():
    """start_max unset keeps the draw U{start, ..., last} from the (seed, step) generator, bit for bit."""
    cfg = SDEWindowConfig(size=2, start=1, random=True)
    n_stochastic, seed = 9, 7
    last = n_stochastic - cfg.size
    before = [int(torch.randint(1, last + 1, (1,), generator=torch.Generator().manual_seed(window_seed(seed, k))))
              for k in range(200)]
    assert [window_start(cfg, n_stochastic, k, seed) for k in range(200)] == before
    assert set(before) == set(range(1, last + 1))
    explicit = SDEWindowConfig(size=2, start=1, start_max=last, random=True)
    assert [window_start(explicit, n_stochastic, k, seed) for k in range(200)] == before


@pytest.mark.parametrize("window, num_steps, message", [
    ({"size": 3, "start_max": 8, "random": True}, 10, "start_max=8 \\+ size=3 runs past the grid"),
    ({"size": 2, "start": 3, "start_max": 2, "random": True}, 10, "start_max=2 is below start=3"),
    ({"size": 2, "start_max": 2}, 10, "start_max bounds a random window"),
    ({"size": 2, "start_max": -1, "random": True}, 10, "sde_window.start_max"),
])
def test_bad_start_max_is_rejected_naming_the_field(window, num_steps, message):
    with pytest.raises(ValidationError, match=message):
        FlowSDESamplerConfig(num_steps=num_steps, sde_window=window)


def test_a_start_max_past_the_stochastic_steps_is_rejected_when_the_sampler_is_built():
    # CPS on the 10-step digits grid: the last two steps have std < min_std (s_next = 0.001, 0), 8 stochastic steps
    with pytest.raises(ValueError, match="start_max=6 \\+ size=3 runs past the sampler's 8 stochastic"):
        cps_sampler(size=3, start_max=6, random=True)  # fits the 10-step grid, not its 8 stochastic steps


# ----------------------------------------------------------------------------------------------------- CPS step
@pytest.mark.parametrize("shift, noise_level", [(1.0, 0.8), (3.0, 0.8), (3.0, 0.5), (1.0, 1.0)])
def test_cps_step_mean_std_and_logp_equal_flow_grpos_cps_branch(shift, noise_level):
    sampler = cps_sampler(num_steps=10, shift=shift, noise_level=noise_level)
    sigmas = flow_grpo_sigmas(10, shift)
    g = torch.Generator().manual_seed(11)
    B = 6
    x = torch.randn(B, 2, 5, 5, generator=g, dtype=F64)
    v = torch.randn(B, 2, 5, 5, generator=g, dtype=F64)
    x_next = torch.randn(B, 2, 5, 5, generator=g, dtype=F64)
    steps = sampler.trainable_steps[torch.randint(len(sampler.trainable_steps), (B,), generator=g)]
    dist = sampler.step_distribution(FixedVelocity(v), x, steps, COND.repeat(2))
    ref_logp, ref_mean, ref_std = flow_grpo_cps_step(sigmas, steps.tolist(), v, x, noise_level, x_next)
    assert torch.allclose(dist.mean, ref_mean, rtol=0, atol=1e-12)
    assert torch.allclose(dist.std, ref_std.flatten(), rtol=0, atol=1e-12)
    assert torch.allclose(dist.log_prob(x_next, "mean"), ref_logp, rtol=0, atol=1e-12)
    assert torch.allclose(dist.log_prob(x_next, "sum"), ref_logp * x[0].numel(), rtol=0, atol=1e-10)
    # it is not the Gaussian log-density (their constants and 1 / (2 std^2) are dropped)
    assert not torch.allclose(dist.log_prob(x_next, "mean"), gaussian_logp(x_next, dist.mean, dist.std, "mean"))


@torch.no_grad()
def test_cps_rollout_logp_is_flow_grpos_and_the_learners_recompute_equals_it():
    """A windowed CPS rollout (Flow-GRPO-Fast's shape): each window step's stored log-prob is flow_grpo's for the
    stored transition and the model's output, the recompute returns it for any micro-batch split and per-sample
    steps, the stored x_next is mean + std z with z ~ N(0, I), and steps outside the window are Euler steps."""
    model, sampler = tiny_policy(), cps_sampler(size=3, start=0, start_max=2, random=True)
    sigmas = flow_grpo_sigmas(10, 1.0)
    batch = sampler.sample(model, COND, 4, torch.Generator().manual_seed(2), dtype=F64, train_step=5, window_seed=1)
    window = torch.nonzero(batch.trainable).flatten().tolist()
    assert len(window) == 3 and window[0] in {0, 1, 2}
    zs = []
    for k in range(10):
        x, x_next = batch.traj[:, k], batch.traj[:, k + 1]
        v = model(x, sampler.timesteps[k].repeat(len(batch)), batch.cond)
        if k in window:
            ref_logp, ref_mean, ref_std = flow_grpo_cps_step(sigmas, [k] * len(batch), v, x, 0.8, x_next)
            assert torch.allclose(batch.old_logp[:, k], ref_logp, rtol=0, atol=1e-12), k
            for micro in (1, 5, len(batch)):
                for mb in batch.split(micro):
                    assert torch.allclose(sampler.log_prob(model, mb, k).logp, mb.old_logp[:, k], rtol=0,
                                          atol=1e-12), (k, micro)
            zs.append((x_next - ref_mean) / ref_std)
        elif bool(sampler.trainable[k]):  # outside the window: the Euler step x + v (s_next - s), no log-prob
            assert torch.allclose(x_next, x + v * (sigmas[k + 1] - sigmas[k]), rtol=0, atol=1e-12), k
            assert bool((batch.old_logp[:, k] == 0).all())
        else:  # std < min_std (k = 8: s_next = 0.001; k = 9: s_next = 0): the CPS mean, no noise, no log-prob
            _, ref_mean, _ = flow_grpo_cps_step(sigmas, [k] * len(batch), v, x, 0.8, x_next)
            assert torch.allclose(x_next, ref_mean, rtol=0, atol=1e-12) and bool((batch.old_logp[:, k] == 0).all())
    steps = torch.tensor(window)[torch.arange(len(batch)) % 3]
    assert torch.allclose(sampler.log_prob(model, batch, steps).logp, batch.old_logp[torch.arange(len(batch)), steps],
                          rtol=0, atol=1e-12)
    z = torch.stack(zs)  # 3 steps x 12 samples x 64 pixels of recorded noise
    assert abs(float(z.mean())) < 0.1 and abs(float(z.var()) - 1) < 0.15


def test_cps_noise_keeps_the_flows_coefficients():
    """With the exact velocity at x = (1 - s) x0 + s eps, x_next = (1 - s_next) x0 + s_next (cos(a pi/2) eps +
    sin(a pi/2) z): the coefficients of x0 and of unit noise are the flow's at s_next (the CPS property)."""
    a, k = 0.8, 2
    sampler = cps_sampler(noise_level=a)
    g = torch.Generator().manual_seed(4)
    x0, eps = torch.randn(3, 1, 4, 4, generator=g, dtype=F64), torch.randn(3, 1, 4, 4, generator=g, dtype=F64)
    s, s_next = float(sampler.sigmas[k]), float(sampler.sigmas[k + 1])
    dist = sampler.step_distribution(FixedVelocity(eps - x0), (1 - s) * x0 + s * eps, torch.full((3,), k), COND)
    c, sn = math.cos(a * math.pi / 2), math.sin(a * math.pi / 2)
    assert torch.allclose(dist.mean, (1 - s_next) * x0 + s_next * c * eps, rtol=0, atol=1e-12)
    assert torch.allclose(dist.std, torch.full((3,), s_next * sn, dtype=F64), rtol=0, atol=1e-15)
    assert c**2 + sn**2 == pytest.approx(1.0)  # the noise coefficient s_next (cos eps + sin z) has unit variance


def test_cps_without_noise_is_the_euler_ode_step_and_its_last_step_is_deterministic():
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(2, 1, 4, 4, generator=g, dtype=F64), torch.randn(2, 1, 4, 4, generator=g, dtype=F64)
    s, s_next = torch.tensor(0.7, dtype=F64), torch.tensor(0.55, dtype=F64)
    assert torch.allclose(cps_step(x, v, s, s_next, torch.zeros((), dtype=F64)), x + v * (s_next - s), rtol=0,
                          atol=1e-14)
    sampler = cps_sampler()
    assert float(sampler.std[-1]) == 0.0 and not bool(sampler.trainable[-1])


def test_cps_log_ratio_is_two_std_squared_times_the_gaussian_log_ratio():
    """What dropping the constants and 1/(2 std^2) does to a PPO ratio: log pi_new - log pi_old scales by 2 std^2."""
    g = torch.Generator().manual_seed(6)
    x_next, m_old, m_new = (torch.randn(4, 1, 4, 4, generator=g, dtype=F64) for _ in range(3))
    std = torch.tensor([0.3, 0.5, 0.8, 1.1], dtype=F64)
    cps = cps_logp(x_next, m_new, "mean") - cps_logp(x_next, m_old, "mean")
    gauss = gaussian_logp(x_next, m_new, std, "mean") - gaussian_logp(x_next, m_old, std, "mean")
    assert torch.allclose(cps, 2 * std**2 * gauss, rtol=1e-12, atol=0)


def test_cps_noise_level_above_one_is_rejected():
    with pytest.raises(ValidationError, match="noise_level=1.2 with sde_type=cps"):
        FlowSDESamplerConfig(sde_type="cps", noise_level=1.2)
    FlowSDESamplerConfig(sde_type="sde", noise_level=1.2)  # the SDE's a may exceed 1 (Qwen-Image presets: 1.2)


# ------------------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("preset", ["digits-flow-grpo-fast", "sd35-grpo-fast"])
def test_flow_grpo_fast_presets_sample_with_their_cps_step_and_window_range(preset):
    from steadyrl.services.config import CONFIG_DIR, load_config

    cfg = load_config(CONFIG_DIR / f"{preset}.yaml", [])
    s = cfg.sampler
    assert (s.sde_type, s.noise_level, s.num_steps) == ("cps", 0.8, 10)  # their *_fast_nocfg presets
    w = s.sde_window
    assert (w.size, w.start, w.start_max, w.random, w.shift_every) == (3, 0, 2, True, None)
    sampler = FlowSDESampler(s, SchedulerConfig(num_train_timesteps=1000))
    theirs = flow_grpo_fast_starts(s.num_steps, w.size)
    firsts = {int(torch.nonzero(sampler.sde_steps(k, window_seed=0)).flatten()[0]) for k in range(60)}
    assert firsts == theirs
