"""FSDPSource over real FSDP2 (``fully_shard``) on 2 CPU processes (gloo): exact full tensors, one collective per
group, a 2-D (dp=1 x tp=2) mesh, mixed dtypes and uneven shards; plus a single-process check of the names.

The two ranks are launched once per module (this file run as a script, ``python test_sources_fsdp.py RANK PORT
OUT``); each rank compares every yielded tensor with ``full_tensor()`` bit for bit and writes what it saw to
``OUT/rank{RANK}.json``, which the tests below assert on.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from shardsync.errors import MetadataMismatch
from shardsync.source import gather_groups
from shardsync.sources.fsdp import FSDPSource, strip_wrappers

from helpers import run_rank_scripts, run_scenarios, scenario

WORLD = 2
LAUNCH_TIMEOUT_S = 50


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


# ---- what each rank runs --------------------------------------------------------------------------------------
def _check_source(src: FSDPSource, full: dict[str, torch.Tensor]) -> dict:
    """One pass of iter_groups, compared with the reference full tensors."""
    names = [m.name for m in src.metadata()]
    yielded, bad = [], []
    for ns, ts in src.iter_groups():
        yielded.append(list(ns))
        bad += [n for n, t in zip(ns, ts) if t is None or not _same_bits(t, full[n])]
    return {"names": names, "yielded": yielded, "expected": gather_groups(names), "mismatches": bad,
            "stats": dict(src.stats), "full_bytes": sum(t.numel() * t.element_size() for t in full.values()),
            "n_full": len(full)}


def _scenario_fsdp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from shardsync.testing.harness.fsdp_trainer import RefTrainer, build_model
    trainer = RefTrainer(init_device_mesh("cpu", (WORLD,)), seed=3)
    init = trainer.source().gather(m.name for m in trainer.source().metadata())   # every rank: lockstep
    replica = dict(build_model(seed=3).named_parameters())     # unsharded, same seed: the same initial weights
    init_equal = all(_same_bits(t, replica[n].detach()) for n, t in init.items()) and init.keys() == replica.keys()
    g = torch.Generator().manual_seed(100 + rank)                # each rank its own data
    losses = [trainer.step(torch.randint(0, 256, (2, 12), generator=g)) for _ in range(2)]
    full = trainer.full_state_dict()
    out = _check_source(trainer.source(), full)
    out.update(init_equal=init_equal, losses=losses, changed=sum(not torch.equal(init[n], full[n]) for n in full))
    return out


def _scenario_tp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from shardsync.testing.harness.fsdp_trainer import RefTrainer
    trainer = RefTrainer(init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp")), seed=5)
    g = torch.Generator().manual_seed(7)                         # TP ranks see the same data
    trainer.step(torch.randint(0, 256, (2, 12), generator=g))
    tp_sharded = [n for n, p in trainer.model.named_parameters()
                  if isinstance(p, DTensor) and p.device_mesh.ndim == 2 and any(not q.is_replicate()
                                                                                   for q in p.placements[1:])]
    out = _check_source(trainer.source(), trainer.full_state_dict())
    out.update(tp_sharded=tp_sharded)
    return out


def _scenario_mixed(rank: int) -> dict:
    """Hand-made DTensor parameters: mixed dtypes in one group, uneven and empty shards, wrapper prefixes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(11)
    ref = {"model.layers.0.a.weight": torch.randn(5, 3, generator=gen),                    # 3 + 2 rows
           "model.layers.0.b.weight": torch.randn(1, 4, generator=gen).to(torch.bfloat16),  # 1 + 0 rows
           "model.layers.0.c.weight": torch.randn(7, 2, generator=gen).double(),
           "model.layers.0.d.count": torch.arange(3, dtype=torch.int32),
           "model.norm.weight": torch.randn(9, generator=gen).half()}
    inner = nn.Module()
    for i, (n, t) in enumerate(ref.items()):
        inner.register_parameter(f"p{i}", nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]),
                                                        requires_grad=t.is_floating_point()))
    root = nn.Module()
    root._orig_mod = inner
    keys = list(ref)
    src = FSDPSource(root, name_map=lambda n: keys[int(n.removeprefix("p"))])
    out = _check_source(src, ref)
    out.update(local_rows=[inner.get_parameter(f"p{i}").to_local().shape[0] for i in range(len(ref))],
               rank=dist.get_rank())
    return out


