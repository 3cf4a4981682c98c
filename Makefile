# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install compile run test fuzz lint typecheck chaos clean bench

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# the project's bytecode, as a deployment compiles it (docs/operations.md): part of a worker's
# cold start otherwise
compile: install
	$(BIN)/python -m compileall -q agentops approvals runs

# migrate, demo login + demo runs, then web + worker + sandbox together (Ctrl-C stops all)
run: install
	DEBUG=$${DEBUG:-1} $(BIN)/python manage.py rundemo $(if $(PORT),--port $(PORT))

# the whole suite; set DATABASE_URL to run it on another database
test: install
	$(BIN)/python -m pytest

# the suite's fuzzing, longer: Schemathesis (every phase, against a served instance) and the
# form properties (Hypothesis), with more examples (README)
FUZZ_EXAMPLES ?= 100
FUZZ_FORM_EXAMPLES ?= 400
fuzz: install
	AGENTOPS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) AGENTOPS_FUZZ_FORM_EXAMPLES=$(FUZZ_FORM_EXAMPLES) \
	$(BIN)/python -m pytest -p no:cacheprovider --timeout=0 \
		tests/api/test_schema.py tests/runs/test_forms_fuzzed.py

# the write path (the record, the engine, the remote protocol, the services that change a
# run) holds no copied transition or checklist: pylint's duplicate-code finds 6 similar lines
WRITE_PATH := runs/record runs/engine runs/remote runs/services.py runs/waits.py runs/waitrules.py \
	runs/gate.py \
	approvals/services.py approvals/gate.py
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pylint --disable=all --enable=duplicate-code --min-similarity-lines=6 \
		--ignore-imports=y --score=n $(WRITE_PATH)
	$(MAKE) --no-print-directory typecheck

# mypy with django-stubs on the record, the engine, the remote protocol and approvals
# ([tool.mypy] in pyproject.toml); .ci/run runs it too
typecheck: install
	$(BIN)/mypy

chaos: install
	DEBUG=$${DEBUG:-1} $(BIN)/python manage.py chaos --runs 20 --random-kills 10

clean:
	rm -rf var

# benchmarks against the physical limit, on PostgreSQL only (DATABASE_URL; it creates and drops
# <name>_bench); production settings; BENCH_ARGS=--quick for small sizes (docs/benchmarks.md)
bench: compile
	DEBUG=0 SECRET_KEY=$${SECRET_KEY:-bench-only-not-a-secret} \
	ALLOWED_HOSTS=$${ALLOWED_HOSTS:-127.0.0.1,localhost} LOG_LEVEL=$${LOG_LEVEL:-WARNING} \
	$(BIN)/python manage.py bench $(BENCH_ARGS)
