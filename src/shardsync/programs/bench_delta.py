"""``shardsync bench --delta``: the reference RL-rate trainer into real vLLM engines, dense sync against delta sync.

The trainer is ``delta_probe.RateTrainer`` (a Llama-shaped policy with fp32 master weights, AdamW at an RL learning
rate, bf16 served). Two passes over the same versions, each a transfer group of its own — a ``Producer`` in this
process over the served weights, ``replicas`` vLLM engines of TP ``tp`` (``harness.vllm_replica``) pulling:

1. **delta**: ``ProducerConfig(delta=True)`` and ``ShardsyncInitInfo(delta=True)``. Version 1 is the initial
   weights (dense: no worker holds a base); each later version is one optimizer step, trained here while the
   engines wait. Every version is written as a checkpoint.
2. **dense**: the same versions, read back from those checkpoints (the same bytes, without training them twice),
   synced with delta off.

After every sync of both passes each engine compares everything it holds with a FRESH load of that version's
checkpoint in its workers (vLLM's model loader: every tensor after processing, a digest); after the last delta
sync a FRESH engine started on the checkpoint is compared too (tensors, probe outputs, greedy tokens).
``seconds``: the wall time of a sync (producer and every engine, from the calls to their return), measured
without the training step or the checks. Bytes are what the workers read from the wire (delta payloads plus any
dense chunks). The last line of ``--json`` is the summary (medians over the syncs after the first)::

    shardsync bench --delta --json                    # tiny policy, a minute or two
    shardsync bench --delta --params 300e6 --json     # a few hundred million parameters (about 15 minutes here)
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from .delta_probe import RateTrainer, changed_fraction, config_for
from ..verify.output import emit_json
from ..testing.zoo import ZooConfig

__all__ = ["run_bench_delta", "write_llama_config", "bench_config"]


def bench_config(params: float | None) -> ZooConfig:
    """``delta_probe.config_for`` near ``params``; unset: a tiny Llama vLLM's CPU attention runs (head_dim 64)."""
    if params:
        return config_for(params)
    return ZooConfig.llama_tiny(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, inter=512)


def write_llama_config(cfg: ZooConfig, out_dir: str) -> str:
    """An HF ``LlamaForCausalLM`` config for the zoo's Llama shape (the names ``hf_shapes`` gives)."""
    import transformers as tf

    if cfg.experts or cfg.fused_qkv or cfg.fused_gate_up or cfg.qk_norm:
        raise ValueError("write_llama_config: a plain Llama shape only (no experts, fused tensors or qk-norm)")
    tf.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                   num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                   intermediate_size=cfg.inter, max_position_embeddings=256, rms_norm_eps=1e-6,
                   tie_word_embeddings=cfg.tie, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
                   torch_dtype="bfloat16").save_pretrained(out_dir)
    return out_dir


def _exact(check: Any, version: int) -> bool:
    return (isinstance(check, dict) and check.get("compared", 0) > 0 and check.get("n_mismatched") == 0
            and check.get("digest") == check.get("fresh_digest") and check.get("weight_version") == str(version))


def _run_pass(*, delta: bool, versions: int, weights: Callable[[int], tuple[dict, str]], ckpt0: str,
              replicas: int, tp: int, transport: str, timeout_s: float, log: Callable[[str], None],
              fresh_engine_at_end: bool) -> list[dict[str, Any]]:
    """One transfer group: versions 1..``versions``; ``weights(v)`` -> (served tensors, checkpoint of them)."""
    from ..testing.harness.vllm_replica import VllmEngine, check_against_fresh, parallel
    from ..engine.producer.producer import Producer, ProducerConfig
    from ..verify.checkpoints import load_checkpoint
    from ..source import ModuleSource

    live = load_checkpoint(ckpt0)  # the source's tensors (the engines' start-up weights), updated in place
    token = secrets.token_hex(16)
    producer = Producer(ModuleSource(live), ProducerConfig(
        rank=0, n_producers=1, n_consumers=replicas * tp, token=token, transport=transport, delta=delta,
        timeout_s=timeout_s, init_timeout_s=max(600.0, timeout_s)))
    engines: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        for i in range(replicas):  # one at a time into the list: a failed start still closes the ones before
            engines.append(VllmEngine(ckpt0, name=f"{'delta' if delta else 'dense'}{i}", tp=tp,
                                      coordinator=list(producer.address), token=token, transport=transport,
                                      timeout_s=timeout_s, connect=False, delta=delta))
        parallel([producer.init, *[e.init for e in engines]])
        for v in range(1, versions + 1):
            served, ckpt = weights(v)
            with torch.no_grad():
                for n, t in served.items():
                    live[n].copy_(t)
            t0 = time.perf_counter()
            res = parallel([lambda: producer.sync(v), *[lambda e=e: e.sync(v) for e in engines]])
            seconds = time.perf_counter() - t0
            prod, got = res[0], res[1:]
            errors = [g["error"] for g in got if not g["ok"]]
            if errors:
                raise RuntimeError(f"{'delta' if delta else 'dense'} sync v{v} failed: {errors[0]}")
            checks = [e.check_fresh_load(ckpt) for e in engines]
            exact = all(_exact(c, v) for c in checks)
            row = {"version": v, "seconds": round(seconds, 4), "wire_bytes": sum(g["wire_bytes"] for g in got),
                   "applied_bytes": sum(g["bytes_received"] for g in got), "exact": exact,
                   "held_bytes": _sum(g.get("delta_held_bytes") for g in got),
                   "live_bytes": _sum(g.get("delta_live_bytes") for g in got),
                   "producer_history_bytes": prod.get("delta_history_bytes"),  # the trainer's delta memory
                   "producer_delta_offered": prod.get("delta_offered"),
                   "producer_delta_payload_bytes": prod.get("delta_payload_bytes"),
                   "producer_ring_bytes": prod.get("ring_bytes"),  # its dense slots and their delta areas
                   "producer_delta_area_bytes": prod.get("delta_area_bytes"),
                   "producer_delta_area_need_bytes": prod.get("delta_area_need_bytes")}
            if fresh_engine_at_end and v == versions:
                ok, bad, n = check_against_fresh(engines, served, tag="-delta" if delta else "-dense")
                row.update(fresh_engine_exact=ok, fresh_engine_compared=n, fresh_engine_differs=bad[:5])
                row["exact"] = exact and ok
            rows.append(row)
            log(f"  {'delta' if delta else 'dense'} v{v}: {row['wire_bytes'] / 1e6:.3f} MB read, "
                f"{seconds:.3f} s, exact={row['exact']}")
    finally:
        for e in engines:
            e.close()
        producer.close()
    return rows


