"""Out-of-memory splitting (trainer/memory_split.py): a piece whose forward passes
`learner.activation_memory_cap_mb` is back-propagated in halves, and the update is the unsplit one.

Each learner test runs the same update three times on fresh, identical learners: without a cap, with a cap no
piece reaches (it measures the largest piece, and must not change a number), and with a cap below that, which
forces the split; the split update's parameters must equal the unsplit update's. The learners step with plain
SGD (a client optimiser of the real DeepSpeed engine): a parameter's change is lr x its gradient, where Adam's
first step, g / (|g| + eps), would turn float noise in a gradient that is zero in exact arithmetic (an attention
key's bias) into a full step of either sign."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.config import SchedulerConfig
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.builders import build_reference, prepare_network
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.memory_split import ActivationCapExceeded, SavedTensorMeter, halves
from steadyrl.trainer.objectives.gardo import GARDOPaperSettings
from steadyrl.trainer.objectives.grpo import GRPOSettings
from steadyrl.trainer.objectives.grpo_d1 import GRPOD1Settings
from steadyrl.trainer.objectives.grpo_guard import GRPOGuardPaperSettings
from steadyrl.trainer.objectives.registry import build_objective
from steadyrl.trainer.objectives.reward_backprop import DraftSettings
from steadyrl.trainer.objectives.stabledrl_code import StableDRLCodeSettings
from steadyrl.trainer.objectives.stabledrl_paper import StableDRLPaperSettings
from steadyrl.trainer.terms import steps_per_sample
from tests.helpers import (IMAGE_FAMILIES, TINY_UNET, after_first_eos, arith_prompts, brightness_batch, masked_sampler,
                           tiny_lm, update_error)

UNREACHED = 1e6  # MB: measures, never splits


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


def test_the_meter_counts_live_saved_storages_and_raises_past_the_cap():
    """exp saves its output: 4000 bytes per [1000] float32; the parameter's storage is never counted, a storage
    saved twice counts once, and a freed graph's bytes go."""
    w = torch.nn.Parameter(torch.randn(1000))
    meter = SavedTensorMeter(cap=float("inf"), skip={w.untyped_storage().data_ptr()})
    with meter.active():
        y = (w * 1.0).exp()  # mul by a number saves nothing; exp saves y
        z = y * y  # saves y twice: the same storage
        assert meter.bytes == 4000
        u = z.exp()
        assert meter.bytes == meter.peak == 8000
    del u
    assert meter.bytes == 4000  # u's graph (its saved u) is freed
    capped = SavedTensorMeter(cap=6000, skip=set())
    with capped.active(), pytest.raises(ActivationCapExceeded, match="activation_memory_cap_mb"):
        torch.randn(1000, requires_grad=True).exp().exp()
    assert capped.peak == 4000 and capped.bytes == 0  # the stopped forward's partial graph is freed: no leak


def test_halves_cut_recursively_to_the_limit_first_half_larger():
    assert [p.tolist() for p in halves(torch.arange(7), 2)] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [p.tolist() for p in halves(torch.arange(7), 7)] == [[0, 1, 2, 3, 4, 5, 6]]
    assert [p.tolist() for p in halves(torch.arange(3), 1)] == [[0], [1], [2]]


def sgd_learner(policy: torch.nn.Module, sampler, objective, reward_fn=None, **learner_kw):
    """A DeepSpeed learner stepping with SGD (learner_kw: LearnerConfig fields), built as the product builds it."""
    from steadyrl.trainer.learner import DeepSpeedLearner

    cfg = LearnerConfig(inner_epochs=1, **learner_kw)
    prepare_network(policy, cfg.balanced)
    reference = build_reference(policy)
    sgd = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    return DeepSpeedLearner(policy, sampler, build_objective(objective), cfg, reference=reference, optimizer=sgd,
                            reward_fn=reward_fn)


def run_update(build, batch, cap: float | None) -> tuple[dict[str, Tensor], dict[str, float], float]:
    """(weights after one update, its metrics, the pre-clip gradient norm of its last step) of a fresh learner."""
    learner = build(cap)
    metrics = learner.update(batch)
    return learner.weights(), metrics, learner._pre_clip_norm


