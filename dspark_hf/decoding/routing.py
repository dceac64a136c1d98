"""Routing ``target.generate(..., assistant_model=DSparkDrafter)`` through DSpark drafting.

transformers has no public argument for a custom candidate generator, so :func:`install` replaces three private
``GenerationMixin`` methods with this module's functions (their ``__module__`` is this module, their
``__wrapped__`` and :func:`stock` the stock method); :func:`uninstall` puts the stock ones back. Every other
assistant keeps transformers' own behaviour untouched.

When it is installed. Importing this module (or any other module of the package) patches nothing. :func:`install`
runs from :func:`dspark_hf.wire`, i.e. at the first use of a public name of ``dspark_hf`` (``dspark_hf.DSparkDrafter``,
``from dspark_hf import SPSCurve``...), when the first ``DSparkDrafter`` of a process is built (however its class
was imported, the ``trust_remote_code`` copy included), and by the ``dspark`` command. :func:`is_installed` tells.

* ``_get_candidate_generator``: a DSpark drafter gets
  :class:`~dspark_hf.decoding.candidate_generator.DSparkCandidateGenerator`, after the final logits processor list
  is checked for stateful processors (:func:`~dspark_hf.decoding.settings._reject_stateful_processors`);
* ``_validate_generation_mode``: ``dspark_*`` settings and unsupported assistant options are refused before any
  compute (:mod:`dspark_hf.decoding.settings`), the drafter is bound to the target, and a ``trust_remote_code``
  copy of the drafter class is swapped for this package's (:func:`package_drafter`);
* ``_assisted_decoding``: a batch of several rows goes to :func:`~dspark_hf.decoding.batch_generate.generate_batch`
  (all rows in one ragged target forward per step); for one row, a user's pre-filled cache is emptied so the whole
  prompt is prefilled (:func:`restart_prefilled_cache`), the call's settings are checked and the drafter given
  the target's SPS curve when they read it (:func:`~dspark_hf.decoding.candidate_generator.prepare_call`), and stop
  strings and custom criteria see every token (:mod:`dspark_hf.decoding.stopping`). The call's statistics are
  ``output.dspark_stats`` with ``return_dict_in_generate=True`` (and ``drafter.last_stats`` in the calling thread).

Version window: transformers ``>=5.24,<5.26`` (:data:`SUPPORTED_TRANSFORMERS`), checked when this module is imported:
the assisted loop's private methods change between minor releases (5.25 reads the candidate generator's
``num_drafting_tokens``, which :class:`~dspark_hf.decoding.candidate_generator.DSparkCandidateGenerator` gives, and
records the cache's past states before the first round, which attention caches ignore). The replacements bind the
stock methods' arguments BY NAME; the parameters they read are checked at import too (:data:`_REQUIRED_PARAMETERS`),
and a transformers without them fails with an error that names the supported range.
Exit condition: when transformers accepts a candidate generator (or a factory) through a public ``generate``
argument, this module reduces to passing it, and the replacing goes.
"""

from __future__ import annotations

import inspect
import os
import weakref

import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

from ..modeling.configuration_dspark import DSparkConfig
from ..modeling.modeling_dspark import DSparkDrafter
from ..runtime.capture import LayerCapture
from .batch_generate import generate_batch
from .calibration import SequentialTemperatureScaling
from .candidate_generator import DSparkCandidateGenerator, prepare_call
from .settings import (
    DSPARK_GENERATE_KWARGS,
    _reject_dspark_settings_without_drafter,
    _reject_stateful_processors,
    _validate_dspark_call,
    call_block_size,
)
from .stats import stand_in
from .stopping import ROUND_EXACT_CRITERIA, PerTokenStopping, _cut_at_stop, _StoppingStreamer

SUPPORTED_TRANSFORMERS = ">=5.24,<5.26"
# the parameters of transformers' private methods that the routing reads or replaces, by name
_REQUIRED_PARAMETERS = {
    "_get_candidate_generator": ("generation_config", "input_ids", "logits_processor", "assistant_model"),
    "_validate_generation_mode": ("generation_mode", "generation_config", "generation_mode_kwargs"),
    "_assisted_decoding": ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "streamer", "assistant_model"),
}


def _stock_signatures() -> dict[str, inspect.Signature]:
    """Signatures of the wrapped ``GenerationMixin`` methods, checked once at import.

    Raises:
        ImportError: transformers is outside :data:`SUPPORTED_TRANSFORMERS`, or a method or a parameter the routing
            relies on is missing (another transformers).
    """
    if not SpecifierSet(SUPPORTED_TRANSFORMERS).contains(transformers.__version__, prereleases=True):
        raise ImportError(f"dspark_hf routes generate() through transformers' private assisted loop, tested with "
                          f"transformers{SUPPORTED_TRANSFORMERS}; this is {transformers.__version__}: install "
                          f"'transformers{SUPPORTED_TRANSFORMERS}'.")
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
# trust_remote_code copy -> this package's drafter standing in for it (package_drafter); weak: dies with the copy
_PACKAGE_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stock(name: str):
    """The stock ``GenerationMixin`` method ``name`` (one of :data:`_REQUIRED_PARAMETERS`) that :func:`install`
    replaces, e.g. to call transformers' own behaviour while routing is installed.

    Raises:
        KeyError: ``name`` is not one of the replaced methods.
    """
    return _STOCK[name]


def is_installed() -> bool:
    """Whether ``GenerationMixin`` currently runs this module's replacements (:func:`install`)."""
    return all(getattr(GenerationMixin, name) is method for name, method in _OURS.items())


