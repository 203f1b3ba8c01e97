# The two commands: `make demo` runs the main job, `make test` lints, type-checks and tests.
# `make docs` builds the documentation site strictly (site/); `make docs-check` runs every command
# the README and the tutorials and how-to guides mark runnable.
# Both create .venv first. torch is installed pinned before the package so that the package's
# own `torch>=2.3` is satisfied by it (a bare `torch` would pull several GB of CUDA wheels).
TORCH ?= torch==2.13.0
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: venv demo test lint typecheck pytest docs docs-check clean

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,docs]"
	touch $(VENV_STAMP)

demo: venv
	.venv/bin/ringtree train
	@echo ""
	@echo "ringtree is installed in .venv. To run it as plain 'ringtree', put it on your PATH:"
	@echo "    source .venv/bin/activate      (or call .venv/bin/ringtree directly)"
	@echo "What the table above means and what to try next: README.md, 'A five-minute tour'."

lint: venv
	.venv/bin/ruff check ringtree tests benchmarks examples
	.venv/bin/ruff format --check ringtree tests benchmarks examples

typecheck: venv
	.venv/bin/mypy

pytest: venv
	$(PY) -m pytest -q

test: lint typecheck pytest

# The reference pages are generated from the code first; then any warning (a broken link, a page
# missing from the nav) fails the build.
docs: venv
	$(PY) -m ringtree.cli.reference docs/reference
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict  # not --quiet: it hides the warnings strict mode fails on

docs-check: venv
	PATH="$(CURDIR)/.venv/bin:$$PATH" $(PY) tests/docs_commands.py --all

clean:
	rm -rf .venv build site *.egg-info .mypy_cache .pytest_cache .ruff_cache
