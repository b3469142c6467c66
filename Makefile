# slmguard developer entry points. See README.md and DEVELOPERS.md.
#
#   make         set up .venv: the CLI (.venv/bin/slmguard), llama-server built from
#                source (cached per machine), the default model; then say how to use them
#   make run     the same, then serve on 127.0.0.1:8080 (make run PORT=8081 HOST=...)
#   make install put the CLI on PATH: a link BINDIR/slmguard to .venv/bin/slmguard
#                (BINDIR: ~/.local/bin, or /usr/local/bin as root); make uninstall
#   make test    same setup plus test tools; lint, format check, import contracts, mypy,
#                pytest
#   make quickstart  walk README's Quickstart in a fresh clone (minutes; not in make test)
#   make clients the agent frameworks and the openai<3 client libraries against a real
#                server (minutes; not in make test)
#   make deb-install-test  README's .deb install, as typed, in a fresh Debian 12 root
#                (as root, minutes; not in make test)
#   make systest boot a Debian VM (systemd, cgroup v2) under qemu and run the
#                deployment scenario in it (as root; see systest/README.md)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8080
BINDIR ?= $(if $(filter 0,$(shell id -u)),/usr/local/bin,$(HOME)/.local/bin)

.DEFAULT_GOAL := all

# The engine is llama.cpp's own llama-server, built once per machine from the
# llama.cpp source vendored in the pinned llama-cpp-python sdist (a PyPI file,
# checked against its sha256; see DEVELOPERS.md). AMX faults inside our VMs, so
# the build is pinned to AVX2/FMA/F16C without native tuning. The binary is
# cached per machine, keyed by version, hash and flags, and linked into the venv.
LLAMA_VERSION := 0.3.36
LLAMA_SDIST_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
ENGINE_CACHE ?= $(HOME)/.cache/slmguard/engine
# slmguard's patches to that llama.cpp, in every build (CPU, Vulkan, the ARM cross
# builds, the packages'): grammar-max-work.patch stops a request alone whose grammar
# needs more parse-stack work per token than --grammar-max-work (issue 37; docs/serve.md).
ENGINE_PATCHES := $(CURDIR)/engine/grammar-max-work.patch
ENGINE_KEY := $(shell { printf '%s' '$(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(LLAMA_CMAKE_ARGS)'; cat $(ENGINE_PATCHES); } | sha256sum | cut -c1-12)
ENGINE_DIR := $(ENGINE_CACHE)/llama-server-$(LLAMA_VERSION)-$(ENGINE_KEY)

.PHONY: all run install uninstall test lint typecheck pytest systest systest-deb systest-faults \
	systest-faults-deb \
	systest-neighbour engine model host-tools clean quickstart clients recycle-test bench-overhead \
	deb-install-test

$(VENV)/.created:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "slmguard needs Python >= 3.10")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

engine: $(VENV)/.engine

$(VENV)/.build-tools: | $(VENV)/.created
	$(PIP) install -q cmake==4.4.5 ninja==1.13.2
	touch $@

$(ENGINE_DIR)/.ok: | $(VENV)/.build-tools
	ENGINE_PATCHES='$(ENGINE_PATCHES)' engine/build.sh $(ENGINE_DIR) $(PY) $(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(LLAMA_CMAKE_ARGS)
	touch $@

$(VENV)/.engine: $(ENGINE_DIR)/.ok | $(VENV)/.created
	ln -sf $(ENGINE_DIR)/bin/llama-server $(VENV)/bin/llama-server
	touch $@

$(VENV)/.serve: pyproject.toml $(VENV)/.engine
	$(PIP) install -q -e '.[serve]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.serve
	$(PIP) install -q -e '.[serve,test]'
	touch $@

model: $(VENV)/.serve
	$(VENV)/bin/slmguard model prepare

# What `make` says once the setup is there (and `make run` before it serves).
define USAGE
slmguard is set up in $(VENV) (the engine: $(VENV)/bin/llama-server, the default model prepared):
  $(VENV)/bin/slmguard --help   the CLI; `make install` puts it on PATH ($(BINDIR))
  make run                      serve on $(HOST):$(PORT) (make run PORT=8081 for another port)
endef
export USAGE

all: $(VENV)/.serve model
	@echo "$$USAGE"

run: $(VENV)/.serve model
	@echo "$$USAGE"
	$(VENV)/bin/slmguard serve --host $(HOST) --port $(PORT)

install: $(VENV)/.serve
	@if [ -e $(BINDIR)/slmguard ] && [ ! -L $(BINDIR)/slmguard ]; then \
	  echo "$(BINDIR)/slmguard exists and is not a link: left alone (remove it, or BINDIR=...)"; \
	  exit 1; fi
	mkdir -p $(BINDIR)
	ln -sfn $(CURDIR)/$(VENV)/bin/slmguard $(BINDIR)/slmguard
	@case ":$$PATH:" in *":$(BINDIR):"*) echo "slmguard is on PATH: $(BINDIR)/slmguard";; \
	  *) echo "$(BINDIR) is not on PATH: add it (export PATH=\"$(BINDIR):\$$PATH\") or run $(BINDIR)/slmguard";; esac

