"""Routing ``target.generate(..., assistant_model=DSparkDrafter)`` through DSpark drafting.

transformers has no public argument for a custom candidate generator, so :func:`install` (run by
``import dspark_hf``) wraps three private ``GenerationMixin`` methods; :func:`uninstall` puts the stock ones back.
Every other assistant keeps transformers' own behaviour untouched.

* ``_get_candidate_generator``: a DSpark drafter gets
  :class:`~dspark_hf.decoding.candidate_generator.DSparkCandidateGenerator`, after the final logits processor list
  is checked for stateful processors (:func:`~dspark_hf.decoding.settings._reject_stateful_processors`);
* ``_validate_generation_mode``: ``dspark_*`` settings and unsupported assistant options are refused before any
  compute (:mod:`dspark_hf.decoding.settings`), the drafter is bound to the target, and a ``trust_remote_code``
  copy of the drafter class is swapped for this package's (:func:`package_drafter`);
* ``_assisted_decoding``: a batch of several rows goes to :func:`~dspark_hf.decoding.batch_generate.generate_batch`
  (all rows in one ragged target forward per step); for one row, a user's pre-filled cache is emptied so the whole prompt is prefilled
  (:func:`restart_prefilled_cache`); stop strings and custom criteria see every token
  (:mod:`dspark_hf.decoding.stopping`).

Version window: transformers ``>=5.24,<6`` (:data:`SUPPORTED_TRANSFORMERS`). The wrappers bind the stock
methods' arguments BY NAME; the parameters they read are checked at import (:data:`_REQUIRED_PARAMETERS`),
and a transformers without them fails at ``import dspark_hf`` with an error that names the supported range.
Exit condition: when transformers accepts a candidate generator (or a factory) through a public ``generate``
argument, this module reduces to passing it, and the wrapping goes.
"""

from __future__ import annotations

import functools
import inspect

import transformers
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

from ..modeling.configuration_dspark import DSparkConfig
from ..modeling.modeling_dspark import DSparkDrafter
from .batch_generate import generate_batch
from .calibration import SequentialTemperatureScaling
from .candidate_generator import DSparkCandidateGenerator
from .settings import (
    DSPARK_GENERATE_KWARGS,
    _reject_dspark_settings_without_drafter,
    _reject_stateful_processors,
    _validate_dspark_call,
    call_block_size,
)
from .stopping import ROUND_EXACT_CRITERIA, PerTokenStopping, _cut_at_stop, _StoppingStreamer

SUPPORTED_TRANSFORMERS = ">=5.24,<6"
# the parameters of transformers' private methods that the routing reads or replaces, by name
_REQUIRED_PARAMETERS = {
    "_get_candidate_generator": ("generation_config", "input_ids", "logits_processor", "assistant_model"),
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
    "_assisted_decoding": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "streamer", "assistant_model"),
}


def _stock_signatures() -> dict[str, inspect.Signature]:
    """Signatures of the wrapped ``GenerationMixin`` methods, checked once at import.

    Raises:
        ImportError: a method or a parameter the routing relies on is missing (another transformers).
    """
    signatures = {}
    for name, parameters in _REQUIRED_PARAMETERS.items():
        method = getattr(GenerationMixin, name, None)
        signature = inspect.signature(method) if callable(method) else None
        missing = parameters if signature is None else [p for p in parameters if p not in signature.parameters]
        if missing or not hasattr(CandidateGenerator, "requires_model_outputs"):
            raise ImportError(
                f"dspark_hf routes generate() through GenerationMixin.{name}({', '.join(parameters)}), which "
                f"transformers {transformers.__version__} lacks ({', '.join(missing) or 'requires_model_outputs'}); "
                f"install transformers{SUPPORTED_TRANSFORMERS}."
            )
        signatures[name] = signature
    return signatures


_STOCK = {name: getattr(GenerationMixin, name) for name in _REQUIRED_PARAMETERS}
_SIGNATURES = _stock_signatures()


def package_drafter(remote) -> DSparkDrafter:
    """This package's :class:`DSparkDrafter` for a ``trust_remote_code`` copy of the class (same config, weights,
    calibration and SPS curve), built once and cached on the copy; the copy's ``last_stats`` follows each call.

    Raises:
        ValueError: the copy's code differs from this package's (its weights do not load): load the drafter
            with ``dspark_hf.DSparkDrafter.from_pretrained``.
    """
    cached = remote.__dict__.get("_dspark_hf_drafter")
    if cached is None:
        cached = DSparkDrafter(DSparkConfig.from_dict(remote.config.to_dict()))
        try:
            cached.load_state_dict(remote.state_dict())
        except RuntimeError as err:
            raise ValueError("This drafter's trust_remote_code files differ from the installed dspark_hf; load it "
                             f"with dspark_hf.DSparkDrafter.from_pretrained(...) instead ({err}).") from err
        cached.to(remote.dtype).train(remote.training)
        if remote.calibration is not None:
            cached.calibration = SequentialTemperatureScaling(temperatures=list(remote.calibration.temperatures))
        if remote.sps_curve is not None:
            cached.set_sps_curve(remote.sps_curve)
        cached.__dict__["_stats_mirror"] = remote
        remote.__dict__["_dspark_hf_drafter"] = cached
    return cached


@functools.wraps(_STOCK["_get_candidate_generator"])
def _get_candidate_generator(self, *args, **kwargs):
    call = _SIGNATURES["_get_candidate_generator"].bind(self, *args, **kwargs).arguments
    if isinstance(call.get("assistant_model"), DSparkDrafter):
        _reject_stateful_processors(call["logits_processor"])
        return DSparkCandidateGenerator(
            self, call["assistant_model"], call["generation_config"], call["logits_processor"], call["input_ids"]
        )
    return _STOCK["_get_candidate_generator"](self, *args, **kwargs)


