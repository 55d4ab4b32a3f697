# The commands of the project: `make test` (CI's tier), `make test-all` (every test) and
# `make demo`. Each creates or reuses its virtual environment(s) and installs what it needs.
#
#   .venv          the engine (Python 3.12, jax 0.11.2 CPU)
#   .venv-oracle   the numerics oracle (Python 3.11, CPU torch 2.13.0 + transformers 5.23.0);
#                  it only writes fixtures under .cache/oracle, the engine never imports torch.
#   .venv-ascend   the Ascend backend on torch's CPU device (Python 3.11, CPU torch 2.13.0, numpy;
#                  no jax, as on an Ascend machine): tests/ascend drive it in a subprocess.
#                  jax cannot join it: jax 0.11.2 requires Python >= 3.12 (pip refuses it on 3.11),
#                  so deepinfer_jax.LLM(..., backend="ascend") runs there without jax.

PY312 ?= $(firstword $(wildcard $(shell pyenv prefix 3.12.1 2>/dev/null)/bin/python3.12 \
                                 $(HOME)/.pyenv/versions/3.12.1/bin/python3.12) python3.12)
PY311 ?= python3.11
VENV := .venv
ORACLE_VENV := .venv-oracle
ASCEND_VENV := .venv-ascend
ORACLE_DIR ?= .cache/oracle
PYTEST_ARGS ?=
# Test files run on three workers (pytest-xdist), a file's tests on one worker so that its
# module fixtures (compiled engines) are built once. A test mostly keeps one core busy
# (tracing is Python; a tiny model's step runs on one thread) and CI's machine has two, but
# many tests also wait (engine and server subprocesses, multi-process meshes, the Ascend
# backend's own interpreter): on that machine the suite took 25:52 on two workers and 23:08
# on three (the same tree and day, memory at most 5 GiB of 24; docs/performance-log.md).
PYTEST_WORKERS ?= 3
# A worker that dies (a native crash) ends the run at once with the test it ran named: with a
# replacement worker, pytest-xdist 3.8's file scheduler was seen to deadlock (the controller and
# both workers idle, each waiting on the other: py-spy) until CI's 90 minutes ran out.

export JAX_PLATFORMS ?= cpu
export DEEPINFER_ORACLE_DIR := $(abspath $(ORACLE_DIR))

.PHONY: test test-all demo oracle env ascend-env clean

$(VENV)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

$(ORACLE_VENV)/.installed: tests/oracle/requirements.txt
	$(PY311) -m venv $(ORACLE_VENV)
	$(ORACLE_VENV)/bin/pip install -q -r tests/oracle/requirements.txt
	touch $@

$(ASCEND_VENV)/.installed: tests/ascend/requirements.txt
	$(PY311) -m venv $(ASCEND_VENV)
	$(ASCEND_VENV)/bin/pip install -q -r tests/ascend/requirements.txt
	touch $@

env: $(VENV)/.installed

ascend-env: $(ASCEND_VENV)/.installed

oracle: $(ORACLE_VENV)/.installed
	$(ORACLE_VENV)/bin/python tests/oracle/build.py --out $(ORACLE_DIR)
	$(ORACLE_VENV)/bin/python tests/oracle/build_quantized.py --out $(ORACLE_DIR)

# CI's tier leaves out the tests marked slow (pyproject.toml): combinations and second cases of
# what it tests, which would take it past a slower CI machine's time limit; `make test-all`
# runs every test.
TEST_TIER ?= -m "not slow"

test: $(VENV)/.installed oracle ascend-env
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --max-worker-restart=0 \
		--durations=15 $(TEST_TIER) \
		$(PYTEST_ARGS)

test-all:
	$(MAKE) test TEST_TIER=

demo: $(VENV)/.installed
	$(VENV)/bin/python -m deepinfer_jax.api.demo

clean:
	rm -rf $(VENV) $(ORACLE_VENV) $(ASCEND_VENV) .cache
