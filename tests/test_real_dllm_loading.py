"""A real dLLM loads by name through the same sampler and estimators (offline: HF_HUB_OFFLINE=1).

LLaDA's route is tested with a tiny random model of our own (tests/assets/tiny_llada) that exposes
LLaDA's interface (config.mask_token_id, model(input_ids).logits, auto_map -> AutoModel /
AutoModelForCausalLM) and loads from a local directory through trust_remote_code; the native route with
a tiny BertForMaskedLM plus a WordLevel tokenizer whose mask token id is set.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from steadyrl.rollout.config import MaskedDiffusionSamplerConfig
from steadyrl.rollout.masked_lm import load_pretrained_masked_lm
from steadyrl.rollout.sampler_factory import build_sampler
from tests.assets.tiny_llada import write_tiny_llada

VOCAB = 24
MASK_ID = VOCAB - 1


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llada_repo")
    original = write_tiny_llada(path, seed=0, vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                max_sequence_length=32)
    return path, original


def _tokenizer(mask_token: str = "[MASK]"):
    """A tiny WordLevel tokenizer (no download): words w0..w{n}, then the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", mask_token]
    vocab = {f"w{i}": i for i in range(VOCAB - len(specials))}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(specials)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   mask_token=mask_token)


def _bert(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, type_vocab_size=1,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=False)
    return BertForMaskedLM(config).eval()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bert_repo")
    original = _bert()
    original.save_pretrained(path)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path)
    return path, original, tokenizer.mask_token_id


def _sampler(mask_id: int, temperature: float = 0.0, estimator: str = "elbo"):
    cfg = MaskedDiffusionSamplerConfig(num_steps=4, gen_length=4, block_length=2, temperature=temperature,
                                       estimator=estimator, mc_samples=3, group_size=2,
                                       score_after_eos=True)  # the tiny tokenizer has no EOS
    return build_sampler(cfg, mask_token_id=mask_id)


def _prompts(n: int = 2, length: int = 3, seed: int = 1):
    return torch.randint(0, MASK_ID - 3, (n, length), generator=torch.Generator().manual_seed(seed))


def _check_sampler(model, mask_id: int):
    """Greedy generation is deterministic and mask-free; the float64 recompute (masks: shared, the rollout's
    stored masks) equals old_logp."""
    prompts = _prompts()
    greedy = _sampler(mask_id)
    first, second = greedy.generate(model, prompts), greedy.generate(model, prompts)
    assert first.shape == (2, 4) and torch.equal(first, second)
    assert not (first == mask_id).any()
    for estimator in ("elbo", "coupled"):
        sampler = _sampler(mask_id, temperature=1.0, estimator=estimator)
        batch = sampler.sample(model, prompts, n_per_cond=2, generator=torch.Generator().manual_seed(3))
        assert batch.samples.shape == (4, 4) and not (batch.samples == mask_id).any()
        assert batch.old_logp.dtype == torch.float64 and torch.isfinite(batch.old_logp).all()
        assert (batch.old_logp < 0).all()
        for j in range(sampler.cfg.mc_samples):
            recompute = sampler.log_prob(model, batch, j).logp  # the stored (rollout) masks
            torch.testing.assert_close(recompute, batch.old_logp[:, j], rtol=0, atol=1e-9)


def test_llada_style_loads_through_trust_remote_code(llada_dir):
    path, _ = llada_dir
    model, mask_id = load_pretrained_masked_lm(str(path), trust_remote_code=True, dtype=torch.float64)
    assert type(model).__name__ == "TinyLLaDAModelLM" and not model.training
    assert type(model).__module__.startswith("transformers_modules.")  # the directory's code, not the asset's
    assert mask_id == json.loads((path / "config.json").read_text())["mask_token_id"] == MASK_ID
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ids = _prompts(3, 7)
    assert model(ids).logits.shape == (3, 7, VOCAB)
    _check_sampler(model, mask_id)


def test_llada_style_weights_round_trip(llada_dir):
    path, original = llada_dir
    model, _ = load_pretrained_masked_lm(str(path), trust_remote_code=True)
    ids = torch.cat([_prompts(2, 5), torch.full((2, 3), MASK_ID)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_remote_code_without_trust_names_trust_remote_code(llada_dir):
    path, _ = llada_dir
    with pytest.raises(ValueError, match="trust_remote_code=True") as info:
        load_pretrained_masked_lm(str(path))
    assert str(path) in str(info.value)


def test_native_masked_lm_loads_by_path(bert_dir):
    path, original, tokenizer_mask_id = bert_dir
    model, mask_id = load_pretrained_masked_lm(str(path), dtype=torch.float64)
    assert type(model).__name__ == "BertForMaskedLM" and not model.training
    assert mask_id == tokenizer_mask_id == MASK_ID
    ids = torch.cat([_prompts(2, 5), torch.full((2, 3), MASK_ID)], dim=1)
    with torch.no_grad():  # the loaded weights are the saved ones
        torch.testing.assert_close(model(ids).logits, copy.deepcopy(original).double()(ids).logits, rtol=0, atol=0)
    _check_sampler(model, mask_id)


def test_model_without_mask_token_is_refused(tmp_path):
    path = tmp_path / "no_mask_repo"
    _bert().save_pretrained(path)  # no tokenizer, and BertConfig has no mask_token_id
    with pytest.raises(ValueError, match="no_mask_repo.*mask token id"):
        load_pretrained_masked_lm(str(path))


def test_native_model_that_is_no_masked_lm_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=VOCAB, n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "causal_repo")
    with pytest.raises(ValueError, match="causal_repo.*AutoModelForMaskedLM"):
        load_pretrained_masked_lm(str(tmp_path / "causal_repo"))