def _ours(function):
    """Label ``function`` as the replacement of the stock ``GenerationMixin`` method of the same name: it keeps
    its own ``__module__``/``__qualname__`` (this module), ``__wrapped__`` is the stock method, and its docstring
    says both."""
    name = function.__name__
    function.__wrapped__ = _STOCK[name]
    function.__doc__ = (f"dspark_hf's replacement of ``GenerationMixin.{name}`` (installed by "
                        f"dspark_hf.decoding.routing.install; the stock method: ``stock({name!r})``).\n\n"
                        + inspect.cleandoc(function.__doc__ or ""))
    return function


def package_drafter(remote) -> DSparkDrafter:
    """This package's :class:`DSparkDrafter` for a ``trust_remote_code`` copy of the class (same config, weights,
    calibration and SPS curve), built once per copy (kept while the copy lives); the copy's ``last_stats``
    follows each call (:func:`~dspark_hf.decoding.stats.stand_in`).

    Raises:
        ValueError: the copy's code differs from this package's (its weights do not load): load the drafter
            with ``dspark_hf.DSparkDrafter.from_pretrained``.
    """
    cached = _PACKAGE_DRAFTERS.get(remote)
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
        stand_in(cached, remote)
        _PACKAGE_DRAFTERS[remote] = cached
    return cached


def _get_candidate_generator(self, *args, **kwargs):
    """A DSpark drafter gets :class:`DSparkCandidateGenerator`; any other assistant, transformers' choice."""
    call = _SIGNATURES["_get_candidate_generator"].bind(self, *args, **kwargs).arguments
    if isinstance(call.get("assistant_model"), DSparkDrafter):
        _reject_stateful_processors(call["logits_processor"])
        return DSparkCandidateGenerator(
            self, call["assistant_model"], call["generation_config"], call["logits_processor"], call["input_ids"]
        )
    return _STOCK["_get_candidate_generator"](self, *args, **kwargs)


def _validate_generation_mode(self, *args, **kwargs):
    """Refuse ``dspark_*`` settings that do not apply, bind a DSpark drafter (this package's class for a
    ``trust_remote_code`` copy), then transformers' own validation."""
    call = _SIGNATURES["_validate_generation_mode"].bind(self, *args, **kwargs).arguments
    generation_config = call["generation_config"]
    assistant = (call["generation_mode_kwargs"] or {}).get("assistant_model")
    if isinstance(assistant, (str, os.PathLike)):  # transformers would fail on `.config` with an AttributeError
        raise ValueError(f"assistant_model must be a loaded model, got the name {str(assistant)!r}: load a DSpark "
                         "drafter first, dspark_hf.DSparkDrafter.from_pretrained(...), and pass it.")
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


def _assisted_decoding(self, *args, **kwargs):
    """transformers' assisted loop; a DSpark drafter's call is prepared first (:func:`prepare_call`) and its
    statistics attached to a dict output (``output.dspark_stats``); the drafter's context layers of the target are
    recorded for the call (:class:`~dspark_hf.runtime.capture.LayerCapture`). A batch of several rows runs in
    :func:`generate_batch`. With criteria beyond max length / EOS / max time, the criteria see every token
    (:class:`PerTokenStopping`) and the output is cut at the first stop."""
    call = _SIGNATURES["_assisted_decoding"].bind(self, *args, **kwargs)
    arguments = call.arguments
    drafter, criteria = arguments.get("assistant_model"), arguments["stopping_criteria"]
    if not isinstance(drafter, DSparkDrafter):
        return _STOCK["_assisted_decoding"](*call.args, **call.kwargs)
    input_ids, config = arguments["input_ids"], arguments["generation_config"]
    if input_ids.shape[0] > 1:  # many rows: one ragged loop
        return generate_batch(self, drafter, input_ids, config, arguments["logits_processor"], criteria,
                              arguments.get("model_kwargs", {}), arguments.get("streamer"))
    restart_prefilled_cache(arguments.get("model_kwargs", {}), input_ids)
    prepare_call(self, drafter, config)
    stopping = None
    if not all(isinstance(c, ROUND_EXACT_CRITERIA) for c in criteria):
        stopping = arguments["stopping_criteria"] = PerTokenStopping(criteria, input_ids.shape[1])
        if arguments.get("streamer") is not None:
            scores_recorded = bool(config.return_dict_in_generate and config.output_scores)
            arguments["streamer"] = _StoppingStreamer(arguments["streamer"], stopping, input_ids, not scores_recorded)
    with LayerCapture(self, drafter.config.target_layer_ids):
        result = _STOCK["_assisted_decoding"](*call.args, **call.kwargs)
    if stopping is not None:
        result = _cut_at_stop(result, stopping.stop_length, input_ids.shape[1], drafter.last_stats)
    return _with_stats(result, drafter)


def _with_stats(result, drafter: DSparkDrafter):
    """``result`` with, when it is a ``ModelOutput`` (``return_dict_in_generate=True``), this call's statistics as
    ``result.dspark_stats``: the object the call's candidate generator created and published as this thread's
    ``drafter.last_stats`` (an attribute, not an output field: ``to_tuple()`` and the keys are unchanged)."""
    if not isinstance(result, torch.Tensor):
        result.dspark_stats = drafter.last_stats
    return result


_OURS = {f.__name__: _ours(f) for f in (_get_candidate_generator, _validate_generation_mode, _assisted_decoding)}


def install() -> None:
    """Replace the three ``GenerationMixin`` methods with this module's (idempotent); run by
    :func:`dspark_hf.wire` (see the module docstring for when)."""
    for name, method in _OURS.items():
        setattr(GenerationMixin, name, method)
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
