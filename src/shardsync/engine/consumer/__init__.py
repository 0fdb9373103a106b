"""Consumer side (an inference worker): ``consumer`` (the public ``Consumer``), ``puller`` (reads a group's chunks
from its producers), ``applier`` (hands received groups to the engine's apply), ``recvslots`` (receive memory)."""
