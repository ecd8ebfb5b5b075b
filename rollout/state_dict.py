"""Writing a model's weights: CPU copies of its state dict, saved as safetensors (no model library needed)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as CPU copies, one per entry: tied entries (an LM head sharing the embeddings, DiffusionGemma's
    shared encoder and decoder) become separate tensors, which safetensors can write."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def save_weights(model: torch.nn.Module, path: Path) -> None:
    save_file(cpu_state(model), str(path))
