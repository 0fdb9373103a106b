"""vLLM-semantics parallel layers: parameters of the local shard plus a ``weight_loader`` each.

Loaders only narrow / select / transpose / chunk the checkpoint tensor and ``copy_`` it into a
region of a parameter — what vLLM's loaders do — so a recording tensor can plan them.
"""

from __future__ import annotations

import torch
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class Replicated(nn.Module):
    """A tensor every rank keeps whole (norms, router gate)."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(*shape, dtype=dtype)

    @staticmethod
    def weight_loader(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)


class ColumnParallel(nn.Module):
    """Output dim split across TP ranks."""

    def __init__(self, in_f: int, out_f: int, *, tp_size: int, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        assert out_f % tp_size == 0, (out_f, tp_size)
        self.tp_size, self.tp_rank, self.out_per = tp_size, tp_rank, out_f // tp_size
        self.weight = _param(self.out_per, in_f, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w.narrow(0, self.tp_rank * self.out_per, self.out_per))


class RowParallel(nn.Module):
    """Input dim split across TP ranks."""

    def __init__(self, in_f: int, out_f: int, *, tp_size: int, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        assert in_f % tp_size == 0, (in_f, tp_size)
        self.tp_rank, self.in_per = tp_rank, in_f // tp_size
        self.weight = _param(out_f, self.in_per, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w.narrow(1, self.tp_rank * self.in_per, self.in_per))


class QKVParallel(nn.Module):
    """Fused q/k/v projection; KV heads replicated when there are fewer of them than TP ranks."""

    def __init__(self, hidden: int, head_dim: int, n_heads: int, n_kv: int, *, tp_size: int, tp_rank: int,
                 dtype: torch.dtype):
        super().__init__()
        assert n_heads % tp_size == 0 and (n_kv % tp_size == 0 or tp_size % n_kv == 0)
        self.hd, self.nh, self.nkv = head_dim, n_heads, n_kv
        self.q_per = n_heads // tp_size
        self.kv_per = max(1, n_kv // tp_size)
        self.kv_rank = tp_rank // (tp_size // n_kv) if n_kv < tp_size else tp_rank
        self.tp_rank = tp_rank
        self.weight = _param((self.q_per + 2 * self.kv_per) * head_dim, hidden, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:  # one fused checkpoint tensor (Phi-3 style): split it, then load each part
            sizes = (self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd)
            for sid, part in zip("qkv", w.split(sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        q, kv = self.q_per * self.hd, self.kv_per * self.hd
        off, size, start = {"q": (0, q, self.tp_rank * q), "k": (q, kv, self.kv_rank * kv),
                            "v": (q + kv, kv, self.kv_rank * kv)}[shard]
        param.data.narrow(0, off, size).copy_(w.narrow(0, start, size))


class MergedColumnParallel(nn.Module):
    """Several column-parallel outputs stacked in one parameter (gate/up)."""

    def __init__(self, in_f: int, sizes: tuple[int, ...], *, tp_size: int, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        self.sizes, self.tp_size, self.tp_rank = sizes, tp_size, tp_rank
        self.weight = _param(sum(sizes) // tp_size, in_f, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:  # fused gate_up checkpoint
            for i, part in enumerate(w.split(self.sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        per = self.sizes[shard] // self.tp_size
        off = sum(self.sizes[:shard]) // self.tp_size
        param.data.narrow(0, off, per).copy_(w.narrow(0, self.tp_rank * per, per))


class VocabParallelEmbedding(nn.Module):
    """Vocab rows split across TP ranks after padding the vocab; padding rows are zero-filled."""

    def __init__(self, vocab: int, hidden: int, *, tp_size: int, tp_rank: int, dtype: torch.dtype, pad_to: int = 64):
        super().__init__()
        padded = -(-vocab // pad_to) * pad_to
        padded = -(-padded // tp_size) * tp_size
        self.rows = padded // tp_size
        self.start = min(tp_rank * self.rows, vocab)
        self.n = min(vocab - self.start, self.rows)
        self.weight = _param(self.rows, hidden, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor) -> None:
        if self.n:
            param.data[: self.n].copy_(w.narrow(0, self.start, self.n))
        param.data[self.n:].fill_(0)


class FusedMoE(nn.Module):
    """Experts stacked in ``w13_weight`` [E_local, 2I/tp, H] and ``w2_weight`` [E_local, H, I/tp].

    Under expert parallelism an ``expert_map`` sends other ranks' experts nowhere: they never
    reach ``copy_`` and so drop out of the plan."""

    def __init__(self, n_experts: int, hidden: int, inter: int, *, tp_size: int, tp_rank: int,
                 ep_size: int = 1, ep_rank: int = 0, dtype: torch.dtype):
        super().__init__()
        assert n_experts % ep_size == 0 and inter % tp_size == 0
        local = n_experts // ep_size
        self.expert_map = [-1] * n_experts
        for i in range(local):
            self.expert_map[ep_rank * local + i] = i
        self.tp_rank, self.i_per = tp_rank, inter // tp_size
        self.w13_weight = _param(local, 2 * self.i_per, hidden, dtype=dtype)
        self.w2_weight = _param(local, hidden, self.i_per, dtype=dtype)

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, expert: int, shard: str) -> None:
        local = self.expert_map[expert]
        if local < 0:
            return
        dst = param.data[local]
        if shard == "w2":
            dst.copy_(w.narrow(1, self.tp_rank * self.i_per, self.i_per))
        else:
            off = 0 if shard == "w1" else self.i_per
            dst.narrow(0, off, self.i_per).copy_(w.narrow(0, self.tp_rank * self.i_per, self.i_per))

    def load_fused(self, param: torch.Tensor, w: torch.Tensor, kind: str) -> None:
        """Llama-4 style fused 3-D checkpoints: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]."""
        for e, w_e in enumerate(w.unbind(0)):
            w_e = w_e.transpose(0, 1)
            if kind == "gate_up":
                gate, up = w_e.chunk(2, dim=0)
                self.weight_loader(param, gate, e, "w1")
                self.weight_loader(param, up, e, "w3")
            else:
                self.weight_loader(param, w_e, e, "w2")
