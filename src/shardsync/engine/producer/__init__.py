"""Producer side (a trainer rank): ``producer`` (the public ``Producer``), ``producer_sync`` (one sync: announce,
gather, pack, release), ``snapshot`` (what a sync freezes), ``versions`` (which versions this rank still serves),
``units`` (ring slots per group), ``publish`` (announcing packed groups), ``same_batches`` (lockstep batching)."""
