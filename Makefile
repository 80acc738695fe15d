# Two commands matter: `make demo` (the main job) and `make test` (the test suite).
# Both bootstrap a virtualenv in .venv on a fresh clone. `make test` runs persist against
# memory://, file:// and s3:// (an in-process moto server, tests/support/s3_fixtures.py) and
# one Spark job on local-cluster[2,1,1024]; under CI=true a missing service fails, never skips.
# Tests run in parallel (pytest-xdist, one process per core; each worker has its own Postgres
# server and moto server, and the Spark files are scheduled onto one worker so that one
# SparkSession serves them: tests/support/schedule.py); the closing note gives the wall time, CPU time and
# load. The long campaigns (tests marked `campaign`) run in `make reliability`, long-sized.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= var/demo
# pytest-xdist workers: `auto` is one per CPU core; `make test PYTEST_WORKERS=0` runs serially.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: venv demo test test-fast lint typecheck bench reliability clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	bash scripts/ensure_java.sh
	$(PY) -m spark.jobs.flights --stash sqlite:///$(abspath $(DEMO_DIR))/stash.db --blob file://$(abspath $(DEMO_DIR))/blob

test: venv
	bash scripts/ensure_postgres.sh
	bash scripts/ensure_java.sh
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not campaign" --durations=15

test-fast: venv
	$(PY) -m pytest -q -x $(XDIST) -m "not slow and not campaign"

lint: venv
	$(VENV)/bin/ruff check stash persist spark tests bench
	$(VENV)/bin/ruff format --check stash persist spark tests bench

typecheck: venv
	$(VENV)/bin/mypy stash persist

bench: venv
	$(PY) -m pip install -q -e '.[dev,bench]'
	bash scripts/ensure_postgres.sh
	bash scripts/ensure_java.sh
	$(PY) -m bench.run_all

reliability: venv
	bash scripts/ensure_postgres.sh
	bash scripts/ensure_java.sh
	STASH_RELIABILITY=long $(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests/reliability
	STASH_RELIABILITY=long $(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "campaign or sized" \
		tests --ignore=tests/reliability
	$(PY) tests/reliability/report.py --mode long

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
