"""`learner.old_logp: auto` on the real DeepSpeed learner: between checks the rollout's log-probs of current samples
stand in for the pre-pass's recompute. When they are bitwise what the recompute gives (the rollout sampled with the
learner's weights and batch shape), training is bitwise the same as `recompute`, with fewer forward passes; a check
that finds a gap, a lagged batch, and a resume each bring the recompute back as the rules say."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.batch import POLICY_VERSION
from steadyrl.rollout.models import build_class_policy
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.recompute import RolloutLogpTrust
from tests.helpers import TINY_UNET, tiny_learner

# one micro-batch holds the whole batch of 4 classes x 6, as the rollout sampled it: the same shapes, the same numbers
CFG = dict(lr=1e-3, micro_batch_size=24, inner_epochs=2, logp_check_every=3)


def _batch(learner, seed: int, version: int | None = None, shift: float = 0.0):
    """A batch sampled with the learner's current weights and scored by brightness; rollout log-probs + `shift`."""
    policy = build_class_policy(TINY_UNET)
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), 6, torch.Generator().manual_seed(seed))
    b = b.replace(rewards=b.samples.mean(dim=(1, 2, 3))[:, None], reward_names=["r"], reward_key="r",
                  old_logp=b.old_logp + shift * learner.sampler.trainable.float())
    if version is not None:
        b = b.with_extras(**{POLICY_VERSION: torch.full((len(b),), version, dtype=torch.long)})
    return b


def _forward_counter(learner) -> list[int]:
    """Counts the policy network's forward calls (every pre-pass, KL-monitor and training forward)."""
    calls = [0]
    learner.network.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_trusted_updates_train_bitwise_as_recompute_with_fewer_forwards():
    runs = {}
    for mode in ("recompute", "auto"):
        learner = tiny_learner(LearnerConfig(**CFG, old_logp=mode))
        calls = _forward_counter(learner)
        recomputed = [learner.update(_batch(learner, seed=s))["policy/old_logp_recomputed"] for s in range(6)]
        runs[mode] = (learner.weights(), calls[0], recomputed)
    trained_steps = len(learner.train_steps)
    (w_re, n_re, rec_re), (w_auto, n_auto, rec_auto) = runs["recompute"], runs["auto"]
    assert all(torch.equal(w_re[k], w_auto[k]) for k in w_re)
    assert rec_re == [1.0] * 6
    assert rec_auto == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # a check at updates 0 and 3 (logp_check_every = 3)
    assert n_re - n_auto == 4 * trained_steps  # four updates without the pre-pass's forward per trained step


def test_a_check_that_finds_a_gap_recomputes_every_update_until_one_finds_none():
    learner = tiny_learner(LearnerConfig(**CFG, old_logp="auto"))
    m = learner.update(_batch(learner, seed=0, shift=0.01))  # the check sees the rollout's log-probs off
    assert m["policy/rollout_logp_absdiff_max"] == pytest.approx(0.01, abs=1e-5) and not learner.logp_trust.trusted
    assert learner.update(_batch(learner, seed=1))["policy/old_logp_recomputed"] == 1.0  # update 1: not a check index
    assert learner.logp_trust.trusted  # that recompute found them equal again
    assert learner.update(_batch(learner, seed=2))["policy/old_logp_recomputed"] == 0.0
    assert learner.update(_batch(learner, seed=3))["policy/old_logp_recomputed"] == 1.0  # update 3: a check


def test_lagged_samples_are_always_recomputed():
    learner = tiny_learner(LearnerConfig(**CFG, old_logp="auto", max_staleness=1))
    learner.update(_batch(learner, seed=0, version=0))
    assert learner.logp_trust.trusted
    stale = _batch(learner, seed=1, version=0)  # sampled a version behind the learner's
    assert learner.update(stale)["policy/old_logp_recomputed"] == 1.0


def test_the_verdict_survives_a_checkpoint_round_trip(tmp_path):
    learner = tiny_learner(LearnerConfig(**CFG, old_logp="auto"))
    learner.update(_batch(learner, seed=0))
    learner.save(tmp_path)
    learner.logp_trust.trusted = False
    learner.load(tmp_path)
    assert learner.logp_trust.trusted
    assert learner.update(_batch(learner, seed=1))["policy/old_logp_recomputed"] == 0.0


def test_recompute_mode_never_trusts():
    trust = RolloutLogpTrust("recompute", check_every=3, tol=0.0)
    trust.observe({"policy/rollout_logp_checked": 1.0, "policy/rollout_logp_absdiff_max": 0.0})
    assert all(trust.recompute_due(u) for u in range(7))
    auto = RolloutLogpTrust("auto", check_every=3, tol=1e-6)
    auto.observe({"policy/rollout_logp_checked": 0.0, "policy/rollout_logp_absdiff_max": 0.0})  # nothing compared
    assert auto.recompute_due(1)
    auto.observe({"policy/rollout_logp_checked": 1.0, "policy/rollout_logp_absdiff_max": 1e-6})
    assert [auto.recompute_due(u) for u in range(1, 7)] == [False, False, True, False, False, True]


def test_a_dllm_learner_trusts_the_rollout_and_still_computes_the_reference_estimate():
    """Masked diffusion (sequence-level MC estimates): a trusted update takes the rollout's per-MC-sample log-probs
    and still computes the reference's estimate for the KL monitor; weights stay bitwise those of recompute."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.objectives.grpo import GRPOSettings
    from tests.helpers import arith_prompts, masked_sampler, tiny_lm

    def batch_at(learner, seed):
        s = learner.sampler
        model = tiny_lm(dtype=torch.float32)
        model.load_state_dict(learner.weights())
        b = s.sample(model, arith_prompts(3), 4, torch.Generator().manual_seed(seed))
        reward = b.samples.float().mean(dim=1, keepdim=True)
        return b.replace(rewards=reward, reward_names=["r"], reward_key="r")

    runs = {}
    for mode in ("recompute", "auto"):
        learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32),
                                          masked_sampler(mc_samples=2, gen_length=4, num_steps=4),
                                          GRPOSettings(eps_clip=0.5), LearnerConfig(micro_batch_size=12, old_logp=mode))
        metrics = [learner.update(batch_at(learner, seed)) for seed in range(3)]
        runs[mode] = (learner.weights(), metrics)
    (w_re, m_re), (w_auto, m_auto) = runs["recompute"], runs["auto"]
    assert [m["policy/old_logp_recomputed"] for m in m_auto] == [1.0, 0.0, 0.0]
    assert all(torch.equal(w_re[k], w_auto[k]) for k in w_re)
    assert [m["policy/kl_ref_monitor"] for m in m_re] == [m["policy/kl_ref_monitor"] for m in m_auto]
