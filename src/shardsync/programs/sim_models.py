"""What the simulator models: the LLM (HF config -> metadata, meta-device consumers, plans) and the cluster.

``model_spec`` turns an HF ``config.json`` (a path, or the name of one shipped in
``shardsync/configs``) into the trainer's checkpoint metadata (names, full shapes, dtypes — no data)
and a factory for one inference rank's model with vLLM loader semantics, built on ``device="meta"``
(no memory). ``record_plans`` then runs the real recorder (:func:`shardsync.record.record_plan`) for
every *distinct* consumer: ranks with the same (TP size, TP rank, EP size, EP rank) build the same
model and so record the same plan (the same rank of different replicas, or DP ranks without EP).

Two recording modes, both the real recorder on the real loaders:

- ``full``: every checkpoint tensor goes through each distinct consumer's ``load_weights``
  (another EP rank's experts return before ``copy_`` and drop out). At trillion-parameter scale the
  plans are recorded by worker processes (``fork``), one per core.
- ``template`` (:mod:`shardsync.plan.template`): decoder layers whose checkpoint tensors *and* engine
  parameters have identical names (up to the layer index), shapes and dtypes form a class; only the first and the last layer of
  each class (plus everything outside the layers) are recorded, the other layers' groups are the
  first one's with the layer index moved. The last layer is the check: its recorded group must equal
  the moved copy of the first, else that consumer is recorded in full. The resulting plans equal the
  ``full`` ones digest for digest (tested), in a fraction of the time::

    spec = model_spec(load_config("kimi-k2"))
    plans = record_plans(spec, [(32, r, 32, r) for r in range(32)], mode="template")

:class:`Topology` holds the cluster: trainer TP/PP/DP/EP/ETP, inference TP/DP/EP and replicas, and
where every rank sits (rank arithmetic only; :mod:`shardsync.sim` derives ownership and costs).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..plan.record import record_plan
from ..plan.template import LayerIndex, record_templated
from ..types import ParamMeta, Plan
from ..testing.zoo import ZooConfig, ZooModel, hf_shapes
from ..testing.zoo.mla import MLAConfig, MLAModel, mla_metadata

__all__ = ["ConsumerKey", "ModelSpec", "Topology", "load_config", "model_spec", "expert_of", "record_plans",
           "zoo_metadata"]

ConsumerKey = tuple[int, int, int, int]
"""(TP size, TP rank, EP size, EP rank) of one inference rank: equal keys record equal plans."""

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_PARALLEL_MIN_WORK = 200_000
"""Consumers × tensors above which ``full`` recording uses one worker process per core."""


def load_config(config: str) -> dict[str, Any]:
    """An HF config dict from a JSON path, or from ``shardsync/configs/<config>.json``."""
    p = Path(config)
    if p.is_file():
        return json.loads(p.read_text())
    shipped = resources.files("shardsync").joinpath("configs", f"{config.removesuffix('.json')}.json")
    if not shipped.is_file():
        names = sorted(f.name.removesuffix(".json") for f in resources.files("shardsync").joinpath("configs").iterdir()
                       if f.name.endswith(".json"))
        raise FileNotFoundError(f"no config file {config!r} and no shipped config of that name (shipped: {names})")
    return json.loads(shipped.read_text())


def expert_of(name: str) -> int | None:
    """Routed-expert index of a checkpoint name (``…experts.7.down_proj…``), None for every other tensor."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def zoo_metadata(cfg: ZooConfig) -> list[ParamMeta]:
    """Checkpoint metadata of a zoo model (names and order of :func:`shardsync.testing.zoo.hf_state_dict`), no data."""
    return [ParamMeta(name=n, dtype=cfg.ckpt_dtype, shape=s) for n, s in hf_shapes(cfg).items()]


@dataclass(frozen=True)
class ModelSpec:
    """A model the simulator can plan: its checkpoint metadata and a consumer-model factory."""

    name: str
    arch: str
    cfg: MLAConfig | ZooConfig
    layers: int
    experts: int

    def metadata(self) -> list[ParamMeta]:
        return mla_metadata(self.cfg) if isinstance(self.cfg, MLAConfig) else zoo_metadata(self.cfg)

    def consumer(self, key: ConsumerKey, *, device: str = "meta") -> nn.Module:
        """One inference rank's model with vLLM loader semantics (parameters on ``device``)."""
        tp, tp_rank, ep, ep_rank = key
        cls = MLAModel if isinstance(self.cfg, MLAConfig) else ZooModel
        with torch.device(device):
            return cls(self.cfg, tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank)


