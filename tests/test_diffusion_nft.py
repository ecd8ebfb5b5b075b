"""DiffusionNFT (trainer/objectives/diffusion_nft.py, trainer/terms.py `ForwardProcessTerms`): the advantage and
optimality against numpy, both losses and their gradients against a re-computation written here, the timestep
draw, the old policy's EMA against the authors' loop (decay per optimiser step) and its checkpoint, the sampler
refusals, and a short learning run on the real learner."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import SchedulerConfig
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.context import UpdateContext
from steadyrl.trainer.objectives import TermInputs, UpdateSchedule, build_objective
from steadyrl.trainer.objectives.diffusion_nft import (DiffusionNFTCodeSettings, DiffusionNFTPaperSettings,
                                                       old_decay)
from steadyrl.trainer.terms import ForwardProcessTerms, term_producer
from tests.helpers import (IMAGE_FAMILIES, TINY_UNET, brightness_batch, make_image_learner, masked_sampler,
                           tiny_sd3_nft_learner)

SETTINGS = {"code": DiffusionNFTCodeSettings, "paper": DiffusionNFTPaperSettings}


def reward_batch(rewards: list[float], groups: list[int]) -> RolloutBatch:
    n = len(rewards)
    return RolloutBatch(cond=torch.zeros(n, dtype=torch.long), group=torch.tensor(groups), samples=torch.zeros(n, 1),
                        traj=torch.zeros(n, 2, 1), old_logp=torch.zeros(n, 1), timesteps=torch.tensor([1]),
                        trainable=torch.tensor([True]), rewards=torch.tensor(rewards).unsqueeze(1),
                        reward_names=["r"], reward_key="r")


@pytest.mark.parametrize("form", ["code", "paper"])
def test_advantage_and_optimality_match_numpy(form):
    """code: (R - prompt mean) / (batch std + 1e-4); paper: / (prompt std + 1e-4); clipped to +-c; r = A_c/2c + 1/2."""
    rewards, groups = [0.0, 1.0, 3.0, 10.0, 10.0, 2.0, -40.0, 5.0], [0, 0, 0, 1, 1, 1, 2, 2]
    obj = build_objective(SETTINGS[form](adv_clip=1.0))
    batch, metrics = obj.prepare_batch(reward_batch(rewards, groups))
    r, g = np.array(rewards), np.array(groups)
    mean = np.array([r[g == k].mean() for k in g])
    std = np.full_like(r, r.std()) if form == "code" else np.array([r[g == k].std() for k in g])
    expected = np.clip((r - mean) / (std + 1e-4), -1.0, 1.0)
    np.testing.assert_allclose(batch.advantages.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert metrics["nft/optimality_mean"] == pytest.approx(float(np.clip(expected / 2 + 0.5, 0, 1).mean()), rel=1e-5)
    assert (np.abs(expected) == 1.0).any()  # the clip is exercised


def flow_setup(seed: int = 0):
    torch.manual_seed(seed)
    sampler = build_sampler(IMAGE_FAMILIES["flow_sde"], SchedulerConfig())
    policy, old, ref = (build_class_policy(TINY_UNET).double() for _ in range(3))
    return sampler, policy, old, ref


def reference_loss(form, cfg, x0, t, eps, v, v_old, v_ref, adv, n_terms):
    """The DiffusionNFT losses written per sample in float64, from the paper's and the authors' code's formulas."""
    total = 0.0
    for i in range(len(x0)):
        a = float(np.clip(adv[i], -cfg.adv_clip, cfg.adv_clip))
        r = min(max(a / cfg.adv_clip / 2.0 + 0.5, 0.0), 1.0)
        xt = (1 - t[i]) * x0[i] + t[i] * eps[i]
        pos = cfg.beta * v[i] + (1 - cfg.beta) * v_old[i]
        neg = (1 + cfg.beta) * v_old[i] - cfg.beta * v[i]
        if form == "code":
            terms = []
            for branch in (pos, neg):
                x0_hat = xt - t[i] * branch
                w = max(float((x0_hat - x0[i]).detach().abs().mean()), 1e-5)
                terms.append(((x0_hat - x0[i]) ** 2).mean() / w)
            policy = cfg.adv_clip * (r * terms[0] + (1 - r) * terms[1]) / cfg.beta
        else:
            target = eps[i] - x0[i]
            policy = r * ((pos - target) ** 2).mean() + (1 - r) * ((neg - target) ** 2).mean()
        total = total + policy + cfg.kl_coef * ((v[i] - v_ref[i]) ** 2).mean()
    return total / n_terms


