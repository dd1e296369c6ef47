# Two commands on a fresh machine: `make demo` and `make test` (both install first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch, pinned on purpose: a bare `pip install torch` pulls a multi-GB
# CUDA build. On a GPU machine: make install TORCH='torch==2.13.0' with a CUDA index
# configured for pip, then `pip install -e '.[gpu]'`. Torch must precede deepspeed.
TORCH  ?= torch==2.13.0

.PHONY: install demo lint test test-all clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH)'
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(BIN)/mainspring demo

# The layering (DESIGN §2, contracts in pyproject.toml) and ruff's rule set, before the tests.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q -m 'not soak' --durations=15

test-all: install
	$(BIN)/pytest -q -m '' --durations=15

clean:
	rm -rf .mainspring .pytest_cache
