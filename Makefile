# Every target sets itself up from pyproject.toml on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export JAX_PLATFORMS ?= cpu

.PHONY: test test-full demo bench clean

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

demo: $(STAMP)
	$(PY) -m ckpt_iter demo

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
