# Two entry points: `make report` (main job) and `make test`. Both set up .venv if missing.
# `make report` installs what the notebooks need (CPU torch + the notebooks extra); `make test`
# adds the test tools and the GPU-kernel compilers, which the CPU tests run: Triton's interpreter
# (kernels) and CuTeDSL's ahead-of-time sm_90a compile (cute). Sizes and times: README.md.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --progress-bar off
# pip's log, one line per package it collects and its final "Successfully installed": the lines
# for cache hits, already-installed packages, downloads, wheel building and index locations a pip
# config lists but that lack the package stay out (errors stay in).
PIPLOG := awk '/^WARNING: Location .* is ignored/ {next} !/^ *(Requirement already satisfied|Using cached|Downloading|Obtaining|Preparing|Checking|Getting requirements|Installing build|Building|Created wheel|Stored in|Processing|Looking in|Attempting|Found existing|Uninstalling|Successfully uninstalled|Installing backend)/ {print; fflush()}'
REPORT_STAMP := $(VENV)/.installed-report
TEST_STAMP := $(VENV)/.installed-test
TEST_EXTRAS := '.[test,kernels,cute,notebooks]'
# one line per set-up step, with its time
step = echo "setup: $(1)"; t0=$$(date +%s); $(2) 2>&1 | $(PIPLOG) && echo "setup: $(1) done in $$(( $$(date +%s) - t0 )) s"

.PHONY: setup test report clean

$(REPORT_STAMP): pyproject.toml
	@test -d $(VENV) || { echo "setup: $(PY) -m venv $(VENV)"; $(PY) -m venv $(VENV); }
	@$(call step,[1/3] pip itself,$(PIP) --upgrade pip)
	@# CPU torch first and explicitly: a bare `torch` would pull a multi-GB CUDA build.
	@$(call step,[2/3] torch 2.13.0 (CPU),$(PIP) torch==2.13.0)
	@$(call step,[3/3] dsv4lab + notebooks extra,$(PIP) -e '.[notebooks]')
	@touch $@

$(TEST_STAMP): $(REPORT_STAMP)
	@$(call step,[test] the test + kernels (triton) + cute (nvidia-cutlass-dsl) extras,$(PIP) -e $(TEST_EXTRAS))
	@touch $@

setup: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

report: $(REPORT_STAMP)
	$(BIN)/python -m dsv4lab report --out reports

clean:
	rm -rf $(VENV) reports
