# The two commands of the README: `make serve` and `make test` (and `make lint` for style;
# `make test-gpu` for the GPU tests on a CUDA machine). All create .venv on first use.
# torch is installed first, pinned: the CPU wheel on our machines (a plain `torch` requirement
# would pull a multi-GB CUDA build); pyproject's range accepts it, so pip keeps it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
# glibc malloc settings, fixed so that every run behaves the same: buffers of 32 MiB and more
# come from mmap and go back at free; the heap keeps up to 1 GiB free rather than trimming it
# (no page-fault storm on the next weight update).
export MALLOC_MMAP_THRESHOLD_ ?= 33554432
export MALLOC_TRIM_THRESHOLD_ ?= 1073741824
export MALLOC_TOP_PAD_ ?= 67108864

.PHONY: serve test test-gpu bench-gpu lint install proto bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[server,dev]"
	touch $@

install: $(BIN)/.installed

serve: $(BIN)/.installed
	$(BIN)/rollserve serve $(ARGS)

# The whole suite, then its 15 slowest tests. `gpu` tests skip without CUDA (tests/conftest.py);
# ROLLSERVE_TEST_CPU_COUNT=16 runs it as if on 16 cores. Test files run in parallel, a file's
# tests on one worker (its module fixtures built once), a worker per core up to
# tests/conftest.py's cap (one process where there is a GPU): most tests wait on a server
# process or a socket, so on 2 cores the suite takes ~0.6 of its serial time. ARGS="-n 0" runs
# it in this one process.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15 $(ARGS)

# GPU checks. On a GPU node whose python already has a CUDA torch (and the project installed
# with `pip install --no-deps -e .`), name it: `make test-gpu GPU_PYTHON=python3`; otherwise the
# venv is used (set TORCH_SPEC to a CUDA build). Without CUDA every gpu test is skipped.
GPU_PYTHON ?=
GPU_PY := $(or $(GPU_PYTHON),$(BIN)/python)
GPU_DEPS := $(if $(GPU_PYTHON),,$(BIN)/.installed)

# Only the tests marked `gpu`.
test-gpu: $(GPU_DEPS)
	$(GPU_PY) -m pytest -q -m gpu --durations=15 $(ARGS)

# Generation on the GPU: HF generate against the engine on the same rows (bench/bench_gpu.py);
# then UpdateWeights into a CUDA server per transport against the H2D and D2D copies
# (bench/bench_gpu_weights.py; its own arguments in WEIGHTS_ARGS, e.g. "--quick"); last, where a
# decode step's and a scoring forward's time goes (bench/profile_gpu.py, PROFILE_ARGS).
bench-gpu: $(GPU_DEPS)
	$(GPU_PY) bench/bench_gpu.py $(ARGS)
	$(GPU_PY) bench/bench_gpu_weights.py $(WEIGHTS_ARGS)
	$(GPU_PY) bench/bench_update_latency.py --device cuda --phases
	$(GPU_PY) bench/profile_gpu.py $(PROFILE_ARGS)

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
