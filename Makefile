# Two commands for a fresh machine:
#   make demo   set up .venv and run the main job (4-rank CPU training demo)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	@if $(PY) -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then \
	  echo "Python < 3.12: CPU torch wheel, then megatron-core without its Python pin"; \
	  $(PIP) install torch==2.13.0 && \
	  $(PIP) install numpy packaging && \
	  $(PIP) install --no-deps --ignore-requires-python megatron-core==0.19.2 && \
	  $(PIP) install triton==3.8.0 && \
	  $(PIP) install --no-deps -e . && \
	  $(PIP) install scipy tqdm matplotlib pytest pytest-timeout hypothesis tensorboard; \
	else \
	  $(PIP) install torch==2.13.0 megatron-core==0.19.2 && \
	  $(PIP) install -e '.[test,plot]'; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-hdp demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