uninstall:
	@if [ "$$(readlink $(BINDIR)/slmguard)" = "$(CURDIR)/$(VENV)/bin/slmguard" ]; then \
	  rm $(BINDIR)/slmguard && echo "removed $(BINDIR)/slmguard"; \
	else echo "$(BINDIR)/slmguard is not this clone's link: left alone"; fi

# The README's Quickstart in a fresh clone of this tree's HEAD, as a newcomer types it
# (issue 38): the clone makes its own venv, the engine comes from this machine's cache.
# Minutes, so run on purpose; make test walks it in this tree (tests/test_docs_runnable.py).
quickstart: $(VENV)/.engine
	ENGINE_CACHE=$(ENGINE_CACHE) $(PY) tests/docblocks.py --clone

# The README's install from the Debian packages (issue 38), run as written in a fresh
# Debian 12 amd64 root (mmdebstrap from Debian's archive, apt lists empty), then its
# frictions (no apt-get update, dpkg -i) and their repair; the run goes to RESULTS.md.
# As root, minutes: on purpose. tests/test_deb_install_docs.py checks the docs say its commands.
deb-install-test: $(VENV)/.test dist-amd64 dist-model
	$(PY) tests/debinstall.py --dist $(DIST)

LINT_PATHS = $(wildcard src tests benchmarks systest container packaging)

# lint-imports checks the package map of docs/architecture.md (contracts in pyproject.toml);
# vermin that nothing needs a Python newer than 3.10 (requires-python; issue 26).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(VENV)/bin/vermin -q --violations --no-tips --eval-annotations -t=3.10- $(LINT_PATHS)

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict systest container
	cd packaging && MYPYPATH=$(CURDIR) ../$(VENV)/bin/mypy --strict debcontrol.py debbuild.py debian/maint.py

# The unit tests run systemd-analyze (verify, security --offline) on rendered
# units: Debian's systemd package provides it even where systemd is not PID 1.
host-tools:
	@command -v systemd-analyze >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; \
	  else echo "note: systemd-analyze is missing (Debian package systemd); unit checks will skip"; fi; }

PYTEST_ARGS ?=

# The whole client matrix is part of `make test` (issue 38): the clients extra and the
# openai < 3 venv below are installed first, and --clients selects their tests.
pytest: $(VENV)/.test $(VENV)/.clients $(VENV)/.openai2 model host-tools
	$(VENV)/bin/pytest --clients $(PYTEST_ARGS)

test: lint typecheck pytest

# The client matrix's agent frameworks (the clients extra: openai-agents, pydantic-ai) and the
# libraries that need openai < 3 (instructor, llama-index: a venv of their own, so that both
# keep their pins, tests/clients-openai2.txt), against a real server: in `make test`, and
# alone with `make clients` (DEVELOPERS.md has the figures).
$(VENV)/.clients: pyproject.toml $(VENV)/.test
	$(PIP) install -q -e '.[serve,test,clients]'
	touch $@

