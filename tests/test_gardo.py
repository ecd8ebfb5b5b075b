"""GARDO (paper and seed forms): each piece against an independent numpy/scipy reference, plus one real learner."""
from __future__ import annotations


import numpy as np
import pytest
import scipy.stats
import torch

from steadyrl.reward.diversity import cosine_nearest_neighbour_distance
from steadyrl.reward.uncertainty import descending_ranks, kendall_gate_score, rank_difference_uncertainty
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.objectives import TermInputs, build_objective
from steadyrl.trainer.objectives.gardo import (GARDOPaperSettings, adapt_beta, aux_scores, diversity_advantages,
                                      percentile_gate)
from steadyrl.trainer.objectives.gardo_seed import GARDOSeedSettings


def make_batch(rewards, names, group=None, features=None, key="proxy"):
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    B = rewards.shape[0]
    group = torch.zeros(B, dtype=torch.long) if group is None else torch.as_tensor(group)
    if features is None:
        features = torch.randn(B, 6, generator=torch.Generator().manual_seed(B), dtype=torch.float64)
    return RolloutBatch(cond=group.clone(), group=group, samples=torch.zeros(B, 1), traj=torch.zeros(B, 2, 1),
                        old_logp=torch.zeros(B, 1), timesteps=torch.zeros(1), trainable=torch.ones(1, dtype=torch.bool),
                        rewards=rewards, reward_names=list(names), reward_key=key, features=features)


class FakeHooks:
    def __init__(self):
        self.resets, self.emas = 0, []

    def reset_reference(self):
        self.resets += 1

    def ema_reference(self, decay):
        self.emas.append(decay)


# ---------------------------------------------------------------- uncertainty
def test_rank_difference_sign_on_a_hand_built_case_and_ranks_match_scipy():
    # the proxy orders 0 > 1 > 2 > 3; both auxiliaries order 3 > 2 > 1 > 0
    main = torch.tensor([4.0, 3.0, 2.0, 1.0])
    aux = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    u = rank_difference_uncertainty(main, aux, "code")
    assert u.tolist() == [-3.0, -1.0, 1.0, 3.0]  # sample 3: the proxy ranks it *worse* (4th vs 1st): u > 0
    assert rank_difference_uncertainty(main, aux, "over_rating").tolist() == [3.0, 1.0, -1.0, -3.0]
    # ranks over the whole batch (not per group), 1 = highest, ties in index order
    x = torch.tensor([[0.3, 1.0], [0.1, 1.0], [0.3, 2.0], [0.9, -1.0], [0.2, 1.0]])
    for k in range(2):
        expected = scipy.stats.rankdata(-x[:, k].numpy(), method="ordinal")
        assert descending_ranks(x)[:, k].tolist() == expected.tolist()
        assert descending_ranks(x[:, k]).tolist() == expected.tolist()


def test_aux_scores_exclude_the_proxy_and_the_ensemble_mean():
    b = make_batch(np.arange(12.0).reshape(3, 4), ["a", "proxy", "mean", "b"])
    assert aux_scores(b).tolist() == [[0.0, 3.0], [4.0, 7.0], [8.0, 11.0]]
    with pytest.raises(ValueError, match="auxiliary"):
        aux_scores(make_batch(np.ones((3, 2)), ["proxy", "mean"]))


# ---------------------------------------------------------------- gate and beta
@pytest.mark.parametrize("beta", [0.02, 0.1, 0.2, 0.25])
def test_gate_is_strictly_above_the_linear_percentile_of_the_nonnegative_u(beta):
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.integers(-6, 7, size=40) / 2.0, [0.0, 1.0, 2.0, 3.0, 4.0]])
    gate, thr = percentile_gate(torch.tensor(u), beta)
    ref_thr = np.percentile(u[u >= 0], 100 - 100 * beta, method="linear")
    assert thr == pytest.approx(ref_thr, abs=1e-12)
    assert gate.numpy().tolist() == ((u >= 0) & (u > ref_thr)).tolist()
    # strictness: 75th percentile of [0..4] is exactly 3: 3 is not gated, 4 is
    g, t = percentile_gate(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, -1.0]), 0.25)
    assert t == 3.0 and g.tolist() == [False, False, False, False, True, False]


