# The targets the README names. `make demo` runs the main job, `make test` the tests;
# both set everything up first (venv, torch==2.13.0 CPU build, the project, the Bible corpus).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SWORD_PACKAGES := sword-text-web sword-text-sparv sword-text-kjv
BROWSER_PACKAGES := chromium chromium-driver fonts-liberation
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_MINUTES ?= 12

.PHONY: venv sword browser compiler test test-fast lint docs notebook demo bench peers pins clean

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build. Then the project
# at the versions of constraints.txt, the set the tests last passed with.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,serve,export]'
	touch $@

venv: $(VENV)/.installed

# The offline default corpus: World English Bible, Reina-Valera 1909, King James (Debian).
sword:
	@if dpkg -s $(SWORD_PACKAGES) >/dev/null 2>&1; then echo "SWORD modules present"; else \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(SWORD_PACKAGES); fi

# Headless Chromium (and a font for its text) for the browser test of `aiayn serve`'s page
# (tests/serving/test_page.py).
browser:
	@if dpkg -s $(BROWSER_PACKAGES) >/dev/null 2>&1; then echo "Chromium present"; else \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq $(BROWSER_PACKAGES); fi

# A C compiler for `--int8`'s kernel (aiayn/inference/native.py builds it on first use).
compiler:
	@if command -v $${CC:-cc} >/dev/null 2>&1; then echo "C compiler present"; else \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq gcc; fi

# Both tiers spread the test files over the cores (pytest-xdist; TEST_WORKERS=0 runs them in
# this one process): each worker runs torch on one thread (tests/conftest.py), and a file's
# tests stay on one worker, so a module's trained run or server is built once.
TEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The full suite names its 15 slowest tests at the end: where the ten minutes go.
test: venv sword browser compiler
	$(PYTEST) --durations=15

# The fast tier for the edit-run loop: the tests marked slow (tests/conftest.py) left out,
# about a minute on two cores; needs neither the Bible nor a browser.
test-fast: venv compiler
	$(PYTEST) -m "not slow"

lint: venv
	$(BIN)/ruff check src tests benchmarks docs

# The pages made from the code and the results files: docs/configuration.md, docs/cli.md,
# docs/results.md, the module map of docs/architecture.md and the signatures of
# docs/interfaces.md (tests/project/test_docs.py fails when they are not current).
docs: venv
	$(BIN)/python docs/generate.py

# Execute the notebooks of docs/ in place (the walkthrough about a minute on a CPU core, the
# ablations three) and record the fingerprint of their code and of the aiayn modules they
# import; tests/project/test_notebook.py fails when a fingerprint is no longer current.
notebook: venv
	$(BIN)/python docs/notebook.py

demo: venv sword
	$(BIN)/aiayn prepare --corpus bible:eng-spa --config configs/demo.yaml --out data/bible-eng-spa --force  # again: replaces what a run before wrote
	rm -rf runs/demo  # a fresh run each time: aiayn train refuses to overwrite a run
	$(BIN)/aiayn train --config configs/demo.yaml --data data/bible-eng-spa --out runs/demo --max-minutes $(DEMO_MINUTES)
	$(BIN)/aiayn evaluate runs/demo --split test  # the run's search: configs/demo.yaml's decode
	printf '%s\n' "In the beginning God created the heavens and the earth." "The Lord is my shepherd." "Love your neighbor as yourself." | $(BIN)/aiayn translate runs/demo

bench: venv
	$(BIN)/python benchmarks/speed.py

# JoeyNMT and OpenNMT-py for the side-by-side of benchmarks/peers/ (run.py there), each in
# its own venv under benchmarks/peers/.venvs with the same torch==2.13.0 CPU build.
peers:
	PYTHON=$(PYTHON) benchmarks/peers/setup.sh

# constraints.txt anew: the newest versions pyproject.toml's ranges allow, installed in a
# fresh venv (.venv-pins), written only when the whole test suite passes with them.
PINS_VENV := .venv-pins
pins: sword browser
	rm -rf $(PINS_VENV)
	$(PYTHON) -m venv $(PINS_VENV)
	$(PINS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PINS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(PINS_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test,serve,export]'
	$(PINS_VENV)/bin/python -m pytest
	head -n 3 constraints.txt > constraints.txt.new
	$(PINS_VENV)/bin/python -m pip freeze --exclude-editable | sed -E 's/\+[^ ]*$$//' >> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(PINS_VENV)
	@echo "constraints.txt rewritten; make venv installs it"

clean:
	rm -rf $(VENV) $(PINS_VENV) build src/*.egg-info .pytest_cache
