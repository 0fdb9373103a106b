"""Source reads, both halves in one place: ``source_share`` (producer: publish where the trainer's tensors lie) and
``source_open`` (consumer: map them and copy the slices it keeps). Whether a transport can share memory is its
declared capability (``transport.base.Transport.shares_memory``)."""
