"""A real masked-diffusion LM by path (`arith.pretrained`), with its own tokenizer, through the same testbed,
sampler, verifier and learner (offline: a tiny LLaDA-interface model written to a temp directory)."""
from __future__ import annotations

import pytest
import torch

from steadyrl.services.config import CONFIG_DIR, load_config

CHARS = list("0123456789+=|")


def write_char_tokenizer(directory) -> None:
    """A character-level tokenizer (no download): [PAD]=0, [EOS]=1, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                            unk_token="[UNK]").save_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.assets.tiny_llada import write_tiny_llada

    d = tmp_path_factory.mktemp("tiny-llada")
    write_tiny_llada(d, vocab_size=24, mask_token_id=23)
    write_char_tokenizer(d)
    return d


def test_the_testbed_uses_the_models_tokenizer_and_mask_id(model_dir):
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml", [f"arith.pretrained={model_dir}", "arith.trust_remote_code=true"])
    testbed = build_testbed(cfg)
    assert testbed.mask_token_id == 23 and testbed.codec.eos_id == 1
    prompts, _ = testbed.train_prompts(0, 1, 0)
    assert prompts.shape == (16, 6) and testbed.codec.decode(prompts[0]) == testbed.task.problem(202, 0).prompt
    from safetensors.torch import load_file

    policy = testbed.build_policy(load_file(str(testbed.base_weights())))
    assert type(policy).__name__ == "TinyLLaDAModelLM"
    batch = testbed.eval_sampler().sample(policy, prompts[:3], 1, torch.Generator().manual_seed(0))
    # the verifier decodes with the model's tokenizer: the reference answers, encoded by it, score 1
    ensemble = testbed.reward_ensemble()
    answers = testbed.task.encode_completions(testbed.task.problems(202, range(3)), testbed.codec)
    assert ensemble.score_all(answers, prompts[:3]).reward.tolist() == [1.0, 1.0, 1.0]
    assert ensemble.score_all(batch.samples, batch.cond).reward.shape == (3,)


def test_a_pretrained_model_trains_in_process_through_the_same_code(model_dir):
    from benchmarks.inprocess import run_in_process
    from steadyrl.services.runtime import free_port

    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml",
                      [f"arith.pretrained={model_dir}", "arith.trust_remote_code=true", "run.steps=2",
                       "arith.eval_problems=8", "arith.prompts_per_step=4", "sampler.samples_per_class=4",
                       "learner.micro_batch_size=16", "learner.optim_batch_size=16"])
    out = run_in_process(cfg, free_port(), eval_every=2)
    assert len(out["rows"]) == 2 and out["stopped_at"] is None
    assert out["evals"][-1]["n_samples"] == 8 and 0 <= out["evals"][-1]["gold_accuracy"] <= 1


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
