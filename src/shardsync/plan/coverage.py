"""Coverage check: which destination parameters a plan fills fully, partly or not at all.

Pure: needs only each parameter's byte size. Bytes written by more than one scatter are reported too
(legal — replay keeps the recorded order — but worth knowing)::

    report = check_coverage(plan, dict(model.named_parameters()))
    report.raise_if_incomplete()
"""

from __future__ import annotations

from typing import Mapping

import msgspec
import torch

from ..errors import CoverageError
from ..types import Plan, dtype_of

__all__ = ["CoverageReport", "check_coverage"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CoverageReport(msgspec.Struct, frozen=True, kw_only=True):
    consumer: str
    full: list[str]
    partial: dict[str, list[int]]
    """name -> [bytes covered, bytes total]."""
    missing: list[str]
    overlapping: list[str]
    """Parameters some of whose bytes more than one scatter writes."""

    @property
    def complete(self) -> bool:
        return not self.partial and not self.missing

    def raise_if_incomplete(self, *, ignore: frozenset[str] = frozenset()) -> None:
        partial = {k: v for k, v in self.partial.items() if k not in ignore}
        missing = [m for m in self.missing if m not in ignore]
        if partial or missing:
            parts = [f"{k}: {c}/{t} bytes" for k, (c, t) in list(partial.items())[:5]]
            raise CoverageError(f"consumer {self.consumer!r}: plan fills {len(partial)} parameter(s) only partly "
                                f"({'; '.join(parts)}) and {len(missing)} not at all ({missing[:5]})")


def check_coverage(plan: Plan, params: Mapping[str, torch.Tensor]) -> CoverageReport:
    """Mark every destination byte of every scatter into ``params`` (others are not checked); parameters
    may be on the meta device."""
    masks: dict[str, torch.Tensor] = {}
    overlapping: set[str] = set()
    for g in plan.groups:
        for s in (*g.scatters, *g.fills):
            p = params.get(s.dst)
            if p is None:  # only the given parameters are checked
                continue
            m = masks.get(s.dst)
            if m is None:
                m = masks[s.dst] = torch.zeros(p.numel() * p.element_size(), dtype=torch.uint8)
            dt = dtype_of(s.dst_dtype)
            ints = m.view(_INT_OF_SIZE[dt.itemsize])
            region = ints.as_strided(s.shape, s.dst_stride, s.dst_byte_offset // dt.itemsize)
            if s.dst not in overlapping and bool(region.any()):
                overlapping.add(s.dst)
            region.fill_(-1)
    full, partial, missing = [], {}, []
    for name, p in params.items():
        m = masks.get(name)
        if m is None:
            missing.append(name)
            continue
        covered = int(torch.count_nonzero(m))
        if covered == m.numel():
            full.append(name)
        else:
            partial[name] = [covered, m.numel()]
    return CoverageReport(consumer=plan.consumer, full=full, partial=partial, missing=missing,
                          overlapping=sorted(overlapping))
