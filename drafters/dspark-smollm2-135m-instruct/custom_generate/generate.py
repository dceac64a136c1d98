"""DSpark speculative decoding as a transformers ``custom_generate`` recipe.

    target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, max_new_tokens=128)

runs the target's own assisted generation with this repository's DSpark drafter as ``assistant_model``
(greedy output is token-identical to plain ``generate``; sampling keeps the target's distribution).
Needs the ``dspark-hf`` package (``custom_generate/requirements.txt``); the caller does not import it.

Which drafter is used, first match wins:

1. ``assistant_model=``: a drafter the caller already loaded;
2. ``dspark_drafter=``: a drafter, Hub id or folder;
3. the folder this file lives in, when that folder holds the drafter (its ``config.json`` is a DSpark config:
   this file imported from a drafter folder; transformers runs a copy of it from its modules cache instead);
4. ``DRAFTER_REPO`` below, written by ``dspark card --repo-id`` (loaded with the call's ``revision=``,
   ``cache_dir=``, ``token=``...).

Every other keyword (``max_new_tokens``, ``do_sample``, ``streamer``, ``dspark_block_size``,
``dspark_verification``, ``dspark_threshold``...) goes to ``generate`` unchanged.
"""

import json
import os
from pathlib import Path

import dspark_hf

DRAFTER_REPO = None  # written by `dspark card`

# keywords of `generate(custom_generate=...)` that locate this repository, not generation settings
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "repo_type")

_drafters = {}  # (location, hub kwargs) -> DSparkDrafter, so repeated calls load the drafter once


def _home_folder():
    """The drafter folder this file lives in (``<folder>/custom_generate/generate.py``), or ``None`` when the
    folder above holds no DSpark ``config.json`` (e.g. transformers' modules-cache copy of this file)."""
    folder = Path(os.path.abspath(__file__)).parent.parent  # not resolve(): a Hub cache snapshot holds symlinks
    config = folder / "config.json"
    try:
        is_drafter = config.is_file() and json.loads(config.read_text()).get("model_type") == "dspark"
    except ValueError:  # not JSON: not a drafter's config
        is_drafter = False
    return str(folder) if is_drafter else None


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
        What ``model.generate`` returns; the call's per-round statistics are ``output.dspark_stats`` with
        ``return_dict_in_generate=True``, and ``drafter.last_stats`` in the calling thread.

    Raises:
        ValueError: no drafter can be found (pass ``dspark_drafter=``).
    """
    hub_kwargs = {k: v for k in HUB_KWARGS if (v := kwargs.pop(k, None)) is not None}
    choices = (kwargs.pop("assistant_model", None), dspark_drafter, _home_folder(), DRAFTER_REPO)
    drafter = next((choice for choice in choices if choice is not None), None)
    if drafter is None:
        raise ValueError("This custom_generate names no drafter (no DRAFTER_REPO: its card was written without "
                         "--repo-id): pass dspark_drafter=HUB_ID_OR_PATH.")
    if isinstance(drafter, (str, os.PathLike)):
        drafter = _drafter(drafter, hub_kwargs)
    # type(model).generate, not model.generate: a target whose own repo overrides `generate` must not loop back here
    return type(model).generate(model, *args, assistant_model=drafter, **kwargs)