@functools.wraps(_STOCK["_validate_generation_mode"])
def _validate_generation_mode(self, *args, **kwargs):
    call = _SIGNATURES["_validate_generation_mode"].bind(self, *args, **kwargs).arguments
    generation_config = call["generation_config"]
    assistant = (call["generation_mode_kwargs"] or {}).get("assistant_model")
    if type(assistant).__name__ == DSparkDrafter.__name__ and not isinstance(assistant, DSparkDrafter):
        assistant = call["generation_mode_kwargs"]["assistant_model"] = package_drafter(assistant)
    if isinstance(assistant, DSparkDrafter):
        _validate_dspark_call(call["generation_mode"], generation_config)
        call_block_size(generation_config, assistant.config.block_size)
        assistant.bind(self)  # shape checks with a clear message, before transformers' tokenizer check
    else:
        _reject_dspark_settings_without_drafter(generation_config)
    return _STOCK["_validate_generation_mode"](self, *args, **kwargs)


def restart_prefilled_cache(model_kwargs: dict, input_ids) -> None:
    """Empty a user's pre-filled cache (``generate(cache=...)`` or ``past_key_values=``, e.g. the cache a previous
    ``generate`` returned) so that DSpark prefills the whole prompt: transformers' assisted loop feeds all of
    ``input_ids`` in its first forward (on top of a pre-filled cache that would put them after the cached positions),
    and the drafter needs the target's features of every prompt position. The cached prefix is recomputed once;
    the output is that of plain ``generate`` with the same cache, and the cache holds the whole sequence afterwards.

    Args:
        model_kwargs: ``generate``'s model kwargs (``cache``, ``attention_mask``).
        input_ids: ``[1, L]`` the prompt.

    Raises:
        ValueError: ``input_ids`` holds only the uncached tokens (the cache covers ``>= L`` positions, or the
            attention mask is longer than ``input_ids``): pass the whole sequence's ids, cached prefix included.
    """
    cache = model_kwargs.get("cache")
    cached = cache.get_seq_length() if cache is not None else 0
    if not cached:
        return
    mask = model_kwargs.get("attention_mask")
    if cached >= input_ids.shape[1] or (mask is not None and mask.shape[-1] != input_ids.shape[1]):
        raise ValueError(f"The cache passed to generate holds {cached} positions and input_ids {input_ids.shape[1]}: "
                         "with a DSpark drafter, pass the ids of the whole sequence (the cached prefix included) as "
                         "input_ids; DSpark rebuilds the drafter's context from them.")
    cache.crop(-cached)


@functools.wraps(_STOCK["_assisted_decoding"])
def _assisted_decoding(self, *args, **kwargs):
    """transformers' assisted loop; with a DSpark drafter and criteria beyond max length / EOS / max time,
    the criteria see every token (:class:`PerTokenStopping`) and the output is cut at the first stop."""
    call = _SIGNATURES["_assisted_decoding"].bind(self, *args, **kwargs)
    arguments = call.arguments
    drafter, criteria = arguments.get("assistant_model"), arguments["stopping_criteria"]
    if isinstance(drafter, DSparkDrafter) and arguments["input_ids"].shape[0] > 1:  # many rows: one ragged loop
        return generate_batch(self, drafter, arguments["input_ids"], arguments["generation_config"],
                              arguments["logits_processor"], criteria, arguments.get("model_kwargs", {}),
                              arguments.get("streamer"))
    if isinstance(drafter, DSparkDrafter):
        restart_prefilled_cache(arguments.get("model_kwargs", {}), arguments["input_ids"])
    if not isinstance(drafter, DSparkDrafter) or all(isinstance(c, ROUND_EXACT_CRITERIA) for c in criteria):
        return _STOCK["_assisted_decoding"](*call.args, **call.kwargs)
    input_ids, config = arguments["input_ids"], arguments["generation_config"]
    stopping = PerTokenStopping(criteria, input_ids.shape[1])
    arguments["stopping_criteria"] = stopping
    if arguments.get("streamer") is not None:
        scores_recorded = bool(config.return_dict_in_generate and config.output_scores)
        arguments["streamer"] = _StoppingStreamer(arguments["streamer"], stopping, input_ids, not scores_recorded)
    result = _STOCK["_assisted_decoding"](*call.args, **call.kwargs)
    return _cut_at_stop(result, stopping.stop_length, input_ids.shape[1], drafter.last_stats)


def install() -> None:
    """Route DSpark drafters through :class:`DSparkCandidateGenerator` (idempotent; done on import)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._assisted_decoding = _assisted_decoding
    for name in DSPARK_GENERATE_KWARGS:  # class defaults make `generate(dspark_...=...)` config fields
        if not hasattr(GenerationConfig, name):
            setattr(GenerationConfig, name, None)


def uninstall() -> None:
    """Undo :func:`install`: the stock ``GenerationMixin`` methods come back and the ``dspark_*`` class defaults of
    ``GenerationConfig`` go (idempotent). DSpark drafters then reach transformers' own assisted decoding."""
    for name, method in _STOCK.items():
        setattr(GenerationMixin, name, method)
    for name in DSPARK_GENERATE_KWARGS:
        if name in GenerationConfig.__dict__ and GenerationConfig.__dict__[name] is None:
            delattr(GenerationConfig, name)
