# Set-up and the two front-door commands. Works on a machine with only Python 3.11, pip and gcc.
#   make demo   # create .venv, install, run the end-to-end demo on this machine (make demo DEMO_ARGS=--repa: with REPA)
#   make test   # create .venv (+ .venv-vision: torchvision), install, run the tests CI runs: all but `full`
#   make test-full     # every test, the `full` long tail included (each family's demo, simulated clusters)
#   make test-floors   # create .venv-floors with every core dependency at its pyproject floor, run the fast tests
#   make gpu-check     # on a GPU machine, offline, with its own python3 (CUDA torch) + .gpu-wheels: every GPU measure
#                      # on random weights at real sizes, one table (without CUDA: the venv's, one line, exit 0)
#   make gpu-wheels    # on a networked machine: the wheels gpu-check needs there (infra/gpu/wheels.txt, <= 40 MiB)
#   make gpu-rehearsal # gpu-check --smoke in a fresh venv holding only what the GPU machine has, plus the wheels
#   make test-gpu      # the tests that need CUDA (marked gpu); skipped with their reason without one
#   make install-vllm  # on a networked GPU machine: the vllm extra (vLLM, ray[llm]) for annotate --engine vllm
PYTHON ?= python3
VENV ?= .venv
# the CPU wheel; installed before the project so nothing pulls the multi-GB CUDA build.
# On a GPU machine: make install TORCH_SPEC="torch>=2.4"
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make test` (CI) leaves out the tests marked `full` (the marker's meaning: pyproject.toml): 20 min on 2 cores
# instead of 56. `make test-full` runs all of them. PYTEST_ARGS="-m ..." replaces this selection.
TEST_MARKERS ?= not full
# test files spread over 2 worker processes (pytest-xdist; a file stays on one worker, so its session and
# module fixtures are built once): most tests wait on subprocesses, Ray and sockets, not on a core.
# TEST_WORKERS=0 runs them in this process, one after another. --no-loadscope-reorder: files go out in collection
# order, which tests/conftest.py makes longest first (xdist's default, most tests first, left the one-test
# end-to-end files for last, running alone).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# `make test-floors`: each core dependency at the lowest version pyproject.toml allows (.ci/floors.py derives
# the pins from it at run time), except torch, which stays TORCH_SPEC: no other torch is installable in CI.
# Dev tools (pytest, moto, ...) stay current. The fast tests: the slow ones would not fit CI's time.
FLOORS_VENV ?= .venv-floors
FLOORS_PY := $(FLOORS_VENV)/bin/python
FLOORS_PYTEST_ARGS ?= -m "not slow"
# `make test` also builds .venv-vision: torch with torchvision, which cannot sit beside the CPU torch (its operators
# are built for another torch), plus the main venv's own transformers, diffusers and the few packages bucketeer's
# encoders import. In it tests/vision_check.py runs what only a torchvision-equipped pipeline computes (FLUX.2-dev's
# PixtralProcessor, Qwen-Image-Edit's Qwen2VLProcessor) beside bucketeer's code (tests/test_qwen2vl_vision.py).
# x86_64: pip takes torch 2.14.1 + torchvision 0.29.1 (a CUDA build that runs on the CPU); VISION=0 leaves it out.
VISION ?= 1
VISION_VENV ?= .venv-vision
VISION_SPEC ?= $(if $(filter aarch64 arm64,$(shell uname -m)),torch==2.9.1 torchvision==0.24.1,torch==2.14.1 torchvision==0.29.1)
VISION_PACKAGES := transformers diffusers tokenizers huggingface_hub safetensors numpy pillow pyarrow fsspec isal jinja2

.PHONY: install demo test test-full test-floors bench bench-deps gpu-check gpu-wheels gpu-rehearsal test-gpu install-vllm clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/bucketeer demo $(DEMO_ARGS)

$(VISION_VENV)/.installed: $(VENV)/.installed
	rm -rf $(VISION_VENV)
	$(PYTHON) -m venv $(VISION_VENV)
	$(VISION_VENV)/bin/python -m pip install -q --upgrade pip
	$(PY) -m pip freeze | grep -iE '^($(subst $() ,|,$(VISION_PACKAGES)))==' > $(VISION_VENV)/constraints.txt
	$(VISION_VENV)/bin/python -m pip install -q --no-compile $(VISION_SPEC) -c $(VISION_VENV)/constraints.txt \
		$(VISION_PACKAGES)
	touch $@

test: install $(if $(filter 1,$(VISION)),$(VISION_VENV)/.installed)
	$(if $(filter 1,$(VISION)),BUCKETEER_VISION_PYTHON=$(abspath $(VISION_VENV))/bin/python) \
		$(PY) -m pytest $(XDIST) -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

test-full: install $(if $(filter 1,$(VISION)),$(VISION_VENV)/.installed)
	$(if $(filter 1,$(VISION)),BUCKETEER_VISION_PYTHON=$(abspath $(VISION_VENV))/bin/python) \
		$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# "s3fs[boto3]" adds no package: it makes aiobotocore pin boto3 (which moto needs) to its botocore range
# up front; without it pip backtracks through hundreds of boto3 releases to find that range at old s3fs.
# --no-compile: byte-compiling all of torch, ray, transformers... is most of an install's time; the tests
# import a fraction of it, compiled on first import and kept (hence PYTHONDONTWRITEBYTECODE unset there).
$(FLOORS_VENV)/.installed: pyproject.toml .ci/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_PY) -m pip install -q --upgrade pip
	$(FLOORS_PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	{ $(PYTHON) .ci/floors.py && echo "$(TORCH_SPEC)"; } > $(FLOORS_VENV)/constraints.txt
	$(FLOORS_PY) -m pip install -q --no-compile -c $(FLOORS_VENV)/constraints.txt -e ".[dev]" "s3fs[boto3]"
	touch $@

test-floors: $(FLOORS_VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(FLOORS_PY) -m pytest $(XDIST) $(FLOORS_PYTEST_ARGS)

# benchmarks/loader.py's peers, without their deps (see the bench extra in pyproject.toml for why)
bench-deps: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m pip install -q --no-deps "litdata==0.2.76" "mosaicml-streaming==0.13.0"

# every published table's benchmark, with the command its results file records (python -m benchmarks.results
# --commands; each writes benchmarks/results/<name>.json), then the tables regenerated from those files. Hours on
# 2 cores; the loader's datasets go under the --work folders its commands name.
bench: install bench-deps
	$(PY) -m benchmarks.results --commands | while IFS= read -r cmd; do \
		echo "== $$cmd"; sh -c "$(PY) $${cmd#python }" || exit 1; done
	$(PY) -m benchmarks.results --write

# The GPU check runs on the GPU machine's own python3 when it has CUDA torch (no venv, no download: that machine
# is offline), with what it lacks installed from GPU_WHEELS (make gpu-wheels, on a networked machine; carried
# beside the working tree). The command is printed first, for a machine without make. Without CUDA there, the
# venv's python runs it and prints one line. GPU_CHECK_ARGS, e.g. --families sdxl --budget 300 --keep.
GPU_CHECK_ARGS ?=
GPU_WHEELS ?= .gpu-wheels
GPU_REHEARSAL_VENV ?= .venv-gpu-rehearsal
# one GPU: the rates are per GPU, and the busy fraction is sampled on the GPU the encoders get
gpu-check:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		cmd="CUDA_VISIBLE_DEVICES=$${CUDA_VISIBLE_DEVICES:-0} $(PYTHON) benchmarks/gpu_check.py --wheels $(GPU_WHEELS) $(GPU_CHECK_ARGS)"; \
	else \
		$(MAKE) --no-print-directory install >/dev/null && cmd="$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)"; \
	fi; echo "$$cmd"; eval "$$cmd"

$(GPU_WHEELS)/.downloaded: infra/gpu/wheels.txt
	$(PYTHON) benchmarks/gpu_env.py download --dest $(GPU_WHEELS)

gpu-wheels: $(GPU_WHEELS)/.downloaded

# A fresh venv with only the packages the GPU machine's python3 has (infra/gpu/preinstalled.txt; CPU torch here),
# the wheel folder installed by the check itself, Ray and vLLM absent: gpu_check.py --smoke must fill every row
# that needs neither. How we know `make gpu-check` works the day a GPU is lent.
gpu-rehearsal: gpu-wheels
	rm -rf $(GPU_REHEARSAL_VENV)
	$(PYTHON) -m venv $(GPU_REHEARSAL_VENV)
	$(GPU_REHEARSAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_REHEARSAL_VENV)/bin/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(GPU_REHEARSAL_VENV)/bin/python -m pip install -q --no-compile -c infra/gpu/preinstalled.txt -r infra/gpu/preinstalled.txt "$(TORCH_SPEC)"
	$(GPU_REHEARSAL_VENV)/bin/python benchmarks/gpu_check.py --smoke --rehearsal --wheels $(GPU_WHEELS) $(GPU_CHECK_ARGS)

test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

# `bucketeer annotate --engine vllm` (and its gpu-marked test, and the gpu-check's annotate row) needs vLLM and
# Ray's LLM batch API: the vllm extra, from the registry, so only where there is a network and a GPU. vLLM pins
# the torch it was built with and pip installs that one (a CUDA build) in place of TORCH_SPEC's.
install-vllm: install
	$(PY) -m pip install -q -e ".[vllm]"

clean:
	rm -rf $(VENV) $(FLOORS_VENV) $(VISION_VENV) $(GPU_REHEARSAL_VENV) .gpu-site .pytest_cache build *.egg-info
