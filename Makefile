# The two commands of the README: `make serve` and `make test` (and `make lint` for style).
# All create .venv on first use.
# torch is installed first, pinned: the CPU wheel on our machines (a plain `torch` requirement
# would pull a multi-GB CUDA build); pyproject's range accepts it, so pip keeps it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
# glibc malloc settings from shared/reference/transport.md: deterministic, no page-fault storms.
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 1073741824
export MALLOC_TOP_PAD_ ?= 67108864

.PHONY: serve test lint install proto bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[server,dev]"
	touch $@

install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/rollserve serve $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q $(ARGS)

# `ruff format` clean over the whole tree, and the lint rules of pyproject.toml.
lint: $(BIN)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Regenerate the checked-in stubs after editing rollout.proto (a test diffs them).
proto: $(BIN)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos protos/rollserve/v1/rollout.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
