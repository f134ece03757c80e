# Everything runs in a local virtual environment (.venv) made from python3.
# torch==2.13.0 is installed first on purpose: it is the CPU build this kind of
# machine holds locally, so the package's loose `torch>=2.4` is already met and no
# CUDA build is downloaded.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,viz,dev,examples]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/treelstm.py

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check batchgraph tests examples benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/treelstm.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
