# Two entry points (see README): `make demo` and `make test`. Each builds .venv by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TESTSTAMP := $(VENV)/.installed-test
# The real SGLang KV-event publisher, used as a peer in tests (its package deps are not needed).
SGLANG := sglang==0.5.23

.PHONY: demo test venv clean

$(STAMP): pyproject.toml enricher/core/_blocktable.c enricher/otlp/_otlpwire.c collectors/_kvwire.c collectors/_kvwire.h
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TESTSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SGLANG)
	touch $(TESTSTAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmiss demo

test: $(TESTSTAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
