"""GARDO on DiffusionNFT (trainer/objectives/gardo_nft.py): the advantage against their stat tracker rewritten in
numpy, every grid value trained per sample, the loss and its gradient against a re-computation of their
per-(micro-batch, timestep) loss, split pieces, the reference resets and the threshold's moves as their code makes
them, and a learning run on the real learner."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.context import UpdateContext
from steadyrl.trainer.objectives import TermInputs, build_objective
from steadyrl.trainer.objectives.diffusion_nft import DiffusionNFTCodeSettings
from steadyrl.trainer.objectives.gardo_nft import GARDONFTSettings
from steadyrl.trainer.terms import ForwardProcessTerms
from tests.helpers import IMAGE_FAMILIES, brightness_batch, make_image_learner
from tests.test_diffusion_nft import flow_setup, reference_loss
from tests.test_gardo import FakeHooks, make_batch, reference_diversity


def test_defaults_are_their_nft_gardo_config():
    cfg = GARDONFTSettings()
    assert (cfg.kl_coef, cfg.beta, cfg.adv_clip, cfg.ref_kl_threshold, cfg.ref_reset_every) == \
        (0.04, 1.0, 5.0, 0.15, 16)
    assert (cfg.ref_threshold_step, cfg.ref_threshold_floor, cfg.ref_threshold_cap, cfg.quick_reset) == \
        (0.01, 0.1, 0.05, 5)
    assert (cfg.decay_rate, cfg.decay_max, cfg.beta_init, cfg.timestep_fraction) == (0.001, 0.5, 0.1, 1.0)


def their_trained_steps(num_steps: int, timestep_fraction: float) -> int:
    """Trained grid values per sample in both scripts: `int(config.sample.num_steps * config.train.timestep_fraction)`
    (GARDO train_sd3_nft_gardo.py L595, DiffusionNFT train_nft_sd3.py L569); the inner loop runs over
    range(num_train_timesteps) of each sample's permuted timesteps."""
    return int(num_steps * timestep_fraction)


@pytest.mark.parametrize("settings,their_fraction", [
    (GARDONFTSettings(), 1.0),  # GARDO config/gardo.py nft_sd3_geneval: config/base.py L105, train.timestep_fraction
    (DiffusionNFTCodeSettings(), 0.99)])  # DiffusionNFT config/base.py L87
def test_each_sample_trains_their_number_of_the_ten_grid_values(settings, their_fraction):
    """With their 10 sampling steps, GARDO-NFT's default trains every grid value of every sample (10 distinct, once
    each), DiffusionNFT's floor(10 x 0.99) = 9: counted in the pieces the terms produce."""
    T = 10
    sampler = build_sampler(FlowSDESamplerConfig(num_steps=T), SchedulerConfig())
    _, policy, _, ref = flow_setup()
    obj = build_objective(settings)
    n = 8
    g = torch.Generator().manual_seed(1)
    mb = RolloutBatch(cond=torch.arange(n) % 4, group=torch.arange(n) // 4,
                      samples=torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), traj=torch.zeros(n, 2, 1),
                      old_logp=torch.zeros(n, 1), timesteps=sampler.timesteps, trainable=sampler.trainable,
                      advantages=torch.zeros(n, dtype=torch.float64))
    ctx = UpdateContext(sampler=sampler, policy=policy, reference=ref, objective=obj, train_steps=torch.arange(T),
                        generator=torch.Generator().manual_seed(2))
    terms = ForwardProcessTerms(ctx, [mb], [None])
    trained: list[list[int]] = [[] for _ in range(n)]
    for key in terms.keys():
        for i, k in enumerate(terms.piece(key).step.tolist()):
            trained[i].append(k)
    expected = their_trained_steps(T, their_fraction)
    assert expected == (T if their_fraction == 1.0 else 9)
    assert [len(steps) for steps in trained] == [expected] * n and terms.n_terms == expected * n
    assert all(len(set(steps)) == expected and set(steps) <= set(range(T)) for steps in trained)


@pytest.mark.parametrize("preset,fraction", [("digits-flow-gardo-nft", 1.0), ("sd35-gardo-nft", 1.0),
                                             ("digits-flow-nft", 0.99), ("sd35-nft", 0.99)])
