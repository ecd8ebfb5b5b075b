"""MixGRPO's grid, model timesteps and MixGRPO-Flash's DPM-Solver++ tail, checked against an independent
transcription of their sampling loop (tests/mixgrpo_reference.py) in float64 and against the closed-form
probability-flow ODE of Gaussian data."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig, SDEWindowConfig
from steadyrl.rollout.dpm_solver import dpm_solver_pp_tail
from steadyrl.rollout.flow_grid import post_window_points, post_window_sigmas, time_shift_sigmas
from steadyrl.rollout.flow_sde import FlowSDESampler
from steadyrl.rollout.sampler import GaussianStepSampler
from steadyrl.rollout.text_to_image import TextToImagePolicy
from steadyrl.services.config import CONFIG_DIR, load_config
from tests import mixgrpo_reference as ref
from tests.tiny_models import TINY_FLUX_SCHEDULER

F64 = torch.float64
COND = torch.tensor([0, 1])
SHAPE = (1, 4, 4)
TAU = 0.5
MU = torch.linspace(-1.0, 1.0, 16, dtype=F64).view(SHAPE)


def flux_net(x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """A "FLUX transformer" given the timestep argument in [0, 1]: the exact velocity of data N(MU, TAU^2 I) there."""
    return ref.gaussian_velocity(x, timestep.double(), MU, TAU)


class GaussianFlowModel(nn.Module):
    """`flux_net` behind a policy called at model timesteps t, as TextToImagePolicy's flux branch calls a float32
    network: timestep = t / 1000 in float32 (MixGRPO's network gets `timesteps / 1000`). Records the t it sees."""

    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))  # a device for module_device
        self.seen: list[float] = []

    def forward(self, x, t, cond=None):
        self.seen.append(float(t.flatten()[0]))
        return flux_net(x, t.to(torch.float32) / 1000)


def flash_sampler(start: int, ratio: float, order: int = 2, solver_type: str = "midpoint",
                  integer_timesteps: bool = True) -> FlowSDESampler:
    window = SDEWindowConfig(size=4, start=start, after="dpm_solver++", dpm_post_compress_ratio=ratio,
                             dpm_solver_order=order, dpm_solver_type=solver_type)
    cfg = FlowSDESamplerConfig(num_steps=25, noise_level=0.7, grid="sd3_time_shift", shift=3.0,
                               integer_timesteps=integer_timesteps, sde_window=window)
    return FlowSDESampler(cfg, SchedulerConfig())


