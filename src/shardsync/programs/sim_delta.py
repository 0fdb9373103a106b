"""Delta sync in the simulator: what a changed fraction does to a sync's bytes and clock.

Every chunk of every routed plan travels in the form the codec (:mod:`shardsync.delta.codec`) would choose if a
fraction ``f`` of its 16-bit words changed — uniformly, so ``round(f * words)`` changed per chunk — plus a header
(``HEADER_MAX``, the bound). Producers encode each packed chunk once per plan at ``encode_gbps`` (GB/s of dense
chunk bytes) after packing it, in the gather/pack stage the schedule overlaps with the previous group's transfer;
consumers decode at ``decode_gbps`` before unpacking the (dense) chunk as usual. Everything else — routes,
control round trips, read latencies, receive slots, the schedule — is the dense model's. Each entry also states the
memory delta sync needs: the producer's history (every chunk it packs, once per plan) and the consumer's held copy
of its chunks (where it cannot apply into its live weights)::

    r = simulate(spec, top, delta=[DeltaModel(fraction=f) for f in (0.01, 0.02, 0.05)])
    r["delta"][0]["parallel_pp_s"], r["delta"][0]["bytes_ratio"]

The default rates are the plain-torch codec measured on one H200 at 1 % changed (measured 2026-12-01: 1.26 GB
encoded in 2.47 ms, decoded in 0.34 ms; decode rounded down); ``benchmarks/delta_codec.py`` measures them on a
device at 1 / 5 / 20 %. Not modelled: changes clustered in some tensors (norms never change at RL rates, so real
chunks are sparser or denser than the mean), the first sync and rejoiners (dense), and the host sync per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..delta import codec

__all__ = ["ENCODE_GBPS", "DECODE_GBPS", "DeltaModel", "delta_summary", "scale_seed", "parse_fractions"]

ENCODE_GBPS = 500.0
"""Producer encode rate, GB/s of dense chunk bytes (H200, plain torch, 1 % changed)."""
DECODE_GBPS = 2000.0
"""Consumer decode rate, GB/s of dense chunk bytes (H200 measured 3.7 TB/s at 1 %; rounded down)."""


@dataclass(frozen=True, kw_only=True)
class DeltaModel:
    """One changed fraction and the codec's rates."""

    fraction: float
    """Changed 16-bit words / all words, in [0, 1]."""
    encode_gbps: float = ENCODE_GBPS
    decode_gbps: float = DECODE_GBPS

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and 0.0 <= self.fraction <= 1.0):
            raise ValueError(f"changed fraction {self.fraction!r} is not in [0, 1]")
        for f in ("encode_gbps", "decode_gbps"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{f} must be a positive rate, got {v!r}")

    def wire_bytes(self, nbytes: int) -> int:
        """Payload + header of a chunk of ``nbytes`` at this fraction (never above dense + header)."""
        words = nbytes // codec.word_size(nbytes)
        k = round(self.fraction * words)
        kind = codec.choose(nbytes, k)
        return codec.payload_nbytes(kind, nbytes, words if kind == codec.DENSE else k) + codec.HEADER_MAX

    def encode_s(self, nbytes: float) -> float:
        return nbytes / (self.encode_gbps * 1e9)

    def decode_s(self, nbytes: float) -> float:
        return nbytes / (self.decode_gbps * 1e9)


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def delta_summary(dense: dict[str, Any], d: dict[str, Any], model: DeltaModel) -> dict[str, Any]:
    """The delta figures of one fraction beside the dense run's (``dense``, ``d``: two ``_cost`` results)."""
    return {
        "changed_fraction": model.fraction, "encode_gbps": model.encode_gbps, "decode_gbps": model.decode_gbps,
        "per_consumer_bytes_max": d["per_consumer_bytes_max"], "replica_bytes": d["replica_bytes"],
        "consumer_bytes_sum": d["consumer_bytes_sum"],
        "bytes_ratio": round(dense["consumer_bytes_sum"] / max(d["consumer_bytes_sum"], 1), 2),
        "abs_sol_s": d["abs_sol_s"], "serial_pp_sol_s": d["serial_pp_sol_s"],
        "predicted_s": d["predicted_s"], "predicted_bottleneck": d["predicted_bottleneck"],
        "parallel_pp_s": d["parallel_pp_s"], "parallel_pp_bottleneck": d["parallel_pp_bottleneck"],
        "speedup_parallel_pp": round(dense["parallel_pp_s"] / d["parallel_pp_s"], 2),
        "speedup_serial_pp": round(dense["predicted_s"] / d["predicted_s"], 2),
        "history_bytes_per_producer_max": d["per_producer_packed_bytes_max"],
        "held_bytes_per_consumer_max": dense["per_consumer_bytes_max"],
    }


def scale_seed(r: dict[str, Any]) -> None:
    """Where a preset carries a measured dense time (``seed.measured_s``: vLLM's own run), add to each delta entry
    that time scaled by this model's serial-PP schedule, delta over dense (``seed_scaled_s``): what the measured
    system would take if its time moved with the bytes as the model's serial-PP schedule does."""
    seed = r.get("seed") or {}
    if "measured_s" not in seed:
        return
    for x in r.get("delta", ()):
        x["seed_scaled_s"] = _sig(seed["measured_s"] * x["predicted_s"] / r["predicted_s"])


def parse_fractions(text: str | None) -> list[float]:
    """``"0.01,0.02,5%"`` -> [0.01, 0.02, 0.05]; ValueError naming what it could not read."""
    out = []
    for part in filter(None, (text or "").replace(" ", "").split(",")):
        try:
            out.append(float(part[:-1]) / 100 if part.endswith("%") else float(part))
        except ValueError:
            raise ValueError(f"changed fraction {part!r} is not a number (e.g. 0.01 or 1%)") from None
        if not 0.0 <= out[-1] <= 1.0:
            raise ValueError(f"changed fraction {part!r} is not in [0, 1]")
    return out