def test_beta_multiplies_by_1_1_or_0_9_against_the_previous_window_and_stays_clipped():
    cfg = GARDOPaperSettings()
    w = torch.zeros(0, dtype=torch.float64)
    beta, w = adapt_beta(0.5, w, 1.0, cfg)  # empty window: beta_init
    assert beta == pytest.approx(0.1)
    beta, w = adapt_beta(beta, w, 2.0, cfg)  # m > max of the window *before* appending
    assert beta == pytest.approx(0.11)
    beta, w = adapt_beta(beta, w, 0.5, cfg)
    assert beta == pytest.approx(0.099)
    beta, w = adapt_beta(beta, w, 1.5, cfg)  # inside [min, max]: unchanged
    assert beta == pytest.approx(0.099) and w.tolist() == [1.0, 2.0, 0.5, 1.5]
    beta, w = adapt_beta(beta, w, 2.0, cfg)  # equal to the max (or min): strict comparisons, unchanged
    beta, w = adapt_beta(beta, w, 0.5, cfg)
    assert beta == pytest.approx(0.099)
    for i in range(30):
        beta, w = adapt_beta(beta, w, 10.0 + i, cfg)
        assert cfg.beta_min <= beta <= cfg.beta_max
    assert beta == pytest.approx(0.2) and len(w) == 20
    for i in range(40):
        beta, w = adapt_beta(beta, w, -1.0 - i, cfg)
    assert beta == pytest.approx(0.02)
    # the window holds the last 20: a big m 21 updates ago no longer blocks an increase
    w = torch.tensor([100.0] + [1.0] * 20, dtype=torch.float64)[-20:]
    assert adapt_beta(0.1, w, 50.0, cfg)[0] == pytest.approx(0.11)


def test_prepare_batch_gates_the_top_share_and_keeps_beta_in_state():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(48, 3))
    obj = build_objective(GARDOPaperSettings())
    b, m = obj.prepare_batch(make_batch(r, ["proxy", "aux1", "aux2"], group=np.repeat(np.arange(6), 8)))
    rk = [scipy.stats.rankdata(-r[:, k], method="ordinal") for k in range(3)]
    u = rk[0] - (rk[1] + rk[2]) / 2
    thr = np.percentile(u[u >= 0], 90, method="linear")  # first update: beta = 0.1
    assert b.extras["gardo_gate"].numpy().tolist() == (u > thr).tolist()
    assert m["gardo/beta"] == pytest.approx(0.1) and float(obj.state["beta"]) == pytest.approx(0.1)
    assert m["gardo/u_mean"] == pytest.approx(u[u >= 0].mean())
    assert m["gardo/gate_frac"] == pytest.approx((u > thr).mean())


# ---------------------------------------------------------------- KL on gated samples only
def step_inputs(kl, gate, n_terms, dt=0.25):
    b = len(kl)
    micro = make_batch(np.zeros((b, 2)), ["proxy", "aux"]).with_extras(gardo_gate=torch.tensor(gate))
    lp = torch.zeros(b, dtype=torch.float64, requires_grad=True)
    return TermInputs(new_logp=lp, old_logp=torch.zeros(b, dtype=torch.float64),
                      advantages=torch.linspace(-1, 1, b, dtype=torch.float64), step=torch.zeros(b, dtype=torch.long),
                      std=torch.ones(b, dtype=torch.float64), dt=torch.full((b,), dt, dtype=torch.float64),
                      n_terms=n_terms, kl_ref=kl, micro=micro)


@pytest.mark.parametrize("kl_mode,average", [("code", "all_terms"), ("exact", "all_terms"), ("code", "gated")])
def test_kl_is_paid_by_gated_samples_only(kl_mode, average):
    obj = build_objective(GARDOPaperSettings(kl_coef=0.5, kl=kl_mode, kl_average=average))
    kl = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64, requires_grad=True)
    inp = step_inputs(kl, [False, True, False, True], n_terms=10)
    loss, m = obj.loss(inp, {})
    pg = -inp.advantages.sum() / 10  # ratio 1
    scale = 0.25 if kl_mode == "code" else 1.0
    kl_term = (2.0 + 8.0) * scale / 10 * (4 / 2 if average == "gated" else 1)
    assert float(loss.detach()) == pytest.approx(float(pg) + 0.5 * kl_term, abs=1e-12)
    loss.backward()
    assert kl.grad[[0, 2]].tolist() == [0.0, 0.0] and (kl.grad[[1, 3]] > 0).all()
    assert float(m["gardo/kl_gated"]) == pytest.approx(5.0 * scale)
    # a micro-batch with no gated sample has no KL term (and no gradient into the KL)
    kl2 = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64, requires_grad=True)
    loss2, m2 = obj.loss(step_inputs(kl2, [False] * 4, n_terms=10), {})
    assert float(loss2.detach()) == pytest.approx(float(pg), abs=1e-12) and "gardo/kl_gated" not in m2
    assert torch.autograd.grad(loss2, kl2, allow_unused=True) == (None,)


