# make run: set up .venv and run the tiny pipeline on CPU.  make test: set up and run the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install -q --disable-pip-version-check -c requirements.lock

.PHONY: setup run test serve lock clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0   # the CPU build (a plain `torch` would pull a multi-GB CUDA build)
	$(PIP) -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/hybrid-rlhf run params/tiny.yaml --summary-json artifacts/summary.json

serve: setup
	$(VENV)/bin/hybrid-rlhf serve

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lock: setup
	$(PY) -m pip freeze --exclude-editable | sed '1i # Every package version the CI and `make` install, resolved together on Python 3.11 (CPU torch 2.13.0).\n# Regenerate after changing dependencies: make lock' > requirements.lock

clean:
	rm -rf $(VENV) artifacts .prefect
