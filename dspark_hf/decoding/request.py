"""One request of the concurrent engine (:class:`~dspark_hf.decoding.concurrent.ConcurrentDecoder`, issue #24): its
tokens, target KV cache, drafter context, round planner and statistics (:class:`Request`), and a batch's logits
processors seen from its row (:class:`RowOfBatch`)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence

import torch

from ..runtime.ragged import RequestKV
from .alone import AlonePlanner
from .calibration import CorrectedCalibration, OnlineCorrection
from .lookup_acceptance import lookup_prior
from .stats import GenerationStats
from .verification import POLICIES


def prompt_ids(prompt) -> list[int]:
    """One request's prompt as a list of token ids: a sequence of ints, or a 1-D integer tensor or array.

    Raises:
        ValueError: an empty prompt, or anything else (text, a bare int, floats, a 2-D tensor), naming the fix: a
            string of digits read as ids would silently decode another prompt.
    """
    values = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            isinstance(t, numbers.Integral) for t in values):
        raise ValueError(f"a prompt must be a sequence of token ids, got {type(prompt).__name__} {str(prompt)[:40]!r}: "
                         "tokenize it first (tok.apply_chat_template(chat, add_generation_prompt=True)['input_ids']), "
                         "and pass one list of ids per request (a single prompt as [ids]).")
    if not values:
        raise ValueError("a request needs at least one prompt token.")
    return [int(t) for t in values]


class Request:
    """One request of a :class:`~dspark_hf.decoding.concurrent.ConcurrentDecoder`: its tokens, target KV cache, drafter context and statistics.

    Attributes:
        index: the order it was added in.
        ids: prompt then generated token ids (host list; the last one is the anchor, not yet in the KV cache).
        prompt_length: tokens of the prompt.
        max_new_tokens: its token budget.
        stats: per-round statistics (:class:`GenerationStats`; ``new_tokens`` counts its tokens).
        planner / calibration: in the scheduled modes, its :class:`~dspark_hf.decoding.alone.AlonePlanner` (alone in
            flight) and the confidences its ℓ is planned on (the drafter's STS, then the planner's online
            correction); ``None`` otherwise.
        done: finished (EOS, budget or stop); its caches are released.
        added_s / finished_s: ``time.perf_counter()`` when it was added and when it finished (``None`` before).
    """

    def __init__(self, index: int, prompt: Sequence[int], max_new_tokens: int, num_layers: int, decoder,
                 padding: Sequence[int] = ()):
        """``decoder``: the engine it belongs to (its drafter, mode, sampling and lookup settings are read)."""
        self.index = index
        self.ids = list(prompt)  # checked and converted by ConcurrentDecoder.add (prompt_ids)
        self.prompt_length = len(self.ids)
        self.padding = [int(t) for t in padding]  # what logits processors and stop checks see before the prompt
        self.max_new_tokens = max_new_tokens
        self.kv: RequestKV | None = RequestKV(num_layers)
        self.context = decoder.drafter.new_context() if decoder.drafter is not None else None
        self.policy = POLICIES[decoder.mode]() if decoder.drafter is not None else None
        scheduled = decoder.drafter is not None and self.policy.needs_calibration  # alone in flight, it plans rounds
        calibration = decoder.drafter.calibration if scheduled else None
        prior = (lambda: lookup_prior(decoder.drafter, decoder.do_sample)) if decoder.lookup else None
        self.planner = AlonePlanner(calibration, OnlineCorrection(), prior) if scheduled else None
        # its ℓ is planned on the estimates its planner's Θ reads: calibrated, then corrected online (built once)
        self.calibration = CorrectedCalibration(calibration, self.planner.correction) if scheduled else None
        self.pending: list[torch.Tensor] = []  # target features [1, n, m·d] not yet in the drafter's context
        self.pending_tokens = 0  # Σ n over pending (kept with it: the gate reads it every step)
        self.processors = None  # its logits processors (set by ConcurrentDecoder.add)
        self.stats = GenerationStats(verification=decoder.mode if decoder.drafter is not None else "plain")
        self.done = False
        self.added_s, self.finished_s = time.perf_counter(), None

    @property
    def generated(self) -> list[int]:
        return self.ids[self.prompt_length:]

    @property
    def room(self) -> int:
        """Tokens it may still emit."""
        return self.max_new_tokens - len(self.generated)

    @property
    def catch_up_tokens(self) -> int:
        """Tokens its drafter context would catch up before its next drafts: its prompt, or the features of several
        steps (it did not draft in the last ones); 0 when only the last step's features wait (a drafting request's
        own extension, part of drafting) or without a drafter."""
        if self.pending and (len(self.pending) > 1 or self.context.length == 0):
            return self.pending_tokens
        return 0

    def keep_features(self, features: torch.Tensor) -> None:
        """Queue target features ``[1, n, m·d]`` of its accepted positions for its drafter's context."""
        self.pending.append(features)
        self.pending_tokens += features.shape[1]

    def take_features(self) -> torch.Tensor:
        """The queued features as one ``[1, Σn, m·d]`` tensor, in order; the queue is emptied.

        Raises:
            ValueError: nothing is queued.
        """
        if not self.pending:
            raise ValueError("Request.take_features: no features are queued.")
        features = torch.cat(self.pending, dim=1) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.pending_tokens = [], 0
        return features

    def release(self) -> None:
        """Free its KV cache and drafter context (a finished request costs nothing)."""
        self.kv, self.context, self.pending, self.pending_tokens, self.done = None, None, [], 0, True
        self.finished_s = time.perf_counter()


class RowOfBatch:
    """A batch's logits processors seen from one of its rows. Some keep per-row state shaped by the batch
    (transformers' repetition penalty keeps a ``prompt_ignore_length`` per row), so row ``row`` is run as row
    ``row`` of a batch of ``rows`` copies of itself and only that row is returned.

    Called as a processor: ``(input_ids [1, L], scores [1, V]) -> [1, V]``.
    """

    def __init__(self, processors, row: int, rows: int):
        self.processors, self.row, self.rows = processors, row, rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        batch = self.processors(input_ids.expand(self.rows, -1), scores.expand(self.rows, -1).clone())
        return batch[self.row:self.row + 1]

    def __len__(self) -> int:
        return len(self.processors)