def assert_same_sgd_update(after: dict[str, Tensor], reference: dict[str, Tensor], start: dict[str, Tensor]) -> None:
    """The SGD update equals the reference's to 1e-3 in L2 and, entry by entry, to 1e-3 of its largest move. Adding
    a gradient's pieces in another order moves float32 sums by ~1e-5 of the update (more on entries whose gradient is
    itself float noise, an attention key's bias); a piece weighted wrongly moves it by its share of the batch.
    Judged on the update, not the weights: a weight near 0 fails any rtol on noise."""
    error = update_error(after, reference, start)
    assert error < 1e-3  # measured 2e-7 .. 1.4e-5
    largest = max(float((reference[k] - start[k]).abs().max()) for k in reference)
    for k in reference:
        torch.testing.assert_close(after[k] - start[k], reference[k] - start[k], rtol=0, atol=1e-3 * largest, msg=k)


def assert_split_equals_unsplit(build, batch, fraction: float = 0.6) -> tuple[dict[str, float], dict[str, float]]:
    """The three updates of the module docstring; returns the split and the unsplit update's metrics."""
    plain, plain_m, plain_norm = run_update(build, batch, None)
    measured, measured_m, measured_norm = run_update(build, batch, UNREACHED)
    assert measured_m["memory/splits"] == 0 and "memory/piece_size_min" not in measured_m
    for k in plain:  # the meter only watches: bitwise the same update
        assert torch.equal(plain[k], measured[k]), k
    assert measured_norm == plain_norm
    peak = measured_m["memory/activation_mb_max"]
    assert peak > 0
    split, split_m, split_norm = run_update(build, batch, fraction * peak)
    assert split_m["memory/splits"] > 0 and split_m["memory/piece_size_min"] < build.micro_batch_size
    assert split_m["memory/activation_mb_max"] <= fraction * peak
    assert split_norm == pytest.approx(plain_norm, rel=1e-4)
    assert_same_sgd_update(split, plain, build.start)
    moved = sum(float((plain[k] - start).abs().max()) for k, start in build.start.items())
    assert moved > 0  # the update did something the split had to reproduce
    return split_m, plain_m


class ImageBuild:
    """Fresh tiny-UNet DDIM learners (lr 1e-3, micro-batches of 8, 2 optimisation steps) with a given cap."""

    micro_batch_size = 8

    def __init__(self, objective, reward_fn=None):
        self.objective, self.reward_fn = objective, reward_fn
        self.start = self(None).weights()

    def __call__(self, cap: float | None):
        torch.manual_seed(0)
        return sgd_learner(build_class_policy(TINY_UNET), build_sampler(IMAGE_FAMILIES["ddim"], SchedulerConfig()),
                           self.objective, reward_fn=self.reward_fn, lr=0.1, micro_batch_size=8, optim_batch_size=16,
                           activation_memory_cap_mb=cap)


def test_grpo_on_ddim_split_by_the_cap_gives_the_unsplit_update():
    build = ImageBuild(GRPOSettings(eps_clip=0.2))
    metrics, _ = assert_split_equals_unsplit(build, brightness_batch(build(None), seed=0))
    assert metrics["policy/samples"] == 24


def test_reward_backprop_split_re_runs_each_part_with_its_own_recorded_noise():
    """DRaFT-K re-runs the last K steps of each piece from the recorded noise: a part takes its rows' noise."""
    build = ImageBuild(DraftSettings(backprop_steps=2), reward_fn=lambda x, cond: x.mean(dim=(1, 2, 3)))
    assert_split_equals_unsplit(build, brightness_batch(build(None), seed=3))


