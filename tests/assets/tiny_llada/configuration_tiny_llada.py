"""Configuration of a tiny random masked-diffusion LM that mirrors LLaDA's *interface* only.

Test asset, not LLaDA's code: it exists so the trust_remote_code loading route (config.json `auto_map`
-> these files) can be tested offline. What it shares with LLaDA is what the samplers rely on:
a `mask_token_id` in the config and `model(input_ids).logits` over bidirectional attention.
"""
from transformers import PretrainedConfig


class TinyLLaDAConfig(PretrainedConfig):
    model_type = "tiny_llada"

    def __init__(self, vocab_size: int = 32, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                 max_sequence_length: int = 64, mask_token_id: int | None = None, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.max_sequence_length = max_sequence_length
        self.mask_token_id = vocab_size - 1 if mask_token_id is None else mask_token_id  # LLaDA: 126336
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
