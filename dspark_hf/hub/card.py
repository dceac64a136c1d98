"""The Hub side of a drafter: its model card, its ``custom_generate/`` recipe and the upload.

A drafter folder (``drafters/<name>/``) is exactly what its Hub repo holds:

* ``config.json``, ``model.safetensors`` (or its shards with their index) and the modeling code named by ``config.auto_map``
  (``config.py``, ``model.py`` and their relative imports; :meth:`DSparkDrafter.save_pretrained` copies
  them), so ``AutoModel.from_pretrained(repo, trust_remote_code=True)`` needs no ``dspark_hf``;
* ``calibration.json`` (``dspark calibrate``) and ``training.json`` (``dspark train``);
* ``custom_generate/generate.py`` + ``requirements.txt``, so ``target.generate(...,
  custom_generate=repo, trust_remote_code=True)`` runs DSpark without the caller importing ``dspark_hf``;
* ``README.md``: the model card, rendered by :func:`build_card` from the records above and the
  benchmark results. Nothing in it is typed by hand; a missing record reads "Not measured yet".

``dspark card DIR`` writes the card and ``custom_generate/``; ``dspark push DIR --repo-id ORG/NAME``
uploads the folder as it is.
"""
from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path

from ..decoding.routing import SUPPORTED_TRANSFORMERS
from ..evaluation.bench_result import BenchResult
from ..modeling.modeling_dspark import CALIBRATION_FILE
from .sections import (
    _REPO_LINE,
    CARD_TEMPLATE,
    DATASET,
    GENERATE_TEMPLATE,
    LEGACY_REMOTE_CODE,
    RELIABILITY_FILE,
    TAGS,
    TRAINING_FILE,
    architecture_section,
    calibration_section,
    limitations_section,
    speed_section,
    training_section,
)


def build_card(config, repo: str, bench: BenchResult | dict | None = None, training: dict | None = None,
               calibration: dict | None = None, n_params: int | None = None, has_diagram: bool = False,
               compare: dict | None = None, local_folder: bool = False):
    """The model card of a drafter, from its records only.

    Args:
        config: the drafter's :class:`~dspark_hf.DSparkConfig`; ``target_name_or_path`` is the base model.
        repo: what the usage snippets load (the Hub id, or the folder before one is chosen).
        bench: benchmark results (a ``dspark bench`` :class:`BenchResult` or its JSON as a dict, or any dict of
            metrics: see :func:`speed_section`), or ``None``.
        compare: ``dspark generate --compare`` medians (see :func:`compare_block`), or ``None``.
        local_folder: ``repo`` is a local folder (no Hub id chosen): the ``custom_generate=`` snippet then names
            the drafter with ``dspark_drafter=`` too (the recipe, run from transformers' modules cache, cannot).
        training: the drafter's ``training.json``, or ``None``.
        calibration: the drafter's ``calibration.json``, or ``None``.
        n_params: the drafter's own parameter count.

    Returns:
        A :class:`huggingface_hub.ModelCard`.

    Raises:
        ValueError: ``config.target_name_or_path`` is not a Hub id (it becomes ``base_model``).
    """
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    base = config.target_name_or_path
    try:
        validate_repo_id(base)
    except HFValidationError as err:
        raise ValueError(
            f"config.target_name_or_path = {base!r} is not a Hub id, and the card names it as base_model: "
            "set drafter.config.target_name_or_path = 'org/name' and save the drafter again."
        ) from err
    data = ModelCardData(
        license="apache-2.0", base_model=base, library_name="transformers", pipeline_tag="text-generation",
        tags=list(TAGS), datasets=[DATASET],
    )
    return ModelCard.from_template(
        data,
        template_path=str(CARD_TEMPLATE),
        title=f"DSpark drafter for {base.split('/')[-1]}",
        repo=repo,
        local_folder=local_folder,
        block_size=config.block_size,
        architecture=architecture_section(config, n_params),
        speed=speed_section(bench, compare),
        calibration=calibration_section(calibration, has_diagram),
        training=training_section(training),
        limitations=limitations_section(config, calibration, bench),
    )


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{repo_id!r} is not a Hub repo id (ORG/NAME): {err}") from err


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _count_params(model_dir: Path) -> int | None:
    """Floating-point parameters in the folder's ``model.safetensors`` or its shards; ``None`` without weights."""
    from huggingface_hub import parse_local_safetensors_file_metadata

    files = _weight_files(model_dir)
    if not files:
        return None
    counts = [parse_local_safetensors_file_metadata(f).parameter_count for f in files]  # {dtype: count} each
    return sum(n for c in counts for dtype, n in c.items() if dtype.startswith(("F", "BF")))  # not the int draft-vocab ids


def _weight_files(model_dir: Path) -> list[Path]:
    """``model.safetensors``, or the shards ``model-0000i-of-0000n.safetensors`` a sharded ``save_pretrained`` writes."""
    return sorted(model_dir.glob("model*.safetensors"))


