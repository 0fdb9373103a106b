"""Delta sync's engine-independent parts: the chunk codec and the producer's history of served bytes.

``codec``: a packed chunk's new bytes against the bytes last served for it, as the smallest of dense bytes,
(int32 index, word) pairs or a bitmap + words, with a header a consumer validates before allocating anything.
``history``: the producer-side store of the last served bytes of every chunk it serves, in a stated budget, with
``commit`` / ``rollback`` so a failed version never becomes a delta base. Pure torch; no processes, no transports.
"""

from .codec import (BITMAP, DENSE, HEADER_MAX, KINDS, PAIRS, DeltaHeader, Encoded, check_header, checksum, choose,
                    decode_, decode_into, dense, encode, header_bytes, payload_nbytes, read_header, verify)
from .history import DeltaHistory

__all__ = ["BITMAP", "DENSE", "HEADER_MAX", "KINDS", "PAIRS", "DeltaHeader", "Encoded", "check_header", "checksum",
           "choose", "decode_", "decode_into", "dense", "encode", "header_bytes", "payload_nbytes", "read_header",
           "verify", "DeltaHistory"]