# .venv/openai2 is layered over .venv: a .pth puts .venv's packages after its own, so pip
# installs only what differs (openai 2, jiter, rich < 15, instructor, llama-index and what
# .venv lacks: 85 MB instead of 311) and compiles no .pyc; its own packages win at import.
# pip's note that openai-agents and llm (in .venv) want openai 3 is expected.
$(VENV)/.openai2: export SITE = import sysconfig; print(sysconfig.get_paths()["purelib"])
$(VENV)/.openai2: tests/clients-openai2.txt $(VENV)/.test
	rm -rf $(VENV)/openai2
	$(PY) -m venv --without-pip $(VENV)/openai2
	$(PY) -c "$$SITE" > "$$($(VENV)/openai2/bin/python -c "$$SITE")/slmguard-test-venv.pth"
	$(PIP) --python $(VENV)/openai2/bin/python install -q --no-compile -r tests/clients-openai2.txt
	touch $@

# The leak-recycling test with the real engine (issue 40) alone; `make test` runs it too.
recycle-test: $(VENV)/.test model
	$(VENV)/bin/pytest tests/test_serve_recycle.py $(PYTEST_ARGS)

# What the front and the bench cost over bare llama-server (issues 39, 41, 42), run on
# purpose on a quiet machine (a few minutes): slmguard bench, one serve with an image, one
# serve of a board, each against a bare llama-server on the served engine's command line,
# environment and a session of its own; each writes its section of benchmarks/RESULTS.md
# with the load average beside it. BENCH_ROUNDS=n rounds each.
BENCH_ROUNDS ?= 10
bench-overhead: $(VENV)/.test model
	$(PY) benchmarks/bench_vs_bare.py --rounds $(BENCH_ROUNDS) --write-results
	$(PY) benchmarks/serve_overhead_vision.py --rounds $(BENCH_ROUNDS) --write-results
	$(PY) benchmarks/serve_overhead.py --board --rounds $(BENCH_ROUNDS) --write-results

clients: $(VENV)/.clients $(VENV)/.openai2 model
	$(VENV)/bin/pytest --clients -m clients tests/test_serve_clients_agents.py $(PYTEST_ARGS)

# The VM system test (issue 8). Installs qemu, mmdebstrap and e2fsprogs from
# Debian's archive itself; caches the guest image in ~/.cache/slmguard/systest
# keyed by its inputs. SYSTEST_ARGS=--strict in CI. The image and the guest's steps
# install slmguard from wheels; the Ansible step's role installs the amd64 packages
# (dist-amd64: slmguard, slmguard-deps, slmguard-engine-avx2, about 80 s here) on the
# guest and uninstall.yml purges them.
systest: $(VENV)/.test dist-amd64
	$(PY) -m systest --engine-dir $(ENGINE_DIR) $(SYSTEST_ARGS)

# Everything from the Debian packages (issue 26; run on purpose, it does not fit CI's 45
# minutes): the image installs the previous package (this tree as $(PREVIOUS_VERSION)),
# the package-upgrade step this tree's over it while the service serves, and every later
# step runs from it (systest/packages.py). Both packages are built first.
systest-deb: $(VENV)/.test dist-amd64 dist-previous-amd64 dist-model
	$(PY) -m systest --dist $(DIST) $(SYSTEST_ARGS)

# Power cuts (issue 40; run on purpose: each cut is a reboot of the TCG guest, minutes that
# CI's run has no room for): qemu resets the guest in the middle of an apply, then while
# session turns are written; after each boot the scenario checks what is on its disk.
# Three model loads and two boots: 120 minutes leave room for a guest 10x slower than a
# quiet host's (SYSTEST_ARGS=--budget-min N overrides).
FAULT_STEPS = guest-facts,plan,apply,service-start,power-cut-apply,power-cut-sessions
systest-faults: $(VENV)/.test
	$(PY) -m systest --engine-dir $(ENGINE_DIR) --steps $(FAULT_STEPS) --budget-min 120 \
		$(SYSTEST_ARGS)

# The power cut during a package upgrade (issue 40; run on purpose, not in CI's run: the
# image holds the previous packages, so they and this tree's are built first (minutes), and
# the step builds the venv twice and boots the TCG guest again): `apt install` of this
# tree's slmguard over the previous one, the power cut inside its configure, then the
# boot's checks and `dpkg --configure -a` (systest/README.md).
FAULT_DEB_STEPS = guest-facts,plan,apply,service-start,power-cut-upgrade
systest-faults-deb: $(VENV)/.test dist-amd64 dist-previous-amd64 dist-model
	$(PY) -m systest --dist $(DIST) --steps $(FAULT_DEB_STEPS) --budget-min 120 $(SYSTEST_ARGS)

