"""GPU-only (run on the device machine with ``pytest -m gpu``): the engine through every GPU transport, and the
benchmark on a small model, bit-exact. Producers on GPU0 and consumers on GPU1 when two GPUs are there; with one GPU
everyone shares it (colocated, as trainer and engine do) and the transports that need two GPUs are left out
(NCCL refuses two ranks of one communicator on one GPU: its pairs, and the broadcast baseline, need two)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.procs,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TWO_GPUS = torch.cuda.device_count() >= 2
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _transports() -> list[str]:
    out = ["cuda_ipc", "auto"] + (["nccl"] if TWO_GPUS else [])
    try:
        import nixl  # noqa: F401
        return out + ["nixl"]
    except ImportError:
        return out


@pytest.mark.parametrize("transport", _transports())
def test_two_producers_to_a_tp2_replica_on_gpus_exact(transport: str) -> None:
    """2 producers (PP2) on GPU0 -> 2 consumers (TP2) on GPU1 (or all on GPU0): 4 syncs; before the last the weights change and
    the consumers' buffers are poisoned; afterwards every byte (bf16 and FP8 kernel tensors) matches a fresh load."""
    sys.path.insert(0, BENCH)
    import gpu_sync

    args = argparse.Namespace(device="cuda", layers=2, experts=16, port=0, chunk_mb=64, lookahead=1, recv_slots=2)
    g = gpu_sync.Group(args, 2, [("tp0", 2, 0, False), ("tp1", 2, 1, False)], bcast=False)
    try:
        r = g.run_engine(transport, 2, 1)
    finally:
        g.close()
    assert r["exact"], r["checked"]
    assert all(c["compared"] > 20 for c in r["checked"].values()), r["checked"]
    got = [c["bytes_received"] for c in r["last"].values() if "bytes_received" in c]
    sent = [p["bytes_sent"] for p in r["last"].values() if "bytes_sent" in p]
    assert len(got) == 2 and len(sent) == 2 and sum(got) == sum(sent) and min(sent) > 0, r["last"]
    if transport == "auto":  # same node, GPU buffers: CUDA IPC
        assert all(set(c["transports"].values()) == {"cuda_ipc"} for c in r["last"].values() if "transports" in c)


def test_gpu_benchmark_small_is_bit_exact(tmp_path) -> None:
    one_gpu = [] if TWO_GPUS else ["--scenarios", "BC", "--transports", "cuda_ipc"]  # A's baseline is NCCL
    subprocess.run([sys.executable, os.path.join(BENCH, "gpu_sync.py"), "--layers", "2", "--experts", "16",
                    "--iters", "1", "--chunk-mb", "64", "--out", str(tmp_path), *one_gpu], check=True, timeout=900)
    s = json.load(open(tmp_path / "gpu_sync.json"))
    assert (not TWO_GPUS or s["A"]["exact"]) and all(r["exact"] for t, r in s["B"].items() if t not in ("raw",) and isinstance(r, dict)
                                   and "exact" in r)
    assert all(r["exact"] for t, r in s["C"].items() if isinstance(r, dict) and "exact" in r)


def test_copy_programs_replayed_from_cuda_graphs_follow_in_place_updates() -> None:
    """On a side stream, a chunk's pack and unpack are captured into CUDA graphs at their second cached call and
    replayed after: every call stays exact while the trainer's tensors change in place; a rebuilt view set (new
    destination tensors) drops its graph."""
    from shardsync.plan.pack import GroupPacker, GroupUnpacker, layout_group
    from shardsync.plan.record import record_plan
    from shardsync.source import ModuleSource
    from shardsync.testing.zoo import ZooConfig, ZooModel, hf_state_dict

    cfg = ZooConfig.qwen3_moe_tiny()
    full = {n: t.cuda().contiguous() for n, t in hf_state_dict(cfg, seed=1).items()}
    with torch.device("meta"):
        dry = ZooModel(cfg, tp_size=2, tp_rank=1)
    plan = record_plan(metadata=ModuleSource(full).metadata(), load_weights=dry.load_weights,
                       params=dict(dry.named_parameters()), consumer="c")
    with torch.device("cuda"):
        live, ref = ZooModel(cfg, tp_size=2, tp_rank=1), ZooModel(cfg, tp_size=2, tp_rank=1)
    params = {n: p.detach() for n, p in live.named_parameters()}
    g = plan.group("model.layers.0")
    lay = layout_group(g)
    pk, up = GroupPacker(g, lay), GroupUnpacker(g, lay)
    ring = torch.zeros(lay.nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    for step in range(6):
        for t in full.values():
            t.mul_(1.5).add_(1)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pk.pack(full, ring)
            up.unpack(ring, params)
        torch.cuda.current_stream().wait_stream(side)
        ref.load_weights([(n, t) for n, t in full.items() if n.startswith("model.layers.0.")])
        mine = {n: p for n, p in params.items() if n.startswith("model.layers.0.")}
        assert all(torch.equal(p, dict(ref.named_parameters())[n]) for n, p in mine.items()), step
    graphs = [st.replay.graph for v in (pk._views, up._views) for st in v.by_key.values()]
    assert graphs and all(x is not None for x in graphs)


_EXPORT = """
import json, sys, torch
from shardsync.transport.cuda_ipc import CudaIpcTransport
t = CudaIpcTransport()
buf = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
src = torch.full((4096,), 7, dtype=torch.float32, device="cuda")
print(json.dumps({"ring": t.register(buf), "shared": t.share(src)}), flush=True)
sys.stdin.readline()
"""


def test_cuda_ipc_refuses_a_descriptor_claiming_more_than_its_allocation() -> None:
    """A peer's descriptor says its storage's size and offset itself: an honest one maps and reads back the exporter's
    bytes; one claiming more bytes than the allocation (or an offset past it) is a TransportError, not a mapping over
    memory nobody shared."""
    from shardsync.errors import TransportError
    from shardsync.transport.cuda_ipc import CudaIpcTransport

    p = subprocess.Popen([sys.executable, "-c", _EXPORT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        descs = json.loads(p.stdout.readline())
        t = CudaIpcTransport()
        t.connect(0, descs["ring"])
        into = torch.empty(1 << 12, dtype=torch.uint8, device="cuda")
        t.read(0, 4096, 4096, into, timeout_s=10)
        assert torch.equal(into.view(torch.int32).cpu(), torch.arange(1024, 2048, dtype=torch.int32))
        shared = t.open_shared(0, descs["shared"])
        assert shared.numel() >= 4096 * 4
        assert torch.equal(shared[:16384].view(torch.float32).cpu(), torch.full((4096,), 7.0))
        for forged in ({**descs["shared"], "size": 1 << 40}, {**descs["shared"], "offset": 1 << 36},
                       {**descs["ring"], "size": descs["ring"]["size"] * 64}):
            with pytest.raises(TransportError, match="refused|cannot open"):
                CudaIpcTransport().open_shared(1, forged)
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=60)