# ----------------------------------------------------------------------------------------------------- the grids
@pytest.mark.parametrize("preset", ["flux-mixgrpo", "flux-mixgrpo-flash", "flux-mixgrpo-flash-star"])
def test_flux_mixgrpo_presets_sample_on_mixgrpos_shift_3_grid_with_its_integer_timesteps(preset):
    cfg = load_config(CONFIG_DIR / f"{preset}.yaml")
    # built as the FLUX testbed builds it: the model's (dynamically shifting) scheduler config and 512 px tokens
    sampler = FlowSDESampler(cfg.sampler, SchedulerConfig(num_train_timesteps=1000),
                             model_scheduler=TINY_FLUX_SCHEDULER, image_seq_len=(512 // 16) ** 2)
    theirs = ref.sigma_schedule(25, 3.0)  # sd3_time_shift(3, linspace(1, 0, 26))
    assert torch.allclose(sampler.sigmas, theirs, atol=1e-15, rtol=0)
    theirs32 = ref.sd3_time_shift(3.0, torch.linspace(1, 0, 26))  # their float32 tensor
    assert torch.allclose(sampler.sigmas.float(), theirs32, atol=2.5e-7, rtol=0)  # float32 rounding
    assert sampler.timesteps.tolist() == [int(s * 1000) for s in theirs32][:25]  # timestep_value = int(sigma * 1000)
    assert bool(sampler.trainable.all())  # on their grid every step, the last (0.111 -> 0) included, is stochastic
    # what the preset would sample on without grid=sd3_time_shift: FluxPipeline's grid, 0.116 away at 512 px
    flux = FlowSDESampler(cfg.sampler.model_copy(update={"grid": "scheduler", "sde_window": None}), SchedulerConfig(),
                          model_scheduler=TINY_FLUX_SCHEDULER, image_seq_len=(512 // 16) ** 2)
    assert (flux.sigmas - theirs).abs().max() > 0.11


@pytest.mark.parametrize("ratio, last, points", [(0.4, 3, 8), (0.4, 10, 6), (0.2, 3, 4), (0.2, 17, 1), (0.4, 22, 1)])
def test_post_window_grid_is_mixgrpos_compressed_shifted_linspace(ratio, last, points):
    sigmas = time_shift_sigmas(25, 3.0)
    assert post_window_points(25, last, ratio) == points
    determistic = ref.determistic_list(25, list(range(last - 3, last + 1)))
    _, _, theirs = ref.run_sample_step(ref.flash_args(ratio), torch.zeros(1, 1), sigmas, lambda z, t: z * 0,
                                       determistic, lambda: torch.zeros(1, 1))
    ours = torch.cat([sigmas[:last + 1], post_window_sigmas(sigmas, last + 1, 3.0, ratio)])
    if points >= 2:
        assert torch.allclose(ours, theirs, atol=1e-15, rtol=0)
    else:  # theirs stops at sigma_{last+1} > 0 (a noisy final latent); ours takes one step on to 0
        assert torch.equal(ours[:-1], theirs) and float(theirs[-1]) > 0 and float(ours[-1]) == 0.0


# ------------------------------------------------------------------------------------------- the whole rollout
@pytest.mark.parametrize("start, ratio, order, solver_type", [
    (0, 0.4, 2, "midpoint"),   # Flash, its first window
    (7, 0.4, 2, "midpoint"),   # Flash, a later window
    (0, 0.2, 2, "midpoint"),   # Flash*
    (3, 0.4, 2, "heun"),
    (0, 0.4, 3, "midpoint"),   # third order, dropping to second at the second-to-last step (grid under 15 steps)
    (2, 0.3, 3, "midpoint"),   # third order on a longer tail
    (5, 0.4, 1, "midpoint"),
])
def test_flash_rollout_matches_mixgrpos_sampling_loop_step_by_step(start, ratio, order, solver_type):
    sampler, model = flash_sampler(start, ratio, order, solver_type), GaussianFlowModel()
    sde = sampler.sde_steps(0)
    assert torch.nonzero(sde).flatten().tolist() == list(range(start, start + 4))
    tail = sampler.tail_solver(sde)
    first = start + 4
    batch = GaussianStepSampler.sample(sampler, tail.watch(model), COND, 2, torch.Generator().manual_seed(11),
                                       dtype=F64, sample_shape=SHAPE, sde_steps=sde, tail=tail)

    g = torch.Generator().manual_seed(11)
    z = torch.randn((len(batch), *SHAPE), generator=g, dtype=F64)
    latents, called, grid = ref.run_sample_step(
        ref.flash_args(ratio, order, solver_type), z, ref.sigma_schedule(25, 3.0), flux_net,
        ref.determistic_list(25, list(range(start, start + 4))), lambda: torch.randn(z.shape, generator=g, dtype=F64))

    assert torch.allclose(tail.grid, grid, atol=1e-15, rtol=0)
    assert model.seen == [float(t) for t in called]  # the same model timesteps, tail included
    assert len(tail.states) == latents.shape[1] - 1 - first  # the compressed tail, step for step
    assert torch.allclose(batch.traj[:, :first + 1], latents[:, :first + 1], atol=1e-12, rtol=0)  # Euler + SDE head
    for j, state in enumerate(tail.states):
        assert torch.allclose(state, latents[:, first + 1 + j], atol=1e-12, rtol=0), f"tail step {j}"
    assert torch.allclose(batch.samples, latents[:, -1], atol=1e-12, rtol=0)

    # the sampler's own entry point takes the same path
    again = sampler.sample(GaussianFlowModel(), COND, 2, torch.Generator().manual_seed(11), dtype=F64,
                           sample_shape=SHAPE, train_step=0)
    assert torch.equal(again.samples, batch.samples)


@torch.no_grad()
def test_a_flash_batch_trains_its_window_as_before_and_holds_its_final_sample_after_it():
    sampler, model = flash_sampler(start=2, ratio=0.4), GaussianFlowModel()
    euler = FlowSDESampler(sampler.cfg.model_copy(update={"sde_window": SDEWindowConfig(size=4, start=2)}),
                           SchedulerConfig())
    b = sampler.sample(model, COND, 2, torch.Generator().manual_seed(3), dtype=F64, sample_shape=SHAPE, train_step=0)
    e = euler.sample(GaussianFlowModel(), COND, 2, torch.Generator().manual_seed(3), dtype=F64, sample_shape=SHAPE,
                     train_step=0)
    first = 6
    assert b.trainable.tolist() == e.trainable.tolist() and b.traj.shape == e.traj.shape
    assert torch.equal(b.traj[:, :first + 1], e.traj[:, :first + 1])  # same noise, same head
    assert torch.equal(b.old_logp, e.old_logp)
    assert bool((b.traj[:, first + 1:] == b.samples[:, None]).all())
    assert not torch.allclose(b.samples, e.samples, atol=1e-3)  # the tail is not the Euler tail
    assert len(model.seen) == first + post_window_points(25, first - 1, 0.4) - 1  # 6 + 7 model calls, not 25
    for k in range(2, 6):  # the learner's recompute of the window's steps is untouched by the tail
        lp = sampler.log_prob(model, b, k).logp
        assert torch.allclose(lp, b.old_logp[:, k], atol=1e-12, rtol=0)
    # evaluation (no training step): every stochastic step from the SDE, no tail
    plain = sampler.sample(GaussianFlowModel(), COND, 2, torch.Generator().manual_seed(3), dtype=F64,
                           sample_shape=SHAPE)
    assert bool(plain.trainable.all())


# ------------------------------------------------------------------------------------------ the ODE it solves
def test_higher_order_tails_follow_the_gaussian_flow_ode_closer_than_euler_and_end_on_the_x0_prediction():
    """Data N(MU, TAU^2): the probability-flow ODE has a closed form. On Flash's compressed grid, with the window's
    last predictions as history, DPM-Solver++ of order 2 (3) stays closer to it than Euler on the same grid up to the
    last step; the last step, first order to sigma = 0 as theirs, returns the data prediction x - sigma v."""
    sigmas = time_shift_sigmas(25, 3.0)
    first = 4  # Flash's first window [0, 4)
    grid = torch.cat([sigmas[:first], post_window_sigmas(sigmas, first, 3.0, 0.4)])
    x = torch.randn((3, *SHAPE), generator=torch.Generator().manual_seed(0), dtype=F64)
    s_first = float(grid[first])
    history = []  # the data predictions m = x - sigma v two and one steps before, on the same ODE path
    for s_prev in (float(grid[first - 2]), float(grid[first - 1])):
        x_prev = ref.gaussian_flow(x, s_first, s_prev, MU, TAU)
        history.append(x_prev - s_prev * ref.gaussian_velocity(x_prev, s_prev, MU, TAU))
    velocity = lambda x_i, i: ref.gaussian_velocity(x_i, float(grid[i]), MU, TAU)  # noqa: E731
    n = len(grid) - 1
    before_last = ref.gaussian_flow(x, s_first, float(grid[n - 1]), MU, TAU)  # the exact state before the last step
    errors, tails = {}, {}
    for order in (1, 2, 3):
        tails[order] = dpm_solver_pp_tail(velocity, x, history, grid, first, order, "midpoint")
        assert len(tails[order]) == n - first
        errors[order] = float((tails[order][-2] - before_last).abs().max())
        x_last = tails[order][-2]
        assert torch.allclose(tails[order][-1], x_last - grid[n - 1] * velocity(x_last, n - 1), atol=1e-14, rtol=0)
    x_e = x
    for i in range(first, n):  # Euler x + (s_next - s) v: equals order 1
        x_e = x_e + (grid[i + 1] - grid[i]) * velocity(x_e, i)
    assert torch.allclose(tails[1][-1], x_e, atol=1e-13, rtol=0)
    assert errors[2] < errors[1] / 2 and errors[3] < errors[2]


# ----------------------------------------------------------------------------------------- the model timestep
def test_integer_timestep_reaches_a_float32_flux_network_as_mixgrpos_timesteps_over_1000():
    """TextToImagePolicy's flux branch hands a float32 FLUX network timestep = t / 1000 in float32: with MixGRPO's
    integer t that is bit for bit their `timesteps / 1000` (a long tensor divided by 1000)."""
    seen = {}

    class FakeFlux(nn.Module):
        config = SimpleNamespace(guidance_embeds=True)

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros((), dtype=torch.float32))

        def forward(self, hidden_states, timestep, **kw):
            seen["timestep"] = timestep
            return SimpleNamespace(sample=hidden_states)

    policy = TextToImagePolicy(FakeFlux(), "flux", guidance_scale=3.5)
    sampler = FlowSDESampler(load_config(CONFIG_DIR / "flux-mixgrpo.yaml").sampler, SchedulerConfig(),
                             model_scheduler=TINY_FLUX_SCHEDULER, image_seq_len=1024)
    cond = {"prompt_embeds": torch.zeros(2, 3, 4), "pooled_prompt_embeds": torch.zeros(2, 4),
            "txt_ids": torch.zeros(2, 3, 3), "img_ids": torch.zeros(2, 5, 3)}
    for k in range(25):
        policy(torch.zeros(2, 5, 8), sampler.timesteps[k].repeat(2), cond)
        theirs = torch.full([2], int(ref.sigma_schedule(25, 3.0)[k].float() * 1000), dtype=torch.long) / 1000
        assert seen["timestep"].dtype == torch.float32 and torch.equal(seen["timestep"], theirs)


def test_dpm_tail_needs_a_statically_shifted_grid():
    window = SDEWindowConfig(size=4, after="dpm_solver++")
    cfg = FlowSDESamplerConfig(num_steps=25, sde_window=window)  # grid=scheduler: FLUX's dynamic shift
    with pytest.raises(ValueError, match="dynamically shifted"):
        FlowSDESampler(cfg, SchedulerConfig(), model_scheduler=TINY_FLUX_SCHEDULER, image_seq_len=1024)
    FlowSDESampler(cfg.model_copy(update={"grid": "sd3_time_shift"}), SchedulerConfig(),
                   model_scheduler=TINY_FLUX_SCHEDULER, image_seq_len=1024)