# ---------------------------------------------------------------- their loss: std weight, gated KL mean
def their_micro_batch_loss(new_logp, old_logp, adv, sigma, kl_code, gate, clip, beta):
    """train_sd3_grpo_gardo.py's micro-batch loss in numpy: mean_b((std_b / mean std) * max(-A r, -A clip(r)))
    + beta * mean over the gated samples of their KL (kl_code: (mu - mu_ref)^2 / (2 std_dev_t^2), element-mean)."""
    r = np.exp(new_logp - old_logp)
    ppo = np.maximum(-adv * r, -adv * np.clip(r, 1 - clip, 1 + clip))
    policy = np.mean(sigma / sigma.mean() * ppo)
    return policy + (beta * kl_code[gate].mean() if gate.any() else 0.0)


def weighted_inputs(std, dt, gate, n_terms, seed=0):
    b = len(std)
    g = torch.Generator().manual_seed(seed)
    micro = make_batch(np.zeros((b, 2)), ["proxy", "aux"]).with_extras(gardo_gate=torch.tensor(gate))
    return TermInputs(new_logp=(0.3 * torch.randn(b, generator=g, dtype=torch.float64)).requires_grad_(),
                      old_logp=0.3 * torch.randn(b, generator=g, dtype=torch.float64),
                      advantages=torch.randn(b, generator=g, dtype=torch.float64), step=torch.arange(b) % 3,
                      std=torch.as_tensor(std, dtype=torch.float64), dt=torch.as_tensor(dt, dtype=torch.float64),
                      n_terms=n_terms, micro=micro,
                      kl_ref=torch.rand(b, generator=g, dtype=torch.float64).requires_grad_())


def test_paper_defaults_are_their_code():
    cfg = GARDOPaperSettings()
    assert cfg.kl_average == "gated" and cfg.std_weighting == "sigma"
    # gardo.seed keeps the earlier loss (all-terms KL, no std weight) as its default
    seed = GARDOSeedSettings()
    assert seed.kl_average == "all_terms" and seed.std_weighting == "none"


@pytest.mark.parametrize("gate", [[True, False, False, True, False], [False] * 5])
def test_default_loss_is_their_micro_batch_loss_with_mixed_steps(gate):
    """Mixed steps in one piece (ours draws each sample's step): the std weights are not 1. Our piece loss is their
    micro-batch loss scaled by b / n_terms (the pieces of an optimisation step sum to their mean over micro-batches);
    with no gated sample there is no KL term."""
    sigma = np.array([1.2, 0.7, 0.7, 0.4, 1.0])  # their std_dev_t per sample (noise level before sqrt|dt|)
    dt = np.array([0.1, 0.05, 0.05, 0.2, 0.1])
    n_terms, clip, beta = 15, 0.2, 0.3
    inp = weighted_inputs(sigma * np.sqrt(dt), dt, gate, n_terms)  # std = the step std s = sigma sqrt|dt|
    obj = build_objective(GARDOPaperSettings(kl_coef=beta, eps_clip=clip))
    loss, m = obj.loss(inp, {})
    g = np.array(gate)
    theirs = their_micro_batch_loss(inp.new_logp.detach().numpy(), inp.old_logp.numpy(), inp.advantages.numpy(),
                                    sigma, inp.kl_ref.detach().numpy() * dt, g, clip, beta)
    assert float(loss.detach()) == pytest.approx(theirs * 5 / n_terms, rel=1e-12)
    w = sigma / sigma.mean()
    assert not np.allclose(w, 1) and float(m["gardo/std_weight_max"]) == pytest.approx(w.max())
    if not g.any():
        assert torch.autograd.grad(loss, inp.kl_ref, allow_unused=True) == (None,)


