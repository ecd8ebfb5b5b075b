"""The autoregressive sampler (rollout/autoregressive.py) and the arith_ar testbed: the exact likelihood against an
independent prefix-by-prefix computation, padding, EOS, seeding, and the config errors a user meets first."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.autoregressive import AutoregressiveSampler, TransformersGeneration
from steadyrl.rollout.batch import BEHAVIOUR_ENGINE, BEHAVIOUR_TOKEN_LOGP
from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm
from steadyrl.rollout.config import AutoregressiveSamplerConfig
from steadyrl.services.config import CONFIG_DIR, load_config
from tests.helpers import after_first_eos, arith_prompts

EOS, PAD = TOKENIZER.eos_id, TOKENIZER.pad_id
TINY = CausalLMConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=32)


def tiny_causal_lm(seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    return build_causal_lm(TINY, len(TOKENIZER), PAD, EOS).to(dtype).eval()


def sampler(**kw) -> AutoregressiveSampler:
    return AutoregressiveSampler(AutoregressiveSamplerConfig(**{"gen_length": 6, **kw}), EOS, PAD)


def reference_token_logp(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log softmax(f(x, y_<t) / T)[y_t] for each token up to the first EOS, one unpadded forward per prefix (no
    cache, no mask): an independent computation of the likelihood."""
    out, seq = [], list(prompt)
    for tok in completion:  # (called under no_grad)
        logits = model(torch.tensor([seq])).logits[0, -1].double()
        out.append(float(torch.log_softmax(logits / temperature, -1)[tok]))
        if tok == EOS:
            break
        seq.append(tok)
    return out


