# Two entry points that work on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed first so that pip takes the CPU build on disk instead of a CUDA build.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast clean

demo: $(VENV)/.installed
	$(BIN)/python -m hookkit demo

# the tests run on every core: pytest-xdist starts one process per core
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto

# the suite without the tests marked slow (wheel builds, subprocesses, the trained model end to end): while you work
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto -m "not slow"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,plot]"
	touch $@

clean:
	rm -rf $(VENV) dist build *.egg-info