def model_spec(hf: dict[str, Any], name: str = "") -> ModelSpec:
    """Map an HF config to a zoo model. Supported: DeepSeek-V2/V3 and Kimi-K2 (MLA), Qwen3-MoE,
    Mixtral, Llama / Mistral / Qwen3 dense."""
    arch = (hf.get("architectures") or [""])[0]
    name = name or hf.get("_name_or_path") or hf.get("model_type", arch)
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        cfg = MLAConfig.from_hf(hf)
        return ModelSpec(name, arch, cfg, cfg.layers, cfg.experts)
    heads = hf["num_attention_heads"]
    common = dict(vocab=hf["vocab_size"], hidden=hf["hidden_size"], layers=hf["num_hidden_layers"], heads=heads,
                  kv_heads=hf.get("num_key_value_heads", heads), head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                  inter=hf["intermediate_size"], tie=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
                  ckpt_dtype=dtype)
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{arch}: dense layers among MoE layers (mlp_only_layers / decoder_sparse_step) "
                             "are not modelled by the zoo")
        cfg = ZooConfig(**common, experts=hf["num_experts"], moe_inter=hf["moe_intermediate_size"], qk_norm=True)
    elif arch == "MixtralForCausalLM":
        cfg = ZooConfig(**common, experts=hf["num_local_experts"], moe_inter=hf["intermediate_size"],
                        moe_layout="mixtral")
    elif arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"):
        cfg = ZooConfig(**common, qk_norm=arch == "Qwen3ForCausalLM")
    else:
        raise ValueError(f"architecture {arch!r} is not modelled (supported: DeepseekV2/V3 (Kimi-K2), Qwen3Moe, "
                         "Mixtral, Llama, Mistral, Qwen3)")
    return ModelSpec(name, arch, cfg, cfg.layers, cfg.experts)


# ---------------------------------------------------------------------------------------------- recording
def _label(key: ConsumerKey) -> str:
    return f"tp{key[1]}of{key[0]}/ep{key[3]}of{key[2]}"


def _record(spec: ModelSpec, metas: Sequence[ParamMeta], key: ConsumerKey, mode: str,
            index: LayerIndex | None = None) -> Plan:
    model = spec.consumer(key)
    params = dict(model.named_parameters())
    if mode == "template":
        plan = record_templated(model.load_weights, params, metas, consumer=_label(key), rank=key[1],
                                index=index or LayerIndex(metas))
        if plan is not None:
            return plan
    return record_plan(metadata=metas, load_weights=model.load_weights, params=params, consumer=_label(key),
                       rank=key[1])


_JOB: dict[str, Any] = {}


def _work(key: ConsumerKey) -> bytes:
    return _record(_JOB["spec"], _JOB["metas"], key, _JOB["mode"]).to_json()


def record_plans(spec: ModelSpec, keys: Sequence[ConsumerKey], *, mode: str = "full",
                 metas: Sequence[ParamMeta] | None = None, workers: int | None = None) -> dict[ConsumerKey, Plan]:
    """The plan of every distinct consumer key (real recorder, meta-device models)."""
    if mode not in ("full", "template"):
        raise ValueError(f"recording mode must be 'full' or 'template', not {mode!r}")
    metas = list(metas if metas is not None else spec.metadata())
    keys = sorted(set(keys))
    n = min(len(keys), workers or os.cpu_count() or 1)
    if n > 1 and mode == "full" and len(keys) * len(metas) > _PARALLEL_MIN_WORK \
            and "fork" in mp.get_all_start_methods():
        import torch._dynamo  # noqa: F401  (the recorder's dispatch mode imports it: once, before forking)

        _JOB.update(spec=spec, metas=metas, mode=mode)  # inherited by the forked workers, never pickled
        try:
            with mp.get_context("fork").Pool(n) as pool:
                out = pool.map(_work, keys, chunksize=1)
        finally:
            _JOB.clear()
        plans = {k: Plan.from_json(b) for k, b in zip(keys, out)}
        for p in plans.values():
            p.verify_digest()
        return plans
    index = LayerIndex(metas) if mode == "template" else None
    return {k: _record(spec, metas, k, mode, index) for k in keys}


