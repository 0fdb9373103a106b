"""The demo's verifiable toy task and its GRPO-style objective (pure functions, unit-tested).

Tokens are the numbers ``0 .. vocab-1``. A prompt is ``prompt_len`` random numbers; the policy answers
with ``answer_len`` numbers, and each answer number scores if it is **greater than the prompt's last
number** — reward = the fraction that do (a random policy scores about one half; a policy that learned
the rule scores near 1). Several samples per prompt; a sample's advantage is its reward minus the mean of
its prompt's group, divided by the group's std (GRPO's group-relative advantage); the loss is
``-mean(advantage * log p(answer token))`` over every answer token (one on-policy step per batch, so the
importance ratio is 1 and there is nothing to clip).

    prompts = make_prompts(rng, 8, task)                       # [[17, 3, 29, 8], ...]
    r = rewards(prompts, answers, task)                        # [[0.67, 0.33, ...] per prompt]
    batch = make_batch(prompts, answers, r)                     # ids [N, P+A], adv [N]
    loss = grpo_loss(model, batch)                              # differentiable
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Task", "make_prompts", "score", "rewards", "advantages", "make_batch", "grpo_loss", "split_batch"]


@dataclass(frozen=True)
class Task:
    vocab: int = 64
    prompt_len: int = 4
    answer_len: int = 6

    def describe(self) -> str:
        return (f"answer {self.answer_len} numbers (0-{self.vocab - 1}), each greater than the last of the "
                f"{self.prompt_len} prompt numbers; reward = the fraction that are")


def make_prompts(rng: random.Random, n: int, task: Task) -> list[list[int]]:
    """``n`` prompts; the last number is drawn from the lower two thirds so that every prompt has an answer."""
    out = []
    for _ in range(n):
        p = [rng.randrange(task.vocab) for _ in range(task.prompt_len - 1)]
        out.append(p + [rng.randrange(2 * task.vocab // 3)])
    return out


def score(prompt: list[int], answer: list[int]) -> float:
    """The fraction of answer numbers greater than the prompt's last number (0 for an empty answer)."""
    return sum(a > prompt[-1] for a in answer) / len(answer) if answer else 0.0


def rewards(prompts: list[list[int]], answers: list[list[list[int]]]) -> list[list[float]]:
    """Per prompt, the reward of each of its sampled answers."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answer groups")
    return [[score(p, a) for a in group] for p, group in zip(prompts, answers)]


def advantages(group_rewards: list[float], eps: float = 1e-4) -> list[float]:
    """GRPO: (r - mean) / (std + eps) within one prompt's group (all zeros when every sample scored the same)."""
    t = torch.tensor(group_rewards, dtype=torch.float64)
    return ((t - t.mean()) / (t.std(unbiased=False) + eps)).tolist()


def make_batch(prompts: list[list[int]], answers: list[list[list[int]]], group_rewards: list[list[float]],
               task: Task) -> dict[str, torch.Tensor]:
    """One row per sample: ``ids`` = prompt + answer ``[N, P+A]``, ``adv`` ``[N]``."""
    ids, adv = [], []
    for p, group, rs in zip(prompts, answers, group_rewards, strict=True):
        for a, g in zip(group, advantages(rs), strict=True):
            if len(p) != task.prompt_len or len(a) != task.answer_len:
                raise ValueError(f"sample of prompt {p} answer {a}: expected {task.prompt_len} + {task.answer_len} "
                                 "tokens")
            ids.append(p + a)
            adv.append(g)
    return {"ids": torch.tensor(ids, dtype=torch.long), "adv": torch.tensor(adv, dtype=torch.float32),
            "prompt_len": torch.tensor(task.prompt_len)}


def split_batch(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s equal share of the rows (data parallel; the row count must divide evenly)."""
    n = batch["ids"].shape[0]
    if n % world:
        raise ValueError(f"{n} samples do not split evenly over {world} ranks")
    k = n // world
    return {"ids": batch["ids"][rank * k:(rank + 1) * k], "adv": batch["adv"][rank * k:(rank + 1) * k],
            "prompt_len": batch["prompt_len"]}


def grpo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``-mean(adv * log p(answer token | prefix))`` over every answer token of every row."""
    ids, adv, p = batch["ids"], batch["adv"], int(batch["prompt_len"])
    logits = model(input_ids=ids).logits[:, p - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1)
    return -(adv[:, None].to(logp.dtype) * logp).mean()