@pytest.mark.parametrize("form", ["code", "paper"])
def test_loss_and_gradient_match_an_independent_computation(form):
    sampler, policy, old, ref = flow_setup()
    with torch.no_grad():  # three different networks
        for p in old.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cfg = SETTINGS[form](beta=0.3, kl_coef=0.2)
    obj = build_objective(cfg)
    g = torch.Generator().manual_seed(1)
    b = 4
    x0, eps = torch.randn(b, 1, 8, 8, generator=g, dtype=torch.float64), torch.randn(b, 1, 8, 8, generator=g,
                                                                                     dtype=torch.float64)
    step, cond = torch.tensor([0, 2, 3, 1]), torch.tensor([0, 1, 2, 3])
    t = sampler.sigmas[step]
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    adv = torch.tensor([7.0, -1.0, 0.5, -6.0], dtype=torch.float64)
    params = list(policy.parameters())

    v = sampler.velocity(policy, x_t, step, cond)
    with torch.no_grad():
        v_old, v_ref = sampler.velocity(old, x_t, step, cond), sampler.velocity(ref, x_t, step, cond)
    inputs = TermInputs(n_terms=10, advantages=adv, x0=x0, t=t, x_t=x_t, velocity=v, old_velocity=v_old,
                        ref_velocity=v_ref)
    loss, _ = obj.loss(inputs, {})
    grads = torch.autograd.grad(loss, params)

    v2 = policy(x_t, sampler.timesteps[step], cond)  # the network called directly, not through the seam
    expected = reference_loss(form, cfg, x0, t, eps, v2, v_old, v_ref, adv.numpy(), 10)
    expected_grads = torch.autograd.grad(expected, params)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-10)
    for a, e in zip(grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-12)


def test_forward_process_terms_draw_a_permutation_of_the_grid_per_sample_and_noise_clean_samples():
    sampler, policy, old, ref = flow_setup()
    obj = build_objective(DiffusionNFTCodeSettings())
    g = torch.Generator().manual_seed(0)
    n = 40
    mb = RolloutBatch(cond=torch.arange(n) % 4, group=torch.arange(n) // 4,
                      samples=torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
                      traj=torch.zeros(n, 2, 1), old_logp=torch.zeros(n, 1), timesteps=sampler.timesteps,
                      trainable=sampler.trainable, advantages=torch.zeros(n, dtype=torch.float64))
    ctx = UpdateContext(sampler=sampler, policy=policy, reference=ref, objective=obj,
                        train_steps=torch.arange(5), generator=torch.Generator().manual_seed(3))
    terms = ForwardProcessTerms(ctx, [mb], [None])
    chosen = terms.chosen[0]
    assert terms.steps_per_sample == 4 == chosen.shape[1]  # floor(5 * 0.99)
    assert terms.n_terms == 4 * n and terms.count == 4
    assert all(len(set(row.tolist())) == 4 and set(row.tolist()) <= set(range(5)) for row in chosen)
    assert bool((chosen == 0).any()) and len({tuple(r.tolist()) for r in chosen}) > 1  # t = 1 drawn; rows differ
    piece = terms.piece((0, 2))
    t = sampler.sigmas[chosen[:, 2]]
    assert torch.equal(piece.t, t)
    expected_xt = (1 - t.view(-1, 1, 1, 1)) * mb.samples + t.view(-1, 1, 1, 1) * terms.noise[0][2]
    torch.testing.assert_close(piece.x_t, expected_xt, rtol=0, atol=0)
    torch.testing.assert_close(piece.velocity, policy(piece.x_t, sampler.timesteps[chosen[:, 2]], mb.cond))
    torch.testing.assert_close(piece.old_velocity, piece.velocity.detach())  # old starts as the policy
    torch.testing.assert_close(piece.ref_velocity, ref(piece.x_t, sampler.timesteps[chosen[:, 2]], mb.cond))
    part = torch.tensor([3, 7])  # a split piece is the whole piece's rows
    torch.testing.assert_close(terms.piece((0, 2), part).velocity, piece.velocity[part])


