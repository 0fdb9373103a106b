"""The programs behind the CLI, one module per command: ``demo``, ``bench``, ``chaos``, ``simulate`` (and
``verify``), each exposing ``run(args)`` with its variants as modes; ``baseline`` (the broadcast baseline ``bench``
and ``benchmarks/gpu_sync.py`` time), ``output`` (``--json``), ``sim_models`` (what ``simulate`` models), ``rl/``
(the demo's RL loop) and ``harness/`` (the scaffolding they, the tests and the benchmarks share: process hosts,
the local cluster, the zoo consumer, the vLLM-engine wrapper, trainer stand-ins)."""
