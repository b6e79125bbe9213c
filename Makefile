# Two entry points, each doing all set-up on a fresh machine:
#   make demo   create .venv (python3.12), install kvjax, run the main job
#   make test   same set-up, then `make lint` (ruff + mypy, fail fast), then the whole test suite on the CPU
#   make test-quick   same set-up, then only the host-side tests (no lint, no model, no server)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# python3.12 may be a pyenv shim that is not selected; probe the usual places.
PYTHON312 ?= $(shell for c in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null) /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	if "$$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo "$$c"; break; fi; done)
PYTEST_ARGS ?=

.PHONY: venv redis-server demo lint test test-quick bench-ledger bench-device clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "python3.12 not found (jax>=0.11 needs Python 3.12)"; exit 1; }
	test -x $(PY) || "$(PYTHON312)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	JAX_PLATFORMS=cpu $(VENV)/bin/kvjax demo

# ruff and mypy are configured in pyproject.toml
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# the Redis store tests start their own redis-server (Debian's package): installed here when missing
# and we are root with apt-get; otherwise they fail (KVJAX_SKIP_REDIS_TESTS=1 skips them on purpose, never in CI)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; \
	  else echo "note: redis-server not found: tests/kv_store's Redis tests will fail (apt-get install redis-server, or KVJAX_SKIP_REDIS_TESTS=1)"; fi; }

test: lint redis-server
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) tests

# the host-side tests: ledger, KV-event wire/adapter/sockets, router index and policies, sizing,
# model specs, transfer plans, packaging, tokenizer. No model compiles, no engine, no server.
QUICK_TESTS := tests/ledger tests/kv_events tests/router/test_index.py tests/router/test_policy.py \
	tests/test_capacity.py tests/test_model_spec.py tests/test_transfer_plan.py tests/test_packaging.py tests/test_tokenizer.py

test-quick: venv
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" $(PYTEST_ARGS) $(QUICK_TESTS)

bench-ledger: venv
	$(PY) benchmarks/ledger_bench.py

bench-device: venv
	JAX_PLATFORMS=cpu $(PY) benchmarks/device_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache results
