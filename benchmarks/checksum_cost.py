"""What chunk integrity costs a sync on the CPU path (tcp, host rings): no check, unkeyed xxh3-64 checksums
(``verify_checksums``), and keyed MACs (``mac``: a BLAKE2b tag per chunk, an HMAC per control frame). Three
clusters of the same shape and model (``LocalCluster``: real processes, producer, coordinator, a consumer with vLLM
loader semantics), synced in turn — off, xxh3, mac, off, ... — so drift in the machine's load hits all three alike;
every sync is checked byte for byte. Prints one JSON line (``--json``) or a table; ``--out`` also writes the JSON.

    python benchmarks/checksum_cost.py --json      # ~284 MB Llama-shaped model, 1 producer -> 1 consumer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from shardsync.testing.harness.cluster import LocalCluster  # noqa: E402
from shardsync.testing.zoo import ZooConfig  # noqa: E402

MODES = {"off": dict(verify_checksums=False), "xxh3": dict(verify_checksums=True), "mac": dict(mac=True)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="also write the JSON result to this file")
    args = ap.parse_args()
    cfg = ZooConfig.llama_tiny(vocab=8000, hidden=args.hidden, layers=args.layers, heads=16, kv_heads=8,
                               head_dim=args.hidden // 16, inter=4 * args.hidden)
    out: dict = {"layers": args.layers, "hidden": args.hidden, "syncs": args.syncs, "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d"), "order": list(MODES)}
    times: dict[str, list[float]] = {k: [] for k in MODES}
    consumer: dict[str, list[float]] = {k: [] for k in MODES}
    clusters: dict[str, LocalCluster] = {}
    try:
        for k, kw in MODES.items():
            clusters[k] = LocalCluster(cfg, producers=1, replicas=1, tp=1, max_chunk_bytes=16 << 20, timeout_s=120,
                                       **kw)
        v, exact = 0, True
        for i in range(args.syncs + 1):  # the first sync of each is a warm-up
            for k, cl in clusters.items():
                v += 1
                r = cl.sync(v)
                exact &= bool(r["exact"])
                if i > 0:
                    times[k].append(r["producers"][0]["seconds"])
                    consumer[k].append(r["consumers"][0]["seconds"])
                out["model_bytes"] = r["producers"][0]["bytes_sent"]
    finally:
        for cl in clusters.values():
            cl.close()
    med = {k: statistics.median(t) for k, t in times.items()}
    out.update({f"seconds_{k}": round(s, 4) for k, s in med.items()})
    out.update({f"consumer_seconds_{k}": round(statistics.median(t), 4) for k, t in consumer.items()})
    out.update({f"all_seconds_{k}": [round(s, 4) for s in t] for k, t in times.items()})
    out.update(cost_ratio_xxh3=round(med["xxh3"] / med["off"], 3), cost_ratio_mac=round(med["mac"] / med["off"], 3),
               mac_vs_xxh3=round(med["mac"] / med["xxh3"], 3), exact=exact)
    line = json.dumps(out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line if args.json else
          f"{out['model_bytes'] / 1e6:.0f} MB: off {med['off']:.3f} s, xxh3 {med['xxh3']:.3f} s "
          f"({out['cost_ratio_xxh3']:.2f}x), mac {med['mac']:.3f} s ({out['cost_ratio_mac']:.2f}x), exact {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
