"""The programs behind the CLI, one module per command: ``demo``, ``bench``, ``chaos``, ``simulate``, each exposing
``run(args)`` with its variants as modes; ``baseline`` (the broadcast baseline ``bench`` and
``benchmarks/gpu_sync.py`` time), ``sim_models`` (what ``simulate`` models), ``rl/`` (the demo's RL loop). They run
from a source checkout (``make demo``) and are not in the wheel; ``verify`` is (``shardsync.verify``)."""
