"""Transports: a consumer pulls byte ranges of a producer's registered buffer (see ``base``)."""

from .base import TRANSPORTS, Caps, Transport, make_group_transport, make_transport, transport_caps

__all__ = ["Caps", "Transport", "make_transport", "make_group_transport", "transport_caps", "TRANSPORTS"]
