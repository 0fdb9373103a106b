"""shardsync's own API, no vLLM trainer API: a plain ``nn.Module`` trainer runs a ``Producer``; a vLLM engine
(``weight_transfer_config={"backend": "shardsync"}``) pulls from it after every optimizer step.

    python examples/plain_module.py --steps 3 [--verify] [--json]

What a new user needs to know, in the order it matters:
- the coordinator is producer 0's control server: ``prod.address`` (or ``"host:port"`` you choose with
  ``ProducerConfig(host=, port=)``); the engines get it, with the token, in their init info;
- ``n_consumers`` counts inference WORKERS (replicas x TP ranks), not engines;
- ``prod.init()`` and ``llm.init_weight_transfer_engine`` wait for each other (the producer needs every
  worker's plan, the workers need routes): run them on different threads or processes; the same holds
  for ``prod.sync(v)`` and ``llm.update_weights`` every step;
- versions start at 1 (an engine holds version 0 before any sync);
- shut down the engines' side first (``shutdown_weight_transfer_engine``), then ``prod.close()``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import threading

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    """Your model: here a tiny random-init Qwen3 built from a transformers config (no download)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # stdout carries only the JSON line: vLLM's logs (driver, engine core, workers) go to stderr
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    log = sys.stderr if args.json else sys.stdout

    from vllm import LLM

    from shardsync import ModuleSource, Producer, ProducerConfig

    work = tempfile.mkdtemp(prefix="shardsync-plain-")
    model = tiny_qwen3(seed=0)
    model.save_pretrained(os.path.join(work, "ckpt"))
    if args.verify:  # the check compares what the engine holds: the testing engine (test scaffolding) inspects it
        from shardsync.verify import registration as plugin

        plugin.enable()
    llm = LLM(model=os.path.join(work, "ckpt"), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              gpu_memory_utilization=0.4, weight_transfer_config={"backend": "shardsync"})

    token = secrets.token_hex(16)
    prod = Producer(ModuleSource(model), ProducerConfig(rank=0, n_producers=1, n_consumers=1, token=token))
    engine_init = threading.Thread(target=llm.init_weight_transfer_engine, args=(
        {"init_info": {"coordinator": prod.address, "token": token}},))
    engine_init.start()
    prod.init()                      # returns once the engine's worker has registered its plan
    engine_init.join()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for v in range(1, args.steps + 1):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        llm.start_weight_update()
        pull = threading.Thread(target=llm.update_weights, args=({"update_info": {"version": v}},))
        pull.start()
        out = prod.sync(version=v)   # serves the pull; returns the version's outcome
        pull.join()
        llm.finish_weight_update(weight_version=str(v))
        print(f"version {v}: {out['bytes_sent']} bytes in {out['seconds']:.3f} s, completed {out['completed']}",
              file=log)
    report = {"steps": args.steps, "version": llm.get_weight_version()}
    if args.verify:  # the check the tests run (test scaffolding: not needed to adopt shardsync)
        from shardsync.verify.reference import compare_with, fresh_reference, inspect_engine

        synced = inspect_engine(llm, os.path.join(work, "synced"), tp=1)
        state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        ref = fresh_reference(os.path.join(work, "ckpt"), state, tp=1, ep=False, out_dir=os.path.join(work, "fresh"))
        n, bad = compare_with(synced, ref.paths)
        report.update(exact=n > 0 and not bad, tensors_compared=n, mismatched=bad[:5])
        print(f"vs a fresh engine: {n} tensors compared, {'all equal' if not bad else f'{len(bad)} differ'}",
              file=log)
    llm.shutdown_weight_transfer_engine()
    prod.close()
    if args.json:
        print(json.dumps(report))
    return 0 if report.get("exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
