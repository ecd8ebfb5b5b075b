"""Reward models: accuracies, data separation, JPEG reward, ensemble uncertainty, diversity, caching."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from steadyrl.reward.base import UserRewardModel, check_scores
from steadyrl.reward.classifiers import load_classifier
from steadyrl.reward.config import RewardConfig, build_reward_models
from steadyrl.reward.diversity import mean_pairwise_distance, nearest_neighbour_distance
from steadyrl.reward.ensemble import RewardEnsemble, combine_scores, rank_disagreement
from steadyrl.reward.jpeg import JpegCompressibilityReward
from steadyrl.rollout.cache import build_dir_atomically
from steadyrl.rollout.digits import digit_splits, load_digits_tensors


@pytest.fixture(scope="module")
def models():
    members, monitors, _ = build_reward_models(RewardConfig())
    return members, monitors[0]


def test_splits_are_disjoint_and_cover_the_data():
    s = digit_splits()
    sets = [set(s.test), set(s.gold), set(s.proxy)]
    assert sum(len(x) for x in sets) == 1797 and len(set().union(*sets)) == 1797
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])


def test_classifier_accuracies_on_held_out_real_digits(models):
    members, gold = models
    images, labels = load_digits_tensors()
    test = torch.as_tensor(digit_splits().test)
    archs = {m.name for m in members}
    assert len(archs) >= 3
    proxy = next(m for m in members if m.name == RewardConfig().train_on)
    for m, floor in [(proxy, 0.90), (gold, 0.97)]:
        acc = float(m.correct(images[test], labels[test]).mean())
        assert acc >= floor, (m.name, acc)
        assert acc == pytest.approx(m.accuracy, abs=1e-6)  # the cached accuracy is what it measures
    # the reward is the probability of the requested digit: high for the true label, low for a wrong one
    assert float(proxy.score(images[test], labels[test]).mean()) > 0.85
    assert float(proxy.score(images[test], (labels[test] + 1) % 10).mean()) < 0.1


def test_gold_trains_on_data_disjoint_from_every_proxy():
    cfg = RewardConfig()
    assert cfg.gold.split == "gold" and all(m.split == "proxy" for m in cfg.members)
    with pytest.raises(ValueError, match="gold"):
        RewardConfig(gold=cfg.gold.model_copy(update={"split": "proxy"}))


def test_jpeg_reward_prefers_compressible_images():
    r = JpegCompressibilityReward()
    flat = torch.full((2, 1, 8, 8), -1.0)
    noise = torch.rand((2, 1, 8, 8), generator=torch.Generator().manual_seed(0)) * 2 - 1
    s = r.score(torch.cat([flat, noise]), torch.zeros(4, dtype=torch.long))
    assert s.shape == (4,) and bool((s[:2] > s[2:].max()).all())
    assert bool((s < 0).all())  # r = -kB


def test_rank_disagreement_is_zero_when_models_agree_and_positive_when_they_do_not():
    agree = torch.tensor([[0.1, 1.0], [0.2, 2.0], [0.3, 3.0]])
    assert torch.equal(rank_disagreement(agree), torch.zeros(3))
    disagree = torch.tensor([[0.1, 3.0], [0.2, 2.0], [0.3, 1.0]])
    u = rank_disagreement(disagree)
    assert torch.allclose(u, torch.tensor([0.5, 0.0, 0.5]))  # ends swap, the middle agrees
    # ranks are taken within a group: two internally consistent groups give zero
    two_groups = torch.tensor([[0.1, 1.0], [0.2, 2.0], [5.0, -3.0], [6.0, -2.0]])
    assert torch.equal(rank_disagreement(two_groups, torch.tensor([0, 0, 1, 1])), torch.zeros(4))


def test_combine_scores_mean_std_and_training_column():
    s = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    out = combine_scores(["a", "b"], s, None, "b")
    assert torch.equal(out.mean, torch.tensor([2.0, 2.0])) and torch.equal(out.std, torch.tensor([1.0, 0.0]))
    assert torch.equal(out.reward, s[:, 1])
    assert torch.equal(combine_scores(["a", "b"], s, None, "mean").reward, out.mean)
    with pytest.raises(ValueError, match="train_on='c'"):
        combine_scores(["a", "b"], s, None, "c")


def test_in_process_ensemble_scores_real_digits(models):
    members, gold = models
    ens = RewardEnsemble(members, "cnn", [gold], members[0], correct=["gold"])
    images, labels = load_digits_tensors()
    idx = torch.as_tensor(digit_splits().test[:40])
    out = ens.score_all(images[idx], labels[idx], labels[idx])
    assert out.scores.shape == (40, len(members)) and out.features.shape[0] == 40
    assert float(out.monitors["gold_correct"].mean()) > 0.9
    # the uncertainty is the stated rank statistic, recomputed independently with numpy
    scores, groups = out.scores.double().numpy(), labels[idx].numpy()
    expected = np.zeros(len(idx))
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        if len(rows) > 1:
            ranks = scores[rows].argsort(axis=0, kind="stable").argsort(axis=0, kind="stable") / (len(rows) - 1)
            expected[rows] = ranks.std(axis=1)
    assert np.allclose(out.uncertainty.double().numpy(), expected, atol=1e-6)
    assert float(out.uncertainty.max()) > 0  # the members do disagree on some real digits


def test_a_built_in_models_non_finite_scores_are_an_error_naming_it_and_a_users_become_nan():
    proxy = JpegCompressibilityReward(name="proxy")
    with pytest.raises(ValueError, match="'proxy' returned 1 non-finite"):
        check_scores(proxy, torch.tensor([0.1, float("nan")]), 2)
    with pytest.raises(ValueError, match="shape"):
        check_scores(proxy, torch.zeros(3), 2)

    class Users(UserRewardModel):
        name = "mine"

    kept = check_scores(Users(), torch.tensor([0.1, float("inf"), float("nan"), -float("inf")]), 4)
    assert kept[0] == 0.1 and kept[1:].isnan().all()


def test_diversity_nearest_neighbour_within_groups():
    f = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0], [100.0, 100.0]])
    g = torch.tensor([0, 0, 0, 1])
    d = nearest_neighbour_distance(f, g)
    assert torch.allclose(d, torch.tensor([1.0, np.hypot(3, 3), 1.0, 0.0], dtype=torch.float32))
    assert mean_pairwise_distance(f[:2], g[:2]) == pytest.approx(5.0)


def test_atomic_build_leaves_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "artefact"

    def broken(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash mid-build")

    with pytest.raises(RuntimeError):
        build_dir_atomically(target, broken)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    build_dir_atomically(target, lambda tmp: (tmp / "ok").write_text("1"))
    assert (target / "ok").read_text() == "1"


def _slow_build(tmp: Path, log: str) -> None:
    with open(log, "a") as f:
        f.write("built\n")
    time.sleep(1.5)
    (tmp / "ok").write_text("1")


def _build_in_child(target: str, log: str) -> None:
    build_dir_atomically(Path(target), lambda tmp: _slow_build(tmp, log))


def test_a_build_another_process_has_under_way_is_waited_for_not_repeated(tmp_path):
    """Two processes asking for one artefact (a test and the suite's pre-warmer, two workers on one node): the
    second waits for the first's lock and reuses its result."""
    target, log = tmp_path / "artefact", tmp_path / "builds.log"
    child = multiprocessing.get_context("fork").Process(target=_build_in_child, args=(str(target), str(log)))
    child.start()
    deadline = time.time() + 30
    while not log.exists():  # the child holds the lock and is building
        assert time.time() < deadline and child.is_alive(), "the child never started its build"
        time.sleep(0.01)
    assert build_dir_atomically(target, lambda tmp: _slow_build(tmp, str(log))) == target
    child.join(timeout=30)
    assert child.exitcode == 0
    assert log.read_text() == "built\n"  # once, by the child
    assert (target / "ok").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artefact", "builds.log"]  # no lock file left


def test_classifier_cache_is_reused_without_training(models, monkeypatch):
    from steadyrl.reward import classifiers

    def no_training(spec):
        raise AssertionError(f"classifier {spec.name!r} was retrained instead of loaded from the cache")

    monkeypatch.setattr(classifiers, "train_classifier", no_training)
    members, _ = models
    again = load_classifier(RewardConfig().members[0])
    for a, b in zip(again.model.state_dict().values(), members[0].model.state_dict().values()):
        assert torch.equal(a, b)


def test_one_factory_builds_every_reward_model_from_its_json_spec():
    """The Serve deployments receive `spec.model_dump()` and the in-process ensemble the spec itself: both
    go through `build_reward_model`, so the same spec gives the same scores."""
    import pydantic

    from steadyrl.reward.config import RewardConfig
    from steadyrl.reward.factory import JpegSpec, build_reward_model, parse_reward_spec
    from steadyrl.reward.jpeg import JpegCompressibilityReward
    from steadyrl.reward.verifiers import VerifierReward, VerifierSpec

    cfg = RewardConfig(jpeg=True)
    specs = [*cfg.member_specs(), cfg.gold, VerifierSpec(task="sudoku")]
    assert [s.kind for s in specs] == ["classifier"] * 3 + ["jpeg", "classifier", "verifier"]
    x = torch.rand(6, 1, 8, 8) * 2 - 1
    c = torch.arange(6) % 10
    for spec in specs[:5]:
        a, b = build_reward_model(spec), build_reward_model(parse_reward_spec(spec.model_dump()))
        assert type(a) is type(b) and a.name == b.name == spec.name
        assert torch.allclose(a.score(x, c), b.score(x, c))
    assert isinstance(build_reward_model(JpegSpec()), JpegCompressibilityReward)
    assert isinstance(build_reward_model({"kind": "verifier", "task": "sudoku"}), VerifierReward)
    with pytest.raises(pydantic.ValidationError, match="kind"):
        parse_reward_spec({"kind": "clip", "name": "x"})
