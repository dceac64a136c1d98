"""The ``dspark_*`` keyword arguments of ``generate`` and the transformers options and logits processors DSpark
refuses.

Read by :class:`~dspark_hf.decoding.candidate_generator.DSparkCandidateGenerator` and checked by the routing
(:mod:`dspark_hf.decoding.routing`) before any compute.
"""

from __future__ import annotations

from transformers import GenerationConfig
from transformers.generation.logits_process import (
    DiaEOSDelayPatternLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
    WhisperNoSpeechDetection,
)
from transformers.generation.utils import GenerationMode

from ..modeling.configuration_dspark import is_int
from ..modeling.limits import MAX_BLOCK_SIZE

DSPARK_GENERATE_KWARGS = ("dspark_block_size", "dspark_verification", "dspark_threshold", "dspark_lookup")


def call_block_size(generation_config, default: int) -> int:
    """γ of one ``generate`` call: ``dspark_block_size``, else ``num_assistant_tokens``, else ``default``.

    transformers' ``num_assistant_tokens`` means the same (tokens drafted per round) and is honoured;
    its global default (20) cannot be told apart from "unset" and is read as unset.

    Raises:
        ValueError: γ is not an integer in ``1..MAX_BLOCK_SIZE`` (e.g. ``2.7`` or ``True``), or
            ``dspark_block_size`` and ``num_assistant_tokens`` are both set and differ.
    """
    gamma = getattr(generation_config, "dspark_block_size", None)
    assistant_tokens = generation_config.num_assistant_tokens
    if assistant_tokens == GenerationConfig._get_default_generation_params()["num_assistant_tokens"]:
        assistant_tokens = None
    if gamma is not None and assistant_tokens is not None and gamma != assistant_tokens:
        raise ValueError(f"dspark_block_size={gamma} and num_assistant_tokens={assistant_tokens} disagree: "
                         "pass one of them (both set γ, the drafts per round).")
    gamma = next((g for g in (gamma, assistant_tokens) if g is not None), default)
    if not is_int(gamma) or not 1 <= gamma <= MAX_BLOCK_SIZE:
        raise ValueError(f"dspark_block_size (γ) must be an integer in 1..{MAX_BLOCK_SIZE}, got {gamma!r}")
    return int(gamma)


def _unsupported_assistant_options(generation_config) -> list[str]:
    """transformers assistant options set on this call that DSpark cannot honour, each with its fix."""
    defaults = GenerationConfig._get_default_generation_params()
    g = generation_config
    problems = []
    if g.num_assistant_tokens_schedule not in (None, defaults["num_assistant_tokens_schedule"]):
        problems.append(f"num_assistant_tokens_schedule={g.num_assistant_tokens_schedule!r}: DSpark adapts ℓ per "
                        "round itself; use dspark_verification='scheduler' (or 'async')")
    if g.assistant_confidence_threshold not in (None, defaults["assistant_confidence_threshold"]):
        problems.append(f"assistant_confidence_threshold={g.assistant_confidence_threshold}: use "
                        "dspark_verification='threshold', dspark_threshold=... (a threshold on DSpark's predicted "
                        "acceptance c_k, not on the draft token's probability)")
    if g.prompt_lookup_num_tokens is not None or g.max_matching_ngram_size is not None:
        problems.append("prompt_lookup_num_tokens / max_matching_ngram_size: prompt lookup is another drafter; "
                        "drop assistant_model to use it, or drop these options to draft with DSpark")
    if g.assistant_early_exit is not None:
        problems.append("assistant_early_exit: self-speculation is another drafter; drop assistant_model to use it")
    if g.assistant_ensemble_weight is not None:
        problems.append("assistant_ensemble_weight: mixing the drafter's law into acceptance is not lossless; drop it")
    if getattr(g, "use_mtp", None):
        problems.append("use_mtp: MTP heads are another drafter; drop assistant_model to use them")
    return problems


