"""The RL demo's pieces (``shardsync demo``, in ``programs/demo.py``): ``task`` (the verifiable toy task and its GRPO
objective, pure), ``loop`` (the loop over hosted trainer ranks and vLLM engines, one step at a time, every sync
checked against a fresh load) and ``report`` (a line per step, the summary table, the plot)."""
