"""How much of a bf16 policy an RL-rate optimizer step changes, and what delta sync would send for it.

A reference trainer: a Llama-shaped model of the zoo (``ZooConfig``; HF checkpoint names, GQA, SwiGLU, RoPE,
RMSNorm, untied head) with **fp32 master weights** (normal(0, 0.02) init, norms 1), **AdamW at lr 1e-6**
(weight decay 0.01), on a toy objective (next-token cross-entropy on fresh synthetic sequences each step), serving
**bf16** weights. Every step the served weights are packed exactly as a producer packs them — the consumers' plans
recorded by the real recorder on the zoo's vLLM-semantics loaders, ``layout_group`` chunks, ``GroupPacker`` — and
each chunk goes through the delta path: ``DeltaHistory.encode`` on the producer side (against the chunk's bytes
of the previous version; the first sync is dense), ``DeltaHistory.apply`` on a consumer-side copy (validated,
checksum-checked), then that copy is compared with the dense chunk, byte for byte. The engine is not involved::

    python -m shardsync.programs.delta_probe --json                    # tiny, a few seconds
    python -m shardsync.programs.delta_probe --params 300e6 --json     # a few hundred million parameters (minutes)

Per step: the fraction of bf16 elements that changed, dense bytes vs delta bytes (payloads + headers) of the sync,
encode / apply seconds. The last line (``--json``) holds the medians over the syncs after the first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from ..verify.output import emit_json, json_mode
from .sim_models import zoo_metadata
from ..delta import codec
from ..delta.history import DeltaHistory
from ..plan.pack import GroupPacker, layout_group
from ..plan.record import record_plan
from ..testing.zoo import ZooConfig, ZooModel, hf_shapes

__all__ = ["config_for", "RateTrainer", "changed_fraction", "run_probe", "main"]


def config_for(params: float | None) -> ZooConfig:
    """Tiny by default; else a Llama shape (head_dim 64, GQA 4:1, SwiGLU 8/3, vocab 32000) near ``params``."""
    if not params:
        return ZooConfig.llama_tiny(vocab=256, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=384)
    vocab = 32000
    hidden = next((h for h in (256, 512, 768, 1024, 1536, 2048, 3072, 4096) if 24 * 12 * h * h + 2 * vocab * h >= params),
                  4096)
    heads = hidden // 64
    kv = max(1, heads // 4)
    inter = max(128, round(8 * hidden / 3 / 128) * 128)
    layer = 2 * hidden * hidden + 2 * hidden * kv * 64 + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / layer))
    return ZooConfig.llama_tiny(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=64,
                                inter=inter)


def init_master(cfg: ZooConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32 master weights with HF names: normal(0, 0.02), norms 1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        t = torch.ones(shape) if "norm" in name else torch.randn(*shape, generator=g) * 0.02
        out[name] = t.requires_grad_(True)
    return out


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def forward(w: dict[str, torch.Tensor], cfg: ZooConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a Llama decoder over the HF-named tensors ``w`` (tokens: [batch, seq])."""
    B, T = tokens.shape
    hd, H, KV = cfg.head_dim, cfg.heads, cfg.kv_heads
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float32), freq)
    cos, sin = ang.cos(), ang.sin()
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * hd)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        g = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + g @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def toy_batch(cfg: ZooConfig, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Sequences t, t+s, t+2s, ... (mod vocab) from a random start and stride: a pattern the model can learn."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % cfg.vocab


class RateTrainer:
    """The reference trainer: fp32 master weights (:func:`init_master`), AdamW at ``lr`` (weight decay 0.01) on
    :func:`toy_batch` sequences, bf16 served. Deterministic for a seed (CPU)."""

    def __init__(self, cfg: ZooConfig, *, lr: float = 1e-6, seed: int = 0, batch: int = 4, seq: int = 32):
        torch.manual_seed(seed)
        self.cfg, self.seed, self.batch, self.seq = cfg, seed, batch, seq
        self.master = init_master(cfg, seed)
        self.params = sum(t.numel() for t in self.master.values())
        self.opt = torch.optim.AdamW(list(self.master.values()), lr=lr, weight_decay=0.01)
        self.steps = 0

    def step(self) -> float:
        """One optimizer step; its loss."""
        self.steps += 1
        cfg = self.cfg
        tokens = toy_batch(cfg, self.steps, self.batch, self.seq, self.seed)
        logits = forward(self.master, cfg, tokens[:, :-1])
        lo = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        lo.backward()
        self.opt.step()
        return float(lo.detach())

    def served(self) -> dict[str, torch.Tensor]:
        """The bf16 weights an engine serves now (fresh tensors)."""
        with torch.no_grad():
            return {n: t.detach().to(torch.bfloat16) for n, t in self.master.items()}


def changed_fraction(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """Fraction of the bf16 elements whose bits differ."""
    diff = sum(int((new[n].view(torch.int16) != old[n].view(torch.int16)).sum()) for n in new)
    return diff / sum(t.numel() for t in new.values())


class Consumers:
    """The packed side: each TP rank's plan (real recorder, zoo loaders on the meta device), its chunk layouts and
    packers, one group buffer each (allocated once, zeroed: alignment gaps hold no stale bytes)."""

    def __init__(self, cfg: ZooConfig, tp: int, max_chunk_bytes: int):
        metas = zoo_metadata(cfg)
        self.units: list[tuple[tuple[str, str, int], GroupPacker, torch.Tensor, Any]] = []
        self.layouts: dict[str, dict[str, Any]] = {}
        for r in range(tp):
            with torch.device("meta"):
                model = ZooModel(cfg, tp_size=tp, tp_rank=r)
            plan = record_plan(metadata=metas, load_weights=model.load_weights,
                               params=dict(model.named_parameters()), consumer=f"tp{r}", rank=r)
            lays = self.layouts.setdefault(plan.digest, {})
            for g in plan.groups:
                lay = lays[g.name] = layout_group(g, max_chunk_bytes=max_chunk_bytes)
                packer, buf = GroupPacker(g, lay), torch.zeros(lay.nbytes, dtype=torch.uint8)
                for c in lay.chunks:
                    self.units.append(((plan.digest, g.name, c.index), packer, buf, c))

    def pack(self, served: dict[str, torch.Tensor]) -> None:
        done: set[int] = set()
        for _, packer, buf, _ in self.units:
            if id(buf) not in done:
                packer.pack(served, buf)
                done.add(id(buf))

    def chunks(self):
        for key, _, buf, c in self.units:
            yield key, buf[c.start: c.start + c.nbytes]


def run_probe(*, params: float | None = None, steps: int = 6, lr: float = 1e-6, tp: int = 1, batch: int = 4,
              seq: int = 32, chunk_mib: float = 16, seed: int = 0, as_json: bool = False) -> dict[str, Any]:
    t_all = time.perf_counter()
    cfg = config_for(params)
    trainer = RateTrainer(cfg, lr=lr, seed=seed, batch=batch, seq=seq)
    n_params = trainer.params
    side = Consumers(cfg, tp, int(chunk_mib * (1 << 20)))
    sizes = {k: c.numel() for k, c in side.chunks()}
    need = sum((n + 63) // 64 * 64 for n in sizes.values())
    producer = DeltaHistory(sizes, budget_bytes=need)   # no journal room: a rolled-back chunk would go dense
    consumer = DeltaHistory(sizes, budget_bytes=need)
    print(f"delta probe: {n_params / 1e6:.1f} M parameters (hidden {cfg.hidden}, {cfg.layers} layers, vocab "
          f"{cfg.vocab}), AdamW lr {lr:g}, bf16 served; {tp} plan(s), {len(sizes)} chunks, {need / 1e6:.1f} MB packed")
    rows: list[dict[str, Any]] = []
    prev: dict[str, torch.Tensor] | None = None
    exact = True
    for step in range(steps + 1):  # version 0: the initial weights (a dense sync); then one per optimizer step
        loss = trainer.step() if step else None
        served = trainer.served()
        changed = None if prev is None else changed_fraction(served, prev)
        prev = served
        side.pack(served)
        enc_s = app_s = 0.0
        wire, dense_b, kinds = 0, 0, Counter()
        producer.begin(step)
        consumer.begin(step)
        for key, chunk in side.chunks():
            t = time.perf_counter()
            enc = producer.encode(key, chunk, checksum=True)
            enc_s += time.perf_counter() - t
            payload = enc.payload.clone() if enc.payload.data_ptr() == chunk.data_ptr() else enc.payload  # "sent"
            hdr = codec.read_header(codec.header_bytes(enc.header), nbytes=chunk.numel())
            t = time.perf_counter()
            held = consumer.apply(key, codec.Encoded(hdr, payload))
            app_s += time.perf_counter() - t
            exact = exact and torch.equal(held, chunk)
            wire += enc.wire_nbytes
            dense_b += chunk.numel()
            kinds[enc.header.kind] += 1
        producer.commit(step)
        consumer.commit(step)
        row = {"step": step, "loss": None if loss is None else round(loss, 4),
               "changed_fraction": None if changed is None else round(changed, 6), "dense_bytes": dense_b,
               "delta_bytes": wire, "encode_s": round(enc_s, 4), "apply_s": round(app_s, 4), "kinds": dict(kinds)}
        rows.append(row)
        print(f"  step {step}: loss {row['loss']}, changed {'-' if changed is None else f'{changed:.4%}'}, "
              f"{dense_b / 1e6:.2f} MB dense -> {wire / 1e6:.3f} MB ({dense_b / max(wire, 1):.1f}x), encode "
              f"{enc_s:.3f} s, apply {app_s:.3f} s, {dict(kinds)}")
    after = rows[1:]
    med = lambda k: statistics.median(r[k] for r in after) if after else None  # noqa: E731
    dense_m, delta_m = med("dense_bytes"), med("delta_bytes")
    enc_m, app_m = med("encode_s"), med("apply_s")
    out = {
        "params": n_params, "hidden": cfg.hidden, "layers": cfg.layers, "vocab": cfg.vocab, "steps": steps,
        "lr": lr, "optimizer": "AdamW(wd=0.01), fp32 master, bf16 served", "objective": "toy next-token CE",
        "tp": tp, "chunks": len(sizes), "chunk_bytes_max": max(sizes.values()),
        "source": f"packed chunks of {len(side.layouts)} recorded zoo plan(s) (TP={tp})",
        "changed_fraction": med("changed_fraction"),
        "changed_fraction_per_step": [r["changed_fraction"] for r in after],
        "first_sync_bytes": rows[0]["delta_bytes"], "dense_bytes": dense_m, "delta_bytes": delta_m,
        "bytes_ratio": round(dense_m / delta_m, 2) if after else None,
        "encode_gbps": round(dense_m / enc_m / 1e9, 3) if after and enc_m else None,
        "apply_gbps": round(dense_m / app_m / 1e9, 3) if after and app_m else None,
        "exact": exact, "seconds": round(time.perf_counter() - t_all, 2),
    }
    if after:
        print(f"median after the first sync: {out['changed_fraction']:.4%} of elements changed; "
              f"{dense_m / 1e6:.2f} MB dense vs {delta_m / 1e6:.3f} MB delta ({out['bytes_ratio']}x); exact={exact}")
    if as_json:
        emit_json(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardsync.programs.delta_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=None, help="target parameter count (e.g. 300e6); tiny if unset")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps (syncs after the first)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--tp", type=int, default=1, help="consumer TP ranks (one plan each)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--chunk-mib", type=float, default=16, help="largest chunk (the engine's max_chunk_bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="the summary as one JSON line on stdout (the rest: stderr)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.tp < 1 or (a.params is not None and not math.isfinite(a.params)):
        ap.error("--steps and --tp must be >= 1, --params finite")
    with json_mode(a.json):
        r = run_probe(params=a.params, steps=a.steps, lr=a.lr, tp=a.tp, batch=a.batch, seq=a.seq,
                      chunk_mib=a.chunk_mib, seed=a.seed, as_json=a.json)
    return 0 if r["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