class Hooks:
    """What `after_update` reads of the learner: the policy's trained tensors."""

    def __init__(self, policy):
        self.policy = policy

    def weights(self):
        return {k: v.detach().clone() for k, v in self.policy.trainable_state_dict().items()}


def test_old_policy_moves_by_the_authors_decay_schedule_and_round_trips_a_checkpoint():
    _, policy, _, _ = flow_setup()
    cfg = DiffusionNFTCodeSettings(decay_flat=2, decay_rate=0.25, decay_max=0.6)
    assert [old_decay(cfg, g) for g in range(6)] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.6]
    obj = build_objective(cfg)
    old = obj.old_network(policy)
    start = {k: v.clone() for k, v in old.state.items()}
    for steps, d in [(4, 0.5), (1, 0.6)]:  # optimiser steps of the update; g = 4, then 5
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1)
        before = {k: v.clone() for k, v in old.state.items()}
        for _ in range(steps):
            obj.step_done()
        assert obj.after_update(Hooks(policy), {})["nft/old_decay"] == d
        current = policy.trainable_state_dict()
        for k, v in old.state.items():
            if v.is_floating_point():
                torch.testing.assert_close(v, d * before[k] + (1 - d) * current[k])
    assert any(not torch.equal(start[k], v) for k, v in old.state.items())
    saved = obj.state_dict()
    fresh = build_objective(cfg)
    fresh.load_state_dict(saved)
    restored = fresh.old_network(copy.deepcopy(policy))
    assert all(torch.equal(restored.state[k], v) for k, v in old.state.items())
    assert int(fresh.state["optimiser_steps"]) == 5


def their_return_decay(step: int, decay_type: int) -> float:
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py `return_decay` (L169-189; tinnerhrhe/GARDO's
    train_sd3_nft_gardo.py L191-211 is the same), transcribed line by line."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    else:
        raise AssertionError(decay_type)
    return their_decay(step, flat, uprate, uphold)


def their_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """The tail of their `return_decay`, for constants of our choosing."""
    if step < flat:
        return 0.0
    decay = (step - flat) * uprate
    return min(decay, uphold)


def their_old_model(theta0: dict[str, np.ndarray], step_size: float, epochs: int, steps_per_epoch: int,
                    decay_type: int) -> tuple[list[int], list[float], dict[str, np.ndarray]]:
    """Their loop's global_step and old-model lines (train_nft_sd3.py): old = a copy of the policy before the first
    epoch (L575-579); `global_step += 1` after each optimizer.step (L1000-1021); after the epoch's inner epochs,
    decay = return_decay(global_step, decay_type) and old = old * decay + theta * (1 - decay) (L1034-1039).
    Each optimiser step here adds `step_size` to every trained value (theta = theta0 + step_size * global_step)."""
    global_step, old = 0, {k: v.copy() for k, v in theta0.items()}
    steps, decays = [], []
    for _epoch in range(epochs):
        for _step in range(steps_per_epoch):
            global_step += 1
        decay = their_return_decay(global_step, decay_type)
        old = {k: v * decay + (theta0[k] + step_size * global_step) * (1.0 - decay) for k, v in old.items()}
        steps.append(global_step)
        decays.append(decay)
    return steps, decays, old


@pytest.mark.parametrize("form", ["code", "gardo"])
def test_old_policy_decay_and_ema_follow_their_loop_with_two_optimiser_steps_per_update(form):
    """Their sd3_ocr config (config/nft.py: decay_type 2, gradient_step_per_epoch=2): with two optimiser steps per
    update the decay sequence and the old copy are their loop's, flat 75, rate 0.0075 and max 0.999 copied as
    written; counting updates instead would give a different sequence (checked, so the comparison can fail)."""
    from steadyrl.trainer.objectives.gardo_nft import GARDONFTSettings

    settings = {"code": DiffusionNFTCodeSettings, "gardo": GARDONFTSettings}[form]
    cfg = settings(decay_flat=75, decay_rate=0.0075, decay_max=0.999)
    assert (cfg.decay_flat, cfg.decay_rate, cfg.decay_max) == (75, 0.0075, 0.999)
    _, policy, _, _ = flow_setup()
    obj = build_objective(cfg)
    old = obj.old_network(policy)
    theta0 = {k: v.detach().numpy().copy() for k, v in policy.trainable_state_dict().items() if v.is_floating_point()}
    epochs, per_update, step_size = 110, 2, 1e-3
    their_steps, their_decays, their_old = their_old_model(theta0, step_size, epochs, per_update, decay_type=2)
    steps, decays = [], []
    for u in range(epochs):
        obj.begin_update(UpdateSchedule(index=u))  # the learner's update count, as it starts update u
        for _ in range(per_update):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(step_size)
            obj.step_done()
        metrics = obj.after_update(Hooks(policy) if form == "code" else GardoHooks(policy), {})
        steps.append(int(metrics["nft/optimiser_steps"]))
        decays.append(metrics["nft/old_decay"])
    assert steps == their_steps and decays == their_decays
    assert decays[36:39] == [0.0, 0.0075, 0.0225] and decays[-1] == 0.999  # flat, rate and cap all reached
    assert decays != [their_return_decay(u + 1, 2) for u in range(epochs)]  # the per-update count differs
    for k, v in their_old.items():
        np.testing.assert_allclose(old.state[k].numpy(), v, rtol=1e-12, atol=1e-12)
    moved = max(float(np.abs(v - theta0[k]).max()) for k, v in their_old.items())
    assert moved > 0.05  # the old copy moved well beyond the tolerance


