"""Producer side (a trainer rank): ``producer`` (the public ``Producer``), ``producer_sync`` (one sync: announce,
gather, pack, release), ``sync_context`` (what one sync is given), ``snapshot`` (what a non-blocking sync freezes),
``versions`` (the version table: which versions this rank still serves, their members and drops), ``units`` (ring
slots per group, the epoch's ring layout), ``publish`` (announcing packed groups), ``lockstep_batches`` (iterating
the source's gather batches in lockstep), ``same_batches`` (the per-batch check cache)."""
