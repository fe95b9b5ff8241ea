# Two commands: `make run` starts tower + store + gateway on loopback (data in ./var),
# `make test` runs the whole suite.  Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup java run test lint bench bench-all pipeline clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,spark]'
	touch $(STAMP)

# Java is only needed by the Spark connector's tests and pipelines.
java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "installing a Java runtime for Spark"; \
	  apt-get update -q && apt-get install -y -q default-jre-headless; }

setup: $(STAMP) java

run: setup
	$(BIN)/dafka up --data var

lint: setup
	$(BIN)/ruff check dafka tests examples

test: setup lint
	$(BIN)/pytest

bench: setup
	$(BIN)/dafka bench live --records 1000000 --runs 3

# Every row of the README's performance table, one after the other.
bench-all: setup
	$(BIN)/dafka bench zmq --records 300000 --runs 3
	$(BIN)/dafka bench live --records 300000 --runs 3
	$(BIN)/dafka bench store --records 300000 --runs 3
	$(BIN)/dafka bench store --no-sync --records 300000 --runs 3
	$(BIN)/dafka bench replay --records 1000000 --runs 3
	$(BIN)/dafka bench tank --records 1000000 --runs 3
	$(BIN)/dafka bench spark --records 1000000 --runs 3

# The edge-to-analytics example: devices -> mesh -> Spark -> mesh -> console.
pipeline: setup
	$(BIN)/python examples/edge_pipeline.py --devices 4 --seconds 60

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache .hypothesis
