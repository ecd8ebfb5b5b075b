"""Weighted multi-reward training (reward/weighting.py, trainer/advantages.py, trainer/reward_stats.py) and the
reward back-propagation diversity term (trainer/diversity_loss.py), each against an independent numpy
re-computation. The batches are scored by the real digits classifier ensemble (cached classifiers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from steadyrl.reward.classifiers import load_classifier
from steadyrl.reward.config import ImageRewardConfig, RewardConfig, differentiable_train_reward
from steadyrl.reward.ensemble import attach_scores
from steadyrl.reward.factory import JpegSpec
from steadyrl.reward.weighting import WEIGHTED, WEIGHTING_KEY, RewardWeighting
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.digits import load_digits_tensors
from steadyrl.trainer.advantages import group_advantages, mean_centred_advantages
from steadyrl.trainer.diversity_loss import group_pairwise_distance
from steadyrl.trainer.objectives import TermInputs, build_objective
from steadyrl.trainer.objectives.registry import objective_class, settings_types
from steadyrl.trainer.reward_stats import weighting_panel

GROUPS, PER_GROUP = 3, 6
ADVANTAGE_OBJECTIVES = [n for n in settings_types() if objective_class(n).update_path == "policy_gradient"]
MEAN_CENTRED = ("grpo.d1", "stabledrl.code")  # no std division (their code)


def digits_batch(cfg: RewardConfig) -> RolloutBatch:
    """GROUPS prompt groups of PER_GROUP real digit images blended with noise at several strengths, scored by
    `cfg`'s ensemble (the real classifiers) and attached as the rollout workers do."""
    images, labels = load_digits_tensors()
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(GROUPS).repeat_interleave(PER_GROUP)
    cond = group + 3  # digits 3, 4, 5
    picks = [int(torch.nonzero(labels == (c if k % 2 == 0 else (c + 1) % 10))[k, 0])
             for k, c in enumerate(cond.tolist())]
    alpha = torch.linspace(0.3, 1.0, len(group))[torch.randperm(len(group), generator=gen)]
    x = alpha[:, None, None, None] * images[picks] + (1 - alpha[:, None, None, None]) * (
        torch.rand(len(group), 1, 8, 8, generator=gen) * 2 - 1)
    batch = RolloutBatch(cond=cond, group=group, samples=x, traj=x[:, None], old_logp=torch.zeros(len(x), 1),
                         timesteps=torch.zeros(1), trainable=torch.ones(1, dtype=torch.bool))
    scores = cfg.ensemble_spec().build().score_all(x, cond, group)
    return attach_scores(batch, scores)


def weighted(weights: dict[str, float], normalise: str = "sum", **kw) -> RewardConfig:
    return RewardConfig(train_on=WEIGHTED, weighting=RewardWeighting(weights=weights, normalise=normalise), **kw)


