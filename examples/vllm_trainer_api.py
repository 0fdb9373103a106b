"""vLLM's own trainer API with shardsync: a trainer trains a tiny Qwen3 and, after every optimizer step, pushes
its weights into a real vLLM engine through ``WeightTransferTrainerFactory`` — the calls vLLM's ``nccl``
backend takes, with ``ShardsyncTrainerInitInfo`` in place of ``NCCLTrainerInitInfo``.

    python examples/vllm_trainer_api.py --steps 3 [--client llm|http] [--async-sync] [--verify] [--json]

``--client llm`` drives an in-process ``vllm.LLM``; ``--client http`` starts a vLLM OpenAI server (with its RL
routes, ``VLLM_SERVER_DEV_MODE=1``) and drives it with vLLM's ``HTTPVLLMWeightSyncClient``. ``--verify``
starts a FRESH engine on the trainer's final weights and compares every tensor the two engines hold, byte
for byte. With ``--json`` the last stdout line is ``{"steps", "versions", "exact", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPT = [1, 17, 42, 99, 7, 3]


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    """Your model: here a tiny random-init Qwen3 built from a transformers config (no download)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")


def start_server(ckpt: str, log, timeout_s: float = 300.0):
    """A vLLM OpenAI server with the RL routes, the shardsync backend selected; returns (process, base URL)."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                             "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
                             "--max-model-len", "128", "--weight-transfer-config", '{"backend": "shardsync"}'],
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=log)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vLLM server did not come up within {timeout_s:.0f} s (exit code {proc.poll()})")
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--client", choices=("llm", "http"), default="llm")
    ap.add_argument("--async-sync", action="store_true", help="send_weights(block=False): train while it serves")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # stdout carries only the JSON line: vLLM's logs (driver, engine core, workers) go to stderr
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    log = sys.stderr if args.json else sys.stdout

    import requests
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.base import ModuleSource  # vLLM's own source, unchanged
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardsync import ShardsyncTrainerInitInfo

    work = tempfile.mkdtemp(prefix="shardsync-example-")
    model = tiny_qwen3(seed=0)                                        # the trainer's policy (tiny, random init)
    model.save_pretrained(os.path.join(work, "ckpt"))                  # the engine starts from the same weights
    if args.verify:  # the check compares what the engine holds: the testing engine (test scaffolding) inspects it
        from shardsync.verify import registration as plugin

        plugin.enable()                                                # this process and the server it starts
    llm = server = None
    if args.client == "llm":
        llm = client = LLM(model=os.path.join(work, "ckpt"), skip_tokenizer_init=True, enforce_eager=True,
                           max_model_len=128, gpu_memory_utilization=0.4,
                           weight_transfer_config={"backend": "shardsync"})     # was {"backend": "nccl"}
    else:
        server, url = start_server(os.path.join(work, "ckpt"), log)
        client = HTTPVLLMWeightSyncClient(url)
    try:
        # --- the only trainer-side line that differs from vLLM's nccl example: the init-info class ---
        info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        versions, tokens = [], None
        for step in range(1, args.steps + 1):
            batch = torch.randint(0, 256, (2, 16), generator=g)
            loss = model(input_ids=batch, labels=batch).loss           # one real optimizer step
            loss.backward()
            opt.step()
            opt.zero_grad()
            if args.async_sync:  # returns once the weights are copied aside; the engines pull in the background
                engine.send_weights(block=False)
                out = engine.wait()  # a real loop would run its next step here; the next send_weights waits too
            else:
                out = engine.send_weights()                             # every trainer rank, every step
            if llm is not None:
                greedy = SamplingParams(temperature=0.0, max_tokens=8)
                tokens = list(llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0]
                              .outputs[0].token_ids)
                versions.append(llm.get_weight_version())
            else:
                versions.append(requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"])
            print(f"step {step}: loss {loss.item():.3f}  sync {out['seconds']:.2f} s  {out['bytes_sent']} bytes  "
                  f"engine version {versions[-1]}  tokens {tokens}", file=log)
        report = {"steps": args.steps, "client": args.client, "versions": versions,
                  "engine_workers": engine.engine_workers}  # what the trainer checked world_size against
        if args.verify:  # the check the tests run (test scaffolding: not needed to adopt shardsync)
            from shardsync.verify.reference import compare_with, fresh_reference

            synced_dir = os.path.join(work, "synced")     # every worker writes what it holds now (read-only)
            client.init_weight_transfer_engine({"inspect_to": synced_dir} if llm is None else
                                               {"init_info": {"inspect_to": synced_dir}})
            engine.shutdown()
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
                server = None
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ref = fresh_reference(os.path.join(work, "ckpt"), state, tp=1, ep=False,
                                  out_dir=os.path.join(work, "fresh"))
            n, bad = compare_with([os.path.join(synced_dir, "inspect_rank0.safetensors")], ref.paths)
            report.update(exact=not bad and n > 0, tensors_compared=n, mismatched=bad[:5], tokens=tokens,
                          fresh_tokens=ref.tokens if tokens is not None else None)
            print(f"vs a fresh engine on the final weights: {n} tensors compared, "
                  f"{'all equal' if not bad else f'{len(bad)} differ'}; tokens {tokens} vs {ref.tokens}", file=log)
        else:
            engine.shutdown()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    if args.json:
        print(json.dumps(report))
    return 0 if report.get("exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
