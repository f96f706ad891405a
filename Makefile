# Every target sets itself up from pyproject.toml on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export JAX_PLATFORMS ?= cpu

.PHONY: test test-heavy test-full test-lowest lint docs demo bench clean clean-cache

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# In-process tiers (unit, property, robustness) on two workers, tests spread
# one by one; then the integration tests, which start processes of their own
# (real Tunix runs, kills, an object-store emulator per worker), on two
# workers a file at a time, so a file's module fixtures are built once.
FAST_TIERS := tests/unit tests/property tests/robustness
WORKERS ?= 2
BY_FILE := -n $(WORKERS) --dist loadfile
# JAX_CACHE_STATS=DIR: every test process counts its compilation-cache lookups
# and hits into DIR; `python tests/cache_stats/summary.py DIR` gives the hit rate.
ifdef JAX_CACHE_STATS
export CKPT_ITER_JAX_CACHE_STATS := $(abspath $(JAX_CACHE_STATS))
endif

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) $(FAST_TIERS)
	$(PY) -m pytest -q -p no:cacheprovider $(BY_FILE) tests/integration

# The real Tunix runs (and bucket-path examples) beyond make test's representative ones (CI runs these too),
# two at a time: a toy Tunix process is mostly one thread of Python and XLA
# compilation (14 minutes here, about 20 one at a time).
test-heavy: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) tests --run-heavy -m heavy

test-full: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests --run-slow

lint: $(STAMP)
	$(PY) -m ruff check ckpt_iter tests benchmarks docs demo

# The documentation site: docs/ with the API reference generated from the
# docstrings (docs/hooks.py), built into site/ in strict mode (mkdocs.yml): a
# broken link between pages or to a heading, a page left out of the nav, a
# public name without a docstring or an entry fails it. External links are
# not fetched. The docs extra alone builds it: the reference reads the
# modules' sources (docs/hooks.py) and never imports ckpt_iter.tunix, which
# needs Tunix; a fresh clone's `make docs` installs no test extra.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict

# The demo lives in demo/, outside the installed package; DEMO_ARGS, e.g. '--learner agentic'.
demo: $(STAMP)
	$(PY) -m demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(MAXTEXT_VENV) build *.egg-info site

# The tests' persistent JAX compilation cache (tests/conftest.py), kept between runs.
clean-cache:
	rm -rf $${XDG_CACHE_HOME:-$$HOME/.cache}/ckpt_iter/test_jax_compilation_cache

# The suite on the lowest versions pyproject.toml allows (its floors), without
# the optional integrations (Tunix, Hugging Face), whose tests then skip.
LOWEST_VENV ?= .venv-lowest
LOWEST_PINS := jax==0.8.3 jaxlib==0.8.3 orbax-checkpoint==0.11.40 grain==0.2.17 numpy==2.0.2
# Re-installed when pyproject.toml changes, as .venv is.
$(LOWEST_VENV)/.installed: pyproject.toml
	[ -x $(LOWEST_VENV)/bin/python ] || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/pip install --quiet --upgrade pip
	$(LOWEST_VENV)/bin/pip install --quiet -e '.[test-core]' $(LOWEST_PINS)
	touch $@

