"""A real masked-diffusion LM by path (`arith.pretrained`), with its own tokenizer, through the same testbed,
sampler, verifier and learner (offline: a tiny LLaDA-interface model written to a temp directory)."""
from __future__ import annotations

import json

import pytest
import torch

from steadyrl.services.config import CONFIG_DIR, load_config

from tests.assets.tiny_llada import write_char_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.assets.tiny_llada import write_tiny_llada

    d = tmp_path_factory.mktemp("tiny-llada")
    write_tiny_llada(d, vocab_size=24, mask_token_id=23)
    write_char_tokenizer(d)
    return d


# the in-process run: 2 steps of GRPO on 4 prompts x 4 samples, evaluated (greedy) on 8 held-out problems
RUN = ["testbed.trust_remote_code=true", "run.steps=2", "testbed.eval_problems=8", "testbed.prompts_per_step=4",
       "sampler.group_size=4", "learner.micro_batch_size=16", "learner.optim_batch_size=16"]
MEMORISED = 6  # held-out problems 0-5 the model is taught; 6 and 7 it has never seen


def run_config(model_dir):
    return load_config(CONFIG_DIR / "arith-grpo.yaml", [f"testbed.pretrained={model_dir}", *RUN])


@pytest.fixture(scope="module")
def memorising_model_dir(tmp_path_factory):
    """The tiny LLaDA taught (masked-token loss on random masks of the completion, 200 Adam steps, ~1 s) the answers
    of the run's first MEMORISED held-out problems, so that its evaluation has a known, non-zero accuracy, and of
    the 8 training problems of its 2 steps, so that its rollouts earn rewards (mixed ones: an update that moves)."""
    from safetensors.torch import save_file

    from steadyrl.services.testbeds import build_testbed
    from tests.assets.tiny_llada import write_tiny_llada

    d = tmp_path_factory.mktemp("tiny-llada-memorising")
    model = write_tiny_llada(d, vocab_size=24, mask_token_id=23)
    write_char_tokenizer(d)
    testbed = build_testbed(run_config(d))
    a = testbed.settings
    problems = testbed.task.problems(a.eval_seed, range(MEMORISED)) + testbed.task.problems(a.train_seed, range(8))
    x = torch.cat([testbed.task.encode_prompts(problems, testbed.codec),
                   testbed.task.encode_completions(problems, testbed.codec)], 1).repeat(4, 1)
    L = testbed.task.gen_length
    P = x.shape[1] - L
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(200):
        masked = torch.rand(len(x), L, generator=gen) < torch.rand(len(x), 1, generator=gen)
        masked[torch.arange(len(x)), torch.randint(L, (len(x),), generator=gen)] = True  # at least one
        inputs = x.clone()
        inputs[:, P:][masked] = testbed.mask_token_id
        loss = torch.nn.functional.cross_entropy(model(inputs).logits[:, P:][masked], x[:, P:][masked])
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


def test_the_testbed_uses_the_models_tokenizer_and_mask_id(model_dir):
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml", [f"testbed.pretrained={model_dir}", "testbed.trust_remote_code=true"])
    testbed = build_testbed(cfg)
    assert testbed.mask_token_id == 23 and testbed.codec.eos_id == 1
    prompts, _ = testbed.train_prompts(0, 1, 0)
    assert prompts.shape == (cfg.testbed.prompts_per_step, 6)
    assert testbed.codec.decode(prompts[0]) == testbed.task.problem(202, 0).prompt
    from safetensors.torch import load_file

    policy = testbed.build_policy(load_file(str(testbed.base_weights())))
    assert type(policy).__name__ == "TinyLLaDAModelLM"
    batch = testbed.eval_sampler().sample(policy, prompts[:3], 1, torch.Generator().manual_seed(0))
    # the verifier decodes with the model's tokenizer: the reference answers, encoded by it, score 1
    ensemble = testbed.reward_ensemble()
    answers = testbed.task.encode_completions(testbed.task.problems(202, range(3)), testbed.codec)
    assert ensemble.score_all(answers, prompts[:3]).reward.tolist() == [1.0, 1.0, 1.0]
    assert ensemble.score_all(batch.samples, batch.cond).reward.shape == (3,)


def test_a_pretrained_model_trains_in_process_through_the_same_code(memorising_model_dir, tmp_path):
    """The run's evaluations, before and after training, are the held-out accuracy of its policy's greedy answers,
    recomputed here apart from the testbed's loading and scoring: the base model loaded by transformers' AutoModel
    (remote code), answers decoded by the model's own tokenizer and compared with the problems' sums; the trained
    policy is the run's last checkpoint (the local runtime: the product loop in this process)."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    from steadyrl.services.testbeds import build_testbed
    from tests.helpers import train_local

    cfg = run_config(memorising_model_dir)
    result, rows = train_local(CONFIG_DIR / "arith-grpo.yaml", tmp_path / "run",
                               [f"testbed.pretrained={memorising_model_dir}", *RUN, "run.eval_every=2"])
    evals = json.loads((result.run_dir / "evals.json").read_text())
    assert len(rows) == 2 and [e["step"] for e in evals] == [0, 2] and all(e["n_samples"] == 8 for e in evals)

    testbed = build_testbed(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(memorising_model_dir))
    problems = testbed.task.problems(cfg.testbed.eval_seed, range(8))
    prompts = testbed.eval_prompts()
    assert [tokenizer.decode(p) for p in prompts] == [p.prompt for p in problems]

    def accuracy(policy) -> float:
        rows = testbed.eval_sampler().sample(policy, prompts, 1, torch.Generator().manual_seed(0)).samples.tolist()
        eos = tokenizer.eos_token_id
        answers = [tokenizer.decode(row[:row.index(eos)] if eos in row else row) for row in rows]
        return sum(a == p.answer for a, p in zip(answers, problems)) / len(problems)

    base = AutoModel.from_pretrained(str(memorising_model_dir), trust_remote_code=True).eval()
    assert accuracy(base) >= MEMORISED / 8  # the taught answers come out: the equalities below are not 0 == 0
    final = testbed.build_policy(load_file(str(result.run_dir / "checkpoints" / "step_2" / "policy.safetensors")))
    trained = final.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in base.state_dict().items())  # the updates moved it
    assert evals[0]["held_out"] == accuracy(base)
    assert evals[-1]["held_out"] == accuracy(final)


def test_tied_weights_left_out_by_save_pretrained_are_rebuilt(tmp_path):
    """BERT ties its LM head to the embeddings and save_pretrained stores one copy: the architecture
    rebuilt from the config still holds every weight; weights that do not fit are refused by name."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForMaskedLM

    from steadyrl.rollout.masked_lm import pretrained_architecture_with_weights

    cfg = BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0,
                     attention_probs_dropout_prob=0, mask_token_id=15)
    original = BertForMaskedLM(cfg).eval()
    original.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert len(weights) < len(original.state_dict())  # the tied copy is not stored
    rebuilt = pretrained_architecture_with_weights(str(tmp_path), weights)
    x = torch.randint(0, 15, (2, 6))
    assert torch.equal(original(x).logits, rebuilt(x).logits)
    with pytest.raises(ValueError, match="unexpected \\['junk'\\]"):
        pretrained_architecture_with_weights(str(tmp_path), {**weights, "junk": torch.zeros(1)})