def _worker(rank: int, port: int, outdir: str) -> None:
    import datetime
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    run_scenarios([(name, lambda fn=fn: fn(rank)) for name, fn in
                   [("fsdp", _scenario_fsdp), ("tp", _scenario_tp), ("mixed", _scenario_mixed)]], rank, outdir)
    dist.barrier()  # no rank tears gloo down while its peer is still in a collective (an abort at exit otherwise)
    dist.destroy_process_group()


# ---- the tests ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_rank_scripts(__file__, WORLD, tmp_path_factory.mktemp("fsdp"), LAUNCH_TIMEOUT_S, "FSDP")


@pytest.mark.procs
def test_fsdp_groups_exact_after_training(ranks):
    for r, res in enumerate(scenario(ranks, "fsdp")):
        assert res["init_equal"], f"rank {r}: the sharded model's first pass differs from an unsharded replica"
        assert res["changed"] == res["n_full"] == 25, res       # two AdamW steps changed every parameter
        assert res["yielded"] == res["expected"] and len(res["expected"]) == 4   # pre, 2 layers, post
        assert res["names"][0] == "model.embed_tokens.weight" and res["names"][-1] == "lm_head.weight"
        assert res["mismatches"] == [], f"rank {r}: not bit-exact: {res['mismatches']}"


@pytest.mark.procs
def test_fsdp_one_collective_per_group(ranks):
    for res in scenario(ranks, "fsdp"):
        assert res["stats"]["collectives"] == len(res["expected"])
        assert res["stats"]["gathered_bytes"] == res["full_bytes"] > 0


@pytest.mark.procs
def test_2d_mesh_tp_sharded_exact(ranks):
    for r, res in enumerate(scenario(ranks, "tp")):
        assert len(res["tp_sharded"]) == 14, res["tp_sharded"]  # q,k,v,o,gate,up,down of 2 layers
        assert res["yielded"] == res["expected"]
        assert res["mismatches"] == [], f"rank {r}: not bit-exact: {res['mismatches']}"
        assert res["stats"]["gathered_bytes"] == res["full_bytes"]
        # fast path: 1 gather per group; each TP tensor adds full_tensor()'s gathers (2 sharded mesh dims)
        assert res["stats"]["collectives"] == len(res["expected"]) + 2 * 14


@pytest.mark.procs
def test_mixed_dtypes_uneven_shards(ranks):
    by_rank = scenario(ranks, "mixed")
    assert [res["local_rows"] for res in by_rank] == [[3, 1, 4, 2, 5], [2, 0, 3, 1, 4]]
    for r, res in enumerate(by_rank):
        assert res["yielded"] == [["model.layers.0.a.weight", "model.layers.0.b.weight", "model.layers.0.c.weight",
                                   "model.layers.0.d.count"], ["model.norm.weight"]]
        assert res["mismatches"] == [], f"rank {r}: not bit-exact: {res['mismatches']}"
        assert res["stats"] == {"collectives": 2, "gathered_bytes": res["full_bytes"]}


def test_names_strip_wrapper_prefixes():
    assert strip_wrappers("_orig_mod.model._checkpoint_wrapped_module.layers.0._fsdp_wrapped_module.w") \
        == "model.layers.0.w"
    assert strip_wrappers("model.norm.weight") == "model.norm.weight"
    assert strip_wrappers("model.my_orig_mod.weight") == "model.my_orig_mod.weight"   # whole segments only

    layer = nn.Module()
    layer._checkpoint_wrapped_module = nn.Linear(3, 2, bias=False)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(4, 3)
    model.layers = nn.ModuleList([layer])
    root = nn.Module()
    root._orig_mod = nn.Module()
    root._orig_mod.model = model
    src = FSDPSource(root)
    metas = src.metadata()
    assert [m.name for m in metas] == ["model.embed_tokens.weight", "model.layers.0.weight"]
    assert [(m.dtype, m.shape) for m in metas] == [("float32", (4, 3)), ("float32", (2, 3))]
    batches = list(src.iter_groups())
    assert [ns for ns, _ in batches] == [["model.embed_tokens.weight"], ["model.layers.0.weight"]]
    assert torch.equal(batches[1][1][0], layer._checkpoint_wrapped_module.weight)
    assert src.stats == {"collectives": 0, "gathered_bytes": (4 * 3 + 2 * 3) * 4}

    renamed = FSDPSource(root, name_map=lambda n: None if "embed" in n else "x." + n)
    assert [m.name for m in renamed.metadata()] == ["x.model.layers.0.weight"]
    with pytest.raises(MetadataMismatch, match="both map to 'same'"):
        FSDPSource(root, name_map=lambda n: "same").metadata()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
