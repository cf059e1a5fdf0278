# One command sets up and runs the demo, one runs the tests. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; pip finds it in the machine's local wheels (see DEVELOPERS.md).
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test bench clean

# DeepSpeed JIT-builds its CPU ops (the shm all-reduce, FusedAdam) on first use, under a lock file
# that a process killed mid-build leaves behind; built here once, starts only check them (see
# gpp_deepspeed/engine/startup.py). Each virtual environment keeps its own build, so two clones on
# one machine never rebuild each other's ops (minutes each); set TORCH_EXTENSIONS_DIR to share one.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
# The ops are built by the venv's ninja, as the tests build them (tests/conftest.py says why).
export PATH := $(abspath $(VENV))/bin:$(PATH)
OPS_BUILT := $(TORCH_EXTENSIONS_DIR)/.gpp-ops-built

setup: $(VENV)/.installed $(OPS_BUILT)

$(OPS_BUILT): $(VENV)/.installed
	$(PY) -c 'from gpp_deepspeed.engine.startup import main; main()'
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,hf]"
	touch $@

demo: setup
	$(VENV)/bin/deepspeed --num_gpus 4 examples/multimodal_demo.py --deepspeed_config configs/example.json

test: setup
	$(PY) -m pytest -q --durations=20 tests   # ends with the 20 slowest: where the suite's time goes

bench: setup
	$(PY) benchmarks/step_time.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/activation_meter.py
	$(PY) benchmarks/compute_stack.py
	$(PY) benchmarks/compute_stack.py --sleeping 10
	$(PY) benchmarks/plan_compare.py
	$(PY) benchmarks/branch_scaling.py
	$(PY) benchmarks/search_speed.py
	$(PY) benchmarks/schedules.py
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/gc_pauses.py
	$(PY) benchmarks/zbv_in_flight.py
	$(PY) benchmarks/zbv_order.py
	$(PY) benchmarks/stage_switch.py
	$(PY) benchmarks/async_convergence.py
	$(PY) benchmarks/transport_costs.py
	$(PY) benchmarks/planned_runs.py
	$(PY) benchmarks/device_profiles.py --compare benchmarks/results/device_profiles   # the GPU run: --out DIR there
	$(PY) benchmarks/large_models.py
	$(PY) benchmarks/zero_memory.py
	$(PY) benchmarks/checkpoint_save.py
	$(PY) benchmarks/elastic_recovery.py --nproc 4

clean:
	rm -rf $(VENV) build *.egg-info