def padded(prompts: list[list[int]]) -> torch.Tensor:
    width = max(map(len, prompts))
    return torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_exact_likelihood_of_each_completion(temperature):
    """float64: the KV-cached loop's per-token log-probs, the stored sequence log-prob and the learner's one-pass
    recompute all equal the prefix-by-prefix reference (to 1e-9). (Left padding in float64 gives NaNs inside
    transformers' eager Llama attention; padding is checked in float32 below.)"""
    model, s = tiny_causal_lm(), sampler(temperature=temperature, logp_reduce="sum")
    prompts = arith_prompts(3)
    batch = s.sample(model, prompts, 3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        recomputed = s.log_prob(model, batch)
    for i in range(len(batch)):
        with torch.no_grad():
            ref = reference_token_logp(model, [t for t in batch.cond[i].tolist() if t != PAD],
                                       batch.samples[i].tolist(), temperature)
        n = len(ref)
        assert batch.extras[BEHAVIOUR_TOKEN_LOGP][i, :n].tolist() == pytest.approx(ref, abs=1e-9)
        assert recomputed.token_logp[i, :n].tolist() == pytest.approx(ref, abs=1e-9)
        assert float(batch.old_logp[i, 0]) == pytest.approx(sum(ref), abs=1e-9)
        assert float(recomputed.logp[i]) == pytest.approx(sum(ref), abs=1e-9)
    assert not batch.extras[BEHAVIOUR_ENGINE].any()  # the transformers backend shares the learner's numerics


def test_a_left_padded_prompt_scores_as_the_same_prompt_alone():
    """float32: a prompt padded to a longer one's width gets the tokens and log-probs it gets alone (greedy), in
    generation and in the learner's recompute."""
    model, s = tiny_causal_lm(dtype=torch.float32), sampler(temperature=0.0)
    short, long = TOKENIZER.encode("5+6="), TOKENIZER.encode("12+34=")
    alone = s.sample(model, torch.tensor([short]), 1, torch.Generator().manual_seed(0))
    both = s.sample(model, padded([long, short]), 1, torch.Generator().manual_seed(0))
    assert torch.equal(both.samples[1], alone.samples[0])
    torch.testing.assert_close(both.extras[BEHAVIOUR_TOKEN_LOGP][1], alone.extras[BEHAVIOUR_TOKEN_LOGP][0],
                               rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(s.log_prob(model, both).logp[1], s.log_prob(model, alone).logp[0], rtol=0, atol=1e-5)


def test_positions_after_the_first_eos_are_pad_and_never_scored():
    model, s = tiny_causal_lm(seed=3), sampler(gen_length=8)
    batch = s.sample(model, arith_prompts(6), 4, torch.Generator().manual_seed(1))
    after = after_first_eos(batch.samples)
    assert (batch.samples[after] == PAD).all()
    assert (batch.extras[BEHAVIOUR_TOKEN_LOGP][after] == 0).all()
    with torch.no_grad():
        lp = s.log_prob(model, batch)
    assert (lp.token_logp[after] == 0).all() and torch.equal(lp.valid, ~after)


def test_mean_reduction_divides_by_the_scored_length():
    model = tiny_causal_lm()
    batch = sampler(logp_reduce="sum").sample(model, arith_prompts(4), 2, torch.Generator().manual_seed(2))
    with torch.no_grad():
        total = sampler(logp_reduce="sum").log_prob(model, batch)
        mean = sampler(logp_reduce="mean").log_prob(model, batch)
    torch.testing.assert_close(mean.logp, total.logp / total.lengths, rtol=0, atol=1e-12)


def test_a_seed_replays_the_same_completions_and_greedy_decoding_is_the_argmax_path():
    model = tiny_causal_lm()
    prompts = arith_prompts(5)
    a = sampler().sample(model, prompts, 3, torch.Generator().manual_seed(7))
    b = sampler().sample(model, prompts, 3, torch.Generator().manual_seed(7))
    assert torch.equal(a.samples, b.samples)
    greedy = sampler(temperature=0.0).sample(model, prompts, 1, torch.Generator().manual_seed(0))
    with torch.no_grad():  # each greedy token is the argmax given the prompt and the tokens before it
        for i, prompt in enumerate(prompts.tolist()):
            seq = list(prompt)
            for tok in greedy.samples[i].tolist():
                assert tok == int(model(torch.tensor([seq])).logits[0, -1].argmax())
                if tok == EOS:
                    break
                seq.append(tok)


def test_transformers_generation_stops_when_every_row_has_ended():
    """A model that always predicts EOS: one forward pass for the prompt, none after (every row ended)."""
    model = tiny_causal_lm()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS] = 1.0
        model.model.norm.weight.fill_(1.0)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = TransformersGeneration(model).generate_tokens(arith_prompts(3), None, 6, 1.0, EOS, PAD,
                                                        torch.Generator().manual_seed(0))
    assert out.tokens[:, 0].eq(EOS).all() and out.tokens[:, 1:].eq(PAD).all()
    assert len(calls) == 1


def test_the_arith_ar_preset_validates_and_refuses_a_masked_diffusion_sampler():
    cfg = load_config(CONFIG_DIR / "arith-ar-grpo.yaml")
    assert cfg.testbed.name == "arith_ar" and cfg.sampler.kind == "autoregressive"
    with pytest.raises(ValueError, match="testbed 'arith_ar' needs sampler.kind=autoregressive"):
        load_config(CONFIG_DIR / "arith-ar-grpo.yaml", ["sampler.kind=masked_diffusion"])
    with pytest.raises(ValueError, match="sampler.backend"):
        load_config(CONFIG_DIR / "arith-ar-grpo.yaml", ["sampler.backend=sglang"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the message shown without vLLM")
def test_the_vllm_backend_without_vllm_installed_fails_before_ray_naming_the_extra():
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(load_config(CONFIG_DIR / "arith-ar-grpo.yaml", ["sampler.backend=vllm"]))
    with pytest.raises(ImportError, match=r"sampler.backend=vllm needs vLLM: `pip install 'steadyrl\[vllm\]'`"):
        testbed.preflight()


def test_a_sequence_level_behaviour_weight_applies_per_row_in_per_term_objectives():
    """Per-term objectives (grpo.d1, bgpo's per-step form) index a behaviour weight by (row, step); a sequence-level
    sampler's weight is one per row [b] (the bug this fixes raised IndexError)."""
    from steadyrl.trainer.recompute import OldPolicy

    old = OldPolicy(torch.zeros(4, 1), behaviour_weight=torch.tensor([1.0, 0.5, 2.0, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    rows = torch.tensor([1, 2, 3])
    assert old.weighted(adv, rows, torch.zeros(3, dtype=torch.long)).tolist() == [0.5, 2.0, -1.0]


@pytest.mark.parametrize("task", [
    ["testbed.task=sudoku", "sampler.gen_length=17", "testbed.model.max_positions=48",
     "testbed.pretrain.iterations=3"],
    ["testbed.task=file", "testbed.file.task_file=arith_addition"],  # the default base (shared with the e2e run)
])
def test_the_causal_lm_runs_every_arith_task_through_the_product_loop_with_an_exact_recompute_and_exact_updates(
        task, tmp_path):
    """Synthetic sudoku and a task file, each sampled, verified and updated for two steps by the local runtime of
    `steadyrl train` (the Ray path: tests/test_e2e_arith_ar.py), the learner's recompute matching the sampled
    log-probs. Sudoku's base (3 pre-training iterations) solves nothing, so every group's rewards tie: zero
    advantages and a policy at its reference give no gradient, and the checkpoint is bitwise the base. The task
    file's default base gets rewards that differ within groups, and its update moves every weight of the model."""
    from safetensors.torch import load_file

    from tests.helpers import train_local

    result, rows = train_local(CONFIG_DIR / "arith-ar-grpo.yaml", tmp_path / "run",
                               ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "testbed.eval_problems=8",
                                "testbed.prompts_per_step=4", *task])
    assert result.steps_done == 2 and len(rows) == 2
    assert all(r["policy/rollout_token_logp_absdiff_max"] < 1e-4 for r in rows)
    assert result.final_eval["n_samples"] == 8
    step = tmp_path / "run" / "checkpoints" / "step_2"
    policy, reference = (load_file(str(step / f"{name}.safetensors")) for name in ("policy", "reference"))
    assert policy and set(policy) == set(reference)
    unmoved = [k for k in policy if torch.equal(policy[k], reference[k])]
    if "testbed.task=sudoku" in task:
        assert all(r["health/zero_std_group_frac"] == 1 for r in rows) and len(unmoved) == len(policy)
    else:
        assert all(r["health/zero_std_group_frac"] < 1 for r in rows) and unmoved == []


def test_a_causal_lm_by_path_with_its_own_tokenizer_trains_through_the_product_loop(tmp_path):
    """testbed.pretrained: a local directory (save_pretrained: a Llama and a character-level tokenizer with its own
    EOS and pad) loads by path, samples under its tokenizer's ids and takes a learner step."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import train_local

    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + list("0123456789+=|"))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>")
    torch.manual_seed(0)
    model = build_causal_lm(TINY, len(vocab), vocab["<pad>"], vocab["<eos>"])
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result, rows = train_local(CONFIG_DIR / "arith-ar-grpo.yaml", tmp_path / "run",
                               [f"testbed.pretrained={tmp_path / 'model'}", "run.steps=1", "run.eval_every=1",
                                "testbed.eval_problems=4", "testbed.prompts_per_step=4"])
    assert result.steps_done == 1 and rows[0]["policy/rollout_token_logp_absdiff_max"] < 1e-4
    assert result.final_eval["n_samples"] == 4


@pytest.mark.parametrize("loader", ["causal", "masked"])
def test_a_diffusiongemma_checkpoint_is_refused_by_name_with_the_reason(loader, tmp_path):
    """DiffusionGemma (uniform-noise block diffusion) loads in transformers but neither of these samplers can train
    it: both testbeds' loaders say so, naming the model and the testbed that does (arith_bd), instead of failing
    later on a missing mask token or class."""
    from transformers import DiffusionGemmaConfig

    from steadyrl.rollout.causal_lm import load_pretrained_causal_lm
    from steadyrl.rollout.masked_lm import resolve_pretrained_masked_lm

    DiffusionGemmaConfig().save_pretrained(tmp_path)
    load = load_pretrained_causal_lm if loader == "causal" else resolve_pretrained_masked_lm
    with pytest.raises(ValueError, match=r"model_type 'diffusion_gemma'\) is not supported: DiffusionGemma is "
                                         r"uniform-noise block diffusion.*testbed.name=arith_bd"):
        load(str(tmp_path))
