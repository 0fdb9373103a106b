"""Transports: a consumer pulls byte ranges of a producer's registered buffer (see ``base``)."""

from .base import TRANSPORTS, Caps, Transport, make_transport

__all__ = ["Caps", "Transport", "make_transport", "TRANSPORTS"]
