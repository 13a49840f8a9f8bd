# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the package, obtain Consul (building v1.14.5 from tools/consul on
# first use) and clean up what they start.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch shipped beside the project; never let pip pick PyPI's multi-GB CUDA build.
WHEELS := $(wildcard $(CURDIR)/../shared/wheels)
ifneq ($(WHEELS),)
export PIP_FIND_LINKS := $(WHEELS)
TORCH_PIN := torch==2.13.0
endif
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint consul bench clean

# consul_rdzv/__init__.py holds the version: reinstalling refreshes the editable metadata.
$(BIN)/.installed: pyproject.toml consul_rdzv/__init__.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_PIN),$(BIN)/pip install -q $(TORCH_PIN))
	$(BIN)/pip install -q -e '.[test]'
	touch $@

consul: $(BIN)/.installed
	@$(BIN)/python -m consul_rdzv.testing path

demo: consul
	$(BIN)/python -m consul_rdzv.cli demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .

test: consul lint
	$(BIN)/python -m pytest

bench: consul
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