# ---------------------------------------------------------------------------------------------- cluster
def _parse(spec: str, allowed: tuple[str, ...], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, spec.replace(" ", "").lower().split(",")):
        m = re.fullmatch(r"([a-z]+)(\d+)", part)
        if not m or m.group(1) not in allowed or int(m.group(2)) < 1:
            raise ValueError(f"{what} spec {spec!r}: cannot read {part!r} (use {', '.join(a + 'N' for a in allowed)})")
        out[m.group(1)] = int(m.group(2))
    return out


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Trainer and inference parallelism plus placement; rank arithmetic only."""

    gpn: int
    trainer_nodes: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    itp: int
    idp: int
    iep: int
    replicas: int
    colocate: bool = False

    @classmethod
    def build(cls, *, trainer: str, inference: str, replicas: int, trainer_nodes: int, gpn: int, experts: int,
              colocate: bool = False) -> "Topology":
        t = _parse(trainer, ("tp", "pp", "ep", "etp", "dp"), "trainer")
        i = _parse(inference, ("tp", "dp", "ep"), "inference")
        world = trainer_nodes * gpn
        tp, pp, ep, etp = t.get("tp", 1), t.get("pp", 1), t.get("ep", 1), t.get("etp", 1)
        if world % (tp * pp):
            raise ValueError(f"trainer: {world} GPUs are not a multiple of TP{tp} x PP{pp}")
        dp = world // (tp * pp)
        if t.get("dp", dp) != dp:
            raise ValueError(f"trainer: {world} GPUs with TP{tp} x PP{pp} give DP{dp}, not DP{t['dp']}")
        if (ep > 1 or etp > 1) and (not experts or (tp * dp) % (ep * etp) or experts % ep):
            raise ValueError(f"trainer: EP{ep} x ETP{etp} must divide the {tp * dp} ranks of a PP stage and EP the "
                             f"{experts} experts")
        itp, idp, iep = i.get("tp", 1), i.get("dp", 1), i.get("ep", 1)
        if iep > 1 and (iep != itp * idp or not experts or experts % iep):
            raise ValueError(f"inference: vLLM's EP spans DP x TP: EP{iep} must equal {itp * idp} and divide the "
                             f"{experts} experts")
        top = cls(gpn=gpn, trainer_nodes=trainer_nodes, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, itp=itp, idp=idp,
                  iep=iep, replicas=replicas, colocate=colocate)
        if colocate and top.consumers > world:
            raise ValueError(f"colocated: {top.consumers} consumers do not fit on {world} trainer GPUs")
        return top

    @property
    def producers(self) -> int:
        return self.trainer_nodes * self.gpn

    @property
    def per_replica(self) -> int:
        return self.itp * self.idp

    @property
    def consumers(self) -> int:
        return self.replicas * self.per_replica

    @property
    def stage_size(self) -> int:
        return self.tp * self.dp

    def producer_node(self, p: int) -> int:
        return p // self.gpn

    def consumer_node(self, c: int) -> int:
        return (0 if self.colocate else self.trainer_nodes) + c // self.gpn

    def consumer_key(self, c: int) -> ConsumerKey:
        j = c % self.per_replica
        return (self.itp, j % self.itp, self.iep, j if self.iep > 1 else 0)

    def consumer_label(self, c: int) -> str:
        j = c % self.per_replica
        return f"r{c // self.per_replica}/" + (f"dp{j // self.itp}/" if self.idp > 1 else "") + f"tp{j % self.itp}"

    def describe(self) -> str:
        inf = "·".join(f"{k}{v}" for k, v in (("DP", self.idp), ("TP", self.itp), ("EP", self.iep)) if v > 1) or "TP1"
        return (f"trainer TP{self.tp}·PP{self.pp}·EP{self.ep}·ETP{self.etp} (DP{self.dp}) on {self.trainer_nodes} "
                f"nodes x {self.gpn} GPUs = {self.producers} producers; inference {self.replicas} replica(s) x {inf} = "
                f"{self.consumers} consumers on {math.ceil(self.consumers / self.gpn)} "
                f"{'trainer (colocated)' if self.colocate else 'inference'} node(s)")
