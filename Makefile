# Set-up and entry points for a fresh Debian machine, as root. Every target
# installs what is missing first and is fast when nothing is.
SHELL := /bin/bash
PYTHON ?= python3
RANKS ?= 4
DEMO ?= jobs/examples/gpt.toml
DEBS := openmpi-bin libopenmpi-dev hdf5-tools slurm-wlm munge iproute2 mariadb-server slurmdbd
STAMPS := .stamps

# Open MPI refuses root and oversubscription unless told; one thread per rank on 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMPI_MCA_mpi_yield_when_idle := 1
export OMP_NUM_THREADS := 1

.PHONY: install debs run test test-nccl-rules test-gpu lint bench bench-gpu bench-gpu-deps slurm-up slurm-up-2nodes slurm-down submit-demo

install: debs $(STAMPS)/pip

debs:
	@missing=$$(for p in $(DEBS); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:" $$missing; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# torchao (train.float8's library) in a folder of its own that only tests/test_float8.py puts on its path:
# installed beside transformers, every rank that imports transformers would import it too (a second a process).
$(STAMPS)/pip: setup.cfg pyproject.toml
	$(PYTHON) -m pip install -q -e '.[dev,hf]'
	$(PYTHON) -m pip install -q --no-deps --upgrade --target $(STAMPS)/torchao 'torchao>=0.17'
	@mkdir -p $(STAMPS) && touch $@

run: install
	hpc run -n $(RANKS) $(DEMO)

# Two workers (pytest-xdist): a third of the suite's time is spent waiting (Slurm's scheduling and KillWait, stall
# and backend timeouts), which the other worker fills. A file's tests share a worker, and so do the files that
# start the local Slurm clusters or the namespace testbed (tests/conftest.py): one machine holds one of each.
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# Every multi-rank test file again under NCCL's rules (tests/nccl_rules.py; docs/TESTING.md): run_ranks takes the
# ncclrules backend where a test names none. Slurm's files (their ranks are Slurm's) and the GPU's aside.
# About 10 minutes on 2 cores.
NCCL_RULES_SKIP := tests/test_submit.py tests/test_sweep.py tests/test_cuda.py
test-nccl-rules: install
	HPC_TEST_BACKEND=ncclrules $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
	    $(filter-out $(NCCL_RULES_SKIP),$(shell grep -l run_ranks tests/test_*.py))

lint: install
	ruff check .

# Writes nothing by itself: docs/BENCHMARKS.md records the commands and their output.
bench: install
	hpc bench allreduce -n $(RANKS) --sizes 1K,64K,1M,16M,64M,256M
	hpc bench pipeline --stages 2,4 --microbatches 4,8
	hpc bench checkpoint -n 2 --size 1G --iters 3
	hpc bench memory -n 2,4

# On a GPU machine, from the checkout, installing nothing (jobs/bench/gpu.py): our trainer against the
# expert's transformers loop and torchtitan, Float8 and the fused head loss, the codecs against a device copy,
# the async checkpoint's stall, DP on one shared GPU. Rows go to runs/bench-gpu/rows.jsonl; docs/BENCHMARKS.md
# keeps the card and the table. The peers' packages come from $(BENCH_SITE) (make bench-gpu-deps, run where
# pip reaches the registry: the GPU machine has no network; carry the folder there).
BENCH_SITE := .bench-site
BENCH_PACKAGES := torchtitan==0.2.2 torchao==0.17.0 torchdata==0.11.0 tyro==1.0.17 tomli==2.5.0 \
	docstring-parser==0.18.0 typeguard==4.6.1
bench-gpu:
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(BENCH_SITE) $(PYTHON) -m jobs.bench.gpu

bench-gpu-deps:
	rm -rf $(BENCH_SITE) && mkdir -p $(BENCH_SITE)/wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 -d $(BENCH_SITE)/wheels $(BENCH_PACKAGES)
	for wheel in $(BENCH_SITE)/wheels/*.whl; do $(PYTHON) -m zipfile -e $$wheel $(BENCH_SITE); done
	rm -rf $(BENCH_SITE)/wheels

# The tests marked cuda, on a GPU machine that installs nothing (only the files that hold them are collected:
# the others may import what such a machine lacks, hypothesis or mpirun's tools). OMP_NUM_THREADS as set above.
test-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -m cuda -v -p no:cacheprovider $$(grep -l "pytest.mark.cuda" tests/test_*.py)

# A real local Slurm (slurm/testbed/cluster.py, state in /tmp/hpc-slurm); point clients at it with
# eval $$($(PYTHON) -m slurm.testbed.cluster env). slurm-up-2nodes: two network-namespace nodes.
slurm-up: install
	$(PYTHON) -m slurm.testbed.cluster start

slurm-up-2nodes: install
	$(PYTHON) -m slurm.testbed.cluster start --nodes 2

slurm-down:
	$(PYTHON) -m slurm.testbed.cluster stop

# The demo job through hpc submit on the local cluster (RANKS tasks), then rank 0's log until it ends.
submit-demo: slurm-up
	@eval $$($(PYTHON) -m slurm.testbed.cluster env) && \
	job=$$(hpc submit $(DEMO) --ntasks-per-node $(RANKS) | tee /dev/stderr | awk '/^submitted job/ {print $$3+0}') && \
	hpc logs $$job --follow
