# Set-up and the two front-door commands. Works on a machine with only Python 3.11, pip and gcc.
#   make demo   # create .venv, install, run the end-to-end demo on this machine
#   make test   # create .venv, install, run every test (unit, S3, Ray, multi-process)
PYTHON ?= python3
VENV ?= .venv
# the CPU wheel; installed before the project so nothing pulls the multi-GB CUDA build.
# On a GPU machine: make install TORCH_SPEC="torch>=2.4"
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/bucketeer demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