def test_gardo_nft_presets_train_every_grid_value_over_their_nft_bases(preset, fraction):
    from steadyrl.services.config import CONFIG_DIR, load_config

    cfg = load_config(CONFIG_DIR / f"{preset}.yaml")
    assert cfg.objective.timestep_fraction == fraction and cfg.sampler.num_steps == 10


def test_advantage_is_their_diversity_weighted_centred_reward_without_std_division():
    rng = np.random.default_rng(4)
    group = np.repeat(np.arange(3), 6)
    r = rng.normal(size=18) * 4  # large enough that the +-5 clip bites
    f = rng.normal(size=(18, 5))
    obj = build_objective(GARDONFTSettings())
    batch, metrics = obj.prepare_batch(make_batch(np.stack([r, rng.normal(size=18)], 1), ["proxy", "aux"], group,
                                                  torch.tensor(f)))
    adv_ref, w_ref, _ = reference_diversity(r, f, group)  # their PerPromptStatTrackerNFT, clipped to +-5
    assert np.allclose(batch.advantages.numpy(), adv_ref, atol=1e-9) and (np.abs(adv_ref) == 5).any()
    assert metrics["nft/optimality_mean"] == pytest.approx(float(np.clip(adv_ref / 10 + 0.5, 0, 1).mean()))
    gate = batch.extras["gardo_gate"]
    assert gate.dtype == torch.bool and 0 < int(gate.sum()) < 18 and metrics["gardo/beta"] == pytest.approx(0.1)


def flow_piece(gate: list[bool], kl_coef: float = 0.3):
    """Four samples of the tiny flow UNet at mixed grid values, a policy, an old and a reference network apart."""
    sampler, policy, old, ref = flow_setup()
    with torch.no_grad():
        for net in (old, ref):
            for p in net.parameters():
                p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x0, eps = (torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64) for _ in range(2))
    step, cond = torch.tensor([0, 2, 3, 1]), torch.tensor([0, 1, 2, 3])
    t = sampler.sigmas[step]
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    adv = torch.tensor([7.0, -1.0, 0.5, -6.0], dtype=torch.float64)
    micro = make_batch(np.zeros((4, 2)), ["proxy", "aux"]).with_extras(gardo_gate=torch.tensor(gate))
    v = sampler.velocity(policy, x_t, step, cond)
    with torch.no_grad():
        v_old, v_ref = sampler.velocity(old, x_t, step, cond), sampler.velocity(ref, x_t, step, cond)
    inputs = TermInputs(n_terms=12, advantages=adv, x0=x0, t=t, x_t=x_t, velocity=v, old_velocity=v_old,
                        ref_velocity=v_ref, micro=micro)
    cfg = GARDONFTSettings(beta=0.4, kl_coef=kl_coef)
    expected_v = policy(x_t, sampler.timesteps[step], cond)  # the network called directly, not through the seam
    return cfg, inputs, list(policy.parameters()), (x0, t, eps, expected_v, v_old, v_ref, adv)


@pytest.mark.parametrize("gate", [[False, True, False, True], [False] * 4])
def test_loss_and_gradient_are_their_nft_loss_plus_the_kl_over_the_gated_samples(gate):
    """Their piece: mean_i policy_i + train.beta * mean_{i gated, or all when none is} mean (v - v_ref)^2, as a share
    b / n_terms of the optimisation step."""
    cfg, inputs, params, (x0, t, eps, v, v_old, v_ref, adv) = flow_piece(gate)
    obj = build_objective(cfg)
    loss, metrics = obj.loss(inputs, {})
    grads = torch.autograd.grad(loss, params)

    policy = reference_loss("code", cfg.model_copy(update={"kl_coef": 0.0}), x0, t, eps, v, v_old, v_ref,
                            adv.numpy(), 12)  # sum_i policy_i / n_terms
    payers = [i for i in range(4) if gate[i]] or list(range(4))
    kl = sum(((v[i] - v_ref[i]) ** 2).mean() for i in payers) / len(payers)
    expected = policy + cfg.kl_coef * kl * 4 / 12
    expected_grads = torch.autograd.grad(expected, params)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-10)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-12)
    assert float(metrics["gardo/kl_gated"]) == pytest.approx(float(kl.detach()), rel=1e-10)


