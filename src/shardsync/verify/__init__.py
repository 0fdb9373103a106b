"""``shardsync verify`` and what it runs: a FRESH vLLM engine on the same weights, the standard a sync is held to.

Shipped with the wheel (users run it on their own checkpoints). ``program`` (the command), ``reference`` (a fresh
engine, compared), ``inspection`` (what a worker holds, to a file), ``verify_engine`` (the shardsync backend with
inspection and driver push), ``registration`` (puts that engine in vLLM's processes), ``push`` (driver push, trainer
side), ``checkpoints`` (load, perturb, tiny checkpoints), ``output`` (``--json``: JSON on stdout only).
"""