def np_z(r: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """(r - mean_g r) / (std_g r + eps), population std, per group."""
    out = np.zeros_like(r)
    for k in np.unique(g):
        m = g == k
        out[m] = (r[m] - r[m].mean()) / (r[m].std() + eps)
    return out


def np_gardo_weight(features: np.ndarray, g: np.ndarray, centred: np.ndarray) -> np.ndarray:
    """GARDO's novelty weight: d_i = min_{j != i in group} (1 - cos), w_i = d_i / mean_g d where centred_i >= 0."""
    f = features / np.linalg.norm(features, axis=1, keepdims=True)
    w = np.ones(len(g))
    for k in np.unique(g):
        idx = np.nonzero(g == k)[0]
        dist = 1 - f[idx] @ f[idx].T
        np.fill_diagonal(dist, np.inf)
        d = dist.min(axis=1)
        if d.mean() > 0:
            w[idx] = np.where(centred[idx] >= 0, d / d.mean(), 1.0)
    return w


def col(batch: RolloutBatch, name: str) -> np.ndarray:
    return batch.rewards[:, batch.reward_names.index(name)].double().numpy()


def advantages_of(name: str, batch: RolloutBatch) -> torch.Tensor:
    out, _ = build_objective(settings_types()[name]()).prepare_batch(batch)
    return out.advantages


# ---------------------------------------------------------------- the weighted reward from the real ensemble
def test_weighted_column_is_the_normalised_weighted_sum_of_the_real_members_scores():
    batch = digits_batch(weighted({"cnn": 7, "mlp": 3}))
    assert batch.reward_names == ["cnn", "mlp", "linear", "mean", WEIGHTED] and batch.reward_key == WEIGHTED
    expected = 0.7 * col(batch, "cnn") + 0.3 * col(batch, "mlp")
    np.testing.assert_allclose(batch.train_reward().double().numpy(), expected, rtol=1e-6, atol=1e-9)
    assert batch.meta[WEIGHTING_KEY].normalised() == pytest.approx({"cnn": 0.7, "mlp": 0.3})
    assert np.ptp(col(batch, "cnn")) > 0.1 and np.ptp(col(batch, "mlp")) > 0.1  # the batch has signal to weigh


def test_weights_7_3_train_like_0_7_0_3_and_70_30():
    advs = [advantages_of("grpo", digits_batch(weighted(w, "per_reward")))
            for w in ({"cnn": 7, "mlp": 3}, {"cnn": 0.7, "mlp": 0.3}, {"cnn": 70, "mlp": 30})]
    assert torch.allclose(advs[0], advs[1], atol=1e-6) and torch.allclose(advs[0], advs[2], atol=1e-6)


# ---------------------------------------------------------------- advantages of every objective, both modes
@pytest.mark.parametrize("name", ADVANTAGE_OBJECTIVES)
def test_per_reward_advantages_equal_the_weighted_sum_of_each_rewards_group_z_score(name):
    batch = digits_batch(weighted({"cnn": 7, "mlp": 3}, "per_reward"))
    g = batch.group.numpy()
    a = 0.7 * np_z(col(batch, "cnn"), g, 1e-4) + 0.3 * np_z(col(batch, "mlp"), g, 1e-4)
    if name.startswith("gardo"):  # its novelty weight multiplies the centred signal; no further std division
        a = a * np_gardo_weight(batch.features.double().numpy(), g, a)
    cfg = settings_types()[name]()
    clip = getattr(cfg, "adv_clip", None)
    expected = a if clip is None else np.clip(a, -clip, clip)
    np.testing.assert_allclose(advantages_of(name, batch).double().numpy(), expected, rtol=1e-5, atol=1e-6)
    # not the sum mode's: the group std of the weighted sum is not the weighted sum of the group stds
    assert not np.allclose(expected, np_z(0.7 * col(batch, "cnn") + 0.3 * col(batch, "mlp"), g, 1e-4), atol=1e-3)


@pytest.mark.parametrize("name", ["grpo", "grpo.d1", "stabledrl.code", "bgpo.paper"])
def test_sum_advantages_equal_the_objectives_own_normalisation_of_the_weighted_reward(name):
    batch = digits_batch(weighted({"cnn": 7, "mlp": 3}, "sum"))
    g = batch.group.numpy()
    r = 0.7 * col(batch, "cnn") + 0.3 * col(batch, "mlp")
    centred = np.array([r[i] - r[g == g[i]].mean() for i in range(len(r))])
    a = centred if name in MEAN_CENTRED else np_z(r, g, settings_types()[name]().eps_std)
    clip = getattr(settings_types()[name](), "adv_clip", None)
    expected = a if clip is None else np.clip(a, -clip, clip)
    np.testing.assert_allclose(advantages_of(name, batch).double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_per_reward_eps_std_is_the_weightings_own():
    batch = digits_batch(weighted({"cnn": 1, "mlp": 1}, "per_reward"))
    batch.meta[WEIGHTING_KEY] = batch.meta[WEIGHTING_KEY].model_copy(update={"eps_std": 0.5})
    g = batch.group.numpy()
    expected = 0.5 * np_z(col(batch, "cnn"), g, 0.5) + 0.5 * np_z(col(batch, "mlp"), g, 0.5)
    np.testing.assert_allclose(advantages_of("grpo", batch).double().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ADVANTAGE_OBJECTIVES)
def test_default_config_gives_exactly_the_single_reward_advantages(name):
    batch = digits_batch(RewardConfig())
    assert batch.reward_names == ["cnn", "mlp", "linear", "mean"] and batch.reward_key == "cnn"
    assert WEIGHTING_KEY not in batch.meta
    adv = advantages_of(name, batch)
    cfg = settings_types()[name]()
    r = batch.train_reward()
    if name.startswith("gardo"):
        centred = mean_centred_advantages(r.double(), batch.group)
        w = torch.as_tensor(np_gardo_weight(batch.features.double().numpy(), batch.group.numpy(), centred.numpy()))
        assert torch.allclose(adv.double(), (centred * w).clamp(-cfg.adv_clip, cfg.adv_clip), atol=1e-6)
        return
    old = mean_centred_advantages(r, batch.group) if name in MEAN_CENTRED else group_advantages(r, batch.group,
                                                                                                 cfg.eps_std)
    clip = getattr(cfg, "adv_clip", None)
    assert torch.equal(adv, old if clip is None else old.clamp(-clip, clip))  # bit for bit


# ---------------------------------------------------------------- per-reward statistics
@pytest.mark.parametrize("mode", ["sum", "per_reward"])
def test_weighting_panel_shares_and_correlations_match_numpy(mode):
    batch, _ = build_objective(settings_types()["grpo"]()).prepare_batch(
        digits_batch(weighted({"cnn": 3, "mlp": 1, "linear": 0}, mode)))
    m = weighting_panel(batch)
    g = batch.group.numpy()
    w = {"cnn": 0.75, "mlp": 0.25, "linear": 0.0}
    z = {k: np_z(col(batch, k), g, 1e-4) for k in w}
    c = z if mode == "per_reward" else {k: col(batch, k) - np.array([col(batch, k)[g == x].mean() for x in g])
                                        for k in w}
    mass = {k: np.abs(w[k] * c[k]).sum() for k in w}
    for k in w:
        assert m[f"reward/{k}_weight"] == pytest.approx(w[k])
        assert m[f"reward/{k}_std"] == pytest.approx(col(batch, k).std(), rel=1e-9)
        group_std = np.mean([col(batch, k)[g == x].std() for x in range(GROUPS)])
        assert m[f"reward/{k}_group_std"] == pytest.approx(group_std)
        assert m[f"reward/{k}_adv_share"] == pytest.approx(mass[k] / sum(mass.values()), rel=1e-9)
        assert m[f"reward/{k}_adv_corr"] == pytest.approx(np.corrcoef(z[k], batch.advantages.double().numpy())[0, 1],
                                                          abs=1e-9)
    assert m["reward/linear_adv_share"] == 0.0 and sum(m[f"reward/{k}_adv_share"] for k in w) == pytest.approx(1)
    assert weighting_panel(digits_batch(RewardConfig())) == {}  # no weighting: no new metrics


def test_a_weight_0_members_nan_does_not_void_the_sample():
    weighting = RewardWeighting(weights={"a": 1, "b": 0})
    scores = torch.tensor([[0.2, float("nan")], [0.6, 1.0], [0.1, 2.0], [0.5, 3.0]])
    group = torch.tensor([0, 0, 1, 1])
    assert weighting.combine(["a", "b"], scores).tolist() == pytest.approx([0.2, 0.6, 0.1, 0.5])
    per = weighting.model_copy(update={"normalise": "per_reward"})
    from steadyrl.trainer.advantages import per_reward_advantages
    adv = per_reward_advantages(scores, ["a", "b"], group, per)
    assert torch.equal(adv, group_advantages(scores[:, 0], group, 1e-4))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(train_on=WEIGHTED, weighting={"weights": {"cnn": 1, "resnet": 1}}), r"weights: \['resnet'\] are not trained"),
    (dict(train_on=WEIGHTED, weighting={"weights": {"cnn": 1, "gold": 1}}), r"\['gold'\] are monitors"),
    (dict(train_on=WEIGHTED, weighting={"weights": {"cnn": -1, "mlp": 2}}), "finite and >= 0"),
    (dict(train_on=WEIGHTED, weighting={"weights": {"cnn": 0, "mlp": 0}}), "at least one weight must be > 0"),
    (dict(train_on=WEIGHTED, weighting={"weights": {"cnn": 1}, "normalise": "rank"}), "normalise"),
    (dict(train_on=WEIGHTED), r"reward.train_on='weighted' needs reward.weighting"),
    (dict(weighting={"weights": {"cnn": 1}}), r"reward.weighting is set but reward.train_on='cnn'"),
])
def test_bad_weightings_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        RewardConfig.model_validate(kwargs)