def test_the_parts_of_a_split_piece_sum_to_the_whole_piece():
    gate = [True, False, False, False]  # the gated sample is in the first part only: the second pays no KL
    cfg, inputs, _, _ = flow_piece(gate)
    obj = build_objective(cfg)
    whole = obj.loss(inputs, {})[0]
    stats = obj.piece_statistics(inputs)
    parts = 0.0
    for idx in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        part = TermInputs(n_terms=12, advantages=inputs.advantages[idx], x0=inputs.x0[idx], t=inputs.t[idx],
                          x_t=inputs.x_t[idx], velocity=inputs.velocity[idx], old_velocity=inputs.old_velocity[idx],
                          ref_velocity=inputs.ref_velocity[idx], micro=inputs.micro.index(idx), piece=stats)
        parts = parts + obj.loss(part, {})[0]
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), rel=1e-12)


def run_update(obj, hooks, steps: list[list[float]]) -> dict[str, float]:
    """One update whose optimisation steps have these pieces' KLs (each piece whole), then `after_update`."""
    for pieces in steps:
        for kl in pieces:
            obj.window.add(kl, 1.0)
        obj.step_done()
    return obj.after_update(hooks, {})


def test_resets_and_threshold_moves_follow_their_code():
    obj = build_objective(GARDONFTSettings())
    hooks = FakeHooks()
    # window = mean over a step's pieces, max over the update's steps: max(0.15, 0.1) = 0.15, not above tau = 0.15
    m = run_update(obj, hooks, [[0.3, 0.0], [0.1]])
    assert m["gardo/kl_window_max"] == pytest.approx(0.15) and m["gardo/ref_reset"] == 0.0 and hooks.resets == 0
    # 0.2 > 0.15 two updates after the start: a quick reset, tau <- min(0.15 + 0.01, 0.05) = 0.05 (their cap)
    m = run_update(obj, hooks, [[0.2]])
    assert m["gardo/ref_reset"] == 1.0 and hooks.resets == 1 and m["gardo/kl_threshold"] == pytest.approx(0.05)
    # 16 updates under tau: the periodic reset, tau <- max(0.05 - 0.01, 0.1) = 0.1 (their floor)
    for i in range(1, 17):
        m = run_update(obj, hooks, [[0.01]])
        assert hooks.resets == 1 + (i == 16), i
    assert m["gardo/updates_since_reset"] == 0.0 and m["gardo/kl_threshold"] == pytest.approx(0.1)
    # above tau after 7 updates: neither quick nor periodic, tau stays
    for _ in range(6):
        run_update(obj, hooks, [[0.0]])
    m = run_update(obj, hooks, [[0.12]])
    assert m["gardo/ref_reset"] == 1.0 and hooks.resets == 3 and m["gardo/kl_threshold"] == pytest.approx(0.1)
    saved = obj.state_dict()
    fresh = build_objective(GARDONFTSettings())
    fresh.load_state_dict(saved)
    assert float(fresh.state["kl_threshold"]) == pytest.approx(0.1) and int(fresh.state["resets"]) == 3
    assert int(fresh.state["updates_since_reset"]) == 0 and len(fresh.state["m_window"]) == 0


def test_gardo_nft_raises_brightness_on_the_real_learner_and_resets_its_reference():
    """Reward = 20 x mean brightness (their advantage has no std division, so the reward's scale is the signal's):
    six updates raise the held-out mean brightness by > 0.05; with ref_reset_every = 3 the reference is the
    policy after the 3rd and 6th updates."""
    set_rank_env(free_port())
    learner = make_image_learner(IMAGE_FAMILIES["flow_sde"], GARDONFTSettings(ref_reset_every=3, kl_coef=0.01),
                                 micro_batch_size=12)

    def score() -> float:
        return float(brightness_batch(learner, 100, n_per_class=16).samples.mean())

    base = score()
    resets, gated = [], []
    for seed in range(6):
        batch = brightness_batch(learner, seed)
        metrics = learner.update(batch.replace(rewards=20 * batch.rewards))
        resets.append(metrics["gardo/ref_reset"])
        gated.append(metrics["gardo/gate_frac"])
    assert score() - base > 0.05
    assert resets == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert 0 < max(gated) < 0.3 and np.isfinite(metrics["nft/policy_loss"])
    ref, weights = learner.reference.trainable_state_dict(), learner.weights()
    assert all(torch.equal(ref[k].cpu(), weights[k]) for k in weights)
