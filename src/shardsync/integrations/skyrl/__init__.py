"""SkyRL integration: a weight-sync strategy named ``shardsync`` (``skyrl-train`` 0.3.1; extra ``shardsync[skyrl]``).

Two lines select it: the config names it, the driver enables it before SkyRL initialises Ray::

    generator.weight_sync_backend=shardsync       # +generator.shardsync={timeout_s: 60, ...}: group settings
    import shardsync; shardsync.enable_skyrl()     # or shardsync.integrations.skyrl.enable()

Files: ``strategy`` (SkyRL's init info, sender and receiver), ``select`` (the name → strategy choice in every Ray
worker; Ray-version compatibility). See ``docs/adoption.md`` (SkyRL).
"""

from .select import enable, enable_skyrl, ray_compat

__all__ = ["enable", "enable_skyrl", "ray_compat"]
