# Every target works on a fresh machine: the venv is created and filled from pyproject.toml on demand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# Where `make run` keeps the sandbox's etcd and bookie data (bkaio honours $BKAIO_HOME too).
BKAIO_HOME ?= $(HOME)/.bkaio

.PHONY: setup test test-slow chaos simulate simulate-exhaustive mutants run bench lint fmt clean clean-sandbox

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Two workers: most tests wait on bookie processes, etcd and fsync, not on the CPU. A module's tests
# stay on one worker; Spark, the fault suite and the network-namespace tests each keep to one
# (tests/conftest.py). `pytest -p no:xdist` or plain `pytest` runs serially.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q -n 2 --dist loadgroup

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

# Long fault runs on real bookie processes (tests/faults): FAULT_CYCLES per nemesis, FAULT_SEED to replay,
# FAULT_FIGURES=FILE to collect each scenario's figures as JSON lines. No per-test time limit here.
chaos: $(STAMP)
	FAULT_CYCLES=$${FAULT_CYCLES:-200} $(BIN)/python -m pytest -m slow -q --timeout=0 tests/faults

# Deterministic simulation (tests/simulation): SEEDS seeds of the general scenario, RACE_SEEDS of
# the race profile and AR_SEEDS of the autorecovery one, from FIRST; a failing seed prints the
# command that replays it (`pytest tests/simulation/test_seeds.py::TEST --seed N`, which prints
# its trace).
SEEDS ?= 1000
RACE_SEEDS ?= $(SEEDS)
AR_SEEDS ?= $(SEEDS)
FIRST ?= 0
simulate: $(STAMP)
	$(BIN)/python -m pytest -q tests/simulation/test_seeds.py::test_seeds_hold_every_invariant \
	  tests/simulation/test_seeds.py::test_race_seeds_hold_every_invariant \
	  tests/simulation/test_seeds.py::test_autorecovery_seeds_hold_every_invariant \
	  --sim-seeds $(SEEDS) --race-seeds $(RACE_SEEDS) --autorecovery-seeds $(AR_SEEDS) --sim-first $(FIRST)

# The three profiles with bookie GC on against the metadata (tests/simulation/gc_sweep.py): GC_SEEDS
# seeds of each from FIRST; a failing seed prints the command that replays it (with its trace).
GC_SEEDS ?= 300
.PHONY: simulate-gc
simulate-gc: $(STAMP)
	SIM_GC_SEEDS=$(GC_SEEDS) SIM_GC_FIRST=$(FIRST) $(BIN)/python -m pytest -q -p no:xdist \
	  tests/simulation/test_gc_seeds.py::test_gc_sweep

# Exhaustive mode (tests/simulation/exhaustive.py): every schedule of the tiny world within
# DEVIATIONS choices off the default one, per fault plan, with state hashing; BUGS plants bug.* switches.
DEVIATIONS ?= 2
BUGS ?=
simulate-exhaustive: $(STAMP)
	$(BIN)/python -m tests.simulation.exhaustive --deviations $(DEVIATIONS) --bugs "$(BUGS)"

# Safety mutants: one-line breaking edits to safety-critical code, each in a scratch copy, each of
# which its targeted tests must kill (tests/faults/mutants.py; MUTANTS="name ..." runs some).
mutants: $(STAMP)
	$(BIN)/python -m tests.faults.mutants $(MUTANTS)

run: $(STAMP)
	$(BIN)/bkaio sandbox

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# A short default comparison on a private sandbox (docs/benchmarks.md): our write path against NATS
# JetStream R3 (fsync always) in the same run, 3 reps interleaved. `make bench BOUND=PATH` adds the
# replication bound (replication_bound.py, not part of this repository).
BENCH_ARGS ?= --duration 5 --warmup 1 --reps 3
bench: $(BENCH_STAMP)
	$(BIN)/bkaio bench write --sandbox $(BENCH_ARGS) --compare nats $(if $(BOUND),--compare bound --bound-script $(BOUND))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
	@if [ -d "$(BKAIO_HOME)/sandbox" ]; then \
	  echo "kept the sandbox data in $(BKAIO_HOME)/sandbox ($$(du -sh "$(BKAIO_HOME)/sandbox" | cut -f1)): make clean-sandbox deletes it"; \
	fi

# The sandbox's etcd and bookie data: every ledger written to it is gone afterwards. Refused while
# the sandbox or a child it left behind (a sandbox killed with SIGKILL) still runs.
clean-sandbox:
	@dir="$(BKAIO_HOME)/sandbox"; \
	pids=$$(cat "$$dir/sandbox.pid" 2>/dev/null; awk '{print $$2}' "$$dir/sandbox.children" 2>/dev/null); \
	live=""; for pid in $$pids; do kill -0 "$$pid" 2>/dev/null && live="$$live $$pid"; done; \
	if [ -n "$$live" ]; then \
	  echo "sandbox processes still run on $$dir (pids$$live): stop them first (Ctrl-C in the sandbox's terminal, or kill -INT PID)"; \
	  exit 1; \
	fi
	rm -rf "$(BKAIO_HOME)/sandbox"
