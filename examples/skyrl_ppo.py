"""SkyRL's own PPO/GRPO entrypoint with its weights synced by shardsync (skyrl-train 0.3.1, GPU machines).

    python examples/skyrl_ppo.py trainer.policy.model.path=Qwen/Qwen3-0.6B generator.weight_sync_backend=shardsync \
        +generator.shardsync.timeout_s=120 ...            # every other override as for skyrl_train.entrypoints.main_base

The two lines that differ from SkyRL's own ``python -m skyrl_train.entrypoints.main_base``: the config names the
backend (``generator.weight_sync_backend=shardsync``; group settings under ``generator.shardsync``), and the driver
calls ``shardsync.enable_skyrl()`` before SkyRL initialises Ray, so that every trainer worker SkyRL starts picks the
strategy by that name. Each update, every trainer rank serves a share of the gathered tensors and every inference
worker pulls them point-to-point; an engine that dies does not fail the others' update.

SkyRL's entrypoint needs CUDA (``flash_attn``) and its vLLM 0.11 engine: this program does not run on the CPU machine
the test suite runs on; ``tests/frameworks/test_skyrl.py`` drives the same strategy through SkyRL's weight-sync
entry points there.
"""

from __future__ import annotations

import shardsync


def main() -> None:
    shardsync.enable_skyrl()  # <- before SkyRL initialises Ray: its workers select "shardsync" by name
    from skyrl_train.entrypoints.main_base import main as skyrl_main

    skyrl_main()


if __name__ == "__main__":
    main()