# transformers' logits processors whose output depends on the calls before (state kept across calls, one call per
# emitted token assumed). DSpark calls the list on drafted positions and once per verified position, rejected ones
# included, so these would silently change the output. Each: why, and the fix.
STATEFUL_PROCESSORS = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: (
        "guidance_scale (classifier-free guidance): the processor keeps its own KV cache of the unconditional "
        "branch and advances it once per call, assuming one call per emitted token; drop guidance_scale (or "
        "assistant_model)"),
    SynthIDTextWatermarkLogitsProcessor: (
        "watermarking_config=SynthIDTextWatermarkingConfig: the processor keeps the last n-gram and the contexts "
        "seen so far across calls; drop the SynthID watermark (or assistant_model). WatermarkingConfig (green list, "
        "stateless) works"),
    WhisperNoSpeechDetection: (
        "WhisperNoSpeechDetection: records the no-speech probability of its first call; drop assistant_model"),
    DiaEOSDelayPatternLogitsProcessor: (
        "DiaEOSDelayPatternLogitsProcessor: remembers across calls which sequences emitted EOS; drop assistant_model"),
}


def _reject_stateful_processors(logits_processor) -> None:
    """Refuse, before any compute, a processor list (from the generation config and ``logits_processor=``) that holds
    one of :data:`STATEFUL_PROCESSORS`.

    DSpark calls every processor on the drafted positions (drafter) and once per verified position (target), so a
    processor must be a function of ``(input_ids, scores)`` alone; user-supplied processors cannot be checked and
    carry that rule themselves (README, "What is guaranteed").

    Raises:
        ValueError: naming each stateful processor, why it breaks losslessness, and the fix.
    """
    problems = [why for p in logits_processor or () for cls, why in STATEFUL_PROCESSORS.items() if isinstance(p, cls)]
    if problems:
        raise ValueError("Logits processors that keep state across calls are not supported with a DSpark drafter "
                         "(it calls them on drafted and on every verified position):\n- " + "\n- ".join(problems))


# greedy decoding or sampling: transformers' modes for them, without and with an assistant
DECODING_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION)


def _validate_decoding_mode(generation_mode: GenerationMode, num_return_sequences: int | None) -> None:
    """Greedy decoding or sampling, one sequence per prompt: the decoding DSpark does, in ``generate`` (one prompt or
    a batch) and in :func:`~dspark_hf.decoding.batch_generate.generate_concurrent`.

    Args:
        generation_mode: transformers' mode of the call (``GenerationConfig.get_generation_mode``: one of
            :data:`DECODING_MODES` for greedy decoding or sampling).
        num_return_sequences: sequences asked per prompt (``None``: one).

    Raises:
        ValueError: another mode (beam search, contrastive search...), or ``num_return_sequences > 1``, naming
            the fix.
    """
    if generation_mode not in DECODING_MODES:
        raise ValueError(
            f"DSpark drafting works with greedy decoding or sampling, not {generation_mode.value}; "
            "set num_beams=1 (and drop beam/contrastive options)."
        )
    if num_return_sequences and num_return_sequences > 1:
        raise ValueError("DSpark drafting returns one sequence per prompt; set num_return_sequences=1 (to draw "
                         "several samples of a prompt, pass it several times).")


def _validate_dspark_call(generation_mode, generation_config):
    """Reject what DSpark decoding cannot do, before any compute, naming the fix."""
    _validate_decoding_mode(generation_mode, generation_config.num_return_sequences)
    if generation_config.speculation_type is not None:
        raise ValueError("speculation_type must be unset when the assistant is a DSparkDrafter.")
    problems = _unsupported_assistant_options(generation_config)
    if problems:
        raise ValueError("Options not supported with a DSpark drafter:\n- " + "\n- ".join(problems))


def _reject_dspark_settings_without_drafter(generation_config):
    """``dspark_*`` settings only mean something with a DSpark drafter: refuse them otherwise."""
    given = [name for name in DSPARK_GENERATE_KWARGS if getattr(generation_config, name, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} a DSpark drafter: pass "
                         "assistant_model=DSparkDrafter... "
                         "or drop them.")
