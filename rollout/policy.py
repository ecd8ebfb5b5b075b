"""The policy seam: what an image sampler calls, between the sampler and whatever network predicts.

    prediction = policy(x_t, t, cond)          # = policy.predict(x_t, t, cond): epsilon or velocity, x_t's shape

`cond` is what the batch carries for the model (`RolloutBatch.model_cond`): class ids [B] for a
class-conditional UNet, or a dict of per-sample tensors (text embeddings, pooled embeddings, the negative
prompt's embeddings) for a text-to-image model; the policy owns how it is used (class embedding,
cross-attention, classifier-free guidance), so sampling and the log-prob recompute call the same function.

A policy also says which of its tensors are trained (`trainable_state_dict`: the whole network, or only
LoRA adapters), and that is what the optimiser steps, the learner publishes to rollout workers and the
checkpoint keeps. Its `reference()` is the frozen policy a KL or reference reset compares against: a
frozen copy when the whole network trains, the same network with the reference's adapter values swapped
in when only adapters train (at the start: the zero-initialised adapters, i.e. adapters off).
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, Union

import torch
from torch import Tensor, nn

Cond = Union[Tensor, dict[str, Tensor]]  # class ids [B], or per-sample model inputs {name: [B,...]}


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU for a module without parameters)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    """A policy's trained tensors (`Policy.trainable_state_dict`); a plain network's whole state dict."""
    return module.trainable_state_dict() if hasattr(module, "trainable_state_dict") else module.state_dict()


def load_trainable_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Load what `trainable_state` returned (into a policy, its reference or a plain network)."""
    if hasattr(module, "load_trainable_state_dict"):
        module.load_trainable_state_dict(state)
    else:
        module.load_state_dict(state)


def state_bytes(state: dict[str, Tensor]) -> int:
    """Bytes a state dict occupies (what one weight sync moves through the object store)."""
    return sum(v.numel() * v.element_size() for v in state.values())


def make_reference(module: nn.Module) -> nn.Module:
    """The frozen reference of a policy (`Policy.reference`); of a plain network, a frozen copy."""
    if hasattr(module, "reference"):
        return module.reference()
    return copy.deepcopy(module).eval().requires_grad_(False)


class AdaptableNetwork(nn.Module):
    """A network (`self.net`) and what of it trains: the whole network, or only its LoRA adapters
    (`trained_keys`, set by `rollout.lora.add_lora`). Image policies and masked-LM policies share this."""

    net: nn.Module

    #: names (in `net.state_dict()`) of the only tensors that train (LoRA adapters); None: the whole network
    trained_keys: frozenset[str] | None = None

    @property
    def device(self) -> torch.device:
        return module_device(self)

    @property
    def adapters_only(self) -> bool:
        """True when only adapters train: the frozen rest never leaves this process."""
        return self.trained_keys is not None

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The tensors the optimiser trains (whole network, or its adapters), keyed as the network names
        them; shares storage with the live parameters."""
        state = self.net.state_dict()
        if self.trained_keys is None:
            return state
        return {k: v for k, v in state.items() if k in self.trained_keys}

    @torch.no_grad()
    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy in a `trainable_state_dict` (a weight sync or a checkpoint); every key must match."""
        own = self.trainable_state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"trainable weights do not fit this policy: missing {missing[:3]}, unexpected {extra[:3]}")
        if not self.adapters_only:
            self.net.load_state_dict(state)
            return
        for k, v in state.items():
            own[k].copy_(v)

    def reference(self) -> nn.Module:
        """The frozen reference policy (see the module docstring)."""
        if self.adapters_only:
            return AdapterReference(self)
        return copy.deepcopy(self).eval().requires_grad_(False)


