"""The ways into concurrent decoding: ``target.generate`` with a batch, and a closed loop over a queue of prompts.

Both drive a :class:`~dspark_hf.decoding.concurrent.ConcurrentDecoder` (issue 24): every request in one target
forward per step, each finishing on its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch
from transformers import GenerationConfig

from ..modeling.modeling_dspark import DSparkDrafter
from .concurrent import ConcurrentDecoder
from .request import Request, prompt_ids
from .settings import _reject_stateful_processors, _validate_decoding_mode, call_block_size
from .stats import BatchStats, publish_stats
from .stopping import ROUND_EXACT_CRITERIA


def generate_concurrent(target, drafter: DSparkDrafter | None, prompts: Iterable[Sequence[int]], *,
                        max_concurrency: int = 4, max_new_tokens: int = 128, on_tokens=None,
                        **decoder_kwargs) -> tuple[list[list[int]], BatchStats]:
    """A closed loop over a queue of prompts: at most ``max_concurrency`` in flight, a finished request replaced by
    the next one at the following step (serving-like load on one Python process).

    Args:
        target / drafter: as :class:`ConcurrentDecoder` (``drafter=None``: plain batched decoding).
        prompts: token-id sequences (e.g. ``tokenizer(text)["input_ids"]``).
        max_concurrency: ``R``, requests per target forward.
        max_new_tokens: each request's token budget.
        on_tokens: optional ``(prompt index, new token ids)`` callback after every step (streaming).
        decoder_kwargs: :class:`ConcurrentDecoder` settings (``block_size``, ``verification``, ``do_sample``,
            ``logits_processor``, ``eos_token_ids``, ``sps``, ...).

    Returns:
        ``(outputs, stats)``: the generated ids of each prompt (in prompt order) and :class:`BatchStats`
        (``stats[i]`` for prompt ``i``).

    Raises:
        ValueError: ``max_concurrency < 1``, a prompt that is not token ids or is empty
            (:func:`~dspark_hf.decoding.request.prompt_ids`), a keyword of ``generate`` that is not a
            :class:`ConcurrentDecoder` setting (:func:`_decoder_settings`: beam search,
            ``num_return_sequences > 1``, a streamer...); as :class:`ConcurrentDecoder`.
    """
    decoder_kwargs = _decoder_settings(decoder_kwargs)
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
    queue = [prompt_ids(p) for p in prompts]  # checked before any compute, not when a bad one's turn comes
    decoder = ConcurrentDecoder(target, drafter, max_requests=max_concurrency, **decoder_kwargs)
    admitted = 0
    with decoder.running():
        while admitted < len(queue) or decoder.active:
            while admitted < len(queue) and len(decoder.active) < max_concurrency:
                decoder.add(queue[admitted], max_new_tokens)
                admitted += 1
            for index, tokens in decoder.step().items():
                if on_tokens is not None and tokens:
                    on_tokens(index, tokens)
    return [r.generated for r in decoder.requests], decoder.stats


# ConcurrentDecoder's settings that generate_concurrent passes on (max_requests is its max_concurrency)
DECODER_SETTINGS = tuple(name for name, p in inspect.signature(ConcurrentDecoder.__init__).parameters.items()
                         if p.kind is p.KEYWORD_ONLY and name != "max_requests")
# generate's keywords with a counterpart in generate_concurrent: what to pass instead
GENERATE_COUNTERPARTS = {
    "streamer": "on_tokens=lambda index, new_ids: ... (called after every step with each prompt's new tokens)",
    "max_requests": "max_concurrency=", "num_assistant_tokens": "block_size=", "dspark_block_size": "block_size=",
    "dspark_verification": "verification=", "dspark_threshold": "threshold=", "dspark_lookup": "lookup=",
    "eos_token_id": "eos_token_ids=", "stop_strings": "stop=lambda request, ids: ... (True ends the request)",
    "stopping_criteria": "stop=lambda request, ids: ... (True ends the request)",
    "assistant_model": "the drafter as the second argument",
    "max_length": "max_new_tokens= (each request's budget)",
}
# generate's output options: generate_concurrent returns (generated ids, BatchStats) and records no per-step tensors
GENERATE_OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                    "output_hidden_states")


def _decoder_settings(options: dict) -> dict:
    """The :data:`DECODER_SETTINGS` among the keywords of :func:`generate_concurrent`, the others refused before any
    compute. ``num_beams`` and ``num_return_sequences`` go through the check ``generate`` runs
    (:func:`~dspark_hf.decoding.settings._validate_decoding_mode`), so ``num_beams=1`` and
    ``num_return_sequences=1`` pass (and are dropped) as the no-ops they are.

    Raises:
        ValueError: beam search, ``num_return_sequences > 1``, or any other keyword that is not a setting, each
            with what to pass instead (:data:`GENERATE_COUNTERPARTS`; :data:`GENERATE_OUTPUTS` are not recorded; a
            generation setting such as ``temperature`` goes into ``logits_processor=``).
    """
    mode = GenerationConfig(num_beams=options.get("num_beams") or 1,
                            do_sample=bool(options.get("do_sample"))).get_generation_mode()
    _validate_decoding_mode(mode, options.get("num_return_sequences"))
    others = [name for name in options if name not in (*DECODER_SETTINGS, "num_beams", "num_return_sequences")]
    if not others:
        return {name: value for name, value in options.items() if name in DECODER_SETTINGS}
    fields = GenerationConfig().to_dict()
    fixes = [f"{name}: pass {GENERATE_COUNTERPARTS[name]}" if name in GENERATE_COUNTERPARTS else
             f"{name}: not recorded; generate_concurrent returns (generated ids, BatchStats: every request's rounds), "
             "and target.generate gives scores, logits and hidden states" if name in GENERATE_OUTPUTS else
             f"{name}: a generation setting; pass its processor in logits_processor=LogitsProcessorList([...]) "
             "(e.g. TemperatureLogitsWarper, TopKLogitsWarper; do_sample=True samples)" if name in fields else
             f"{name}: neither a setting nor a generate keyword (a typo?)" for name in others]
    raise ValueError(f"generate_concurrent takes ConcurrentDecoder's settings ({', '.join(DECODER_SETTINGS)}), "
                     "and not:\n- " + "\n- ".join(fixes))


def _left_padded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens (``attention_mask == 1``) of a left-padded batch.

    Raises:
        ValueError: a row is right-padded or has holes (``padding_side="left"`` is what batched generation
            needs), or has no token at all.
    """
    if attention_mask is None:
        return input_ids.tolist()
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.long().tolist()):
        real = sum(mask)
        if real == 0 or mask[len(mask) - real:] != [1] * real:
            raise ValueError("Batched DSpark generate needs left-padded rows with at least one token each "
                             "(tokenizer.padding_side = 'left'); got a row with padding after or inside its tokens.")
        rows.append(ids[len(ids) - real:])
    return rows


