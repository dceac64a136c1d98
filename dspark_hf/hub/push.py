"""``dspark push``: check a card folder is a complete Hub repo, then upload it as it is."""

from __future__ import annotations

import json
from pathlib import Path

from ..decoding.verification import POLICIES
from ..modeling.modeling_dspark import CALIBRATION_FILE
from .card import _check_modeling_code, _check_repo_id, _weight_files, card_repo_id
from .sections import _UPLOAD_IGNORE


class HubTokenError(RuntimeError):
    """No Hugging Face token is available for an upload."""


REQUIRED_FILES = ("README.md", "config.json", "custom_generate/generate.py", "custom_generate/requirements.txt")


def check_card_folder(model_dir: str | Path, repo_id: str) -> None:
    """Raise unless ``model_dir`` is a complete drafter repo whose card was written for ``repo_id``."""
    _check_repo_id(repo_id)
    model_dir = Path(model_dir)
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if not _weight_files(model_dir):
        missing.append("model.safetensors")
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks {', '.join(missing)}: run "
                                f"`dspark card {model_dir} --repo-id {repo_id}` on a saved drafter first.")
    config = json.loads((model_dir / "config.json").read_text())
    _check_modeling_code(model_dir, config)
    mode = config.get("verification", "scheduler")
    if POLICIES[mode].needs_calibration and not (model_dir / CALIBRATION_FILE).is_file():
        raise FileNotFoundError(f"{model_dir} has no {CALIBRATION_FILE} and its default verification {mode!r} "
                                f"which needs it: run `dspark calibrate --drafter {model_dir}` first.")
    written_for = card_repo_id(model_dir)
    if written_for != repo_id:
        raise ValueError(f"The card in {model_dir} was written for {written_for or 'a local folder'}, not {repo_id}: "
                         f"run `dspark card {model_dir} --repo-id {repo_id}` (with the same --bench) first.")


def push(model_dir: str | Path, repo_id: str, private: bool = False, token: str | None = None,
         commit_message: str = "Upload DSpark drafter"):
    """Upload a drafter folder to ``repo_id`` so that the repo holds exactly the folder's files.

    The folder is checked (:func:`check_card_folder`) and a token looked up before any network call.
    Files of the repo that are no longer in the folder are deleted (``.gitattributes`` is kept).

    Returns:
        The :class:`huggingface_hub.CommitInfo` of the upload.

    Raises:
        HubTokenError: no token (``hf auth login`` / ``huggingface-cli login``, or ``HF_TOKEN``).
        FileNotFoundError, ValueError: see :func:`check_card_folder`.
    """
    import huggingface_hub

    check_card_folder(model_dir, repo_id)
    token = token or huggingface_hub.get_token()
    if not token:
        raise HubTokenError("No Hugging Face token found: log in with `hf auth login` (formerly `huggingface-cli "
                            "login`) or set the HF_TOKEN environment variable, with write access to "
                            f"{repo_id.split('/')[0]}.")
    api = huggingface_hub.HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(repo_id=repo_id, folder_path=str(model_dir), repo_type="model",
                             commit_message=commit_message, ignore_patterns=_UPLOAD_IGNORE, delete_patterns="*")
