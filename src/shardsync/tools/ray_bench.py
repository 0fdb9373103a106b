"""``shardsync bench --ray``: the same trainer and engines as Ray actors, once per transport — the direct ones
(``tcp``, ``nixl``) against Ray Direct Transport (``rdt``) — side by side in one run on a local Ray instance.

Two trainer actors (PP2) -> ``replicas`` x TP ``tp`` zoo engine actors; a warm-up sync, then ``syncs`` timed
ones (the slowest producer's ``sync`` seconds; each version's weights differ); every engine checked byte for
byte against a fresh load after the last sync.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from .bench import PRESETS
from .output import emit_json


def run_ray_bench(*, model: str = "qwen3-moe-bench", replicas: int = 2, tp: int = 2, syncs: int = 3,
                  transports: tuple[str, ...] = ("tcp", "nixl", "rdt"), as_json: bool = False) -> dict[str, Any]:
    import ray

    from .harness.ray_actors import TrainerRank, ZooEngine, close_actors

    cfg = asdict(PRESETS[model])
    spec = {"kind": "zoo", "cfg": cfg}
    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="shardsync-bench")
    out: dict[str, Any] = {"model": model, "replicas": replicas, "tp": tp, "syncs": syncs, "transports": {}}
    try:
        for t in transports:
            group = f"bench-{t}"
            trainers = [TrainerRank.remote(spec, r, 2, group=group, n_consumers=replicas * tp, transport=t,
                                           timeout_s=300, lease_s=30) for r in range(2)]
            engines = [ZooEngine.remote(f"r{i}/tp{k}", cfg, tp, k, group=group, timeout_s=300)
                       for i in range(replicas) for k in range(tp)]
            try:
                ray.get([a.init.remote() for a in trainers + engines], timeout=600)
                times, got = [], 0
                for v in range(1, syncs + 2):
                    refs = [a.sync.remote(v) for a in trainers] + [e.sync.remote(v) for e in engines]
                    res = ray.get(refs, timeout=600)
                    if v > 1:
                        times.append(max(r["seconds"] for r in res[:2]))
                    got = sum(r.get("bytes_received", 0) for r in res[2:])
                checks = ray.get([e.check.remote() for e in engines], timeout=600)
                out["transports"][t] = {"seconds": statistics.median(times), "all_s": [round(x, 4) for x in times],
                                        "bytes_per_sync": got,
                                        "exact": all(c["mismatched"] == [] for c in checks)}
            finally:
                close_actors(engines + trainers, group, timeout_s=30, kill=True)
            r = out["transports"][t]
            print(f"  {t:<5} median {r['seconds']:.4f} s {r['all_s']}  {r['bytes_per_sync'] / r['seconds'] / 1e9:.3f} "
                  f"GB/s  exact={r['exact']}", flush=True)
    finally:
        if own:
            ray.shutdown()
    best = min(out["transports"], key=lambda k: out["transports"][k]["seconds"])
    out["fastest"] = best
    out["exact"] = all(r["exact"] for r in out["transports"].values())
    out["vs_rdt"] = {k: out["transports"]["rdt"]["seconds"] / r["seconds"] for k, r in out["transports"].items()} \
        if "rdt" in out["transports"] else {}
    print(f"fastest inside Ray: {best}; speed vs rdt: " + ", ".join(f"{k} {x:.2f}x" for k, x in out["vs_rdt"].items()))
    if as_json:
        emit_json(out)
    return out