class LanguageModelPolicy(AdaptableNetwork):
    """A language model (masked-diffusion or causal) as a trainable policy: called exactly as the bare model
    (`policy(input_ids, attention_mask=..., position_ids=...).logits`), plus what trains (the whole network or
    its LoRA adapters, `rollout.lora.add_lora`) and its frozen reference (`AdaptableNetwork`)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        return self.net(input_ids, **kwargs)


# language-model families the masked-diffusion and autoregressive loaders refuse, and where they train instead
UNSUPPORTED_LM_FAMILIES = {
    "diffusion_gemma": "DiffusionGemma is uniform-noise block diffusion (no mask token: a block starts as random "
                       "tokens and is re-noised with random tokens): train it with testbed.name=arith_bd and "
                       "sampler.kind=block_diffusion",
}


def check_lm_family(config: Any, name: str) -> None:
    """Refuse, naming the model and the reason, a language-model family this loader's sampler cannot train."""
    reason = UNSUPPORTED_LM_FAMILIES.get(getattr(config, "model_type", None))
    if reason is not None:
        raise ValueError(f"testbed.pretrained={name!r} (model_type {config.model_type!r}) is not supported: {reason}")


def lora_targets_by_type(net: Any, table: dict[str, list[str]]) -> list[str]:
    """The default LoRA target modules of a language model (or of its transformers config), by its model type
    (`table`)."""
    model_type = getattr(getattr(net, "config", net), "model_type", None)
    if model_type not in table:
        raise ValueError(f"no default LoRA targets for model type {model_type!r} (known: {', '.join(table)}): name "
                         "them with testbed.lora.target_modules")
    return table[model_type]


def load_tied_weights(model: nn.Module, weights: dict[str, Tensor], name: str) -> nn.Module:
    """A transformers model (built from its config) holding `weights`, in their dtype and eval mode. Tied copies
    that `save_pretrained` leaves out (an LM head tied to the embeddings) are re-tied; any other missing or
    unexpected key is an error naming the model."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    state = model.state_dict()
    loaded = {state[k].data_ptr() for k in weights if k in state}
    untied = [k for k in missing if state[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(f"weights do not fit {name!r}: missing {untied[:5]}, unexpected {unexpected[:5]}")
    return model.to(next(iter(weights.values())).dtype).eval()


class Policy(AdaptableNetwork, ABC):
    """A denoising network behind `predict(x_t, t, cond)`. Subclasses hold the network as `self.net`.

    `autocast`: a reduced-precision dtype (bf16/fp16) the prediction runs under (`torch.autocast` on x's
    device; None: full precision); the output is cast back to x_t's dtype, so the sampler's Gaussian stays
    in float32/64.
    """

    autocast: torch.dtype | None = None

    @abstractmethod
    def predict(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """The network's prediction (epsilon or velocity) at x [B,...], model timesteps t [B] or []."""

    def forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        if self.autocast is None:
            return self.predict(x, t, cond)
        with torch.autocast(x.device.type, dtype=self.autocast):
            return self.predict(x, t, cond).to(x.dtype)


class AdapterReference(nn.Module):
    """The reference of an adapter-trained policy: the live network called with the reference's adapter
    values in place of its own (no second copy of the frozen base). It starts from the
    adapters' initial values (LoRA: B = 0, so exactly the base model); `load_trainable_state_dict` (a
    reference reset) and in-place updates of `trainable_state_dict()` (an EMA) move it."""

    def __init__(self, policy: AdaptableNetwork):
        super().__init__()
        object.__setattr__(self, "policy", policy)  # not a submodule: the policy belongs to the engine
        self.state = {k: v.detach().clone() for k, v in policy.trainable_state_dict().items()}

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return self.state

    @torch.no_grad()
    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        for k, v in self.state.items():
            v.copy_(state[k])

    def _apply(self, fn, recurse: bool = True):  # `.to(device)` moves the reference adapters with it
        self.state = {k: fn(v) for k, v in self.state.items()}
        return self

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        """The policy called with the reference adapters in place of its own (`functional_call`: the live
        parameters are never written, so a graph through them stays valid); the policy's own arguments."""
        device = module_device(self.policy)
        swapped = {f"net.{k}": v.to(device) for k, v in self.state.items()}
        return torch.func.functional_call(self.policy, swapped, args, kwargs)


class ClassConditionalPolicy(Policy):
    """A class-conditional diffusers `UNet2DModel`: predict = net(x, t, class_labels=cond).sample."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def predict(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        if isinstance(cond, dict):
            raise TypeError("a class-conditional policy takes class ids, not text embeddings")
        return self.net(x, t.to(x.device), class_labels=cond.to(x.device)).sample
