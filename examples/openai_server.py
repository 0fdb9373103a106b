"""vLLM's OpenAI server with shardsync: a trainer syncs a tiny Qwen3 into ``vllm serve`` over vLLM's HTTP client.

    python examples/openai_server.py --steps 2 [--url http://127.0.0.1:8000 --model DIR] [--json]

Without ``--url`` it writes a tiny random checkpoint and starts the server itself, exactly as you would::

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 vllm serve CKPT --port PORT --enforce-eager \\
        --max-model-len 128 --skip-tokenizer-init --weight-transfer-config '{"backend": "shardsync"}'

(``--url`` with ``--model``: a server you started on ``--model``'s checkpoint, whose shapes the trainer's model
must have.) Each step: one optimizer step, ``send_weights()`` (every worker of the server pulls its slices), then a
greedy ``/v1/completions`` from the new weights. It prints where the server's status files are
(``{TMPDIR}/shardsync-vllm/pid{PID of vllm serve}``) and stops the server it started with Ctrl-C's signal, after
which that folder is gone. With ``--json`` the last stdout line is ``{"versions", "tokens", "status_dir", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

PROMPT = [1, 17, 42, 99, 7, 3]


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")


def serve(ckpt: str, log) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` with the shardsync backend and vLLM's RL routes; returns (process, base URL) once healthy."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")  # this environment's vllm command
    cmd = [vllm, "serve", ckpt, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len",
           "128", "--skip-tokenizer-init", "--weight-transfer-config", '{"backend": "shardsync"}']
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"vllm serve did not come up (exit code {proc.poll()})")
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--url", default="", help="a running server (then also --model: its checkpoint)")
    ap.add_argument("--model", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    log = sys.stderr if args.json else sys.stdout

    import requests
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shardsync import ShardsyncTrainerInitInfo

    model = tiny_qwen3(seed=0)
    server = None
    if args.url:
        url = args.url.rstrip("/")
        if args.model:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        ckpt = os.path.join(tempfile.mkdtemp(prefix="shardsync-openai-"), "ckpt")
        model.save_pretrained(ckpt)                                     # the server starts from the same weights
        server, url = serve(ckpt, log)
    report: dict = {"url": url, "versions": [], "tokens": []}
    try:
        client = HTTPVLLMWeightSyncClient(url)                          # vLLM's client: (base_url, timeout=300)
        info = ShardsyncTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, rank=0)
        try:
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        except requests.HTTPError as e:  # shardsync's EngineHTTPError: the engine's reason, not a bare HTTP 500
            print(f"the server refused the trainer: {getattr(e, 'engine_message', e)}", file=log)
            raise
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        try:
            for step in range(1, args.steps + 1):
                batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                out = engine.send_weights()                             # every worker pulls its own slices
                r = requests.post(f"{url}/v1/completions", timeout=120, json={
                    "model": requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"],
                    "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True,
                    "detokenize": False})
                r.raise_for_status()                                    # a torn engine: 503 naming the reason
                tokens = r.json()["choices"][0]["token_ids"]
                version = requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
                report["versions"].append(version)
                report["tokens"].append(tokens)
                print(f"step {step}: loss {loss.item():.3f}  sync {out['seconds']:.2f} s  engine version {version}  "
                      f"tokens {tokens}", file=log)
        finally:
            engine.shutdown()                                           # releases the engine for the next trainer
    finally:
        if server is not None:
            status_dir = os.path.join(tempfile.gettempdir(), "shardsync-vllm", f"pid{server.pid}")
            report["status_dir"] = status_dir
            report["status"] = json.load(open(os.path.join(status_dir, "status_rank0.json")))
            print(f"status files: {status_dir} (status_rank0.json: complete_version "
                  f"{report['status']['complete_version']})", file=log)
            server.send_signal(signal.SIGINT)                           # Ctrl-C: vLLM stops its engine and workers
            server.wait(timeout=120)
            report["status_dir_left"] = os.path.exists(status_dir)
            print(f"server stopped; status folder left behind: {report['status_dir_left']}", file=log)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
