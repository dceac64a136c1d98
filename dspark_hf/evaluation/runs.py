"""Running the drafter on real prompts: timed generations and the speculative rounds they produce.

Shared by ``dspark generate``, ``dspark calibrate`` (STS needs fixed-length rounds, paper §3.2.1) and
``dspark bench``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..decoding.candidate_generator import GenerationStats


@dataclass
class Run:
    """One timed ``generate`` call: new token ids, wall seconds and (speculative runs) round stats."""

    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


@torch.inference_mode()
def timed_generate(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, drafter=None,
                   streamer=None, seed: int = 0, **generate_kwargs) -> Run:
    """``target.generate`` on one chat-formatted prompt, with (``drafter`` given) or without DSpark.

    ``temperature`` 0 means greedy. Returns a :class:`Run` of the NEW tokens only.
    """
    ids = torch.tensor([prompt_ids], device=target.device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    if drafter is not None:
        generate_kwargs["assistant_model"] = drafter
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, streamer=streamer,
                          **sampling, **generate_kwargs)
    seconds = time.perf_counter() - start
    stats = drafter.last_stats if drafter is not None else None
    return Run(tokens=out[0, ids.shape[1]:].tolist(), seconds=seconds, stats=stats)


def collect_rounds(target, drafter, prompts: list[list[int]], max_new_tokens: int = 128,
                   temperature: float = 0.0, block_size: int | None = None, progress: bool = True):
    """Fixed-length speculative rounds on chat-formatted ``prompts`` (token ids; every draft is
    verified, so every label is seen).

    Returns ``(confidences [N, γ], accepted [N], runs)``; ``accepted`` counts drafts, bonus excluded.
    """
    gamma = block_size or drafter.config.block_size
    confs, accepted, runs = [], [], []
    for prompt in tqdm(prompts, desc="speculative rounds", disable=not progress):
        run = timed_generate(target, prompt, max_new_tokens, temperature, drafter,
                             dspark_verification="fixed", dspark_block_size=gamma, dspark_lookup=False)
        c, a = run.stats.full_rounds()
        confs.append(c)
        accepted.append(a)
        runs.append(run)
    return torch.cat(confs), torch.cat(accepted), runs