def card_repo_id(model_dir: str | Path) -> str | None:
    """The Hub id the folder's card was written for (``DRAFTER_REPO`` of its ``custom_generate``)."""
    file = Path(model_dir) / "custom_generate" / "generate.py"
    if not file.is_file():
        return None
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DRAFTER_REPO" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def write_custom_generate(model_dir: str | Path, repo_id: str | None = None) -> Path:
    """Write ``custom_generate/generate.py`` (the template, ``DRAFTER_REPO = repo_id``) and ``requirements.txt``."""
    from ..defaults import __version__

    out = Path(model_dir) / "custom_generate"
    out.mkdir(parents=True, exist_ok=True)
    code, n = _REPO_LINE.subn(f"DRAFTER_REPO = {repo_id!r}  # written by `dspark card`", GENERATE_TEMPLATE.read_text())
    if n != 1:
        raise RuntimeError(f"{GENERATE_TEMPLATE} must define DRAFTER_REPO exactly once (found {n}).")
    (out / "generate.py").write_text(code)
    (out / "requirements.txt").write_text(f"dspark-hf>={__version__}\ntransformers{SUPPORTED_TRANSFORMERS}\n")
    return out


def write_remote_code(model_dir: Path) -> dict:
    """Write the drafter's modeling code into ``model_dir`` as ``save_pretrained`` does for a class registered with
    ``register_for_auto_class`` (``custom_object_save``: ``dspark_hf/modeling/modeling_dspark.py``, its relative
    imports and the config's module), and point ``config.json``'s ``auto_map`` at it, so
    ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` works. The weights are not touched; the files of a
    previous ``auto_map`` (older releases: ``model.py``, ``config.py`` and their imports) are removed.

    Returns:
        The new ``auto_map``.
    """
    import torch
    from transformers.dynamic_module_utils import custom_object_save

    from ..modeling.configuration_dspark import DSparkConfig
    from ..modeling.modeling_dspark import DSparkDrafter

    config_path = model_dir / "config.json"
    config_dict = json.loads(config_path.read_text())
    old = {ref.split(".")[0] for ref in (config_dict.get("auto_map") or {}).values()}
    config = DSparkConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # only the class and its module are needed, not weights
        drafter = DSparkDrafter(config)
    config_dict["auto_map"] = {}
    # DSparkConfig -> AutoConfig, DSparkDrafter -> AutoModel (register_for_auto_class in dspark_hf/__init__.py)
    new = {Path(f).stem for obj in (config, drafter) for f in custom_object_save(obj, model_dir, config=config_dict)}
    stale = old - new | (set(LEGACY_REMOTE_CODE) if "model" in old else set())
    for name in sorted(stale - new):
        (model_dir / f"{name}.py").unlink(missing_ok=True)
    config_path.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    return config_dict["auto_map"]


def _check_modeling_code(model_dir: Path, config_dict: dict) -> None:
    """The files ``auto_map`` names must be in the folder; warn when they differ from this ``dspark_hf``."""
    from ..modeling import modeling_dspark

    modules = {ref.split(".")[0] for ref in (config_dict.get("auto_map") or {}).values()}
    if not modules:
        raise ValueError(f"{model_dir}/config.json has no auto_map: run `dspark card {model_dir}`, which writes the "
                         "modeling code, so trust_remote_code can load it.")
    package = Path(modeling_dspark.__file__).resolve().parent
    for name in sorted(modules):
        file = model_dir / f"{name}.py"
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing (named by config.json auto_map): run `dspark card {model_dir}` "
                                    "to write the modeling code.")
        if (package / file.name).is_file() and file.read_bytes() != (package / file.name).read_bytes():
            warnings.warn(f"{file} differs from the installed dspark_hf/modeling/{file.name}: trust_remote_code users "
                          f"get the folder's copy. Run `dspark card {model_dir}` to refresh it.")


def write_card(model_dir: str | Path, bench: BenchResult | dict | str | Path | None = None, repo_id: str | None = None,
               compare: str | Path | None = None) -> Path:
    """Write ``README.md``, ``custom_generate/`` and the modeling code (:func:`write_remote_code`) into a drafter folder.

    Args:
        model_dir: a folder written by :meth:`DSparkDrafter.save_pretrained` (plus ``calibration.json``
            and ``training.json`` when they exist).
        bench: benchmark results, as a :class:`BenchResult`, a dict or a JSON file; ``None`` = not measured.
        compare: JSON file of ``scripts/compare_generate.py``, or ``None``.
        repo_id: the Hub id the folder will be pushed to. ``None`` keeps the one the card was last
            written for, else the snippets load the local folder (and ``dspark push`` asks for an id).

    Returns:
        The path of ``README.md``.

    Raises:
        FileNotFoundError: no ``config.json``; ``bench`` file missing.
        ValueError: the config's target is not a Hub id.
    """
    from ..modeling.configuration_dspark import DSparkConfig

    model_dir = Path(model_dir)
    if repo_id is not None:
        _check_repo_id(repo_id)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: pass a folder written by "
                                "DSparkDrafter.save_pretrained.")
    if bench is not None and not isinstance(bench, (dict, BenchResult)):
        if not Path(bench).is_file():
            raise FileNotFoundError(f"Benchmark results {bench} not found.")
        bench = json.loads(Path(bench).read_text())
    write_remote_code(model_dir)
    config = DSparkConfig.from_pretrained(model_dir)
    repo_id = repo_id or card_repo_id(model_dir)
    card = build_card(
        config,
        repo=repo_id or str(model_dir),
        bench=bench,
        training=_read_json(model_dir / TRAINING_FILE),
        calibration=_read_json(model_dir / CALIBRATION_FILE),
        n_params=_count_params(model_dir),
        has_diagram=(model_dir / RELIABILITY_FILE).is_file(),
        compare=json.loads(Path(compare).read_text()) if compare is not None else None,
        local_folder=repo_id is None,
    )
    write_custom_generate(model_dir, repo_id)
    card.save(model_dir / "README.md")
    return model_dir / "README.md"