test-lowest: $(LOWEST_VENV)/.installed
	$(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs -n $(WORKERS) $(FAST_TIERS)
	$(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs $(BY_FILE) tests/integration

# MaxText's pretraining input through its own config and checkpoint code (tests/maxtext), in a
# venv of its own: MaxText 0.2.5 needs Python >= 3.12 (pyenv's here). Its modules' imports are
# pinned in requirements/maxtext.txt; maxtext itself is installed without its extras (CUDA or TPU
# stacks), as make test-maxtext does on a fresh machine.
MAXTEXT_VENV ?= .venv-maxtext
PYTHON312 ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
$(MAXTEXT_VENV)/.installed: pyproject.toml requirements/maxtext.txt requirements/maxtext-sft.txt
	[ -x $(MAXTEXT_VENV)/bin/python ] || $(PYTHON312) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/pip install --quiet --upgrade pip
	$(MAXTEXT_VENV)/bin/pip install --quiet -r requirements/maxtext.txt
	$(MAXTEXT_VENV)/bin/pip install --quiet --no-deps -r requirements/maxtext-sft.txt
	$(MAXTEXT_VENV)/bin/pip install --quiet --no-deps maxtext==0.2.5
	$(MAXTEXT_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

.PHONY: test-maxtext
test-maxtext: $(MAXTEXT_VENV)/.installed
	$(MAXTEXT_VENV)/bin/python -m pytest -q -p no:cacheprovider -rs $(BY_FILE) tests/maxtext tests/unit/test_maxtext.py

# The runnable MaxText example (demo/maxtext_pretrain.py): a run killed before saving a step, then resumed.
.PHONY: demo-maxtext
demo-maxtext: $(MAXTEXT_VENV)/.installed
	rm -rf /tmp/ckpt_iter_maxtext_demo
	-$(MAXTEXT_VENV)/bin/python -m demo.maxtext_pretrain --workdir /tmp/ckpt_iter_maxtext_demo --steps 4 --kill
	$(MAXTEXT_VENV)/bin/python -m demo.maxtext_pretrain --workdir /tmp/ckpt_iter_maxtext_demo --steps 4

# MaxText's own input pipeline against ckpt_iter's for one config (benchmarks/hand_run.md).
.PHONY: bench-maxtext
bench-maxtext: $(MAXTEXT_VENV)/.installed
	$(MAXTEXT_VENV)/bin/python benchmarks/maxtext_input.py | tee benchmarks/results_maxtext.jsonl

# The Tunix integration tests against upstream Tunix main (0.1.8), from the wheel
# in ../shared/peer/wheels (the same venv ../shared/peer/run main builds).
TUNIX_MAIN_VENV ?= .venv-tunix-main
TUNIX_MAIN_WHEEL ?= ../shared/peer/wheels/google_tunix-0.1.8-py3-none-any.whl
.PHONY: test-tunix-main test-tunix-main-core
# Drawn differential examples per property on main (make test-full draws 12 on 0.1.7).
TUNIX_MAIN_CONFORMANCE_EXAMPLES ?= 2
$(TUNIX_MAIN_VENV)/.installed: pyproject.toml
	[ -x $(TUNIX_MAIN_VENV)/bin/python ] || $(PYTHON) -m venv $(TUNIX_MAIN_VENV)
	$(TUNIX_MAIN_VENV)/bin/pip install -q -e '.[test]'
	$(TUNIX_MAIN_VENV)/bin/pip install -q --no-deps $(TUNIX_MAIN_WHEEL)
	$(TUNIX_MAIN_VENV)/bin/pip install -q perfetto tenacity 'qwix>=0.1.6'
	touch $@

test-tunix-main: $(TUNIX_MAIN_VENV)/.installed $(STAMP)
	$(TUNIX_MAIN_VENV)/bin/python -m pytest -q -p no:cacheprovider --run-slow \
	  tests/integration/test_tunix_main.py tests/integration/test_tunix_bugs.py \
	  tests/integration/test_tunix_sft.py tests/integration/test_tunix_agentic.py \
	  tests/integration/test_tunix_packing.py tests/integration/test_tunix_cli.py \
	  tests/integration/test_tunix_object_store.py tests/integration/test_tunix_audit.py \
	  tests/integration/test_tunix_multihost.py \
	  tests/unit/test_tunix_api.py tests/unit/test_tunix_signature.py tests/unit/test_tunix_input.py \
	  tests/unit/test_tunix_shardings.py
	CKPT_ITER_CONFORMANCE_EXAMPLES=$(TUNIX_MAIN_CONFORMANCE_EXAMPLES) \
	  CKPT_ITER_AGENTIC_CONFORMANCE_EXAMPLES=$(TUNIX_MAIN_CONFORMANCE_EXAMPLES) $(TUNIX_MAIN_VENV)/bin/python -m pytest \
	  -q -p no:cacheprovider --run-slow -s tests/integration/test_tunix_conformance.py

# What CI runs on main (it runs all of it on 0.1.7, in make test and
# test-heavy): the learners and orders where main differs from 0.1.7 (every
# RL learner family, the agentic loop and its full-batch replay, packing) and
# the differential suite's explicit examples. make test-tunix-main runs all.
test-tunix-main-core: $(TUNIX_MAIN_VENV)/.installed $(STAMP)
	$(TUNIX_MAIN_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --run-slow \
	  tests/integration/test_tunix_main.py tests/integration/test_tunix_agentic.py \
	  tests/integration/test_tunix_packing.py \
	  tests/unit/test_tunix_api.py tests/unit/test_tunix_signature.py tests/unit/test_tunix_input.py \
	  tests/unit/test_tunix_shardings.py
	$(TUNIX_MAIN_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --run-heavy \
	  tests/integration/test_tunix_conformance.py
