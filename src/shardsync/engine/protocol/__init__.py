"""The control plane both sides speak: ``messages`` (the closed msgspec union), ``wire`` (authenticated framing),
``control`` (the request/response server and client), ``heartbeat`` (leases)."""
