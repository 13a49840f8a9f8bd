# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the package, obtain Consul (building v1.14.5 from tools/consul on
# first use) and clean up what they start. `make smoke` builds and checks the release artifacts
# (`make dist`) and runs the wheel in a fresh virtualenv (docs/release.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch shipped beside the project; never let pip pick PyPI's multi-GB CUDA build.
WHEELS := $(wildcard $(CURDIR)/../shared/wheels)
TORCH_PIN := torch==2.13.0
ifneq ($(WHEELS),)
export PIP_FIND_LINKS := $(WHEELS)
endif
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint consul bench dist smoke clean

# consul_rdzv/__init__.py holds the version: reinstalling refreshes the editable metadata.
$(BIN)/.installed: pyproject.toml consul_rdzv/__init__.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(WHEELS),$(BIN)/pip install -q $(TORCH_PIN))
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

# sdist and wheel with the standard frontend (isolated build), checked: twine's metadata check,
# then tools/check_dist.py (the wheel holds exactly the package, no test-only code; the sdist
# every tracked file). It lists the wheel.
dist: $(BIN)/.installed
	rm -rf dist
	$(BIN)/python -m build --quiet --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python tools/check_dist.py dist

# The wheel, not the checkout, in a fresh virtualenv: CPU torch from ../shared/wheels first, then
# torch's registry, the CLI, a 2-node torchrun job and `consul-rdzv demo` (tools/wheel_smoke.py).
smoke: dist consul
	@test -n "$(WHEELS)" || { echo "make smoke: needs ../shared/wheels (the CPU torch wheel)" >&2; \
	    exit 1; }
	$(PYTHON) tools/wheel_smoke.py --wheel dist/consul_rdzv-*.whl --find-links $(WHEELS) \
	    --torch $(TORCH_PIN) --consul-bin "$$($(BIN)/python -m consul_rdzv.testing path)"

bench: consul
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
