"""Running the drafter on real prompts: timed generations and the speculative rounds they produce.

Shared by ``dspark generate``, ``dspark calibrate`` (STS needs fixed-length rounds, paper §3.2.1) and
``dspark bench``.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..decoding.stats import GenerationStats, full_rounds


@dataclass
class Run:
    """One timed ``generate`` call: new token ids, wall seconds, (speculative runs) round stats, and when each of
    the target's forward passes ran.

    Attributes:
        forward_ms: milliseconds of each target forward, in order: the prefill first, then one per decoding step
            (plain) or per round (speculative).
        step_ms: milliseconds from the start of one decoding forward to the start of the next (a plain decoding
            step, or a speculative round seen from the target: its forward, transformers' loop, the next planning
            and drafting); the prefill and the last step are not in it.
    """

    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None
    forward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


_ACTIVE_CLOCKS = contextvars.ContextVar("forward_clocks", default=())  # the ForwardClocks entered in this context


class ForwardClock:
    """Notes when each forward of ``model`` starts and ends (forward hooks, removed on exit), for
    :attr:`Run.forward_ms` and :attr:`Run.step_ms`: two clock reads per forward, the same for every method timed.
    Only the forwards run in the context that entered it count (its thread or greenlet: another run may share the
    model, :func:`~dspark_hf.bench.lockstep.run_lockstep`)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.starts, self.ends, self._handles, self._token = model, [], [], [], None

    def __enter__(self) -> ForwardClock:
        self._token = _ACTIVE_CLOCKS.set((*_ACTIVE_CLOCKS.get(), self))

        def note(times):
            return lambda *_: times.append(time.perf_counter()) if self in _ACTIVE_CLOCKS.get() else None

        self._handles = [self.model.register_forward_pre_hook(note(self.starts)),
                         self.model.register_forward_hook(note(self.ends))]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        _ACTIVE_CLOCKS.reset(self._token)

    @property
    def forward_ms(self) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(self.starts, self.ends)]

    @property
    def step_ms(self) -> list[float]:
        return [1e3 * (b - a) for a, b in zip(self.starts[1:], self.starts[2:])]


@torch.inference_mode()
def timed_generate(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, drafter=None,
                   streamer=None, seed: int = 0, **generate_kwargs) -> Run:
    """``target.generate`` on one chat-formatted prompt, with (``drafter`` given) or without DSpark.

    ``temperature`` 0 means greedy. Returns a :class:`Run` of the NEW tokens only, with the target's forward
    times (:class:`ForwardClock`).
    """
    ids = torch.tensor([prompt_ids], device=target.device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    if drafter is not None:
        generate_kwargs["assistant_model"] = drafter
    torch.manual_seed(seed)
    with ForwardClock(target) as clock:
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              streamer=streamer, **sampling, **generate_kwargs)
        seconds = time.perf_counter() - start
    stats = drafter.last_stats if drafter is not None else None
    return Run(tokens=out[0, ids.shape[1]:].tolist(), seconds=seconds, stats=stats, forward_ms=clock.forward_ms,
               step_ms=clock.step_ms)


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
        a, c = full_rounds([run.stats], gamma)
        confs.append(torch.tensor(c, dtype=torch.float32).reshape(-1, gamma))  # [N, γ]
        accepted.append(torch.tensor(a[:len(c)], dtype=torch.long))  # [N]; none without a confidence head
        runs.append(run)
    return torch.cat(confs), torch.cat(accepted), runs
