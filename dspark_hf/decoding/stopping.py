"""Stop strings and custom stopping criteria applied after EVERY token of a verified round, as plain ``generate``
stops: transformers' assisted loop only checks them per round, so the routing wraps them
(:class:`PerTokenStopping`), holds back the streamer (:class:`_StoppingStreamer`) and cuts the output at the
first stop (:func:`_cut_at_stop`)."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from .stats import GenerationStats

ROUND_EXACT_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)  # transformers trims a round at these


class PerTokenStopping(StoppingCriteriaList):
    """A call's stopping criteria applied after EVERY generated token, as plain ``generate`` applies them.

    transformers' assisted loop checks the criteria once per round on the whole sequence, so a stop string
    completed inside a verified block is missed (``StopStringCriteria`` only looks at the sequence's end).
    Here each prefix ``input_ids[:, :n]`` ending in one of the round's new tokens is checked in order and
    the first stopping length is kept in ``stop_length``; the caller cuts the output there. Rounds are
    verified in full first, so no admission depends on a draft's value and the cut is a function of the
    emitted tokens only: the output law is plain generate's (Leviathan et al. 2023; paper Appendix A).

    Args:
        criteria: the call's ``StoppingCriteriaList``.
        prompt_length: length of ``input_ids`` when decoding starts (nothing before it is checked).
    """

    def __init__(self, criteria, prompt_length: int):
        super().__init__(criteria)
        self.prompt_length = prompt_length
        self.checked = prompt_length  # sequence length already judged
        self.stop_length: int | None = None

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        """``input_ids`` ``[1, L]``; ``scores`` ``None`` or one ``[1, V]`` tensor per generated token.
        Returns ``[1]``: whether some prefix of the new tokens met a criterion."""
        total, start = input_ids.shape[1], self.checked
        self.checked = max(total, start)
        for length in range(start + 1, total + 1):
            if self.stop_length is not None:
                break
            prefix_scores = None if scores is None else scores[: length - self.prompt_length]
            if bool(super().__call__(input_ids[:, :length], prefix_scores, **kwargs).any()):
                self.stop_length = length
        return torch.full((input_ids.shape[0],), self.stop_length is not None, dtype=torch.bool,
                          device=input_ids.device)


class _StoppingStreamer(BaseStreamer):
    """Forwards each round's tokens to ``streamer`` up to the first stop found by ``stopping``.

    When the loop passes no scores to its criteria (the default), each chunk is judged when it arrives
    and forwarded at once; when it records scores (``return_dict_in_generate=True, output_scores=True``)
    a chunk is held back until the loop's own criteria call has judged it (one round later).
    """

    def __init__(self, streamer, stopping: PerTokenStopping, input_ids: torch.Tensor, judge_on_put: bool):
        self.streamer, self.stopping, self.judge_on_put = streamer, stopping, judge_on_put
        self.ids = input_ids  # ``[1, L]``: the sequence the chunks extend
        self.pending = None

    def put(self, value):
        self._flush()
        self.pending = value.reshape(1, -1)
        if self.judge_on_put:
            self.stopping(torch.cat([self.ids, self.pending.to(self.ids.device)], dim=-1), None)
            self._flush()

    def end(self):
        self._flush()
        self.streamer.end()

    def _flush(self):
        if self.pending is None:
            return
        chunk, self.pending = self.pending, None
        start = self.ids.shape[1]
        self.ids = torch.cat([self.ids, chunk.to(self.ids.device)], dim=-1)
        stop = self.stopping.stop_length
        keep = chunk.shape[1] if stop is None else max(0, min(chunk.shape[1], stop - start))
        if keep > 0:
            self.streamer.put(chunk[:, :keep])


def _cut_at_stop(result, stop_length: int | None, prompt_length: int, stats: GenerationStats):
    """Cut ``generate``'s result (tensor or ``GenerateDecoderOnlyOutput``) after ``stop_length`` tokens.

    Per-token tuples (scores, logits, attentions) and the returned cache are cut to match, and the last
    round of ``stats`` loses the cut tokens from its ``accepted`` count.
    """
    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    removed = 0 if stop_length is None else sequences.shape[1] - stop_length
    if removed <= 0:
        return result
    if stats is not None and stats.rounds:  # the stop lies in the last round's tokens (earlier ones were checked)
        stats.rounds[-1].accepted -= removed
    if isinstance(result, torch.Tensor):
        return result[:, :stop_length]
    for name in ("scores", "logits", "attentions", "hidden_states"):
        if getattr(result, name, None) is not None:
            setattr(result, name, getattr(result, name)[: stop_length - prompt_length])
    if getattr(result, "cache", None) is not None:
        result.cache.crop(-removed)
    result.sequences = sequences[:, :stop_length]
    return result