class GardoHooks(Hooks):
    """`Hooks` plus the reference reset GARDO-NFT's `after_update` may ask for."""

    def reset_reference(self) -> None:
        pass


def test_a_checkpoint_without_the_step_count_resumes_at_its_updates_times_the_steps_per_update():
    """A checkpoint written before the count was kept: g is taken as updates done x this update's steps."""
    obj = build_objective(DiffusionNFTCodeSettings(decay_rate=0.01))
    obj.load_state_dict({})
    obj.begin_update(UpdateSchedule(index=3))  # three updates done before this one
    for _ in range(2):
        obj.step_done()
    metrics = obj.after_update(Hooks(flow_setup()[1]), {})
    assert metrics["nft/optimiser_steps"] == 8.0 and metrics["nft/old_decay"] == pytest.approx(0.08)
    assert int(obj.state_dict()["optimiser_steps"]) == 8


def test_samplers_without_clean_velocity_samples_are_refused_by_name():
    obj = build_objective(DiffusionNFTCodeSettings())
    ddim = build_sampler(IMAGE_FAMILIES["ddim"], SchedulerConfig())
    for sampler, kind in [(ddim, "ddim"), (masked_sampler(), sampler_kind(masked_sampler()))]:
        with pytest.raises(ValueError, match=rf"objective.name='diffusion_nft.code'.*sampler.kind='{kind}'"):
            term_producer(obj, sampler, None)
    assert term_producer(obj, build_sampler(IMAGE_FAMILIES["flow_sde"], SchedulerConfig()), None) is \
        ForwardProcessTerms


def sampler_kind(sampler) -> str:
    return sampler.cfg.kind


@pytest.mark.parametrize("form,sign", [("code", 1.0), ("paper", 1.0), ("code", -1.0)])
def test_nft_moves_brightness_the_rewarded_way_on_the_real_learner(form, sign):
    """Reward = sign x mean brightness on the tiny flow UNet: six updates of the DeepSpeed learner move the held-out
    mean brightness the rewarded way (by > 0.05; ~0.1 seen); the old policy follows the policy (d(g) = 0.001 g, g the
    optimiser steps)."""
    set_rank_env(free_port())
    learner = make_image_learner(IMAGE_FAMILIES["flow_sde"], SETTINGS[form](beta=1.0), micro_batch_size=12)

    def score() -> float:
        return float(brightness_batch(learner, 100, n_per_class=16).samples.mean())

    base = score()
    for seed in range(6):
        batch = brightness_batch(learner, seed)
        metrics = learner.update(batch.replace(rewards=sign * batch.rewards))
    assert np.isfinite(metrics["nft/policy_loss"])
    assert sign * (score() - base) > 0.05
    old, current = learner.objective.old.state, learner.weights()
    d = metrics["nft/old_decay"]
    assert metrics["nft/optimiser_steps"] == 6 * metrics["policy/optimizer_steps"] == 12  # 24 samples, 12 a step
    assert d == pytest.approx(0.012)  # d(g) = 0.001 g
    assert max(float((old[k].cpu() - current[k]).abs().max()) for k in old) < 1.0


