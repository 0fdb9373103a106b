"""The coordinator (producer 0's control server): ``coordinator`` (routes, plan registration, version outcomes) and
``membership`` (who takes part in which version; leases, drops, rejoin)."""
