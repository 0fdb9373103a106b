"""The runtime, by side. A path says which side a file runs on:

- ``producer/`` — trainer ranks: serve a version (gather in lockstep, replay, pack, the ring, the version table).
- ``consumer/`` — inference workers: pull the routed groups and apply them (receive slots, pullers, the applier).
- ``coordinator/`` — producer 0: membership, routing, plan registration, the fate of every version.
- ``protocol/`` — what crosses the control plane: the closed message union, framing, the control client/server,
  heartbeats. Both sides and the coordinator use it; it uses neither.
- ``source_reads/`` — one feature across both sides: a consumer maps the trainer's own tensors (no pack, no ring).
- ``schedule.py`` (the overlap rules, stated once), ``lanes.py`` (device lanes, the hot path) and ``inprocess.py``
  (the in-process sync the multi-process engine must agree with) are shared.

Depends on ``plan``, ``transport``, ``delta`` and ``security``; never on ``integrations``, ``programs`` or
``testing``.
"""