def test_config_refuses_a_sampler_without_clean_velocity_samples_by_name():
    from steadyrl.services.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"objective.name='diffusion_nft.paper'.*sampler.kind='flow_sde'.*'ddim'"):
        load_config("configs/digits-flow-nft.yaml", ["objective.name=diffusion_nft.paper", "sampler.kind=ddim"])


def test_one_update_on_a_tiny_sd3_lora_policy_moves_the_adapters_and_the_old_copy(tmp_path):
    """The text-to-image flow policy (tiny random SD3 pipeline, LoRA): the same velocity seam, the old copy holds
    the adapters only, and after one update old = d old_0 + (1 - d) theta with d = 0.001."""
    learner, batch = tiny_sd3_nft_learner(tmp_path, DiffusionNFTCodeSettings())
    before = learner.weights()
    metrics = learner.update(batch)
    after = learner.weights()
    old = learner.objective.old.state
    assert set(old) == set(after) and all("lora" in k for k in old)  # the adapters only
    assert any(not torch.equal(before[k], after[k]) for k in after) and np.isfinite(metrics["nft/policy_loss"])
    for k, v in old.items():
        torch.testing.assert_close(v.cpu(), 0.001 * before[k] + 0.999 * after[k])


def resumed_pair(tmp_path, cfg: DiffusionNFTCodeSettings):
    """A learner after one update, saved, and a fresh learner (another seed) loaded from its checkpoint."""
    set_rank_env(free_port())
    first = make_image_learner(IMAGE_FAMILIES["flow_sde"], cfg, micro_batch_size=12)
    first.update(brightness_batch(first, 0))
    first.save(tmp_path / "ckpt")
    second = make_image_learner(IMAGE_FAMILIES["flow_sde"], cfg, micro_batch_size=12, seed=5)
    second.load(tmp_path / "ckpt")
    return first, second


def test_a_resumed_learner_continues_exactly_with_the_old_copy_from_its_checkpoint(tmp_path):
    """save after one update, load into a fresh learner: the next update gives the same weights and old copy."""
    first, second = resumed_pair(tmp_path, DiffusionNFTCodeSettings(decay_rate=0.2))
    batch = brightness_batch(first, 1)
    first.update(batch)
    second.update(batch)
    a, b = first.weights(), second.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(v, second.objective.old.state[k]) for k, v in first.objective.old.state.items())


def test_the_learner_counts_every_optimiser_step_of_an_update_in_the_old_policy_decay():
    """24 samples in micro-batches of 6, optimisation batches of 12, two inner epochs: 2 x 2 = 4 optimiser steps per
    update, so their global_step is 4, 8, 12 after each; d = their schedule there and old = d old + (1 - d) theta."""
    set_rank_env(free_port())
    cfg = DiffusionNFTCodeSettings(decay_flat=5, decay_rate=0.1, decay_max=0.999)
    learner = make_image_learner(IMAGE_FAMILIES["flow_sde"], cfg, micro_batch_size=6, optim_batch_size=12,
                                 inner_epochs=2)
    old = learner.weights()  # the old copy starts as the policy
    for u in range(3):
        metrics = learner.update(brightness_batch(learner, u))
        global_step = 4 * (u + 1)
        d = their_decay(global_step, 5, 0.1, 0.999)
        assert metrics["policy/optimizer_steps"] == 4 and metrics["nft/optimiser_steps"] == global_step
        assert metrics["nft/old_decay"] == d
        current = learner.weights()
        old = {k: d * v + (1 - d) * current[k] for k, v in old.items()}
        for k, v in learner.objective.old.state.items():
            torch.testing.assert_close(v.cpu(), old[k])
    assert d == pytest.approx(0.7)


def test_a_resumed_learner_keeps_the_optimiser_step_count_when_the_steps_per_update_change(tmp_path):
    """Two optimiser steps in the first update, one in the next (a smaller batch): the resumed learner's g is 3, as the
    one that went straight through, not 2 (its update count times its steps per update)."""
    first, second = resumed_pair(tmp_path, DiffusionNFTCodeSettings(decay_rate=0.1))
    batch = brightness_batch(first, 1, n_per_class=3)
    a, b = first.update(batch), second.update(batch)
    assert a["nft/optimiser_steps"] == b["nft/optimiser_steps"] == 3.0
    assert a["nft/old_decay"] == b["nft/old_decay"] == pytest.approx(0.3)
    assert all(torch.equal(v, second.objective.old.state[k]) for k, v in first.objective.old.state.items())