def _sum(xs: Any) -> int | None:
    got = list(xs)
    return None if None in got else sum(got)


def run_bench_delta(*, params: float | None = None, syncs: int = 4, lr: float = 1e-6, replicas: int = 1, tp: int = 1,
                    transport: str = "tcp", seed: int = 0, timeout_s: float = 300.0, fresh_engine: bool = True,
                    as_json: bool = False) -> dict[str, Any]:
    """Both passes (delta, then dense) over ``syncs + 1`` versions; the summary (also the ``--json`` line)."""
    t_all = time.perf_counter()
    cfg = bench_config(params)
    trainer = RateTrainer(cfg, lr=lr, seed=seed)
    work = tempfile.mkdtemp(prefix="shardsync-bench-delta-")
    versions = syncs + 1
    print(f"bench --delta: Llama-shaped policy, {trainer.params / 1e6:.1f} M parameters (hidden {cfg.hidden}, "
          f"{cfg.layers} layers, vocab {cfg.vocab}), fp32 master, AdamW lr {lr:g}, bf16 served; 1 producer -> "
          f"{replicas} vLLM engine(s) x TP{tp} over {transport}; {versions} versions (the first dense), each pass")
    from ..integrations.vllm.fresh_check import state_digest
    from ..verify.reference import save_checkpoint

    cfg_dir = write_llama_config(cfg, os.path.join(work, "config"))
    ckpts: dict[int, str] = {}
    meta: dict[int, dict[str, Any]] = {}
    prev: dict[str, torch.Tensor] | None = None

    def trained(v: int) -> tuple[dict, str]:  # the delta pass: train (after version 1), write the checkpoint
        nonlocal prev
        loss = trainer.step() if v > 1 else None
        served = trainer.served()
        ckpts[v] = save_checkpoint(served, cfg_dir, os.path.join(work, f"ckpt-v{v}"))
        meta[v] = {"loss": loss, "changed_fraction": None if prev is None else changed_fraction(served, prev),
                   "digest": state_digest(served)}
        prev = served
        return served, ckpts[v]

    def replayed(v: int) -> tuple[dict, str]:  # the dense pass: the same bytes, from the checkpoints
        from ..verify.checkpoints import load_checkpoint

        served = load_checkpoint(ckpts[v])
        if state_digest(served) != meta[v]["digest"]:
            raise RuntimeError(f"checkpoint of version {v} does not hold the weights the delta pass served")
        return served, ckpts[v]

    try:
        trained(1)  # the engines start on version 1's checkpoint (a vLLM engine needs weights to start)
        common = dict(versions=versions, ckpt0=ckpts[1], replicas=replicas, tp=tp, transport=transport,
                      timeout_s=timeout_s, log=print)
        pd = _run_pass(delta=True, weights=lambda v: replayed(1) if v == 1 else trained(v),
                       fresh_engine_at_end=fresh_engine, **common)
        pn = _run_pass(delta=False, weights=replayed, fresh_engine_at_end=False, **common)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda rows, k: round(statistics.median(r[k] for r in rows[1:]), 4)  # noqa: E731
    fracs = [meta[v]["changed_fraction"] for v in range(2, versions + 1)]
    out = {"syncs": syncs, "dense_bytes": med(pn, "wire_bytes"), "delta_bytes": med(pd, "wire_bytes"),
           "changed_fraction": round(statistics.median(fracs), 6) if fracs else None,
           "seconds_dense": med(pn, "seconds"), "seconds_delta": med(pd, "seconds"),
           "exact": all(r["exact"] for r in pd + pn)}
    detail = {"params": trainer.params, "hidden": cfg.hidden, "layers": cfg.layers, "vocab": cfg.vocab, "lr": lr,
              "replicas": replicas, "tp": tp, "transport": transport,
              "first_sync_bytes": {"dense": pn[0]["wire_bytes"], "delta": pd[0]["wire_bytes"]},
              "bytes_ratio": round(out["dense_bytes"] / max(out["delta_bytes"], 1), 2),
              "changed_fraction_per_sync": [round(f, 6) for f in fracs],
              "losses": [meta[v]["loss"] for v in range(2, versions + 1)],
              "delta": pd, "dense": pn, "seconds": round(time.perf_counter() - t_all, 1)}
    print(f"after the first sync (medians of {syncs}): {out['changed_fraction']:.4%} of elements changed; dense "
          f"{out['dense_bytes'] / 1e6:.3f} MB in {out['seconds_dense']:.3f} s, delta {out['delta_bytes'] / 1e6:.3f} "
          f"MB in {out['seconds_delta']:.3f} s ({detail['bytes_ratio']}x fewer bytes); every sync equal to a fresh "
          f"load: {'yes' if out['exact'] else 'NO'}")
    if as_json:
        emit_json({**out, **detail})  # one line: the summary's fields first, then the detail
    return {**out, **detail}