def test_a_piece_sharing_one_step_has_std_weight_exactly_one():
    """As in their trainer (a micro-batch at one timestep): sigma_b / mean(sigma) = 1 exactly, the unweighted loss."""
    gate = [False, True, True, False]
    inp = weighted_inputs([0.3] * 4, [0.1] * 4, gate, n_terms=8, seed=1)
    weighted, m = build_objective(GARDOPaperSettings(eps_clip=0.2)).loss(inp, {})
    plain, _ = build_objective(GARDOPaperSettings(eps_clip=0.2, std_weighting="none")).loss(inp, {})
    assert float(m["gardo/std_weight_max"]) == 1.0 and float(weighted.detach()) == float(plain.detach())


def test_earlier_form_is_the_kl_all_no_std_weight_variant():
    """`gardo.paper[kl_all,no_std_weight]`: sum_i ppo_i / n_terms + kl_coef * sum_{gated} k_i dt_i / n_terms."""
    gate = np.array([True, False, True, False, False])
    std, dt = np.array([0.5, 0.2, 0.3, 0.9, 0.4]), np.array([0.1, 0.3, 0.2, 0.1, 0.05])
    inp = weighted_inputs(std, dt, gate.tolist(), n_terms=12, seed=2)
    cfg = GARDOPaperSettings(kl_coef=0.7, eps_clip=0.1, kl_average="all_terms", std_weighting="none")
    loss, _ = build_objective(cfg).loss(inp, {})
    r = np.exp(inp.new_logp.detach().numpy() - inp.old_logp.numpy())
    a = inp.advantages.numpy()
    ppo = np.maximum(-a * r, -a * np.clip(r, 0.9, 1.1))
    k = inp.kl_ref.detach().numpy() * dt
    assert float(loss.detach()) == pytest.approx(ppo.sum() / 12 + 0.7 * k[gate].sum() / 12, rel=1e-12)


@pytest.mark.parametrize("weighting", ["sigma", "step"])
def test_split_parts_sum_to_the_whole_piece_with_std_weight(weighting):
    """Parts of a piece split to fit memory, given the whole piece's statistics, sum to the whole piece's loss: the
    std weight's mean is over the whole piece (a sum over rows, `std_sum`), not over each part."""
    gate = [True, False, False, True, True, False]
    inp = weighted_inputs([0.5, 0.2, 0.3, 0.9, 0.4, 0.6], [0.1, 0.3, 0.2, 0.1, 0.05, 0.3], gate, n_terms=12, seed=3)
    obj = build_objective(GARDOPaperSettings(eps_clip=0.2, std_weighting=weighting))
    whole, _ = obj.loss(inp, {})
    stats = obj.piece_statistics(inp)
    parts = 0.0
    for idx in (torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])):
        part = TermInputs(new_logp=inp.new_logp[idx], old_logp=inp.old_logp[idx], advantages=inp.advantages[idx],
                          step=inp.step[idx], std=inp.std[idx], dt=inp.dt[idx], n_terms=12, kl_ref=inp.kl_ref[idx],
                          micro=inp.micro.index(idx), piece=stats)
        parts = parts + obj.loss(part, {})[0]
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), rel=1e-12)


# ---------------------------------------------------------------- reference resets
def run_step(obj, kls_per_piece, gates, n_terms):
    for kl, gate in zip(kls_per_piece, gates):
        obj.loss(step_inputs(torch.tensor(kl, dtype=torch.float64), gate, n_terms, dt=1.0), {})
    obj.step_done()  # as the learner, after the step's last piece


def test_reset_fires_on_the_windowed_kl_threshold_and_on_the_period():
    obj = build_objective(GARDOPaperSettings(ref_kl_threshold=1e-3, ref_reset_every=3))
    hooks = FakeHooks()
    # one optimisation step of 2 pieces x 2 samples: window = mean(piece gated means) = (2e-3 + 0)/2 = 1e-3:
    # not above the threshold
    run_step(obj, [[2e-3, 9.0], [5.0, 5.0]], [[True, False], [False, False]], n_terms=4)
    m = obj.after_update(hooks, {})
    assert m["gardo/kl_window_max"] == pytest.approx(1e-3) and hooks.resets == 0 and m["gardo/ref_reset"] == 0.0
    # two steps, the second one above the threshold -> reset after the update
    run_step(obj, [[0.0, 0.0]], [[True, True]], n_terms=2)
    run_step(obj, [[3e-3, 1e-3]], [[True, True]], n_terms=2)
    m = obj.after_update(hooks, {})
    assert m["gardo/kl_window_max"] == pytest.approx(2e-3) and hooks.resets == 1 and m["gardo/resets"] == 1.0
    # period: with low KL, the reset comes on the 3rd update after the last one
    for i in range(1, 7):
        run_step(obj, [[0.0, 0.0]], [[True, True]], n_terms=2)
        obj.after_update(hooks, {})
        assert hooks.resets == 1 + i // 3, i
    assert int(obj.state["resets"]) == 3


