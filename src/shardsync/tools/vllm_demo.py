"""``shardsync demo``: producer processes sync a tiny Qwen3-MoE into real vLLM replicas on CPU.

Two trainer ranks (each holding half the layers, as PP2) serve, through the transfer engine, two vLLM
replicas of TP2 (four real vLLM workers, each pulling only its own slices). Three syncs with changed
weights; after each, every replica is compared byte for byte with a FRESH vLLM engine started on a
checkpoint of the same weights (every tensor after processing, kernel outputs on a probe, greedy tokens).
"""

from __future__ import annotations

import os
import tempfile
import time

from .output import emit_json
from .harness.cluster import LocalCluster
from ..integrations.vllm.checkpoints import build_tiny_checkpoint, load_checkpoint, perturb
from .harness.vllm_engine import VllmReplicas, parallel


def run_vllm_demo(*, arch: str = "qwen3_moe", producers: int = 2, replicas: int = 2, tp: int = 2, syncs: int = 3,
                  transport: str = "tcp", as_json: bool = False, workdir: str | None = None) -> bool:
    workdir = workdir or os.path.join(tempfile.gettempdir(), "shardsync-demo")
    ckpt = build_tiny_checkpoint(arch, os.path.join(workdir, arch))
    base = load_checkpoint(ckpt)
    full_bytes = sum(t.nbytes for t in base.values())
    print(f"checkpoint {ckpt}: {full_bytes / 1e6:.2f} MB; {producers} producers (PP shares) -> "
          f"{replicas} vLLM replicas x TP{tp} over {transport}")
    t0 = time.perf_counter()
    cluster = LocalCluster(None, producers=producers, spec={"kind": "checkpoint", "path": ckpt},
                           external_consumers=replicas * tp, transport=transport, timeout_s=300)
    reps = VllmReplicas(ckpt, replicas=replicas, tp=tp, coordinator=cluster.coordinator, token=cluster.token,
                        transport=transport, timeout_s=300)
    try:
        reps.init()
        cluster.wait_ready()
        print(f"init (engines started, plans recorded + validated, routes agreed): {time.perf_counter() - t0:.1f} s")
        all_ok = True
        for v in range(1, syncs + 1):
            ts = time.perf_counter()
            prod, _ = parallel([lambda: cluster.sync(v), lambda: reps.sync(v)])
            dt = time.perf_counter() - ts
            per = [s["bytes_received"] for s in reps.status()]
            exact, bad, n = reps.check_against_fresh(perturb(base, v), tag=f"-v{v}")
            all_ok &= exact
            print(f"sync v{v}: bytes/consumer {[f'{b / 1e6:.2f}MB' for b in per]} ({max(per) / full_bytes:.0%} of "
                  f"model max)  {dt:.2f} s  {sum(per) / dt / 1e9:.3f} GB/s  max resident groups "
                  f"{[p['max_resident'] for p in prod['producers']]}  exact vs fresh engine: {'yes' if exact else 'NO ' + str(bad[:3])}"
                  f" ({n} tensors/probes)")
            if as_json:
                emit_json({"version": v, "bytes_per_consumer": per, "seconds": dt, "exact": exact,
                                  "tensors_compared": n, "full_model_bytes": full_bytes})
        print("summary: " + ("after every sync each replica holds what a fresh engine holds" if all_ok else "MISMATCH"))
        return all_ok
    finally:
        reps.close()
        cluster.close()
