"""A tiny bidirectional transformer that mirrors LLaDA's *interface* only (test asset, own code).

`TinyLLaDAModelLM(config)(input_ids).logits` is [B, S, V] with full (non-causal) attention, the way the
masked-diffusion samplers call LLaDA. Like LLaDA it is registered in config.json's `auto_map` under
AutoConfig, AutoModel and AutoModelForCausalLM and loads with `trust_remote_code=True`. Architecture: token embeddings, pre-norm
blocks (self-attention with rotary position embeddings, as LLaDA's, GELU MLP), a final norm and an untied LM
head. Like LLaDA's forward it takes `attention_mask` but no position ids: rotary attention only sees offsets,
so a left-padded row under its attention mask scores as the unpadded one.
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_tiny_llada import TinyLLaDAConfig


def rotate(x, base: float = 10000.0):
    """Rotary position embedding of q or k [B, H, S, d]: pairs (x_i, x_{i + d/2}) rotated by angle pos * base^(-2i/d)."""
    d = x.shape[-1] // 2
    freq = base ** (-torch.arange(d, dtype=x.dtype, device=x.device) / d)
    angle = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None] * freq
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h, key_mask=None):
        B, S, D = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q), rotate(k)
        bias = None
        if key_mask is not None:  # [B, S] True = attend; no causal mask anywhere
            bias = torch.zeros(B, 1, 1, S, dtype=q.dtype, device=q.device).masked_fill(
                ~key_mask.bool()[:, None, None, :], torch.finfo(q.dtype).min)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False)
        h = h + self.proj(a.transpose(1, 2).reshape(B, S, D))
        return h + self.mlp(self.norm2(h))


class TinyLLaDAModelLM(PreTrainedModel):
    config_class = TinyLLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config: TinyLLaDAConfig):
        super().__init__(config)
        d = config.d_model
        self.wte = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList(Block(d, config.n_heads) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.wte(input_ids)
        for block in self.blocks:
            h = block(h, attention_mask)
        return MaskedLMOutput(logits=self.lm_head(self.norm(h)))
