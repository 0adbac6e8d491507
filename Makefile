# Two commands for a fresh machine:
#   make demo   set up .venv and run the main job (4-rank CPU training demo)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean gpu-check

setup: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	@if $(PY) -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then \
	  echo "Python < 3.12: CPU torch wheel, then megatron-core without its Python pin"; \
	  $(PIP) install torch==2.13.0 && \
	  $(PIP) install numpy packaging psutil && \
	  $(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2 && \
	  $(PIP) install triton==3.8.0 && \
	  $(PIP) install --no-deps -e . && \
	  $(PIP) install scipy tqdm matplotlib pytest pytest-timeout hypothesis tensorboard ninja; \
	else \
	  $(PIP) install torch==2.13.0 megatron-core==0.19.2 psutil && \
	  $(PIP) install -e '.[test,plot]'; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-hdp demo

test: $(STAMP)
	$(PY) -m pytest -q

# On a machine with GPUs: GPU tests, benchmarks against their targets, calibrate, 2-step NCCL runs;
# writes benchmarks/results/selftest.md (<= 30 min on one H100)
gpu-check: $(STAMP)
	$(VENV)/bin/megatron-hdp selftest

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
