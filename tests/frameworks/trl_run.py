"""One TRL GRPO run on CPU for ``test_trl.py`` (a process of its own: TRL's colocated ``LLM`` initialises
torch.distributed in-process). ``--sync shardsync``: shardsync's integration; ``--sync reload``: the engine synced by
vLLM's own in-place ``reload_weights`` with TRL's parameters (TRL's own ``load_weights`` loop fails on CPU vLLM 0.32:
its CPU linear layers drop ``weight_loader``). After every sync the engine is compared with a fresh load of the
trainer's weights (``check_fresh``) and its greedy tokens are kept with the checkpoint of those weights. Writes JSON:
``losses``, ``syncs`` (one entry per sync: fresh check, tokens, checkpoint)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def tiny_model(out: str) -> str:
    """A 2-layer Llama with a word-level tokenizer (what TRL's trainer and vLLM both load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in "a b c d e f g h i j k l m n o p q r s t u v w x y z hello world the cat dog".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>")
    t.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    t.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    return out


# The engine arguments of the synced engine, so that the fresh one runs the same kernels: a compiled and an eager
# CPU engine may break a near-tie of greedy logits differently. ``colocate``: what TRL's ``VLLMGeneration`` passes
# (compiled); ``server``: ``VllmServer`` (eager).
ENGINES = {
    "colocate": {"max_model_len": 64, "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 4096,
                 "logprobs_mode": "processed_logprobs", "seed": 0},
    "server": {"max_model_len": 64, "gpu_memory_utilization": 0.3, "enforce_eager": True},
}


def fresh_tokens(checkpoints: list[str], engine: str) -> list[list[int]]:
    """Greedy tokens of a FRESH engine, configured as the synced one (``ENGINES``), started on each checkpoint (the
    standard a synced engine is held to)."""
    from vllm import LLM, SamplingParams

    out = []
    for ckpt in checkpoints:
        llm = LLM(model=ckpt, **ENGINES[engine])
        r = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8),
                         use_tqdm=False)
        out.append(list(r[0].outputs[0].token_ids))
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


PROMPT = [1, 30, 31, 32]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", nargs="*", default=None, help="only: greedy tokens of fresh engines on these")
    ap.add_argument("--engine", choices=tuple(ENGINES), default="colocate", help="with --fresh: configured as")
    ap.add_argument("--sync", choices=("shardsync", "reload"))
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--server", default="", help="vllm_mode='server': the URL of a `vllm serve` with shardsync")
    ap.add_argument("--model", default="", help="the model directory (default: a tiny Llama made here)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.fresh is not None:
        with open(args.out, "w") as f:
            json.dump({"tokens": fresh_tokens(args.fresh, args.engine)}, f)
        sys.stdout.flush()
        os._exit(0)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    from shardsync.verify.reference import save_checkpoint

    model_dir = args.model or tiny_model(os.path.join(args.work, "model"))
    syncs: list[dict] = []

    def after_sync(gen) -> None:
        """The engine vs a fresh load of what the trainer holds now (TRL's merged names), and its greedy tokens."""
        k = len(syncs)
        state = {n: p.detach().clone().cpu() for n, p in gen._iter_named_params()}
        ckpt = save_checkpoint(state, model_dir, os.path.join(args.work, f"v{k}"))
        insp = os.path.join(args.work, f"inspect{k}")
        check = {"inspect_to": insp, "check_fresh": ckpt}
        if args.server:
            import requests

            from shardsync.integrations.vllm.clients import ShardsyncHTTPClient

            ShardsyncHTTPClient(args.server).init_weight_transfer_engine(check)
            r = requests.post(f"{args.server}/v1/completions", json={
                "model": gen.vllm_client.model, "prompt": [PROMPT], "max_tokens": 8, "temperature": 0.0,
                "return_token_ids": True}, timeout=60).json()
            tokens = list(r["choices"][0]["token_ids"])
        else:
            from vllm import SamplingParams

            gen.llm.init_weight_transfer_engine({"init_info": check})
            out = gen.llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8),
                                   use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
        fresh = json.load(open(os.path.join(insp, "fresh_rank0.json")))
        syncs.append({"fresh": fresh, "tokens": tokens, "checkpoint": ckpt, "stats": getattr(gen, "last_sync", None)})

    if args.sync == "shardsync":
        from shardsync import enable_trl

        cls = enable_trl(timeout_s=60.0)
        inner = cls.sync_weights

        def sync_weights(self) -> None:
            inner(self)
            after_sync(self)

        cls.sync_weights = sync_weights
    else:
        import trl.generation.vllm_generation as vg

        llm_cls = vg.LLM
        vg.LLM = lambda *a, **kw: llm_cls(*a, weight_transfer_config={"backend": "shardsync"}, **kw)  # to inspect

        def sync_weights(self) -> None:  # vLLM's own in-place reload, TRL's parameters and names
            pairs = [(n, p.detach().clone()) for n, p in self._iter_named_params()]
            self.llm.llm_engine.model_executor.driver_worker.model_runner.reload_weights(
                weights_iterator=iter(pairs))
            self.llm.reset_prefix_cache()
            after_sync(self)

        VLLMGeneration.sync_weights = sync_weights

    ds = Dataset.from_dict({"prompt": ["hello world the", "the cat", "a b c", "dog d e"] * 4})

    def reward(completions, **kw):
        return [float(len(c)) for c in completions]

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                 lora_dropout=0.0)
    cfg = GRPOConfig(output_dir=os.path.join(args.work, "out"), use_cpu=True, bf16=False, max_steps=args.steps,
                     per_device_train_batch_size=4, num_generations=2, max_completion_length=8, logging_steps=1,
                     report_to=[], save_strategy="no", learning_rate=5e-2, seed=0, use_vllm=True,
                     vllm_mode="server" if args.server else "colocate", vllm_server_base_url=args.server or None,
                     vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    tr = GRPOTrainer(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=ds, peft_config=peft_config)
    tr.train()
    losses = [x["loss"] for x in tr.state.log_history if "loss" in x]
    gen = tr.vllm_generation
    if hasattr(gen, "shutdown_shardsync"):
        gen.shutdown_shardsync()
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "syncs": syncs, "class": type(gen).__name__}, f)
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine would otherwise linger in its atexit teardown


if __name__ == "__main__":
    raise SystemExit(main())
