"""Test scaffolding users never import, kept out of the wheel: ``testing/zoo/`` (loader-zoo models with vLLM loader
semantics), ``harness/`` (process hosts, the local cluster, zoo consumers, the vLLM replica wrapper, trainer
stand-ins), ``vllm/`` (fault-injection models, more tiny model families, a real ``vllm serve`` for tests).
Product code never imports it (``tests/house/test_layout.py``)."""
