"""The behaviour-policy correction of asynchronous rollouts (trainer/off_policy.py) on the real DeepSpeed learner:
each lagged term is weighted by w = min(pi_prox / pi_b, c), a batch from the current policy is not weighted at
all, and a batch older than learner.max_staleness is refused."""
from __future__ import annotations

import math

import pytest
import torch

from steadyrl.rollout.batch import POLICY_VERSION
from steadyrl.rollout.models import build_class_policy
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.off_policy import behaviour_weight
from tests.helpers import TINY_UNET, tiny_learner

CAP = 2.0


@pytest.fixture(scope="module")
def learner():
    # one micro-batch, one optimiser step per update: the update's gradient is one back-propagation; the current
    # batch of the weighting test carries deliberately wrong log-probs, which only a recompute replaces
    return tiny_learner(LearnerConfig(lr=1e-3, micro_batch_size=32, inner_epochs=1, max_staleness=1,
                                      behaviour_weight_cap=CAP, old_logp="recompute"))


def _batch(learner, version: int | None, behaviour_shift: float = 0.0, seed: int = 0):
    """A scored batch sampled with the learner's weights, labelled as policy `version`, whose recorded
    (behaviour) log-probs are lowered by `behaviour_shift` at every stochastic step."""
    policy = build_class_policy(TINY_UNET)
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), 6, torch.Generator().manual_seed(seed))
    b = b.replace(rewards=b.samples.mean(dim=(1, 2, 3))[:, None], reward_names=["r"], reward_key="r",
                  old_logp=b.old_logp - behaviour_shift * learner.sampler.trainable.float())
    if version is not None:
        b = b.with_extras(**{POLICY_VERSION: torch.full((len(b),), version, dtype=torch.long)})
    return b


def test_behaviour_weight_is_the_truncated_ratio_where_lagged_and_exactly_one_elsewhere():
    prox = torch.tensor([[0.0, -1.0], [0.5, 0.2], [3.0, -2.0]], dtype=torch.float64)
    behav = torch.tensor([[-0.5, -1.0], [0.0, 0.4], [0.0, 0.0]], dtype=torch.float64)
    lagged = torch.tensor([True, True, False])
    w = behaviour_weight(prox, behav, lagged, cap=1.5)
    expected = torch.tensor([[min(math.exp(0.5), 1.5), 1.0], [min(math.exp(0.5), 1.5), math.exp(-0.2)], [1.0, 1.0]],
                            dtype=torch.float64)
    assert torch.allclose(w, expected, rtol=0, atol=1e-12)
    assert torch.equal(w[2], torch.ones(2, dtype=torch.float64))  # not lagged: exactly 1, not exp(0)-ish


@pytest.mark.parametrize("shift, weight", [(0.1, math.exp(0.1)), (1.5, CAP)])
def test_a_lagged_batch_scales_the_gradient_by_its_behaviour_weight(learner, tmp_path, shift, weight):
    """At the first optimiser step rho = pi_theta / pi_prox = 1 inside the clip range, so the gradient is linear in
    the advantages: behaviour log-probs lower by `shift` on every term scale it by min(e^shift, c) exactly."""
    learner.update(_batch(learner, None, seed=9))  # one update, so that a lagged version exists
    learner.save(tmp_path)
    current = learner.update(_batch(learner, learner.updates, shift, seed=1))  # current: the shift is ignored
    learner.load(tmp_path)
    lagged = learner.update(_batch(learner, learner.updates - 1, shift, seed=1))
    assert current["async/behaviour_weight_mean"] == 1.0 and current["async/staleness_max"] == 0.0
    assert current["policy/rollout_logp_absdiff_max"] == pytest.approx(shift, abs=1e-4)  # the recompute alarm sees it
    assert lagged["async/staleness_max"] == 1.0
    assert lagged["async/behaviour_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert lagged["async/behaviour_weight_capped"] == (1.0 if weight == CAP else 0.0)
    assert lagged["policy/rollout_logp_absdiff_max"] == 0.0  # a lagged batch's gap is its lag, not an alarm
    assert lagged["policy/grad_norm"] == pytest.approx(weight * current["policy/grad_norm"], rel=1e-4)


def test_a_batch_older_than_the_staleness_bound_is_refused(learner):
    learner.update(_batch(learner, None, seed=3))
    learner.update(_batch(learner, None, seed=4))
    with pytest.raises(ValueError, match=r"sampled 2 updates ago exceeds learner.max_staleness=1"):
        learner.update(_batch(learner, learner.updates - 2))
    with pytest.raises(ValueError, match=r"ahead of the learner"):
        learner.update(_batch(learner, learner.updates + 1))