def generate_batch(target, drafter: DSparkDrafter, input_ids: torch.Tensor, generation_config, logits_processor,
                   stopping_criteria, model_kwargs: dict, streamer=None) -> torch.LongTensor:
    """``target.generate(**batch, assistant_model=drafter)`` for a batch of ``R > 1`` rows (routed here by
    :mod:`dspark_hf.decoding.routing` in place of transformers' batch-1 assisted loop).

    All rows run in one :class:`ConcurrentDecoder`; each finishes on its own (EOS, ``max_new_tokens``, stop strings
    and custom stopping criteria, checked after every token) and then costs nothing. ``drafter.last_stats`` (in the
    calling thread) is the call's :class:`BatchStats` (``drafter.last_stats[i]``: row ``i``'s rounds).

    Args:
        input_ids: ``[R, L]`` left-padded prompts; model_kwargs: ``generate``'s (``attention_mask`` ``[R, L]``).
        generation_config / logits_processor / stopping_criteria: as ``generate`` prepared them.

    Returns:
        ``[R, L + T]``: the padded prompts, then each row's new tokens, padded after its end with the pad token
        (as batched plain ``generate`` returns them; ``T`` is the longest row's new tokens).

    Raises:
        ValueError: a streamer, ``return_dict_in_generate``, ``dspark_lookup=True``, a pre-filled cache or
            right-padded rows (not supported for batches), and as :class:`ConcurrentDecoder`.
    """
    _reject_batch_options(generation_config, logits_processor, model_kwargs, streamer)
    rows = _left_padded_rows(input_ids, model_kwargs.get("attention_mask"))
    width = input_ids.shape[1]
    eos = generation_config._eos_token_tensor
    decoder = ConcurrentDecoder(
        target, drafter, block_size=call_block_size(generation_config, drafter.config.block_size), verification=getattr(generation_config, "dspark_verification", None),
        threshold=getattr(generation_config, "dspark_threshold", None), do_sample=bool(generation_config.do_sample),
        logits_processor=logits_processor, eos_token_ids=eos.reshape(-1).tolist() if eos is not None else (),
        stop=_per_token_stop(stopping_criteria, input_ids.device), max_requests=len(rows),
        lookup=getattr(generation_config, "dspark_lookup", None) is not False)
    publish_stats(drafter, decoder.stats)
    for i, row in enumerate(rows):  # processors and stop checks see each row as batched plain generate shows it
        decoder.add(row, generation_config.max_length - width, padding=input_ids[i, : width - len(row)].tolist(),
                    batch_row=(i, len(rows)))
    with decoder.running():
        while decoder.active:
            decoder.step()
    return torch.cat([input_ids, _padded_new_tokens(decoder.requests, generation_config, input_ids)], dim=1)


