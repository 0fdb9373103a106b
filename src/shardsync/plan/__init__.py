"""Pure planning: record (RecordingTensor, dry run → plan), groups, coverage, pack (layout, replay), route,
opcodec, validate. No processes, no sockets, no CUDA streams; nothing here imports ``engine``,
``transport``, ``integrations`` or torch.distributed."""
