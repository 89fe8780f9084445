# Every target sets itself up: a fresh clone needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test bench lab lint format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/allocator.py

lab: $(STAMP)
	$(BIN)/prefixcache lab

lint: $(STAMP)
	$(BIN)/ruff check --output-format concise src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
