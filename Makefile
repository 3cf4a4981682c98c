# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint chaos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# migrate, demo login + demo runs, then web + worker + sandbox together (Ctrl-C stops all)
run: install
	$(BIN)/python manage.py rundemo

# the whole suite; set DATABASE_URL to run it on another database
test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

chaos: install
	$(BIN)/python manage.py chaos --runs 20 --random-kills 10

clean:
	rm -rf var
