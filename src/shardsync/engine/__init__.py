"""The runtime: producer, consumer, coordinator, messages (the schema) and control (client/server),
loopback (in-process sync). The overlap rules are stated once, in ``schedule.py``.
Depends on ``plan`` and ``transport``; never on ``integrations``, ``tools`` or ``zoo``."""
