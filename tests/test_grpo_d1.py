"""d1's token-level GRPO (`grpo.d1`): the per-token clipped ratio and k3 KL, token-averaged per micro-batch,
checked against the formula written out here, and learning on a masked-diffusion LM through the learner."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.builders import build_deepspeed_learner
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.objectives.grpo_d1 import GRPOD1Settings
from tests.helpers import after_first_eos, arith_prompts, masked_sampler, tiny_lm


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def one_step_sampler():
    return masked_sampler(estimator="one_step", mc_samples=2, gen_length=4, num_steps=4, prompt_mask_prob=0.3)


def rewarded(batch, token: int):
    r = (batch.samples[:, 0] == token).float()
    return batch.replace(rewards=r.unsqueeze(1), reward_names=["r"], reward_key="r")


def test_the_d1_loss_is_the_token_mean_of_the_clipped_ratio_and_k3_kl():
    """Off policy, the learner's gradient equals that of d1's loss written out: per MC sample and micro-batch,
    sum_{i,t} [-min(rho A, clip(rho) A) + beta k3] m / sum m over the positions up to each completion's first EOS,
    A = r - mean_g r, the step's loss the mean of those token means. Off policy: the second epoch of an update runs
    at the weights W1 the first epoch reached (an identical learner with one epoch gives W1), its old policy and
    reference are the start W0."""
    s = one_step_sampler()
    cfg = GRPOD1Settings(eps_clip=0.05, kl_coef=0.04)
    one = TOKENIZER.encode("1")[0]
    batch = rewarded(s.sample(tiny_lm(dtype=torch.float32), arith_prompts(4), 4, torch.Generator().manual_seed(0)), one)

    def learner(epochs: int):
        return build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, cfg, LearnerConfig(
            lr=1e-2, micro_batch_size=16, optim_batch_size=16, inner_epochs=epochs, grad_clip=1e9))

    first = learner(1)
    first.update(batch)
    policy, start = tiny_lm(dtype=torch.float32), tiny_lm(dtype=torch.float32)  # W1, and W0 (old = reference)
    policy.load_state_dict(first.weights())
    r, group = batch.train_reward(), batch.group
    adv = torch.stack([r[i] - r[group == group[i]].mean() for i in range(len(r))])
    assert (adv != 0).any()
    scored = ~after_first_eos(batch.samples)
    total, clipped = 0.0, False
    for mb, a, m in [(batch, adv, scored)]:  # one micro-batch: the learner's shuffle cannot regroup the means
        for j in range(2):
            with torch.no_grad():
                lp_old = s.log_prob(start, mb, j).token_logp
            lp = s.log_prob(policy, mb, j).token_logp
            rho = torch.exp(lp - lp_old)
            pg = -torch.minimum(rho * a[:, None], rho.clamp(1 - 0.05, 1 + 0.05) * a[:, None])
            d = lp_old - lp  # the reference is W0 too
            per_token = pg + 0.04 * (d.exp() - d - 1)
            total = total + (per_token * m).sum() / m.sum() / 2  # the mean over the 2 MC samples' pieces
            clipped = clipped or bool(((rho - 1).abs() > 0.05)[m].any())
    total.backward()
    second = learner(2)
    metrics = second.update(batch)
    assert clipped and metrics["policy/clip_frac"] > 0 and metrics["policy/kl_ref"] > 0  # every arm is live
    assert second._pre_clip_norm == pytest.approx(float(grads(policy).norm()), rel=1e-4)


def test_d1_grpo_raises_the_reward_of_a_token():
    s = one_step_sampler()
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, GRPOD1Settings(),
                                      LearnerConfig(lr=3e-3, micro_batch_size=16, inner_epochs=1))
    one = TOKENIZER.encode("1")[0]

    def batch(seed):
        policy = tiny_lm(dtype=torch.float32)
        policy.load_state_dict(learner.weights())
        return rewarded(s.sample(policy, arith_prompts(8, seed), 8, torch.Generator().manual_seed(seed)), one)

    start = float(batch(100).rewards.mean())
    for i in range(8):
        learner.update(batch(i))
    assert float(batch(100).rewards.mean()) > start + 0.2


def test_d1_grpo_is_refused_where_per_token_ratios_do_not_exist():
    from steadyrl.trainer.objectives import build_objective
    from steadyrl.trainer.terms import term_producer
    from tests.helpers import masked_sampler as ms

    objective = build_objective(GRPOD1Settings())
    with pytest.raises(ValueError, match="sampler.masks=shared, or sampler.estimator=one_step"):
        term_producer(objective, ms(masks="independent"), None)
    term_producer(objective, ms(masks="independent", estimator="one_step"), None)  # only the prompt masks differ
    from steadyrl.rollout.config import DDIMSamplerConfig
    from steadyrl.rollout.sampler_factory import build_sampler

    with pytest.raises(ValueError, match="per-token ratios of a masked-diffusion LM"):
        term_producer(objective, build_sampler(DDIMSamplerConfig()), None)