def test_a_monitor_only_image_reward_cannot_be_weighted():
    models = [JpegSpec(name="a", upscale=1), JpegSpec(name="b", upscale=2), JpegSpec(name="held", upscale=4)]
    ok = ImageRewardConfig(models=models, monitor_only=["held"], train_on=WEIGHTED,
                           weighting=RewardWeighting(weights={"a": 7, "b": 3}))
    assert ok.ensemble_spec().weighting.normalised() == pytest.approx({"a": 0.7, "b": 0.3})
    with pytest.raises(ValidationError, match=r"\['held'\] are monitors"):
        ImageRewardConfig(models=models, monitor_only=["held"], train_on=WEIGHTED,
                          weighting=RewardWeighting(weights={"a": 1, "held": 1}))


def test_text_to_image_jpeg_pair_scores_the_weighted_sum():
    models = [JpegSpec(name="a", upscale=1), JpegSpec(name="b", upscale=2)]
    cfg = ImageRewardConfig(models=models, train_on=WEIGHTED, weighting=RewardWeighting(weights={"a": 7, "b": 3}))
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    s = cfg.ensemble_spec().build().score_all(images, ["p"] * 4, torch.zeros(4, dtype=torch.long))
    np.testing.assert_allclose(s.reward.double().numpy(), (0.7 * s.scores[:, 0] + 0.3 * s.scores[:, 1]).double(),
                               rtol=1e-6)


