"""The runtime: producer, consumer, coordinator, control (the wire), loopback (in-process sync).
Depends on ``plan`` and ``transport``; never on ``integrations``, ``tools`` or ``zoo``."""
