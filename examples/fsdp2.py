"""An FSDP2 trainer (2 ranks, gloo on CPU: ``fully_shard`` of its own Hugging Face model) pushes its weights after
every optimizer step into a real vLLM engine of TP2, through vLLM's trainer API with shardsync: each of the engine's
2 workers pulls only its own slices, from both trainer ranks.

    python examples/fsdp2.py --steps 3 [--source shardsync|vllm] [--verify] [--json]

``--source shardsync`` hands ``FSDPSource`` (one all-gather per layer); ``--source vllm`` hands vLLM's own
``ModuleSource`` over the same FSDP2 module, unchanged (one ``full_tensor()`` per parameter). ``--verify``
compares the engine, byte for byte, with a FRESH engine started on the trainer's final weights. With
``--json`` the last stdout line is the report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


ENGINES: list = []
"""The vLLM engines this process started: shut down on every exit path (``os._exit`` below skips vLLM's own)."""


def trainer_rank(rank: int, args: argparse.Namespace, port: int, work: str) -> None:
    try:
        _trainer_rank(rank, args, port, work)
    except BaseException:  # say it now: the other rank may be waiting in a collective for this one
        import traceback
        print(f"trainer rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        for llm in ENGINES:  # no engine core or TP worker may outlive this failed run
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        os._exit(1)


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    """Your model: here a tiny random-init Qwen3 built from a transformers config (no download), the same on every
    rank for the same seed."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")


def _trainer_rank(rank: int, args: argparse.Namespace, port: int, work: str) -> None:
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    log = sys.stderr if args.json else sys.stdout
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardsync import FSDPSource, ShardsyncTrainerInitInfo

    model = tiny_qwen3(seed=0)
    if rank == 0:  # the engine starts from the trainer's initial weights
        model.save_pretrained(os.path.join(work, "ckpt"))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:                                       # FSDP2 over both ranks
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    llm = None
    if rank == 0:  # the sender drives the engine; here an in-process LLM (HTTP / Ray clients work the same)
        from vllm import LLM

        if args.verify:  # the check compares what the engine holds: the testing engine (test scaffolding) inspects it
            from shardsync.verify import registration as plugin

            plugin.enable()
        llm = LLM(model=os.path.join(work, "ckpt"), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                  gpu_memory_utilization=0.4, tensor_parallel_size=2, weight_transfer_config={"backend": "shardsync"})
        ENGINES.append(llm)
    if args.source == "vllm":
        from vllm.distributed.weight_transfer.base import ModuleSource
        source = ModuleSource(model)
    else:
        source = FSDPSource(model)                                          # one all-gather per layer
    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=3, rank=rank)  # 1 + 2 workers
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=source)
    g = torch.Generator().manual_seed(0)
    syncs = []
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        model.train()
        loss = model(input_ids=batch, labels=batch).loss                  # one optimizer step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(loss.detach())
        out = engine.send_weights()
        syncs.append({"step": step, "loss": loss, "seconds": out["seconds"], "bytes_sent": out["bytes_sent"],
                      "gathered_bytes": out["gathered_bytes"], "gather_batches": out["gather_batches"],
                      "collectives": getattr(source, "stats", {}).get("collectives")})
        if rank == 0:
            print(f"step {step}: loss {loss:.3f}  sync {out['seconds']:.2f} s  engine {llm.get_weight_version()}",
                  file=log)
    report: dict = {"rank": rank, "syncs": syncs}
    if args.verify:
        # full tensors (DTensor.full_tensor() is a collective: every rank, in the same order)
        full = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        if rank == 0:  # the check the tests run (test scaffolding: not needed to adopt shardsync)
            from shardsync.verify.reference import compare_with, fresh_reference, inspect_engine, shutdown

            synced = inspect_engine(llm, os.path.join(work, "synced"), tp=2)
            engine.shutdown()
            shutdown(llm)
            ref = fresh_reference(os.path.join(work, "ckpt"), full, tp=2, ep=False, out_dir=os.path.join(work, "fresh"))
            n, bad = compare_with(synced, ref.paths)
            report.update(exact=n > 0 and not bad, tensors_compared=n, mismatched=bad[:5])
            print(f"vs a fresh engine on the final weights: {n} tensors compared, "
                  f"{'all equal' if not bad else f'{len(bad)} differ'}", file=log)
        else:
            engine.shutdown()
    else:
        engine.shutdown()
    with open(os.path.join(work, f"report{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--source", choices=("shardsync", "vllm"), default="shardsync")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # stdout carries only the JSON line: vLLM's logs (driver, engine core, workers) go to stderr
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    work = tempfile.mkdtemp(prefix="shardsync-fsdp2-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(trainer_rank, args=(args, port, work), nprocs=2, join=True)
    reports = [json.load(open(os.path.join(work, f"report{r}.json"))) for r in range(2)]
    out = {"source": args.source, "steps": args.steps, "ranks": reports, "exact": reports[0].get("exact")}
    if args.json:
        print(json.dumps(out))
    return 0 if out["exact"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
