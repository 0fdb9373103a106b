"""The scaffolding tests, benchmarks and the CLI's programs share, written once: zoo consumers
(``consumers``), the vLLM replica wrapper (``vllm_replica``), process hosts (``hosts``: local processes and Ray
actors behind one interface), the local cluster (``cluster``) and the trainer stand-ins (``trainers``)."""
