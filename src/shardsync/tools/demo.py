"""``shardsync demo``: sync a tiny Qwen3-MoE-shaped model into TP2 consumers and check every byte.

The consumers here are loader-zoo models (vLLM loader semantics) in this process, fed by the
in-process loopback sync; each rank receives only the bytes it keeps.
"""

from __future__ import annotations

from .harness.consumers import ZooConsumer
from .output import emit_json
from ..engine.loopback import loopback_sync
from ..source import ModuleSource
from ..zoo import ZooConfig, hf_state_dict


def run_zoo_demo(*, tp: int = 2, syncs: int = 3, layers: int = 4, as_json: bool = False) -> bool:
    cfg = ZooConfig.qwen3_moe_tiny(layers=layers, hidden=128, moe_inter=64, experts=16, vocab=1000)
    metas = ModuleSource(hf_state_dict(cfg)).metadata()
    full_bytes = sum(m.nbytes for m in metas)
    zoos = [ZooConsumer(cfg, f"tp{r}", tp=tp, tp_rank=r) for r in range(tp)]
    consumers = [z.local(metas) for z in zoos]
    for r, plan in enumerate(c.plan for c in consumers):
        print(f"rank {r}: plan {plan.digest[:12]}  {sum(len(g.scatters) for g in plan.groups)} slices in "
              f"{len(plan.groups)} groups, {plan.nbytes / 1e6:.2f} MB of {full_bytes / 1e6:.2f} MB")
    all_ok = True
    for version in range(1, syncs + 1):
        sd = hf_state_dict(cfg, seed=version)  # the trainer's weights after step `version`
        report = loopback_sync(ModuleSource(sd), consumers, version=version)
        ok = [not z.mismatched(sd) for z in zoos]  # vs what the engine's own loaders make of the full tensors
        all_ok &= all(ok)
        per = "  ".join(f"rank{r} {b / 1e6:.3f} MB ({b / full_bytes:.0%})" for r, b in enumerate(report.bytes_per_consumer))
        print(f"sync v{version}: {per}  {report.seconds * 1e3:.1f} ms  bit-exact: {'yes' if all(ok) else 'NO'}")
        if as_json:
            emit_json({"version": version, "bytes_per_consumer": report.bytes_per_consumer,
                              "full_model_bytes": full_bytes, "seconds": report.seconds, "exact": all(ok)})
    print("all syncs bit-exact" if all_ok else "MISMATCH: some consumer differs from its own loaders' result")
    return all_ok
