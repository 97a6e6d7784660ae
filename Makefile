# The two commands: `make run` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export SPARK_LOCAL_IP ?= 127.0.0.1
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: run test lint typecheck docs unit install clean constraints

CONSTRAINTS := .ci/constraints.txt

# Everything: the broker, the Spark report (and Spark Connect) extras, the test tools and the
# documentation site's tools, at the versions CI pins.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,report,connect,docs]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/chronomq cluster up --nodes 3 --http-port 8080 --raft-port 9080 --data-dir ./var

lint: $(STAMP)
	$(BIN)/ruff check raftlog schedule timer pop cluster ops chronomq tests
	$(BIN)/ruff format --check raftlog schedule timer pop cluster ops chronomq tests

typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site (docs/, mkdocs.yml) into site/, which git ignores: --strict fails on
# a warning, a broken link or anchor included (not with --quiet, which drops the warnings).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Two test processes (pytest-xdist; each test file stays on one): the integration tests mostly
# wait on real nodes, so two at a time halve the wall time on two cores. TEST_WORKERS=0 runs
# the suite in this one process. Tests marked `alone` run afterwards, with nothing beside them.
TEST_WORKERS ?= 2

test: $(STAMP) lint typecheck docs
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -q -ra -m alone

# Pin what a fresh install resolves to now (run after changing dependencies).
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install --quiet --upgrade pip
	.venv-constraints/bin/python -m pip install --quiet '.[test,report,connect,docs]'
	{ sed -n '1,2p' $(CONSTRAINTS); .venv-constraints/bin/python -m pip freeze --exclude-editable \
	  | grep -v '^chronomq'; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .venv-constraints

clean:
	rm -rf $(VENV) var site .pytest_cache .mypy_cache .ruff_cache
