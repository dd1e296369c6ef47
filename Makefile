# Two commands on a fresh machine: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch, pinned on purpose: a bare `pip install torch` pulls a multi-GB
# CUDA build. On a GPU machine: make install TORCH='torch==2.13.0' with a CUDA index
# configured for pip, then `pip install -e '.[gpu]'`. Torch must precede deepspeed.
TORCH  ?= torch==2.13.0

.PHONY: install demo lint test test-fast test-all clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH)'
	$(BIN)/pip install --quiet -e '.[dev]'
	# DeepSpeed's JIT-built ops (on CPU its shared-memory comm op): built here, not by the
	# first trainer to start
	$(BIN)/python -m trainer.prebuild
	touch $@

demo: install
	$(BIN)/mainspring demo

# The layering (DESIGN §2, contracts in pyproject.toml) and ruff's rule set, before the tests.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .

# The suite's wall time goes into the log (the budget: 20 minutes on a 2-core CI machine),
# and pytest's own status is make's: a failed test fails `make test`.
test: lint
	@t0=$$(date +%s); $(BIN)/pytest -q -m 'not soak' --durations=30; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - t0 )) s wall time (exit $$rc)"; exit $$rc

# The fast tier: no test that starts a process or a service (the `process` marker, set at
# collection by tests/conftest.py, which also fails a test here that starts one unmarked).
test-fast: install
	@t0=$$(date +%s); $(BIN)/pytest -q -m 'not soak and not process' --durations=10; rc=$$?; \
	echo "make test-fast: pytest took $$(( $$(date +%s) - t0 )) s wall time (exit $$rc)"; exit $$rc

test-all: install
	@t0=$$(date +%s); $(BIN)/pytest -q -m '' --durations=30; rc=$$?; \
	echo "make test-all: pytest took $$(( $$(date +%s) - t0 )) s wall time (exit $$rc)"; exit $$rc

clean:
	rm -rf .mainspring .pytest_cache
