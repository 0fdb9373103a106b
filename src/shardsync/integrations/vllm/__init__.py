"""shardsync as a vLLM weight-transfer backend.

Select it with ``LLM(..., weight_transfer_config={"backend": "shardsync"})`` (the plugin registers it
through the ``vllm.general_plugins`` entry point) and drive it with vLLM's own RL API:
``init_weight_transfer_engine`` → ``start_weight_update`` → ``update_weights`` → ``finish_weight_update``.

Modules: ``plugin`` (registration) · ``layerwise`` (dry run, validation and per-layer apply on top of
vLLM's layerwise-reload machinery) · ``engine`` (the backend) · ``trainer`` (driver-side packing) ·
``checkpoints`` (tiny checkpoints, perturbation) · ``verify`` (``shardsync verify``).
"""