def test_gardo_gated_kl_mean_and_its_reset_window_survive_the_split():
    """gardo.paper with kl_average=gated divides each piece's gated KL by the piece's gated count, and its reference
    reset reads a window that averages over pieces: both must be the whole piece's. So must the mean of its default
    std weight sigma_b / mean(sigma) (each sample at its own step: the weights are not 1)."""
    build = ImageBuild(GARDOPaperSettings(kl_average="gated", eps_clip=0.2, kl_coef=1.0))
    split_m, plain_m = assert_split_equals_unsplit(build, brightness_batch(build(None), seed=2))
    assert plain_m["gardo/kl_window_max"] > 0 and plain_m["gardo/gate_frac"] > 0
    assert plain_m["gardo/std_weight_max"] > 1.1
    assert split_m["gardo/kl_window_max"] == pytest.approx(plain_m["gardo/kl_window_max"], rel=1e-5)


def test_local_self_normalisation_keeps_the_whole_pieces_sum_when_split():
    """stabledrl.paper normalise=local divides each piece by its own sum of clipped ratios: a part must use the
    whole piece's (Objective.piece_statistics), or the update changes."""
    build = ImageBuild(StableDRLPaperSettings(normalise="local", eps_clip=0.2))
    assert_split_equals_unsplit(build, brightness_batch(build(None), seed=1), fraction=0.3)


def tiny_causal_lm() -> torch.nn.Module:
    from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm

    torch.manual_seed(0)
    tiny = CausalLMConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=32)
    return build_causal_lm(tiny, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id).eval()


class ArithBuild:
    """Fresh tiny language-model learners on arith prompts (micro-batches of 8, float32) with a given cap."""

    micro_batch_size = 8

    def __init__(self, objective, sampler, model=lambda: tiny_lm(dtype=torch.float32)):
        self.objective, self.sampler, self.model = objective, sampler, model
        self.start = self(None).weights()

    def __call__(self, cap: float | None):
        return sgd_learner(self.model(), self.sampler, self.objective, lr=0.1, micro_batch_size=8,
                           optim_batch_size=16, activation_memory_cap_mb=cap)


def arith_batch(sampler, seed: int, model=None):
    """16 completions of 4 prompts, rewarded 1 when the completion starts with the digit 1."""
    one = TOKENIZER.encode("1")[0]
    model = tiny_lm(dtype=torch.float32) if model is None else model
    b = sampler.sample(model, arith_prompts(4, seed), 4, torch.Generator().manual_seed(seed))
    r = (b.samples[:, 0] == one).float() + 0.1 * (torch.arange(len(b)) % 3)  # no group's rewards all equal
    return b.replace(rewards=r.unsqueeze(1), reward_names=["r"], reward_key="r")


def test_sequence_grpo_on_a_masked_diffusion_lm_split_by_the_cap_gives_the_unsplit_update():
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    build = ArithBuild(GRPOSettings(eps_clip=0.2, kl_coef=0.01), s)
    assert_split_equals_unsplit(build, arith_batch(s, seed=0))


def test_sequence_grpo_on_an_autoregressive_lm_split_by_the_cap_gives_the_unsplit_update():
    from steadyrl.rollout.autoregressive import AutoregressiveSampler
    from steadyrl.rollout.config import AutoregressiveSamplerConfig

    s = AutoregressiveSampler(AutoregressiveSamplerConfig(gen_length=6), TOKENIZER.eos_id, TOKENIZER.pad_id)
    build = ArithBuild(GRPOSettings(eps_clip=0.2), s, model=tiny_causal_lm)
    assert_split_equals_unsplit(build, arith_batch(s, seed=4, model=tiny_causal_lm()))


def test_stabledrl_code_softmax_over_the_step_and_sandwich_survive_the_split():
    """stabledrl.code's weights are a softmax over the step's samples and its EUBO needs every MC sample's tokens:
    both come from `prepare` over whole pieces, and a part reads its rows of them."""
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    build = ArithBuild(StableDRLCodeSettings(), s)
    assert_split_equals_unsplit(build, arith_batch(s, seed=5))


def test_d1_token_mean_over_the_micro_batch_survives_the_split():
    """grpo.d1 averages its per-token terms over the piece's scored tokens (a micro-batch statistic): the parts
    hold different token counts, and each must divide by the whole piece's."""
    s = masked_sampler(estimator="one_step", mc_samples=2, gen_length=4, num_steps=4, prompt_mask_prob=0.3)
    build = ArithBuild(GRPOD1Settings(eps_clip=0.2), s)
    batch = arith_batch(s, seed=1)
    scored = (~after_first_eos(batch.samples)).sum(1)
    assert len(set(scored.tolist())) > 1  # completions of several lengths: per-part token means would differ
    assert_split_equals_unsplit(build, batch)


