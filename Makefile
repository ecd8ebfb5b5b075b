# The two set-up commands of the README: `make run` (default job) and `make test` (the suite).
# Both create/refresh .venv. torch is installed first, pinned, so pip never pulls a CUDA build on a
# CPU machine; GPU users override TORCH_SPEC (see README).
VENV        ?= .venv
PYTHON      ?= python3
TORCH_SPEC  ?= torch==2.13.0
PY          := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: run test install install-test pretrain bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/steadyrl train $(ARGS)

test: install-test
	$(PY) -m pytest $(PYTEST_ARGS)

pretrain: install
	$(VENV)/bin/steadyrl pretrain

bench: install
	$(PY) benchmarks/step_time.py

clean:
	rm -rf runs .pytest_cache