def test_seed_form_updates_the_reference_by_ema_and_never_resets():
    obj = build_objective(GARDOSeedSettings())
    hooks = FakeHooks()
    run_step(obj, [[1.0, 1.0]], [[True, True]], n_terms=2)
    m = obj.after_update(hooks, {})
    assert hooks.emas == [0.99] and hooks.resets == 0 and m["gardo/kl_window_max"] == 1.0


# ---------------------------------------------------------------- diversity-aware advantage
def reference_diversity(r, f, group):
    """Their PerPromptStatTracker.update(type='gardo') rewritten in numpy, plus the adv clip."""
    f = f / np.linalg.norm(f, axis=1, keepdims=True)
    adv, w, d = np.zeros_like(r), np.ones_like(r), np.zeros_like(r)
    for g in np.unique(group):
        ix = np.nonzero(group == g)[0]
        dist = 1 - np.clip(f[ix] @ f[ix].T, -1, 1)
        np.fill_diagonal(dist, np.inf)
        d[ix] = dist.min(axis=1)
        mean = r[ix].mean()
        w[ix] = np.where(r[ix] - mean < 0, 1.0, d[ix] / d[ix].mean())
        adv[ix] = (r[ix] - mean) * w[ix]
    return np.clip(adv, -5, 5), w, d


def test_diversity_weights_and_a_duplicate_has_zero_distance():
    rng = np.random.default_rng(2)
    group = np.repeat(np.arange(3), 5)
    r = rng.normal(size=15) * 3
    r[:5] = [1.0, 2.0, 3.0, 4.0, 5.0]  # sample 2 sits exactly at its group mean: weighted (their `< 0` test)
    f = rng.normal(size=(15, 7))
    f[3] = 2.5 * f[1]  # a duplicate up to scale: cosine distance 0 for both
    obj = build_objective(GARDOPaperSettings())
    b, m = obj.prepare_batch(make_batch(np.stack([r, -r], 1), ["proxy", "aux"], group, torch.tensor(f)))
    adv_ref, w_ref, d_ref = reference_diversity(r, f, group)
    d = cosine_nearest_neighbour_distance(torch.tensor(f), torch.tensor(group))
    assert d[1] == pytest.approx(0, abs=1e-12) and d[3] == pytest.approx(0, abs=1e-12)
    assert np.allclose(d.numpy(), d_ref, atol=1e-12)
    assert np.allclose(b.advantages.numpy(), adv_ref, atol=1e-9)
    above = r >= np.array([r[group == g].mean() for g in group])
    assert np.allclose(w_ref[~above], 1.0) and not np.allclose(w_ref[above], 1.0)
    assert m["gardo/div_weight_mean"] == pytest.approx(w_ref.mean())
    assert np.allclose(diversity_advantages(b, 5.0)[1].numpy(), w_ref, atol=1e-12) and w_ref[2] != 1.0
    # the std-normalised variant divides by the group's population std + eps_std
    obj2 = build_objective(GARDOPaperSettings(adv_std_normalise=True, adv_clip=100.0))
    b2, _ = obj2.prepare_batch(make_batch(np.stack([r, -r], 1), ["proxy", "aux"], group, torch.tensor(f)))
    std = np.array([r[group == g].std() for g in group]) + 1e-4
    assert np.allclose(b2.advantages.numpy(), _unclipped(r, f, group) / std, atol=1e-9)


def _unclipped(r, f, group):
    f = f / np.linalg.norm(f, axis=1, keepdims=True)
    out = np.zeros_like(r)
    for g in np.unique(group):
        ix = np.nonzero(group == g)[0]
        dist = 1 - np.clip(f[ix] @ f[ix].T, -1, 1)
        np.fill_diagonal(dist, np.inf)
        dd = dist.min(axis=1)
        out[ix] = (r[ix] - r[ix].mean()) * np.where(r[ix] < r[ix].mean(), 1.0, dd / dd.mean())
    return out