def test_differentiable_weighted_reward_is_the_weighted_sum_of_the_classifiers():
    cfg = weighted({"cnn": 7, "mlp": 3})
    x = digits_batch(cfg).samples.clone().requires_grad_(True)
    cond = torch.arange(GROUPS).repeat_interleave(PER_GROUP) + 3
    r = differentiable_train_reward(cfg)(x, cond)
    cnn, mlp = (load_classifier(m).differentiable_score(x, cond) for m in cfg.members[:2])
    assert torch.allclose(r, 0.7 * cnn + 0.3 * mlp, atol=1e-7)
    (grad,) = torch.autograd.grad(r.sum(), x)
    assert grad.abs().sum() > 0


# ---------------------------------------------------------------- the diversity term of reward back-propagation
def np_diversity(x: np.ndarray, g: np.ndarray, eps: float = 1e-12) -> tuple[float, np.ndarray]:
    """D = mean over same-group pairs i < j of sqrt(mean_d (x_i - x_j)^2 + eps), and dD/dx."""
    flat = x.reshape(len(x), -1)
    n_dim = flat.shape[1]
    pairs = [(i, j) for i in range(len(x)) for j in range(i + 1, len(x)) if g[i] == g[j]]
    grad = np.zeros_like(flat)
    total = 0.0
    for i, j in pairs:
        d = np.sqrt(((flat[i] - flat[j]) ** 2).mean() + eps)
        total += d
        grad[i] += (flat[i] - flat[j]) / (n_dim * d)  # d d_ij / d x_i
        grad[j] -= (flat[i] - flat[j]) / (n_dim * d)
    return total / len(pairs), grad.reshape(x.shape) / len(pairs)


