"""DSpark speculative decoding as a transformers ``custom_generate`` recipe.

    target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, max_new_tokens=128)

runs the target's own assisted generation with this repository's DSpark drafter as ``assistant_model``
(greedy output is token-identical to plain ``generate``; sampling keeps the target's distribution).
Needs the ``dspark-hf`` package (``custom_generate/requirements.txt``); the caller does not import it.

Which drafter is used, first match wins:

1. ``assistant_model=``: a drafter the caller already loaded;
2. ``dspark_drafter=``: a drafter, Hub id or folder;
3. the repository this file was loaded from: the ``custom_generate=`` argument of the calling
   ``GenerationMixin.generate`` (a Hub id or a local folder, with the call's ``revision=``/``cache_dir=``);
4. ``DRAFTER_REPO`` below, written by ``dspark card --repo-id`` (used if transformers stops exposing 3).

Every other keyword (``max_new_tokens``, ``do_sample``, ``streamer``, ``dspark_block_size``,
``dspark_verification``, ``dspark_threshold``...) goes to ``generate`` unchanged.
"""

import os
import sys

import dspark_hf

DRAFTER_REPO = None  # written by `dspark card`

# keywords of `generate(custom_generate=...)` that locate this repository, not generation settings
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "repo_type")

_drafters = {}  # (location, hub kwargs) -> DSparkDrafter, so repeated calls load the drafter once


def _calling_repo(depth=2):
    """The ``custom_generate`` argument of the ``GenerationMixin.generate`` call that ran this file.

    transformers calls ``generate`` below straight from its own ``generate`` (whose local
    ``custom_generate`` is the Hub id or folder it loaded this file from), so only that one frame is
    read: ``depth`` frames up from here. Anything else (a direct call, another transformers) gives ``None``.
    """
    try:
        frame = sys._getframe(depth)
    except ValueError:  # called from the top of the stack
        return None
    if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils":
        location = frame.f_locals.get("custom_generate")
        return location if isinstance(location, str) else None
    return None


def _drafter(location, hub_kwargs):
    key = (str(location), tuple(sorted((k, str(v)) for k, v in hub_kwargs.items())))
    if key not in _drafters:
        _drafters[key] = dspark_hf.DSparkDrafter.from_pretrained(location, **hub_kwargs).eval()
    return _drafters[key]


def generate(model, *args, dspark_drafter=None, **kwargs):
    """``model.generate(*args, assistant_model=<this repo's DSpark drafter>, **kwargs)``.

    Args:
        model: the target (any transformers causal LM the drafter was trained for).
        dspark_drafter: a ``DSparkDrafter``, Hub id or folder overriding this repository's drafter.
        kwargs: ``generate`` arguments; the Hub keywords that located this repository (``revision``,
            ``cache_dir``, ``token``, ...) are used to load the drafter and not passed on.

    Returns:
        What ``model.generate`` returns; the drafter's per-round statistics are in ``drafter.last_stats``.

    Raises:
        ValueError: no drafter location can be found (pass ``dspark_drafter=``).
    """
    hub_kwargs = {k: v for k in HUB_KWARGS if (v := kwargs.pop(k, None)) is not None}
    drafter = kwargs.pop("assistant_model", None)
    if drafter is None:
        drafter = dspark_drafter
    if drafter is None:
        drafter = _calling_repo() or DRAFTER_REPO
    if drafter is None:
        raise ValueError("Cannot tell which repository this custom_generate came from: "
                         "pass dspark_drafter=HUB_ID_OR_PATH.")
    if isinstance(drafter, (str, os.PathLike)):
        drafter = _drafter(drafter, hub_kwargs)
    # type(model).generate, not model.generate: a target whose own repo overrides `generate` must not loop back here
    return type(model).generate(model, *args, assistant_model=drafter, **kwargs)