def host_memory_bytes() -> int:
    """MemTotal + SwapTotal: a single allocation larger than this fails under Linux's default overcommit."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(info[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))


def refused_allocation() -> int:
    """0.4 x the host's memory, in bytes: an allocation of 2 of them succeeds (never touched, nothing is used) and
    one of 3 fails with the allocator's real out-of-memory error, as Linux refuses an allocation beyond RAM + swap."""
    size = int(0.4 * host_memory_bytes())
    try:
        torch.empty(2 * size, dtype=torch.uint8)
        refused = False
        torch.empty(3 * size, dtype=torch.uint8)
    except RuntimeError:
        refused = True
    if not refused:
        pytest.skip("this host does not refuse allocations beyond its memory (vm.overcommit_memory)")
    return size


def test_a_real_out_of_memory_error_in_the_forward_splits_the_piece():
    """A module that, with gradients on, allocates `refused_allocation()` bytes per sample: 8 and 4 samples fail
    with the allocator's real error, 2 fit. The update is the one of a learner without that module."""
    per_sample = refused_allocation()

    def hungry(module, args):
        if torch.is_grad_enabled():  # activations for the backward; the no-grad passes keep none
            torch.empty(len(args[0]) * per_sample, dtype=torch.uint8)

    build = ImageBuild(GRPOSettings(eps_clip=0.2))
    batch = brightness_batch(build(None), seed=0)
    plain, _, plain_norm = run_update(build, batch, None)
    learner = build(None)
    learner.network.register_forward_pre_hook(hungry)
    metrics = learner.update(batch)
    assert metrics["memory/piece_size_min"] == 2 and metrics["memory/splits"] == 2  # 8 -> 4 -> 2, then remembered
    pieces = 3 * steps_per_sample(learner.context())  # 3 micro-batches x the steps each sample trains, all split
    assert metrics["memory/pieces_split"] == pieces
    assert learner._pre_clip_norm == pytest.approx(plain_norm, rel=1e-4)
    assert_same_sgd_update(learner.weights(), plain, build.start)


def test_an_out_of_memory_error_in_the_backward_is_not_split_and_names_the_cap():
    """The backward of a piece has accumulated part of its gradient when it fails: no split, a clear error."""
    size = refused_allocation()
    build = ImageBuild(GRPOSettings(eps_clip=0.2))
    learner = build(None)
    hungry = lambda module, grad: torch.empty(3 * size, dtype=torch.uint8)  # noqa: E731 - the backward's allocation
    learner.network.conv_in.register_full_backward_pre_hook(hungry)
    with pytest.raises(RuntimeError, match=r"out of memory in the backward .*learner\.activation_memory_cap_mb"):
        learner.update(brightness_batch(build(None), seed=0))


def test_the_cap_over_several_zero_2_ranks_is_refused():
    with pytest.raises(ValidationError, match="activation_memory_cap_mb needs zero_stage 0 or 1"):
        LearnerConfig(activation_memory_cap_mb=10, ranks=2, zero_stage=2)


def test_a_cap_below_one_sample_fails_naming_the_setting():
    build = ImageBuild(GRPOSettings(eps_clip=0.2))
    learner = build(1e-6)
    with pytest.raises(MemoryError, match=r"one sample does not fit .*learner\.activation_memory_cap_mb"):
        learner.update(brightness_batch(build(None), seed=0))


def test_an_objective_whose_piece_statistic_has_a_gradient_refuses_the_split():
    """grpo_guard.paper's batch bias averages over the piece with gradient through every sample: no exact split."""
    build = ImageBuild(GRPOGuardPaperSettings(bias="batch"))
    with pytest.raises(MemoryError, match=r"objective\.bias=batch.*learner\.activation_memory_cap_mb"):
        build(1e-3).update(brightness_batch(build(None), seed=0))  # 1 kB: the whole piece passes it