def test_group_pairwise_distance_value_and_gradient_match_numpy():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2, 3, 3, generator=gen, dtype=torch.float64)
    x[5] = x[4]  # a coinciding pair: finite gradient
    g = torch.tensor([0, 1, 0, 0, 2, 2, 1])
    leaf = x.clone().requires_grad_(True)
    d, pairs = group_pairwise_distance(leaf, g)
    (grad,) = torch.autograd.grad(d, leaf)
    ref, ref_grad = np_diversity(x.numpy(), g.numpy())
    assert pairs == 5 and d.item() == pytest.approx(ref, rel=1e-12)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(grad).all()
    lone, n = group_pairwise_distance(leaf, torch.arange(7))
    assert n == 0 and lone.item() == 0.0


@pytest.mark.parametrize("name", ["draft", "grpo_guard.seed"])
def test_diversity_term_subtracts_lambda_d_times_its_piece_share(name):
    gen = torch.Generator().manual_seed(4)
    x0 = torch.randn(6, 1, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    micro = RolloutBatch(cond=group, group=group, samples=x0.detach(), traj=x0.detach()[:, None],
                         old_logp=torch.zeros(6, 1), timesteps=torch.zeros(1), trainable=torch.ones(1, dtype=bool))
    inputs = TermInputs(n_terms=10, micro=micro, sample=x0, reward_grad=torch.randn(6, 1, 4, 4, generator=gen,
                        dtype=torch.float64), reward=torch.zeros(6, dtype=torch.float64))
    S = settings_types()[name]
    off, m_off = build_objective(S()).loss(inputs, {})
    on, m_on = build_objective(S(diversity_coef=0.3)).loss(inputs, {})
    ref, ref_grad = np_diversity(x0.detach().numpy(), group.numpy())
    assert (on - off).item() == pytest.approx(-0.3 * ref * 6 / 10, rel=1e-12)
    assert "diversity/x0_pairwise" not in m_off and m_on["diversity/x0_pairwise"].item() == pytest.approx(ref)
    assert m_on["diversity/x0_pairs"].item() == 4.0
    (g_on,) = torch.autograd.grad(on, x0, retain_graph=True)
    (g_off,) = torch.autograd.grad(off, x0)
    np.testing.assert_allclose((g_on - g_off).numpy(), -0.3 * ref_grad * 6 / 10, rtol=1e-9, atol=1e-14)


def test_diversity_coef_must_not_be_negative():
    with pytest.raises(ValidationError, match="diversity_coef"):
        settings_types()["draft"](diversity_coef=-0.1)


def test_a_monitor_weight_is_refused_by_the_run_config_naming_the_testbeds_reward_section():
    from steadyrl.services.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["testbed.reward.train_on=weighted", "testbed.reward.weighting.weights={cnn: 7, gold: 3}"])
    assert "testbed.reward" in str(err.value) and "['gold'] are monitors" in str(err.value)


# ---------------------------------------------------------------- in the real DeepSpeed learner
def tiny_learner(objective_cfg, reward_fn=None):
    from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_class_policy, build_scheduler
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.trainer.config import LearnerConfig

    set_rank_env(free_port())
    from steadyrl.trainer.builders import build_deepspeed_learner

    torch.manual_seed(0)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    policy = build_class_policy(UNetConfig(block_out_channels=(8, 16), norm_num_groups=4))
    return build_deepspeed_learner(policy, sampler, objective_cfg, LearnerConfig(lr=1e-3, micro_batch_size=12,
                                                                                 inner_epochs=1), seed=0,
                                   reward_fn=reward_fn), sampler


