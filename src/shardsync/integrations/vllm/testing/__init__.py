"""Verification and test scaffolding for the vLLM integration: never imported by product code (tests, the CLI's
programs in ``shardsync.tools`` and benchmarks use it).

Modules: ``plugin`` (the test registration: the testing engine and the test models in every vLLM process, through
entry points the tests enable) · ``engine`` (the ``shardsync`` backend with the roles only tests need: inspection,
driver push, the full baseline) · ``push`` (driver push, trainer side: read the workers' plans, pack updates) ·
``inspection`` (what a worker holds, to a file; files compared) · ``reference`` (a FRESH engine on the same
weights, the standard a sync is held to) · ``checkpoints`` (tiny checkpoints, perturbation) · ``tiny_archs`` (more
model families) · ``models`` (fault-injection test models).
"""