# The innocent neighbour (issue 39; run on purpose: five boots of the TCG guest, about an
# hour): a real service declared with `plan --neighbour` holds its memory beside the LLM
# while a hog in the LLM's cgroup drives the governor to critical, 5 times with two CPU
# hogs beside the VM; the 5 results go to benchmarks/RESULTS.md (`## systest neighbour`).
systest-neighbour: $(VENV)/.test
	$(PY) benchmarks/systest_neighbour.py --runs 5 --hogs 2 --engine-dir $(ENGINE_DIR) $(SYSTEST_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# ARM under emulation (issue 19; not part of `make test`, see DEVELOPERS.md).
#   make arm       cross-build llama-server for aarch64 per CPU profile (cached beside
#                  the x86 build) and measure the plan against it under qemu-user
#                  (ARM_BENCH_ARGS=--write-results records benchmarks/RESULTS.md)
#   make arm-test  the pure-Python suite under aarch64 Python in an emulated arm64 tree
# Needs root for apt-get, binfmt_misc and chroot.
ARM_PROFILES := dotprod=armv8.2-a+dotprod+fp16 armv8=armv8-a i8mm=armv8.6-a+dotprod+fp16+i8mm
ARM_CACHE ?= $(HOME)/.cache/slmguard/arm
ARM_BENCH_ARGS ?=
ARM_TEST_ARGS ?=

.PHONY: arm arm-tools arm-engines arm-test

arm-tools:
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null \
	  && command -v mmdebstrap >/dev/null && command -v arch-test >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "arm: run as root (apt-get install g++-aarch64-linux-gnu qemu-user-static binfmt-support mmdebstrap arch-test)"; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    g++-aarch64-linux-gnu qemu-user-static binfmt-support mmdebstrap arch-test; }
	@[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
	@[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

arm-engines: arm-tools | $(VENV)/.build-tools
	@for p in $(ARM_PROFILES); do \
	  engine/build-arm.sh $(ENGINE_CACHE) $(PY) $(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $${p%%=*} $${p#*=} || exit 1; \
	done

arm: arm-engines $(VENV)/.test model
	$(PY) benchmarks/plan_accuracy_arm.py $(foreach p,$(ARM_PROFILES),--build $(firstword $(subst =, ,$(p)))=$$(engine/build-arm.sh $(ENGINE_CACHE) $(PY) $(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(subst =, ,$(p)))) $(ARM_BENCH_ARGS)

arm-test: arm-tools
	arm/test.sh "$$(arm/tree.sh $(ARM_CACHE))" $(CURDIR) build/arm-test $(ARM_TEST_ARGS)

# Packages (issues 26 and 43; not part of `make test`: the ARM engines take 4-40 minutes
# each). Each part moves on its own (packaging/debcontrol.py):
#   make dist        the wheel and sdist, and per architecture (amd64, arm64)
#                    dist/slmguard_<version>-1_ARCH.deb (the tool: its wheel; the venv
#                    /opt/slmguard built at install time, offline),
#                    dist/slmguard-deps_1+<lock hash>-1_ARCH.deb (the pinned wheels,
#                    packaging/requirements.lock, CPython 3.10-3.13),
#                    dist/slmguard-engine-PROFILE_<llama>+b<hash>-1_ARCH.deb per engine build
#                    (amd64: avx2, make's build; arm64: the make-arm cross builds), and the
#                    default model's dist/slmguard-model-gemma-3-270m-q4-k-m_1+<sha>-1_all.deb;
#                    lintian run on each (0 errors or it fails)
#   make dist-amd64  only the amd64 packages, no model (what `make systest` installs)
#   make dist-model  only the default model's package (DIST_MODEL=FILE.gguf for another)
#   make dist-test   the arm64 packages in an emulated Debian 12 arm64 root: install, plan,
#                    doctor, serve a completion, upgrade, remove, purge (packaging/debroot.py)
#   make dist-lock   re-resolve packaging/requirements.lock (needs python3.10..3.13 on PATH)
# Needs root for the arm64 parts (apt-get, binfmt_misc, chroot) and lintian (apt-get).
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' src/slmguard/__init__.py)
DIST ?= dist
WHEEL := $(DIST)/slmguard-$(VERSION)-py3-none-any.whl
DEB_ARGS ?=
ARM_ENGINE_ARGS = $(foreach p,$(ARM_PROFILES),--engine $(firstword $(subst =, ,$(p)))=$$(engine/build-arm.sh $(ENGINE_CACHE) $(PY) $(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(subst =, ,$(p))))

.PHONY: dist dist-python dist-amd64 dist-arm64 dist-model dist-test dist-lock dist-tools \
	dist-previous-amd64 dist-previous-arm64

$(VENV)/.dist-tools: | $(VENV)/.created
	$(PIP) install -q build==1.6.1
	touch $@

dist-tools:
	@command -v lintian >/dev/null && command -v dpkg-deb >/dev/null && command -v readelf >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "dist: run as root (apt-get install lintian dpkg binutils)"; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lintian dpkg binutils; }

dist-python: $(VENV)/.dist-tools
	rm -f $(DIST)/slmguard-$(VERSION)*.whl $(DIST)/slmguard-$(VERSION).tar.gz
	SOURCE_DATE_EPOCH=1767225600 $(PY) -m build -q --wheel --sdist --outdir $(DIST) .

dist-amd64: dist-python dist-tools $(VENV)/.serve
	$(PY) packaging/debbuild.py deb --arch amd64 --version $(VERSION) --wheel $(WHEEL) \
	  --engine avx2=$(ENGINE_DIR) --out $(DIST) --lintian $(DEB_ARGS)

dist-arm64: dist-python dist-tools arm-engines $(VENV)/.serve
	$(PY) packaging/debbuild.py deb --arch arm64 --version $(VERSION) --wheel $(WHEEL) \
	  $(ARM_ENGINE_ARGS) --out $(DIST) --lintian $(DEB_ARGS)

# The default model as a package (arch all); DIST_MODEL=FILE.gguf packages another.
DIST_MODEL ?=
dist-model: dist-tools model
	$(PY) packaging/debbuild.py model --model "$${DIST_MODEL:-$$($(VENV)/bin/slmguard model prepare | tail -1)}" \
	  --out $(DIST) --lintian

dist: dist-amd64 dist-arm64 dist-model

# The "previous" package the upgrade tests start from: there is no earlier release, so
# this tree built as an older version (uncompressed: it never leaves this machine).
PREVIOUS_VERSION ?= 0.0.99
PREVIOUS := $(DIST)/previous
PREVIOUS_WHEEL := $(PREVIOUS)/slmguard-$(PREVIOUS_VERSION)-py3-none-any.whl

$(PREVIOUS_WHEEL): pyproject.toml README.md $(shell git ls-files src packaging) | $(VENV)/.created
	$(PY) packaging/debbuild.py wheel --version $(PREVIOUS_VERSION) --out $(PREVIOUS)

dist-previous-amd64: $(PREVIOUS_WHEEL) dist-tools $(VENV)/.serve
	$(PY) packaging/debbuild.py deb --arch amd64 --version $(PREVIOUS_VERSION) \
	  --wheel $(PREVIOUS_WHEEL) --engine avx2=$(ENGINE_DIR) --out $(PREVIOUS) --compression none

dist-previous-arm64: $(PREVIOUS_WHEEL) dist-tools arm-engines $(VENV)/.serve
	$(PY) packaging/debbuild.py deb --arch arm64 --version $(PREVIOUS_VERSION) \
	  --wheel $(PREVIOUS_WHEEL) $(ARM_ENGINE_ARGS) --out $(PREVIOUS) --compression none

# The packages beside slmguard's in DIR for ARCH, as --with / --previous-with arguments.
split_debs = $(foreach f,$(wildcard $(1)/slmguard-deps_*_$(2).deb $(1)/slmguard-engine-*_$(2).deb $(3)),--$(4) $(f))

dist-test: dist-arm64 dist-previous-arm64 dist-model
	$(PY) packaging/debroot.py $(ARM_CACHE) $(DIST)/slmguard_$(VERSION)-1_arm64.deb \
	  $(call split_debs,$(DIST),arm64,$(wildcard $(DIST)/slmguard-model-*_all.deb),with) \
	  --previous $(PREVIOUS)/slmguard_$(PREVIOUS_VERSION)-1_arm64.deb \
	  $(call split_debs,$(PREVIOUS),arm64,,previous-with) --json $(DIST)/dist-test.json

dist-lock: dist-python
	$(PY) packaging/debbuild.py lock --wheel $(WHEEL)

# The GPU (issue 25; not part of `make test`, see DEVELOPERS.md "The GPU").
#   make gpu-engine build the same pinned llama-server with the Vulkan backend (its own
#                   cache key beside the CPU build)
#   make gpu        that build, then the offload cells of benchmarks/plan_accuracy.py on
#                   lavapipe, Mesa's CPU Vulkan driver, and their report against the plan
#                   (GPU_BENCH_ARGS: measure arguments; GPU_REPORT_ARGS=--write-results
#                   records benchmarks/RESULTS.md)
#   make gpu-test   the serve tests with offload on lavapipe (tests/test_serve_gpu.py: that
#                   build and the real model; serve --plan with an offload plan, a real
#                   completion and chat, the engine's offload flags, the device memory
#                   source); they skip, saying so, while the build is absent (make
#                   gpu-engine first). GPU_TEST_ARGS: more pytest arguments.
# The Debian packages it needs (glslc, libvulkan-dev, mesa-vulkan-drivers) are installed
# when run as root, as arm-tools does.
# Debian 12's Vulkan headers (1.3.239) predate VK_EXT_layer_settings, which this
# llama.cpp uses only to configure the validation layer: the patch guards that block.
VULKAN_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DGGML_VULKAN=ON
VULKAN_PATCHES := $(ENGINE_PATCHES) $(CURDIR)/engine/vulkan-headers-1.3.239.patch
VULKAN_KEY := $(shell { printf '%s' '$(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(VULKAN_CMAKE_ARGS)'; cat $(VULKAN_PATCHES); } | sha256sum | cut -c1-12)
VULKAN_DIR := $(ENGINE_CACHE)/llama-server-$(LLAMA_VERSION)-vulkan-$(VULKAN_KEY)
GPU_BENCH_ARGS ?= --max-fill 16
GPU_REPORT_ARGS ?=
GPU_CELLS ?= build/plan_accuracy_gpu_cells.json

.PHONY: gpu gpu-test gpu-tools gpu-engine

gpu-tools:
	@command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.hpp ] \
	  && [ -d /usr/share/cmake/SPIRV-Headers ] && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "gpu: run as root (apt-get install glslc libvulkan-dev spirv-headers mesa-vulkan-drivers)"; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    glslc libvulkan-dev spirv-headers mesa-vulkan-drivers; }

$(VULKAN_DIR)/.ok: | gpu-tools $(VENV)/.build-tools
	ENGINE_PATCHES='$(VULKAN_PATCHES)' engine/build.sh $(VULKAN_DIR) $(PY) $(LLAMA_VERSION) $(LLAMA_SDIST_SHA256) $(VULKAN_CMAKE_ARGS)
	touch $@

gpu-engine: $(VULKAN_DIR)/.ok

GPU_TEST_ARGS ?=

gpu-test: $(VENV)/.test model
	SLMGUARD_TEST_VULKAN_SERVER=$(VULKAN_DIR)/bin/llama-server GGML_VK_VISIBLE_DEVICES=0 \
	  $(VENV)/bin/pytest -m gpu tests/test_serve_gpu.py $(GPU_TEST_ARGS)

gpu: gpu-engine $(VENV)/.test model
	mkdir -p $(dir $(GPU_CELLS))
	$(PY) benchmarks/plan_accuracy.py --offload --measure $(GPU_CELLS) \
	  --llama-server $(VULKAN_DIR)/bin/llama-server $(GPU_BENCH_ARGS)
	$(PY) benchmarks/plan_accuracy.py --offload --report $(GPU_CELLS) $(GPU_REPORT_ARGS)
