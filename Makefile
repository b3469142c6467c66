# slmguard developer entry points. See README.md and DEVELOPERS.md.
#
#   make run     set up .venv (engine built from source, cached), prepare the
#                default model, serve on 127.0.0.1:8080
#   make test    same setup plus test tools; lint, format check, mypy, pytest
#   make systest boot a Debian VM (systemd, cgroup v2) under qemu and run the
#                deployment scenario in it (as root; see systest/README.md)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8080

# The engine has no wheel on PyPI for these machines: pip builds it from
# source (about 5 minutes). AMX faults inside our VMs, so the build is pinned
# to AVX2/FMA/F16C without native tuning. The wheel is cached per machine,
# keyed by version and flags.
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
WHEEL_CACHE ?= $(HOME)/.cache/slmguard/wheels
LLAMA_KEY := $(shell printf '%s' '$(LLAMA_VERSION) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
LLAMA_WHEEL_DIR := $(WHEEL_CACHE)/llama-cpp-python-$(LLAMA_VERSION)-$(LLAMA_KEY)

.PHONY: run test lint typecheck pytest systest engine-wheel model host-tools clean

$(VENV)/.created:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "slmguard needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

engine-wheel: $(LLAMA_WHEEL_DIR)/.ok

$(LLAMA_WHEEL_DIR)/.ok: | $(VENV)/.created
	@echo "building llama-cpp-python $(LLAMA_VERSION) from source (about 5 minutes, cached in $(LLAMA_WHEEL_DIR))"
	mkdir -p $(LLAMA_WHEEL_DIR).tmp
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) wheel --no-deps -w $(LLAMA_WHEEL_DIR).tmp llama-cpp-python==$(LLAMA_VERSION)
	rm -rf $(LLAMA_WHEEL_DIR) && mv $(LLAMA_WHEEL_DIR).tmp $(LLAMA_WHEEL_DIR)
	touch $@

$(VENV)/.engine: $(LLAMA_WHEEL_DIR)/.ok | $(VENV)/.created
	$(PIP) install -q $(LLAMA_WHEEL_DIR)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	touch $@

$(VENV)/.serve: pyproject.toml $(VENV)/.engine
	$(PIP) install -q -e '.[serve]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.serve
	$(PIP) install -q -e '.[serve,test]'
	touch $@

model: $(VENV)/.serve
	$(VENV)/bin/slmguard model prepare

run: $(VENV)/.serve model
	$(VENV)/bin/slmguard serve --host $(HOST) --port $(PORT)

LINT_PATHS = $(wildcard src tests benchmarks systest)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict systest

# The unit tests run systemd-analyze (verify, security --offline) on rendered
# units: Debian's systemd package provides it even where systemd is not PID 1.
host-tools:
	@command -v systemd-analyze >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; \
	  else echo "note: systemd-analyze is missing (Debian package systemd); unit checks will skip"; fi; }

PYTEST_ARGS ?=

pytest: $(VENV)/.test model host-tools
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The VM system test (issue 8). Installs qemu, mmdebstrap and e2fsprogs from
# Debian's archive itself; caches the guest image in ~/.cache/slmguard/systest
# keyed by its inputs. SYSTEST_ARGS=--strict in CI.
systest: $(VENV)/.test
	$(PY) -m systest --engine-wheels $(LLAMA_WHEEL_DIR) $(SYSTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
