"""What chunk checksums cost a sync on the CPU path (tcp, host rings): the same cluster of real processes
(``LocalCluster``: producers, coordinator, consumers with vLLM loader semantics) synced with checksums off and on,
alternating, every sync checked byte for byte. Prints one JSON line (``--json``) or a table.

    python benchmarks/checksum_cost.py --json      # ~250 MB Llama-shaped model, 1 producer -> 1 consumer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from shardsync.tools.harness.cluster import LocalCluster  # noqa: E402
from shardsync.zoo import ZooConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = ZooConfig.llama_tiny(vocab=8000, hidden=args.hidden, layers=args.layers, heads=16, kv_heads=8,
                               head_dim=args.hidden // 16, inter=4 * args.hidden)
    out: dict = {"layers": args.layers, "hidden": args.hidden, "syncs": args.syncs}
    times: dict[str, list[float]] = {"off": [], "on": []}
    clusters = {k: LocalCluster(cfg, producers=1, replicas=1, tp=1, max_chunk_bytes=16 << 20, timeout_s=120,
                                verify_checksums=(k == "on")) for k in ("off", "on")}
    try:
        v, exact = 0, True
        for _ in range(args.syncs + 1):  # the first sync of each is a warm-up
            for k, cl in clusters.items():
                v += 1
                r = cl.sync(v)
                exact &= bool(r["exact"])
                if v > 2:
                    times[k].append(r["producers"][0]["seconds"])
                out["model_bytes"] = r["producers"][0]["bytes_sent"]
    finally:
        for cl in clusters.values():
            cl.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    out.update(seconds_off=round(off, 4), seconds_on=round(on, 4), cost_ratio=round(on / off, 3), exact=exact)
    print(json.dumps(out) if args.json else
          f"{out['model_bytes'] / 1e6:.0f} MB: checksums off {off:.3f} s, on {on:.3f} s ({on / off:.2f}x), exact {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
