# rtrl: the README names `make demo` and `make test`; everything else is a building block.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install install-run demo test test-fast lint format typecheck check proto proto-check bench-loop up down status report clean

RUN_STAMP := $(VENV)/.installed-run

# What the demo runs: the server, the client and the classifier, in one resolve (pip's time
# goes to one index lookup per package, so one command asks once). torch is named with its
# pin in the same resolve, so nothing pulls a CUDA build; the client is installed from this
# checkout (the server depends on it). No .pyc files up front: Python writes them as the
# demo first imports each module.
$(RUN_STAMP): pyproject.toml clients/python/pyproject.toml constraints.txt scripts/bootstrap.sh
	bash scripts/bootstrap.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt torch==2.13.0 -e clients/python -e '.[classifier]'
	touch $(RUN_STAMP)

# Everything else the tests and checks use (the dev extra).
$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install-run: $(RUN_STAMP)
install: $(STAMP)

# Node packages, exactly as locked, for the tests and checks (the demo needs none): the
# TypeScript SDK's compiler, generators and test tools (clients/typescript;
# tests/clients/test_typescript_sdk.py runs its suite; --ignore-scripts: esbuild and buf ship
# their binaries as optional packages), and the dashboards' schema check (deploy/grafana).
TS_DEPS := clients/typescript/node_modules/.package-lock.json
GRAFANA_DEPS := deploy/grafana/node_modules/.package-lock.json
.PHONY: install-node
install-node: $(TS_DEPS) $(GRAFANA_DEPS)
$(TS_DEPS): clients/typescript/package-lock.json
	npm ci --prefix clients/typescript --ignore-scripts --no-audit --no-fund --loglevel=error
$(GRAFANA_DEPS): deploy/grafana/package-lock.json
	npm ci --prefix deploy/grafana --no-audit --no-fund --loglevel=error

## The demo: the whole loop on the embedded stack, ending with the A/B table.
demo: install-run
	$(BIN)/rtrl demo

## The tests: unit, integration (real Tansu, Redis, chdb, gRPC) and end-to-end, on
## TEST_WORKERS pytest workers (pytest-xdist), each test file whole on one worker, so a
## module's stack starts once. Much of a test's time is waiting on the processes it started:
## two workers keep two cores busy.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install install-node
	$(PYTEST)

test-fast: install install-node
	$(PYTEST) -m "not slow"

## The habits CI holds every change to, before the tests (ruff, deptry and mypy: pyproject.toml).
## deptry: every import of the shipped code is a declared dependency of the wheel.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/deptry .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: install
	$(BIN)/mypy

check: lint typecheck proto-check

proto: install
	PATH=$(BIN):$$PATH bash scripts/gen_proto.sh

# Generated code is never edited by hand: regenerating must change nothing.
proto-check: proto
	git diff --exit-code -- rtrl/v1 clients/python/src/rtrl_client/v1

## Monitoring: the alert rules and their unit tests (promtool), the Grafana dashboards
## against Grafana's own schema (deploy/grafana).
.PHONY: check-alerts check-dashboards

check-alerts:
	promtool check rules deploy/prometheus/alerts.yml
	promtool test rules deploy/prometheus/alerts_test.yml

check-dashboards: $(GRAFANA_DEPS)
	npm run --prefix deploy/grafana --silent check

bench-loop: install
	$(BIN)/rtrl bench loop

up: install-run
	$(BIN)/rtrl up
down:
	$(BIN)/rtrl down
status:
	$(BIN)/rtrl status
report:
	$(BIN)/rtrl report

clean:
	-$(BIN)/rtrl down
	rm -rf .rtrl reports
