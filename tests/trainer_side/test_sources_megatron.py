"""Megatron TP·PP·EP(·ETP) weight source: the pure layout conversion (every rank of many layouts round-trips to
the exact HF tensors it holds), Megatron's fused layouts pinned on hand-made tensors, the source's checks, and
4 gloo processes (TP2×PP2 dense, EP2×PP2 MoE, TP2×EP2 with ETP on the TP group or its own, TP2×EP2 ETP1):
bit-exact HF tensors, one collective per held group, nothing gathered across PP or EP."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.errors import MetadataMismatch
from shardsync.sources.megatron import MegatronSource
from shardsync.sources.megatron_layout import (Item, MegatronConfig, MegatronParallel, hf_shapes, hf_to_megatron_shards,
                                               held_hf_names, local_shapes, megatron_to_hf, merge, padded_vocab, shard)
from shardsync.testing.zoo.zoo_models import ZooConfig, hf_state_dict

from helpers import run_rank_scripts, run_scenarios, scenario

WORLD = 4
LAUNCH_TIMEOUT_S = 55


def _cfg(zc: ZooConfig, **kw) -> MegatronConfig:
    return MegatronConfig.like(zc, dtype=zc.ckpt_dtype, **kw)


def _zoo(moe: bool, *, qk_norm: bool = False, tie: bool = False, layers: int = 4) -> ZooConfig:
    # 8 heads / 4 KV heads so that tp=4 divides; vocab 250 is not a multiple of anything used
    return ZooConfig(vocab=250, hidden=32, layers=layers, heads=8, kv_heads=4, head_dim=8, inter=48,
                     experts=4 if moe else 0, moe_inter=16, qk_norm=qk_norm, tie=tie)


def _expected_held(zc: ZooConfig, stage: range, first: bool, last: bool, experts: set[int] | None) -> set[str]:
    """HF names a rank holds, from first principles (not from the layout module)."""
    out = set()
    for n in hf_shapes(_cfg(zc)):
        parts = n.split(".")
        if n == "model.embed_tokens.weight":
            keep = first
        elif n in ("model.norm.weight", "lm_head.weight"):
            keep = last
        else:
            keep = int(parts[2]) in stage and (".experts." not in n or experts is None or int(parts[5]) in experts)
        if keep:
            out.add(n)
    return out


# ---- pure round trip ------------------------------------------------------------------------------------------
LAYOUTS = [(tp, pp, ep, etp, moe) for tp in (1, 2, 4) for pp in (1, 2) for moe in (False, True)
           for ep in ((1, 2) if moe else (1,)) for etp in ((1, 2) if moe else (1,))]


@pytest.mark.parametrize("variant", ["plain", "qk_tie", "qk_div1", "te_names_off"])
@pytest.mark.parametrize("tp,pp,ep,etp,moe", LAYOUTS)
def test_round_trip_every_rank(tp, pp, ep, etp, moe, variant):
    zc = _zoo(moe, qk_norm=variant != "plain", tie=variant == "qk_tie")
    cfg = _cfg(zc, make_vocab_size_divisible_by=1 if variant == "qk_div1" else 128,
               fused_norms=variant != "te_names_off")
    hf = hf_state_dict(zc, seed=tp * 100 + pp * 10 + ep + etp)
    assert set(hf) == set(hf_shapes(cfg))
    lps = (1, 3) if pp == 2 and tp == 2 else None                     # uneven stages too
    base = MegatronParallel(tp=tp, pp=pp, ep=ep, etp=etp, layers_per_stage=lps)
    coords = list(itertools.product(range(tp), range(pp), range(ep), range(etp)))
    shards = {c: hf_to_megatron_shards(hf, cfg, base.replace(tp_rank=c[0], pp_rank=c[1], ep_rank=c[2], etp_rank=c[3]))
              for c in coords}
    seen: dict[str, int] = {}
    for (t, p, e, x), local in shards.items():
        par = base.replace(tp_rank=t, pp_rank=p, ep_rank=e, etp_rank=x)
        assert {k: tuple(v.shape) for k, v in local.items()} == local_shapes(cfg, par)
        tp_peers = [shards[(r, p, e, x)] for r in range(tp)]
        etp_peers = [shards[(t, p, e, r)] for r in range(etp)] if etp > 1 else None
        got = megatron_to_hf(cfg, par, tp_peers, etp_peers)
        stage = par.stage_layers(zc.layers)
        experts = set(range(e * zc.experts // ep, (e + 1) * zc.experts // ep)) if moe else None
        assert set(got) == _expected_held(zc, stage, p == 0, p == pp - 1, experts) == set(held_hf_names(cfg, par))
        for n, v in got.items():
            assert v.dtype == hf[n].dtype and torch.equal(v, hf[n]), f"{n} on {par.where()}"
            seen[n] = seen.get(n, 0) + 1
        if p == 0:                                                     # vocab-parallel, zero-padded
            emb = local["embedding.word_embeddings.weight"]
            pv = padded_vocab(cfg, tp)
            assert pv % (cfg.make_vocab_size_divisible_by * tp) == 0 and pv >= zc.vocab and emb.shape[0] == pv // tp
            if t == tp - 1 and pv > zc.vocab:
                assert not emb[emb.shape[0] - (pv - zc.vocab):].any()
        if p == pp - 1:
            assert ("output_layer.weight" in local) == (not zc.tie or pp > 1)   # tied: Megatron's copy, pp > 1
    # every HF tensor is held by exactly the ranks that share it: TP (and ETP) peers; experts by one EP rank
    for n in hf:
        copies = tp * etp * (1 if ".experts." in n else ep)
        assert seen.get(n) == copies, (n, seen.get(n), copies)


def test_fused_qkv_interleaving_and_fc1_layout():
    # 4 q heads, 2 KV groups, head_dim 1, hidden 1: Megatron's per-group order [q0 q1 k0 v0 | q2 q3 k1 v1]
    cfg = MegatronConfig(vocab=4, hidden=1, layers=1, heads=4, kv_heads=2, head_dim=1, inter=4)
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    qkv = Item("x", "qkv", ("q", "k", "v"), "tp")
    full = shard(qkv, [q, k, v], cfg, MegatronParallel())
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    r1 = shard(qkv, [q, k, v], cfg, MegatronParallel(tp=2, tp_rank=1))
    assert r1.flatten().tolist() == [2, 3, 11, 21]
    fc1 = Item("y", "fc1", ("g", "u"), "tp")
    g, u = torch.arange(4.).view(4, 1), torch.arange(10., 14.).view(4, 1)
    parts = [shard(fc1, [g, u], cfg, MegatronParallel(tp=2, tp_rank=r)) for r in range(2)]
    assert [p.flatten().tolist() for p in parts] == [[0, 1, 10, 11], [2, 3, 12, 13]]     # [gate_r ; up_r]
    gm, um = merge(fc1, parts, cfg)
    assert torch.equal(gm, g) and torch.equal(um, u)


@settings(max_examples=40, deadline=None)
@given(ng=st.sampled_from([1, 2, 4, 8]), qpg=st.integers(1, 4), hd=st.integers(1, 5), hidden=st.integers(1, 6),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_qkv_round_trip_any_shape(ng, qpg, hd, hidden, tp):
    if ng % tp:
        tp = 1
    cfg = MegatronConfig(vocab=8, hidden=hidden, layers=1, heads=ng * qpg, kv_heads=ng, head_dim=hd, inter=tp)
    q, k, v = (torch.randn(n * hd, hidden) for n in (ng * qpg, ng, ng))
    it = Item("x", "qkv", ("q", "k", "v"), "tp")
    peers = [shard(it, [q, k, v], cfg, MegatronParallel(tp=tp, tp_rank=r)) for r in range(tp)]
    assert all(p.shape == ((qpg + 2) * hd * ng // tp, hidden) for p in peers)
    assert all(torch.equal(a, b) for a, b in zip(merge(it, peers, cfg), (q, k, v)))


def test_parallel_validation():
    cfg = _cfg(_zoo(True))
    with pytest.raises(ValueError, match="kv_heads=4 % tp=8"):
        hf_to_megatron_shards({}, cfg, MegatronParallel(tp=8))
    with pytest.raises(ValueError, match="experts=4 % ep=3"):
        MegatronParallel(ep=3).check(cfg)
    with pytest.raises(ValueError, match="tp_rank=2"):
        MegatronParallel(tp=2, tp_rank=2)
    with pytest.raises(ValueError, match="covers 3 layers"):
        MegatronParallel(pp=2, layers_per_stage=(1, 2)).stage_layers(4)
    assert MegatronParallel(pp=2, pp_rank=1, layers_per_stage=(1, 3)).stage_layers(4) == range(1, 4)


# ---- the source, one process ----------------------------------------------------------------------------------
def test_source_single_rank_ep_exact():
    zc = _zoo(True, qk_norm=True, layers=2)
    cfg, hf = _cfg(zc), hf_state_dict(zc, seed=7)
    par = MegatronParallel(ep=2, ep_rank=1)
    src = MegatronSource(hf_to_megatron_shards(hf, cfg, par), cfg, par, tp_group=None)
    metas = src.metadata()
    assert [m.name for m in metas] == list(hf) and all(tuple(m.shape) == tuple(hf[m.name].shape) for m in metas)
    assert [g[0] for g in src.groups()] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                            "model.layers.1.input_layernorm.weight", "model.norm.weight"]
    held = set(src.held_names())
    n_none = 0
    for names, ts in src.iter_groups():
        for n, t in zip(names, ts):
            if t is None:
                n_none += 1
                assert n not in held and ".experts." in n and int(n.split(".")[5]) < 2      # EP rank 0's experts
            else:
                assert n in held and torch.equal(t, hf[n]), n
    assert n_none == 2 * 2 * 3                                            # 2 layers × 2 experts × gate/up/down
    assert src.stats == {"collectives": 0, "gathered_bytes": sum(hf[n].numel() * 2 for n in held)}
    assert dict(src).keys() == {n for g in src.groups() for n in g}       # __iter__ covers groups() in order


def test_source_rejects_bad_local_state():
    zc = _zoo(False, layers=2)
    cfg, par = _cfg(zc), MegatronParallel(pp=2, pp_rank=1)
    local = hf_to_megatron_shards(hf_state_dict(zc), cfg, par)
    bad = dict(local)
    bad["decoder.layers.0.mlp.linear_fc2.weight"] = bad["decoder.layers.0.mlp.linear_fc2.weight"][:, :-1]
    with pytest.raises(MetadataMismatch, match=r"pp 1/2.*'decoder.layers.0.mlp.linear_fc2.weight' is "
                                               r"bfloat16\[32, 47\]"):
        MegatronSource(bad, cfg, par, tp_group=None)
    missing = {k: v for k, v in local.items() if k != "output_layer.weight"}
    with pytest.raises(MetadataMismatch, match="'output_layer.weight' is missing"):
        MegatronSource(missing, cfg, par, tp_group=None)
    with pytest.raises(MetadataMismatch, match="not in the Megatron layout"):
        MegatronSource({**local, "embedding.word_embeddings.weight": torch.zeros(1)}, cfg, par, tp_group=None)
    with pytest.raises(MetadataMismatch, match="float32"):
        MegatronSource({k: v.float() for k, v in local.items()}, cfg, par, tp_group=None)
    extra = {**local, "decoder.layers.0.self_attention.linear_qkv._extra_state": torch.zeros(0)}
    assert len(MegatronSource(extra, cfg, par, tp_group=None).groups()) == 2           # layer 1, post
    with pytest.raises(ValueError, match="tp=2 needs tp_group"):
        MegatronSource(hf_to_megatron_shards(hf_state_dict(zc), cfg, par.replace(tp=2)), cfg, par.replace(tp=2),
                       tp_group=None)


# ---- the source, 4 gloo processes -----------------------------------------------------------------------------
def _scenarios(r: int, groups: dict) -> list[tuple[str, ZooConfig, MegatronParallel, object, object]]:
    tp_g, tp_g2 = groups["tp"], groups["tp2"]                       # {0,1},{2,3} twice (distinct group objects)
    dense = _zoo(False, qk_norm=True, layers=3)
    moe = _zoo(True, qk_norm=True, layers=2)
    return [
        ("dense_tp2_pp2", dense, MegatronParallel(tp=2, pp=2, tp_rank=r % 2, pp_rank=r // 2, layers_per_stage=(2, 1)),
         tp_g, None),
        ("moe_ep2_pp2", moe, MegatronParallel(ep=2, pp=2, ep_rank=r % 2, pp_rank=r // 2), None, None),
        # Megatron's rank order: ETP fastest, so the ETP group {0,1},{2,3} is the TP group, EP {0,2},{1,3}
        ("moe_tp2_ep2_etp2_merged", moe, MegatronParallel(tp=2, ep=2, etp=2, tp_rank=r % 2, etp_rank=r % 2,
                                                          ep_rank=r // 2), tp_g, tp_g),
        ("moe_tp2_ep2_etp2_own_group", moe, MegatronParallel(tp=2, ep=2, etp=2, tp_rank=r % 2, etp_rank=r % 2,
                                                             ep_rank=r // 2), tp_g, tp_g2),
        # ETP 1: EP is fastest, so TP peers {0,1} hold different experts; only dense tensors cross TP
        ("moe_tp2_ep2_etp1", moe, MegatronParallel(tp=2, ep=2, tp_rank=r % 2, ep_rank=r % 2), tp_g, None),
    ]


def _run_scenario(zc: ZooConfig, par: MegatronParallel, tp_group, etp_group) -> dict:
    cfg, hf = _cfg(zc), hf_state_dict(zc, seed=11)
    src = MegatronSource(hf_to_megatron_shards(hf, cfg, par), cfg, par, tp_group=tp_group, etp_group=etp_group)
    yielded, mismatches, got = [], [], set()
    for names, ts in src.iter_groups():
        yielded.append(names)
        for n, t in zip(names, ts):
            if t is not None:
                got.add(n)
                if not (t.dtype == hf[n].dtype and torch.equal(t, hf[n])):
                    mismatches.append(n)
    held = sorted(src.held_names())
    return dict(yielded=yielded, groups=src.groups(), got=sorted(got), held=held, mismatches=mismatches,
                stats=src.stats, held_bytes=sum(hf[n].numel() * hf[n].element_size() for n in held),
                total_bytes=sum(t.numel() * t.element_size() for t in hf.values()))


def _worker(rank: int, port: int, outdir: str) -> None:
    import datetime

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    groups = {}
    for key in ("tp", "tp2"):
        for ranks in ([0, 1], [2, 3]):                                 # every rank creates every group, in order
            g = dist.new_group(ranks)
            if rank in ranks:
                groups[key] = g
    run_scenarios([(name, lambda a=(zc, par, tp_g, etp_g): _run_scenario(*a))
                   for name, zc, par, tp_g, etp_g in _scenarios(rank, groups)], rank, outdir)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_rank_scripts(__file__, WORLD, tmp_path_factory.mktemp("megatron"), LAUNCH_TIMEOUT_S, "Megatron")


def _check_exact(res: dict, r: int, expected_held: set[str]) -> None:
    assert set(res["held"]) == expected_held, (r, sorted(set(res["held"]) ^ expected_held)[:6])
    assert res["yielded"] == res["groups"] and res["got"] == res["held"]
    assert res["mismatches"] == [], f"rank {r}: not bit-exact: {res['mismatches']}"
    assert res["stats"]["gathered_bytes"] == res["held_bytes"] < res["total_bytes"]


@pytest.mark.procs
def test_dense_tp2_pp2(ranks):
    zc = _zoo(False, qk_norm=True, layers=3)
    for r, res in enumerate(scenario(ranks, "dense_tp2_pp2")):
        first = r // 2 == 0
        _check_exact(res, r, _expected_held(zc, range(0, 2) if first else range(2, 3), first, not first, None))
        assert len(res["groups"]) == (3 if first else 2)                # pre + 2 layers | layer 2 + post
        assert res["stats"]["collectives"] == len(res["groups"])        # one TP all-gather per group, none across PP


@pytest.mark.procs
def test_moe_ep2_pp2(ranks):
    zc = _zoo(True, qk_norm=True, layers=2)
    for r, res in enumerate(scenario(ranks, "moe_ep2_pp2")):
        e, first = r % 2, r // 2 == 0
        _check_exact(res, r, _expected_held(zc, range(0, 1) if first else range(1, 2), first, not first,
                                            {2 * e, 2 * e + 1}))
        assert len(res["groups"]) == 2
        assert res["stats"]["collectives"] == 0                         # tp = etp = 1: nothing crosses EP or PP
        other = {n for g in res["yielded"] for n in g} - set(res["held"])
        assert other and all(".experts." in n and int(n.split(".")[5]) // 2 != e for n in other)


@pytest.mark.parametrize("name,per_layer", [("moe_tp2_ep2_etp2_merged", 1), ("moe_tp2_ep2_etp2_own_group", 2),
                                            ("moe_tp2_ep2_etp1", 1)])
@pytest.mark.procs
def test_moe_tp2_ep2(ranks, name, per_layer):
    zc = _zoo(True, qk_norm=True, layers=2)
    for r, res in enumerate(scenario(ranks, name)):
        e = r % 2 if name.endswith("etp1") else r // 2
        _check_exact(res, r, _expected_held(zc, range(0, 2), True, True, {2 * e, 2 * e + 1}))
        assert len(res["groups"]) == 4
        assert res["stats"]["collectives"] == 2 + 2 * per_layer         # pre, post: 1; layers: TP (+ ETP)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
