"""Security, one folder: ``handshake`` (mutual challenge-response on the token), ``admission`` (bounds on
unauthenticated connections), ``framemac`` (per-connection control-frame MACs), ``chunkmac`` (keyed chunk tags).
Depends on nothing of shardsync but ``errors``."""
