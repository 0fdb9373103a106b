"""shardsync as a vLLM weight-transfer backend.

Select it with ``LLM(..., weight_transfer_config={"backend": "shardsync"})`` (the plugin registers it
through the ``vllm.general_plugins`` entry point) and drive it with vLLM's own RL API:
``init_weight_transfer_engine`` → ``start_weight_update`` → ``update_weights`` → ``finish_weight_update``.

Modules: ``plugin`` (registration) · ``selection`` (which engines select shardsync) · ``worker_backend`` (the
worker backend, pull mode) · ``trainer_backend`` and ``clients`` (the trainer side through vLLM's trainer API) ·
``layerwise`` (dry run, validation and per-layer apply on top of vLLM's layerwise-reload machinery) · ``first_load``
and ``processor`` (first-load processing) · ``guard`` (the torn-weights guard) · ``vllm_source`` (adapters to vLLM's
``WeightSource``) · ``fresh_check`` and ``model_state`` (the verify helper: a running engine vs a fresh load of a
checkpoint). Test scaffolding lives in ``shardsync.testing`` (never imported from here).
"""