def test_the_learner_trains_on_per_reward_advantages_and_logs_each_rewards_share():
    cfg = weighted({"cnn": 7, "mlp": 3}, "per_reward")
    learner, sampler = tiny_learner(settings_types()["grpo"](eps_clip=0.2))
    raw = sampler.sample(learner.policy, torch.arange(3, 7), 6, torch.Generator().manual_seed(0))
    batch = attach_scores(raw, cfg.ensemble_spec().build().score_all(raw.samples, raw.cond, raw.group))
    before = learner.weights()
    m = learner.update(batch)
    g = batch.group.numpy()
    z = {k: np_z(col(batch, k), g, 1e-4) for k in ("cnn", "mlp")}
    mass = {"cnn": np.abs(0.7 * z["cnn"]).sum(), "mlp": np.abs(0.3 * z["mlp"]).sum()}
    for k in ("cnn", "mlp"):
        assert m[f"reward/{k}_adv_share"] == pytest.approx(mass[k] / sum(mass.values()), rel=1e-6)
        assert np.isfinite(m[f"reward/{k}_adv_corr"])
    assert m["reward/cnn_weight"] == pytest.approx(0.7) and "reward/linear_weight" not in m
    after = learner.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_draft_with_the_diversity_term_logs_d_in_the_learner():
    cfg = weighted({"cnn": 7, "mlp": 3})
    learner, sampler = tiny_learner(settings_types()["draft"](backprop_steps=2, diversity_coef=0.1),
                                    reward_fn=differentiable_train_reward(cfg))
    raw = sampler.sample(learner.policy, torch.arange(3, 7), 3, torch.Generator().manual_seed(0))
    batch = attach_scores(raw, cfg.ensemble_spec().build().score_all(raw.samples, raw.cond, raw.group))
    m = learner.update(batch)
    ref, _ = np_diversity(raw.samples.double().numpy(), raw.group.numpy())  # x0 replayed: the same samples
    assert m["diversity/x0_pairwise"] == pytest.approx(ref, rel=1e-4) and m["diversity/x0_pairs"] == 12.0


# ---------------------------------------------------------------- the Serve ensemble combines alike
def test_the_serve_ensemble_scores_the_weighted_reward_and_carries_the_weighting(serve_port):
    from ray import serve

    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import TextToImageSettings
    from tests.helpers import make_testbed

    models = [JpegSpec(name="a", upscale=1), JpegSpec(name="b", upscale=2), JpegSpec(name="held", upscale=4)]
    cfg = ImageRewardConfig(models=models, monitor_only=["held"], train_on=WEIGHTED,
                            weighting=RewardWeighting(weights={"a": 7, "b": 3}, normalise="per_reward"))
    app, prefix = "weighted_jpeg", "/weighted_jpeg"
    deploy_reward_app(make_testbed(TextToImageSettings(pretrained="not-loaded-by-the-reward-app", reward=cfg)),
                      name=app, route_prefix=prefix)
    try:
        images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
        group = torch.tensor([0, 0, 0, 1, 1, 1])
        out = serve.get_app_handle(app).score_tensors.remote(images, ["p"] * 6, group).result()
        ref = cfg.ensemble_spec().build().score_all(images, ["p"] * 6, group)
        assert out.train_on == WEIGHTED and out.weighting == cfg.weighting
        assert torch.allclose(out.reward, 0.7 * out.scores[:, 0] + 0.3 * out.scores[:, 1], atol=1e-6)
        assert torch.allclose(out.reward, ref.reward, atol=1e-6)
        import httpx

        infos = httpx.get(f"http://127.0.0.1:{serve_port}{prefix}/v1/models", timeout=60).json()
        assert infos["train_on"] == WEIGHTED
        assert {m["name"]: m["trained_on"] for m in infos["models"]} == {"a": True, "b": True, "held": False}
    finally:
        serve.delete(app)
