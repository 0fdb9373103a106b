"""vLLM test scaffolding: ``fault_models`` (fault-injection test models), ``tiny_archs`` (more tiny model families),
``vllm_server`` (a real ``vllm serve`` with the shardsync backend, started and stopped for tests)."""
