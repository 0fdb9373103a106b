"""Shared test helpers: bit-exact comparison and a plan-record-replay round trip over zoo models."""

from __future__ import annotations

import torch

from shardsync.engine.loopback import LocalConsumer, loopback_sync
from shardsync.plan.record import record_plan
from shardsync.source import ModuleSource
from shardsync.zoo import ZooConfig, ZooModel


from shardsync.plan.validate import fill_sentinel, mismatched, raw_bytes as raw  # noqa: F401 (re-exported for tests)


def garbage(model: torch.nn.Module) -> None:
    """Fill every parameter with a non-zero byte pattern."""
    with torch.no_grad():
        for p in model.parameters():
            fill_sentinel(p)


def zoo_roundtrip(cfg: ZooConfig, sd: dict[str, torch.Tensor], tp: int, ep: int = 1):
    """Record plans for every rank, sync through loopback into fresh models, return
    (mismatched names per rank, report, plans)."""
    src = ModuleSource(sd)
    refs, lives, consumers, plans = [], [], [], []
    for r in range(tp):
        kw = dict(tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=r % ep)
        ref = ZooModel(cfg, **kw)
        ref.load_weights(sd.items())
        dry, live = ZooModel(cfg, **kw), ZooModel(cfg, **kw)
        garbage(live)  # the sync must write every byte the loader writes, padding included
        plan = record_plan(metadata=src.metadata(), load_weights=dry.load_weights,
                           params=dict(dry.named_parameters()), consumer=f"tp{r}", rank=r)
        consumers.append(LocalConsumer(plan, dict(live.named_parameters())))
        refs.append(ref), lives.append(live), plans.append(plan)
    report = loopback_sync(src, consumers)
    bad = [mismatched(ref.state_dict(), live.state_dict()) for ref, live in zip(refs, lives)]
    return bad, report, plans
