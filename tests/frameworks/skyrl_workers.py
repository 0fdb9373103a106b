"""Ray actors for the SkyRL test: SkyRL's own trainer ``Worker`` (its constructor and ``init_weight_sync_state``
run unchanged) around a tiny Llama, and an inference engine that receives the way SkyRL's vLLM ``WorkerWrap`` does.

What stands in, and why:
- ``Trainer.broadcast_to_inference_engines`` is SkyRL's FSDP worker's method with its ``FSDPWeightExtractor``'s
  one-chunk-per-parameter path written out: ``skyrl_train.workers.fsdp.fsdp_worker`` imports ``flash_attn`` (a
  CUDA-only build) at module level. The model is replicated on both ranks (``state_dict`` of plain tensors: the
  extractor's gather is then the identity).
- ``Engine`` is an ``InferenceEngineInterface`` whose weight calls are ``WorkerWrap``'s
  (``init_weight_update_communicator``: the pickled init info, ``strategy_type().create_receiver``; ``load_weights``:
  every pair of ``receive_weights`` collected). SkyRL's ``VLLMInferenceEngine`` targets vLLM 0.11 and does not
  import on vLLM 0.32 (``vllm.entrypoints.openai.serving_chat``); its next step, ``model.load_weights`` on the
  collected pairs, is SkyRL's code, unchanged by shardsync. The engine keeps a copy of what it received.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

import shardsync.integrations.skyrl as skyrl

skyrl.ray_compat()

from skyrl_train.inference_engines.base import InferenceEngineInterface  # noqa: E402
from skyrl_train.weight_sync import WeightChunk  # noqa: E402
from skyrl_train.workers.worker import Worker  # noqa: E402


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def weights_at(step: int) -> dict[str, torch.Tensor]:
    """The model after ``step`` optimizer steps: the same on every rank, different every step."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype), alpha=0.01 * step)
    return {k: v.clone() for k, v in model.state_dict().items()}


class Trainer(Worker):
    def __init__(self, cfg: Any, world_size: int, rank: int, master_addr: str, master_port: int) -> None:
        super().__init__(cfg, world_size, rank, 0, master_addr, master_port, 1)

    def init_model(self) -> str:
        torch.distributed.init_process_group("gloo")
        self.model = tiny_llama()
        return type(self._transfer_strategy_cls).__name__ + ":" + self._transfer_strategy_cls.__name__

    def set_step(self, step: int) -> None:
        self.model.load_state_dict(weights_at(step))

    def extract_weights(self, dtype: torch.dtype):
        for name, param in self.model.state_dict().items():  # FSDPWeightExtractor, group_by_module=False
            tensor = param.to(dtype).detach().contiguous()
            yield WeightChunk(names=[name], dtypes=[str(dtype)], shapes=[list(tensor.shape)], tensors=[tensor])

    async def broadcast_to_inference_engines(self, inference_engine_client: Any) -> None:
        await self._weight_transfer_sender.send_chunks(self.extract_weights(torch.bfloat16))

    def sender_stats(self) -> dict[str, Any]:
        return dict(self._weight_transfer_sender.stats)


class Engine(InferenceEngineInterface):
    def __init__(self) -> None:
        self.receiver: Any = None
        self.received: dict[str, torch.Tensor] = {}
        self.updates = 0

    # ---------------------------------------------------------------- WorkerWrap's weight calls
    async def init_weight_update_communicator(self, init_info: Any) -> None:
        info = pickle.loads(pickle.dumps(init_info))  # as VLLMInferenceEngine → collective_rpc → WorkerWrap
        self.receiver = info.strategy_type().create_receiver(info)

    async def update_named_weights(self, request: Any) -> None:
        request = pickle.loads(pickle.dumps(request))
        weight_list = [(name, tensor) for name, tensor in self.receiver.receive_weights(request)]
        self.received = {name: tensor.clone() for name, tensor in weight_list}  # model.load_weights(weight_list)
        self.updates += 1

    def got(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.updates, self.received

    async def teardown(self) -> None:
        if self.receiver is not None:
            self.receiver.teardown()

    def tp_size(self) -> int:
        return 1

    def pp_size(self) -> int:
        return 1

    def dp_size(self) -> int:
        return 1

    # ---------------------------------------------------------------- generation: not what this test exercises
    async def generate(self, input_batch: Any) -> Any:
        raise NotImplementedError

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def reset_prefix_cache(self) -> None:
        return None

    async def abort_generation(self) -> None:
        return None