# ---------------------------------------------------------------- seed form: leave-one-out Kendall gate
def test_leave_one_out_kendall_gate_flags_the_disagreeing_sample_only():
    n = 12
    base = np.arange(n, dtype=float)
    main = base.copy()
    main[4] = 100.0  # the proxy puts sample 4 on top; both auxiliaries keep it in the middle
    aux = np.stack([base, base + 0.01 * np.sin(base)], 1)
    g = kendall_gate_score(torch.tensor(main), torch.tensor(aux))
    # against the definition, with scipy's tau-b on explicit subsets
    def tau(idx):
        return np.mean([scipy.stats.kendalltau(main[idx], aux[idx, k]).statistic for k in range(2)])
    full = tau(np.arange(n))
    ref = [(n - 2) / 2 * (tau(np.delete(np.arange(n), i)) - full) for i in range(n)]
    assert np.allclose(g.numpy(), ref, atol=1e-12)
    obj = build_objective(GARDOSeedSettings(kendall_delta=0.2))
    b, m = obj.prepare_batch(make_batch(np.concatenate([main[:, None], aux], 1), ["proxy", "a", "b"]))
    assert b.extras["gardo_gate"].nonzero().flatten().tolist() == [4]
    assert m["gardo/gate_frac"] == pytest.approx(1 / n)


# ---------------------------------------------------------------- state
def test_state_survives_state_dict_into_a_fresh_objective():
    rng = np.random.default_rng(3)
    cfg = GARDOPaperSettings(ref_reset_every=2)
    obj, hooks = build_objective(cfg), FakeHooks()
    batches = [make_batch(rng.normal(size=(16, 3)) * (1 + i), ["proxy", "a", "b"]) for i in range(6)]
    for b in batches[:5]:
        obj.prepare_batch(b)
        obj.after_update(hooks, {})
    fresh = build_objective(cfg)
    fresh.load_state_dict(obj.state_dict())
    for k in ("beta", "m_window", "updates_since_reset", "resets"):
        assert torch.equal(fresh.state[k], obj.state[k]), k
    assert len(obj.state["m_window"]) == 5 and int(obj.state["resets"]) == 2
    _, m1 = obj.prepare_batch(batches[5])
    _, m2 = fresh.prepare_batch(batches[5])
    assert m1["gardo/beta"] == m2["gardo/beta"]
    assert obj.after_update(hooks, {}) == fresh.after_update(FakeHooks(), {})


# ---------------------------------------------------------------- the real learner
def test_gardo_paper_in_the_deepspeed_learner_resets_the_reference_on_schedule():
    from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_scheduler, build_class_policy
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.trainer.config import LearnerConfig

    set_rank_env(free_port())
    from steadyrl.trainer.builders import build_deepspeed_learner

    torch.manual_seed(0)
    tiny = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    # the KL threshold is out of reach: the reset below comes from the period alone
    cfg = GARDOPaperSettings(eps_clip=0.2, kl_coef=0.05, ref_reset_every=1, ref_kl_threshold=1e9)
    learner = build_deepspeed_learner(build_class_policy(tiny), sampler, cfg,
                                      LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1), seed=0)
    assert learner.objective.needs_reference
    b = sampler.sample(learner.policy, torch.arange(4), 6, torch.Generator().manual_seed(0))
    x = b.samples.flatten(1)
    scores = torch.stack([x.mean(1), x.std(1), x[:, 0]], 1)
    rewards = torch.cat([scores, scores.mean(1, keepdim=True)], 1)
    b = b.replace(rewards=rewards, reward_names=["proxy", "aux1", "aux2", "mean"], reward_key="proxy",
                  features=x[:, :16])
    before = learner.weights()
    m = learner.update(b)
    for k in ("gardo/gate_frac", "gardo/beta", "gardo/u_mean", "gardo/div_weight_mean", "gardo/kl_window_max",
              "gardo/resets", "gardo/ref_reset", "policy/ratio_mean", "policy/clip_frac"):
        assert k in m and np.isfinite(m[k]), k
    assert m["gardo/beta"] == pytest.approx(0.1) and 0 < m["gardo/gate_frac"] < 0.2
    assert m["gardo/kl_gated"] > 0  # gated samples paid a KL (the reference lagged within the update)
    assert m["gardo/ref_reset"] == 1.0 and m["gardo/resets"] == 1.0
    after = learner.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    ref = learner.reference.trainable_state_dict()
    assert all(torch.equal(ref[k], after[k]) for k in after)
