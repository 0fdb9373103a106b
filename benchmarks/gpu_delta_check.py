"""On the device: the engine's delta path on a GPU (``python benchmarks/gpu_delta_check.py``): 2 producers (PP2) on
GPU0 -> 2 consumers (TP2) over ``cuda_ipc+delta``; weights unchanged between the warm-up and timed syncs (empty
deltas), then new weights, poisoned consumers, one more sync (dense), byte check. Prints JSON."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import gpu_sync  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--transport", default="cuda_ipc+delta")  # a CPU dry run: --device cpu --transport tcp+delta
    ap.add_argument("--layers", type=int, default=2)
    cli = ap.parse_args()
    args = argparse.Namespace(device=cli.device, layers=cli.layers, experts=16, port=0, chunk_mb=64, lookahead=1,
                              recv_slots=2)
    g = gpu_sync.Group(args, 2, [("tp0", 2, 0, False), ("tp1", 2, 1, False)], bcast=False)
    try:
        r = g.run_engine(cli.transport, 2, 1)
    finally:
        g.close()
    print(json.dumps({"exact": r["exact"], "seconds": r["seconds"], "all_s": r["all_s"],
                      "last": r["last"]}, default=str))
