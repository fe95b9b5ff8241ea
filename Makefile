# Two commands: `make run` starts tower + store + gateway on loopback (data in ./var),
# `make test` runs the whole suite.  Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup java netns chromium run test lint typecheck docs bench bench-all pipeline sim sim-sweep fuzz-deep chaos console-soak console-cost clean

# The install also compiles the I/O extension in place (setup.py, Cython from
# the build requirements); a failed compile leaves the pure-Python twin.
$(STAMP): pyproject.toml setup.py dafka/fastio/_compiled.pyx dafka/fastio/zmq_api.h dafka/kafka/_compiled.pyx
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,spark,docs]'
	touch $(STAMP)

# Java is only needed by the Spark connector's tests and pipelines.
java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "installing a Java runtime for Spark"; \
	  apt-get update -q && apt-get install -y -q default-jre-headless; }

# iproute2 (`ip`) builds the network namespaces of tests/test_multihost.py.
netns:
	@command -v ip >/dev/null 2>&1 || { \
	  echo "installing iproute2 for the multi-host test"; \
	  apt-get update -q && apt-get install -y -q iproute2; }

# Headless Chromium and its WebDriver: the console's real-browser test (tests/test_console_browser.py).
chromium:
	@command -v chromedriver >/dev/null 2>&1 || { \
	  echo "installing Chromium and chromium-driver for the console's browser test"; \
	  apt-get update -q && apt-get install -y -q chromium chromium-driver; }

setup: $(STAMP) java netns chromium

# The services need the venv only (no Java, Chromium or iproute2: those are for tests).
run: $(STAMP)
	$(BIN)/dafka up --data var

lint: setup
	$(BIN)/ruff check dafka tests examples

# The public Python API type-checks strictly (settings in pyproject's [tool.mypy]).
MYPY_STRICT := dafka/producer.py dafka/consumer.py dafka/nodes/producer.py dafka/nodes/consumer.py dafka/nodes/loop.py dafka/aio.py dafka/config.py dafka/tank/client.py dafka/store/block.py dafka/store/blocktable.py dafka/store/reader.py dafka/store/writer.py dafka/store/retention.py dafka/store/compaction.py dafka/store/upgrade.py dafka/console/model.py dafka/console/server.py dafka/cli/console.py dafka/cli/args.py dafka/cli/common.py dafka/cli/parser.py dafka/outbox/host.py dafka/kafka/txn.py dafka/kafka/txn_api.py dafka/kafka/txn_admin.py dafka/store/pipeline.py
typecheck: setup
	$(BIN)/mypy --strict $(MYPY_STRICT)

# The documentation site (docs/, mkdocs.yml) into site/; strict: a broken link
# or a docstring mkdocstrings cannot render fails the build (not --quiet: with it,
# mkdocs does not count the warnings strict mode fails on).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The whole suite with the compiled extension (asserted active), then the
# mesh, store and wire tests again on the pure-Python twin (test_fastio's
# differential tests already run both twins in the first pass).
# TEST_WORKERS pytest-xdist workers: most tests wait on the mesh (timers,
# processes, a JVM), not on a core, so three share a 2-core machine (a quiet
# fresh clone: 8 min 43 s on three, 11 min 33 s on two); tests/conftest.py
# keeps the Spark tests and the docs' runs each on one worker.  TEST_WORKERS=0
# runs everything in one process.  PASS_TIMEOUT bounds each pass in seconds:
# pytest-timeout bounds each test, but pytest-xdist hung once after replacing a
# crashed worker, and a hang must fail (--foreground: Ctrl-C still reaches pytest).
TEST_WORKERS ?= 3
PASS_TIMEOUT ?= 2700
test: setup lint typecheck docs
	DAFKA_REQUIRE_EXTENSIONS=1 timeout --foreground -k 30 $(PASS_TIMEOUT) $(BIN)/pytest -n $(TEST_WORKERS)
	DAFKA_NO_EXTENSIONS=1 timeout --foreground -k 30 $(PASS_TIMEOUT) $(BIN)/pytest -n $(TEST_WORKERS) tests/test_mesh.py tests/test_batches.py tests/test_store_node.py tests/test_wire.py tests/kafka/test_records.py

bench: setup
	$(BIN)/dafka bench live --records 1000000 --runs 3

# Every row of the performance table (docs/reference/performance.md), one after the other.
bench-all: setup
	$(BIN)/dafka bench zmq --records 300000 --runs 3
	$(BIN)/dafka bench live --records 300000 --runs 3
	$(BIN)/dafka bench store --records 300000 --runs 3
	$(BIN)/dafka bench store --no-sync --records 300000 --runs 3
	$(BIN)/dafka bench replay --records 1000000 --runs 3
	$(BIN)/dafka bench tank --records 1000000 --runs 3
	$(BIN)/dafka bench spark --records 1000000 --runs 3

# Deterministic fault simulation (dafka.sim): SEEDS seeded schedules from FIRST;
# a failing seed prints its replay command (SHRINK=1 also shrinks it; CLASSIC=1
# runs the first generator's schedules, which seeds found before issue 40 name).
SEEDS ?= 200
FIRST ?= 0
sim: setup
	$(BIN)/python -m dafka.sim --seeds $(SEEDS) --first $(FIRST) --keep-going $(if $(SHRINK),--shrink) $(if $(CLASSIC),--classic)

# A long sweep (not CI): 10,000 seeds from 200000 by default, a range CI and the
# docs do not use (they start at 0); prints only failing seeds with their replay
# lines, progress every 500, and the total.  JOBS worker processes; stops
# starting seeds after MAX_MINUTES.  E.g. `make sim-sweep FIRST=300000 SEEDS=20000`.
sim-sweep: SEEDS = 10000
sim-sweep: FIRST = 200000
JOBS ?= 2
MAX_MINUTES ?= 120
sim-sweep: setup
	$(BIN)/python -m dafka.sim --seeds $(SEEDS) --first $(FIRST) --keep-going --quiet --jobs $(JOBS) --minutes $(MAX_MINUTES) $(if $(CLASSIC),--classic)

# Every fuzz (hypothesis) test with 2,000 examples each (not part of `make test`).
fuzz-deep: setup
	DAFKA_HYPOTHESIS_PROFILE=deep $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider $$(grep -rl "@given" tests)

# Chaos soak with real processes on loopback for MINUTES (not part of `make test`).
MINUTES ?= 5
chaos: setup
	$(BIN)/python -m dafka.sim.chaos --minutes $(MINUTES)

# The web console over a busy mesh for SOAK_MINUTES (not part of `make test`), with the
# landing and a topic page open in headless Chromium: the console's RSS (anon and
# file-backed), the pages' JS heaps and Chromium's PSS sampled every 10 s into
# console-soak.csv, summed up at the end.
SOAK_MINUTES ?= 60
console-soak: setup chromium
	nice -n 10 $(BIN)/python -m dafka.console.soak --minutes $(SOAK_MINUTES) --browser --out console-soak.csv

# What an observer costs the mesh: the live transfer with no observer, `dafka status
# --watch`, and `dafka console` with a page open, alternating (not part of `make test`).
console-cost: setup
	$(BIN)/python -m dafka.console.cost --rounds 5 --records 2000000

# The edge-to-analytics example: devices -> mesh -> Spark -> mesh -> console.
pipeline: setup
	$(BIN)/python examples/edge_pipeline.py --devices 4 --seconds 60

clean:
	rm -rf $(VENV) var site .pytest_cache .ruff_cache .mypy_cache .hypothesis build dafka/fastio/_compiled.c dafka/fastio/*.so
