# Every target sets itself up from pyproject.toml on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export JAX_PLATFORMS ?= cpu

.PHONY: test test-full lint demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-full: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests --run-slow

lint: $(STAMP)
	$(PY) -m ruff check ckpt_iter tests benchmarks

demo: $(STAMP)
	$(PY) -m ckpt_iter demo

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info

# The Tunix integration tests against upstream Tunix main (0.1.8), from the wheel
# in ../shared/peer/wheels (the same venv ../shared/peer/run main builds).
TUNIX_MAIN_VENV ?= .venv-tunix-main
TUNIX_MAIN_WHEEL ?= ../shared/peer/wheels/google_tunix-0.1.8-py3-none-any.whl
.PHONY: test-tunix-main
$(TUNIX_MAIN_VENV)/bin/python:
	$(PYTHON) -m venv $(TUNIX_MAIN_VENV)
	$(TUNIX_MAIN_VENV)/bin/pip install -q -e '.[test]'
	$(TUNIX_MAIN_VENV)/bin/pip install -q --no-deps $(TUNIX_MAIN_WHEEL)
	$(TUNIX_MAIN_VENV)/bin/pip install -q perfetto tenacity 'qwix>=0.1.6'

test-tunix-main: $(TUNIX_MAIN_VENV)/bin/python
	$(TUNIX_MAIN_VENV)/bin/python -m pytest -q -p no:cacheprovider --run-slow \
	  tests/integration/test_tunix_main.py tests/integration/test_tunix_bugs.py \
	  tests/integration/test_tunix_sft.py tests/integration/test_tunix_agentic.py \
	  tests/integration/test_tunix_packing.py tests/integration/test_tunix_cli.py \
	  tests/integration/test_tunix_object_store.py tests/unit/test_tunix_api.py
