"""One learner, any image sampler and any objective: the same update on both families, state that resumes."""
from __future__ import annotations


import pytest
import torch

from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from tests.helpers import IMAGE_FAMILIES, brightness_batch, make_image_learner


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


@pytest.mark.parametrize("family", sorted(IMAGE_FAMILIES))
def test_the_same_learner_update_trains_both_image_families(family):
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    learner = make_image_learner(IMAGE_FAMILIES[family], GRPOSettings(eps_clip=0.2), optim_batch_size=16)
    start = float(brightness_batch(learner, 100).samples.mean())
    for i in range(4):
        m = learner.update(brightness_batch(learner, i))
        # 24 samples in optimisation steps of 16 = 2 steps per update, whatever the sampler
        assert m["policy/optimizer_steps"] == 2 and m["policy/rollout_logp_absdiff_max"] < 1e-4
    assert float(brightness_batch(learner, 100).samples.mean()) > start + 0.05, family


def test_objective_state_and_reference_survive_save_and_load(tmp_path):
    """GARDO's adaptive beta, its m window and reset counter, and the reference model round-trip the checkpoint."""
    from steadyrl.trainer.objectives.gardo import GARDOPaperSettings

    cfg = GARDOPaperSettings(kl_coef=0.1, ref_reset_every=2, train_min_std=0.05)
    learner = make_image_learner(IMAGE_FAMILIES["ddim"], cfg)
    for i in range(3):
        learner.update(brightness_batch(learner, i))
    learner.save(tmp_path)
    state = learner.objective.state_dict()
    assert state and all(torch.is_tensor(v) for v in state.values())
    ref = {k: v.clone() for k, v in learner.reference.state_dict().items()}
    fresh = make_image_learner(IMAGE_FAMILIES["ddim"], cfg, seed=1)
    assert fresh.objective.state_dict().keys() != state.keys() or any(
        not torch.equal(fresh.objective.state_dict()[k], v) for k, v in state.items())
    fresh.load(tmp_path)
    restored = fresh.objective.state_dict()
    assert restored.keys() == state.keys() and all(torch.equal(restored[k], v) for k, v in state.items())
    assert all(torch.equal(fresh.reference.state_dict()[k], v) for k, v in ref.items())
    assert fresh.updates == 3
    # both continue identically from here (same weights, optimiser, RNG and objective state)
    batch = brightness_batch(learner, 50)
    a, b = learner.update(batch), fresh.update(batch)
    assert a["gardo/beta"] == b["gardo/beta"] and a["policy/grad_norm"] == pytest.approx(b["policy/grad_norm"], rel=1e-5)


def test_a_checkpoint_from_another_objective_is_refused(tmp_path):
    from steadyrl.trainer.objectives.grpo import GRPOSettings
    from steadyrl.trainer.objectives.stabledrl_paper import StableDRLPaperSettings

    make_image_learner(IMAGE_FAMILIES["ddim"], GRPOSettings()).save(tmp_path)
    with pytest.raises(ValueError, match="objective 'grpo'"):
        make_image_learner(IMAGE_FAMILIES["ddim"], StableDRLPaperSettings()).load(tmp_path)