def _reject_batch_options(generation_config, logits_processor, model_kwargs: dict, streamer) -> None:
    """Refuse, before any compute, what batched DSpark ``generate`` does not support (see :func:`generate_batch`).

    Raises:
        ValueError: a streamer, ``return_dict_in_generate``, ``dspark_lookup=True``, a pre-filled cache, or a
            stateful logits processor.
    """
    if streamer is not None:
        raise ValueError("Streamers take one row; with a batch, use dspark_hf.generate_concurrent(..., on_tokens=...) "
                         "or call generate once per prompt.")
    if generation_config.return_dict_in_generate:
        raise ValueError("return_dict_in_generate is not supported for batched DSpark generate; read per-row "
                         "statistics from drafter.last_stats.")
    if getattr(generation_config, "dspark_lookup", None):
        raise ValueError("dspark_lookup=True (prompt lookup every round) runs for one request; batched DSpark "
                         "generate plans it only for a row left alone in flight (dspark_lookup=False: never): drop "
                         "dspark_lookup or call generate once per prompt.")
    cache = model_kwargs.get("cache")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("A pre-filled cache is not supported for batched DSpark generate; pass the whole sequences.")
    _reject_stateful_processors(logits_processor)


def _per_token_stop(stopping_criteria, device):
    """The ``stop(request, ids)`` check of the criteria beyond max length / EOS / max time (stop strings, custom
    criteria), which see each row as batched plain ``generate`` shows it (its left padding, then its ids);
    ``None`` when there are none."""
    per_token = [c for c in stopping_criteria if not isinstance(c, ROUND_EXACT_CRITERIA)]

    def stop(request: Request, ids: list[int]) -> bool:
        row = torch.tensor([request.padding + ids], device=device)
        return any(bool(c(row, None).any()) for c in per_token)

    return stop if per_token else None


def _padded_new_tokens(requests: list[Request], generation_config, input_ids: torch.Tensor) -> torch.Tensor:
    """``[R, T]`` each row's new tokens, padded after its end with the pad token (else the first EOS, else 0), as
    batched plain ``generate`` returns them; ``T`` is the longest row's new tokens."""
    pad, eos = generation_config._pad_token_tensor, generation_config._eos_token_tensor
    pad_id = int(pad.reshape(-1)[0]) if pad is not None else (eos.reshape(-1)[0].item() if eos is not None else 0)
    longest = max(len(r.generated) for r in requests)
    new = torch.full((len(requests), longest), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for i, request in enumerate(requests):
        new[i, : len(request.generated)] = torch.tensor(request.generated, dtype=input_ids.dtype)
    return new
