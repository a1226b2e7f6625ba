# The two set-up commands (README):  `make demo` runs the embedded default job, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test test-ready test-all test-fast test-explore test-user-install system-deps install ops gpu-validate

# What a user installs (the demo needs nothing more), then the test extras on top for `make test`.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	touch $@

# The test extras alone (read from zerorun's installed metadata), not `pip install -e '.[test]'`: that would reinstall
# zerorun itself while `make test` builds the ops beside it with zerorun's prebuild.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -c 'from importlib.metadata import requires; print(*[r.split(";")[0] for r in requires("zerorun") if "extra == \"test\"" in r], sep="\n")' > $(VENV)/test-requirements.txt
	$(PIP) install -r $(VENV)/test-requirements.txt
	touch $@

install: $(VENV)/.installed-test

# libaio for NVMe offload (DeepSpeed async_io); tcmalloc (CPU ranks' default allocator, launcher.allocator) and
# jemalloc (its fallback, tested). Needs root/apt; elsewhere zerorun falls back to glibc and says how to install.
SYSTEM_PKGS := libaio-dev libtcmalloc-minimal4 libjemalloc2
system-deps:
	@if ! dpkg -s $(SYSTEM_PKGS) >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PKGS) >/dev/null; \
	  else echo "note: not root or no apt-get: install $(SYSTEM_PKGS) yourself (NVMe offload is refused without libaio; CPU ranks run glibc's malloc, slower, without tcmalloc)"; fi; \
	fi

# The demo builds only the DeepSpeed ops its job loads: none (CPU ranks skip DeepSpeed's shared-memory all-reduce
# op, which training never calls); a run that needs one (offload=cpu: cpu_adam, offload=nvme: async_io) builds it
# before its ranks start.
demo: system-deps $(VENV)/.installed
	DS_ACCELERATOR=cpu $(PY) -m zerorun.prebuild --for demo
	$(VENV)/bin/zerorun

# All of DeepSpeed's CPU ops zerorun loads (cpu_adam, async_io: ~4 min on 2 cores, built side by side, async_io's
# units on a precompiled torch header) compiled once, before the tests. They need only the user's install: `make
# test` builds them while pip installs the test extras.
ops: system-deps $(VENV)/.installed
	DS_ACCELERATOR=cpu $(PY) -m zerorun.prebuild

# The test extras and the ops at once (pip waits on the network and unpacks; the op builds fill the cores).
test-ready: system-deps $(VENV)/.installed
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed-test ops

# CI's command: every tier, each feature proved by at least one real job; the rest of the e2e matrices (the other
# ZeRO stage x launcher points, each model's pipeline parity, ...) are marked slow and run in `make test-all`.
# (Building the ops beside the unit and integration tiers was tried: 41:35 against 41:51 sequential, no gain on 2
# cores, both saturated.) Tests run in TEST_WORKERS pytest-xdist workers, a whole module at a time (its fixtures
# run once), in collection order: the long e2e modules start first, the many short unit ones fill the end. A 2-rank
# CPU job leaves ~27% of 2 cores idle (its launcher, imports and checks are one process) and a second job fills
# it: measured on 7 e2e tests, 357 s alone, 256 s in two workers.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: test-ready
	$(PY) -m pytest -v -rs -m "not slow" $(XDIST) --timeout=1800 --durations=15 --junitxml=$(VENV)/test-report.xml tests
	$(PY) benchmarks/suite_time.py --from $(VENV)/test-report.xml --slowest 0

# Everything, the slow matrices included (about an hour on 2 cores).
test-all: test-ready
	$(PY) -m pytest -v -rs $(XDIST) --timeout=1800 --durations=25 --junitxml=$(VENV)/test-report.xml tests
	$(PY) benchmarks/suite_time.py --from $(VENV)/test-report.xml --slowest 0

# The unit tier less its heavy tests (pyproject's `heavy` mark: many Hydra compositions at ~0.1 s each, torch imported
# or run, searches): 216 of the 539 unit tests (config, plan, argv, ops, estimate, ...), torch never imported, in one
# process: 11.3 s wall on 2 idle cores (17.5 s shared with a 2-rank job, where the whole tier took 2:12; 2 xdist workers:
# 22 s, each pays the ~2 s start). `make test` runs every tier, the heavy unit tests included.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "unit and not heavy" tests/unit

# zerorun as a user installs it: `pip install .` (no extras) into a venv of its own (made once per dependency list;
# FRESH=1 makes it anew), then real 2-rank jobs from a directory holding only a config.json (GPT-2 and Llama types;
# `make test-all` runs the GPT-2 one). Cold: ~2.5 min of install and ~1 min of op build on 2 cores; warm ~1 min a job.
test-user-install: system-deps $(VENV)/.installed-test
	ZERORUN_USER_VENV_FRESH=$(if $(FRESH),1,0) ZERORUN_USER_INSTALL_ALL=1 $(PY) -m pytest -v -rs -s tests/e2e/test_user_install.py

# The property tests (Hypothesis) with new random examples each run; `make test` replays fixed ones.
test-explore: $(VENV)/.installed-test
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q -m unit \
		$$(grep -l hypothesis tests/unit/*.py)

# On a machine with NVIDIA GPUs: the memory matrix at OOM level (reserved peak; context + NCCL + reserved from the
# driver's mem_get_info) against the gate, written to benchmarks/results/gpu/ (commit it: the priors become facts;
# `validate_memory_gpu.py --rescore benchmarks/results/gpu/*.json` scores them anywhere). On a borrowed machine
# whose image lacks zerorun's packages: benchmarks/gpu_session.sh.
GPUS ?= 1
gpu-validate: $(VENV)/.installed-test
	mkdir -p benchmarks/results/gpu
	$(PY) benchmarks/validate_memory_gpu.py --nproc $(GPUS) --json benchmarks/results/gpu/gpu-validation-$(GPUS)gpu.json
