"""DeepSpeed's FusedAdam build reads TORCH_CUDA_ARCH_LIST; the architecture-specific entries GPU images set (`9.0a`)
stop DeepSpeed 0.19's parser, and `fused_adam_build_env` gives it a list it reads, checked with DeepSpeed's own
builder (its JIT arch parsing runs without a GPU once the list is set)."""
from __future__ import annotations

import pytest
from deepspeed.ops.op_builder.builder import CUDAOpBuilder
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

from steadyrl.trainer.deepspeed_config import fused_adam_build_env, jit_arch_list


def parse_with_deepspeed(monkeypatch: pytest.MonkeyPatch, arch_list: str) -> list[str]:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    return CUDAOpBuilder.compute_capability_args(builder)


def test_deepspeed_rejects_an_architecture_specific_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the H200 smoke met (benchmarks/results/gpu_smoke.json's first run), reproduced without a GPU."""
    with pytest.raises(ValueError, match="invalid literal for int"):
        parse_with_deepspeed(monkeypatch, "9.0a")


@pytest.mark.parametrize("value", ["9.0a", "8.0 9.0a", "8.0;9.0a;10.0f+PTX", "12.0a", "9.0"])
def test_build_env_gives_a_list_deepspeed_parses(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    fixed = fused_adam_build_env({"TORCH_CUDA_ARCH_LIST": value})["TORCH_CUDA_ARCH_LIST"]
    parse_with_deepspeed(monkeypatch, fixed)  # raises on an entry it cannot read


def test_suffixes_dropped_ptx_and_order_kept() -> None:
    assert jit_arch_list("8.0 9.0a;10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert jit_arch_list(" 9.0a ; 9.0 ") == "9.0"  # one entry per architecture
    assert jit_arch_list("7.5;8.6") == "7.5;8.6"


def test_no_list_no_update() -> None:
    """Unset (or blank): DeepSpeed probes the visible GPUs itself, so nothing is set."""
    assert fused_adam_build_env({}) == {}
    assert fused_adam_build_env({"TORCH_CUDA_ARCH_LIST": "  "}) == {}
