"""vLLM's own trainer API with shardsync: a trainer trains a tiny Qwen3 and, after every optimizer step, pushes
its weights into a real vLLM engine through ``WeightTransferTrainerFactory`` — the calls vLLM's ``nccl``
backend takes, with ``ShardsyncTrainerInitInfo`` in place of ``NCCLTrainerInitInfo``.

    python examples/vllm_trainer_api.py --steps 3 [--verify] [--json]

``--verify`` starts a FRESH engine on the trainer's final weights and compares every tensor the two engines
hold, byte for byte. With ``--json`` the last stdout line is ``{"steps", "versions", "exact", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--async-sync", action="store_true", help="send_weights(block=False): train while it serves")
    args = ap.parse_args()
    if args.json:  # stdout carries only the JSON line: vLLM's logs (driver, engine core, workers) go to stderr
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    log = sys.stderr if args.json else sys.stdout

    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.base import ModuleSource  # vLLM's own source, unchanged
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo
    from shardsync.tools.reftrainer import build_model

    work = tempfile.mkdtemp(prefix="shardsync-example-")
    model = build_model("qwen3", seed=0, dtype=torch.bfloat16)        # the trainer's policy (tiny, random init)
    model.save_pretrained(os.path.join(work, "ckpt"))                  # the engine starts from the same weights
    llm = LLM(model=os.path.join(work, "ckpt"), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              gpu_memory_utilization=0.4, weight_transfer_config={"backend": "shardsync"})   # was "nccl"

    # --- the only trainer-side line that differs from vLLM's nccl example: the init-info class ---
    info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ModuleSource(model))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompt = [{"prompt_token_ids": [1, 17, 42, 99, 7, 3]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    g = torch.Generator().manual_seed(0)
    versions = []
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=batch, labels=batch).loss               # one real optimizer step
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.async_sync:  # returns once the weights are copied aside; the engines pull in the background
            engine.send_weights(block=False)
            out = engine.wait()  # a real loop would run its next step here; the next send_weights waits too
        else:
            out = engine.send_weights()                                 # every trainer rank, every step
        tokens = list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        versions.append(llm.get_weight_version())
        print(f"step {step}: loss {loss.item():.3f}  sync {out['seconds']:.2f} s  {out['bytes_sent']} bytes  "
              f"engine version {versions[-1]}  tokens {tokens}", file=log)
    report = {"steps": args.steps, "versions": versions}
    if args.verify:
        from shardsync.integrations.vllm.reference import compare_with, fresh_reference, inspect_engine

        synced = inspect_engine(llm, os.path.join(work, "synced"), tp=1)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        engine.shutdown()
        ref = fresh_reference(os.path.join(work, "ckpt"), state, tp=1, ep=False, out_dir=os.path.join(work, "fresh"))
        n, bad = compare_with(synced, ref.paths)
        report.update(exact=not bad and n > 0, tensors_compared=n, mismatched=bad[:5], tokens=tokens,
                      fresh_tokens=ref.tokens)
        print(f"vs a fresh engine on the final weights: {n} tensors compared, "
              f"{'all equal' if not bad else f'{len(bad)} differ'}; tokens {tokens} vs {ref.tokens}", file=log)
    else:
        engine.shutdown()
    if args.json:
        print(json.dumps(report))
    return 0 if report.get("exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
