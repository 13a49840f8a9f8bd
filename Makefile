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

# The other CPython versions the torch-free tests run on (`make test-pythons`, part of
# `make test`); PYTHON (3.11) runs the whole suite, torch included. Each gets .venv-X.Y, made
# from the interpreter tools/find-python finds (PATH, pyenv's installs, or PYTHON_X_Y=path).
# A missing one fails under CI=true and is skipped with a warning elsewhere.
OTHER_PYTHONS ?= 3.10 3.12 3.13
# The torch-free tests: the Consul client, the protocol, the CLI, the settings, the packaging.
CORE_TESTS := tests/test_client.py tests/test_rendezvous.py tests/test_cli.py \
	tests/test_settings.py tests/test_service.py tests/test_config.py tests/test_ranks.py \
	tests/test_package.py tests/test_dist.py
# Left to the main run: the failure-injection tests (agent restarts, outages and freezes, killed
# nodes, retry deadlines) test timing, not the interpreter, and take a third of the time.
CORE_DESELECT := agent_restart or agent_down or frozen or coordinator_killed or killed_node \
	or read_timeout_plus_retry

.PHONY: demo test test-main unit test-pythons lint ruff mypy consul bench dist smoke clean

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

lint: ruff mypy

ruff: $(BIN)/.installed
	$(BIN)/ruff check .

mypy: $(BIN)/.installed
	$(BIN)/mypy

# The unit tier: every test that needs no Consul (tests/conftest.py marks them `unit`), in
# seconds, without the Consul binary (a unit test that would start Consul fails, naming the
# marker it lacks).
unit: $(BIN)/.installed
	$(BIN)/python -m pytest -m unit -q

# pytest-xdist workers of the main run (0: one process). Most tests wait on Consul, on
# timeouts or on child processes, so 4 workers keep 2 cores busy. Tests go out one at a time,
# in tests/conftest.py's order, to whichever worker is free (--maxschedchunk 1; plain
# --dist load hands each worker a quarter of its share at once: the first worker got every
# test on a cluster, one after another): the tests on clusters first, each worker runs its
# share of them on a cluster of its own, then stops it; then the longest.
TEST_WORKERS ?= 4

# ruff, then mypy, the main run and the other CPython versions' runs at the same time (the
# other runs mostly wait, they take little CPU); each one's output is printed when it ends
# (the other runs' from .venv-X.Y/pytest.log). A mypy error fails `make test` once the runs end.
test: consul ruff
	@$(MAKE) --no-print-directory -j$(words mypy main $(OTHER_PYTHONS)) --output-sync=target \
	    mypy test-main test-pythons

# The main run requires torch: a torch that cannot be imported is one error, not skipped tests.
test-main: consul
	@began=$$(date +%s); \
	CONSUL_RDZV_REQUIRE_TORCH=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist load \
	    --maxschedchunk 1 --durations=15 && \
	echo "== main run: $$(( $$(date +%s) - began ))s"

test-pythons: $(addprefix test-python-,$(OTHER_PYTHONS))

test-python-%: consul
	@if ! tools/find-python $* >/dev/null 2>&1; then \
	    tools/find-python $* || true; \
	    if [ "$${CI:-}" = true ]; then \
	        echo "make: CPython $* is missing on this CI machine: its tests cannot run" >&2; \
	        exit 1; \
	    fi; \
	    echo "WARNING: CPython $* not found: the torch-free tests did NOT run on it" >&2; \
	    exit 0; \
	fi; \
	began=$$(date +%s); \
	$(MAKE) --no-print-directory $(VENV)-$*/.installed || exit; \
	log=$(VENV)-$*/pytest.log; \
	$(VENV)-$*/bin/python -m pytest -q $(CORE_TESTS) -k 'not ($(CORE_DESELECT))' >$$log 2>&1; \
	status=$$?; \
	echo "== torch-free tests on $$($(VENV)-$*/bin/python --version)"; \
	cat $$log; \
	echo "== CPython $*: venv and tests in $$(( $$(date +%s) - began ))s"; \
	exit $$status

$(VENV)-%/.installed: pyproject.toml consul_rdzv/__init__.py
	@py=$$(tools/find-python $*) && echo "creating $(VENV)-$* with $$py" && \
	    rm -rf $(VENV)-$* && $$py -m venv $(VENV)-$*
	$(VENV)-$*/bin/pip install -q -e '.[test-core]'
	touch $@

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
	rm -rf $(VENV) $(addprefix $(VENV)-,$(OTHER_PYTHONS)) .pytest_cache .ruff_cache *.egg-info \
	    build dist
