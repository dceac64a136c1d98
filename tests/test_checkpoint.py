"""Atomic training checkpoints (issue #27): a save never removes the old checkpoint before the new one is complete,
and training resumes from whatever complete checkpoint a crash left."""

import json
from pathlib import Path

import pytest
import torch
from test_training import tiny_data  # noqa: F401 (a fixture)

from dspark_hf.training.checkpoint import recover_checkpoint, save_checkpoint
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.trainer import train


class _Drafter:
    """Stands in for a drafter: ``save_pretrained`` writes one weights file holding ``tag``."""

    def __init__(self, tag: str):
        self.tag = tag

    def save_pretrained(self, folder, max_shard_size):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_text(self.tag)


def _save(out: Path, step: int):
    param = torch.nn.Parameter(torch.zeros(2))
    save_checkpoint(_Drafter(f"weights of step {step}"), torch.optim.AdamW([param]), torch.Generator(), step, 1.5,
                    out / "checkpoint")


def _saved_step(ckpt: Path) -> tuple[int, str]:
    state = torch.load(ckpt / "state.pt", weights_only=False)
    return state["step"], (ckpt / "model.safetensors").read_text()


def _fail_on(monkeypatch, method_owner, name, when):
    original = getattr(method_owner, name)

    def failing(*args, **kwargs):
        if when(*args):
            raise OSError("disk full (simulated)")
        return original(*args, **kwargs)

    monkeypatch.setattr(method_owner, name, failing)


def test_a_save_that_fails_while_writing_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    _fail_on(monkeypatch, torch, "save", lambda obj, path, *a: Path(path).name == "state.pt")
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2)
    assert (tmp_path / "checkpoint.partial").is_dir()  # the incomplete new one, never resumed from
    assert recover_checkpoint(tmp_path) == tmp_path / "checkpoint"
    assert _saved_step(tmp_path / "checkpoint") == (1, "weights of step 1")
    monkeypatch.undo()
    _save(tmp_path, 3)  # the next save replaces the stale partial folder
    assert _saved_step(tmp_path / "checkpoint") == (3, "weights of step 3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_a_crash_between_the_renames_resumes_from_the_old_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    _fail_on(monkeypatch, Path, "rename", lambda src, dst: src.name == "checkpoint.partial")
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint").exists() and (tmp_path / "checkpoint.old" / "state.pt").is_file()
    assert recover_checkpoint(tmp_path) == tmp_path / "checkpoint"
    assert _saved_step(tmp_path / "checkpoint") == (1, "weights of step 1")
    assert not (tmp_path / "checkpoint.old").exists()


def test_no_checkpoint_and_an_incomplete_folder_resume_nothing(tmp_path):
    assert recover_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint").mkdir()  # e.g. weights written, state.pt not
    assert recover_checkpoint(tmp_path) is None


def test_training_resumes_from_the_checkpoint_a_failed_save_left(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    target, out = tiny_data
    cfg = TrainConfig(data_dir=str(out), out_dir=str(tmp_path / "run"), num_hidden_layers=1, sequential_rank=8,
                      block_size=4, num_context_layers=2, draft_vocab_size=None, mask_token_id=0, steps=4,
                      sequences_per_step=2, anchors_per_sequence=4, warmup_steps=2, eval_every=100, save_every=2,
                      val_sequences=2)
    saves = []
    _fail_on(monkeypatch, torch, "save", lambda obj, path, *a: Path(path).name == "state.pt"
             and (saves.append(obj["step"]) or obj["step"] == 4))
    with pytest.raises(OSError, match="simulated"):
        train(target, cfg, progress=False)
    monkeypatch.undo()
    assert saves == [2, 4]
    ckpt = tmp_path / "run" / "checkpoint"
    assert torch.load(ckpt / "state.pt", weights_only=False)["step"] == 2
    final = train(target, cfg, progress=False)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 3, 4]  # the failed run logged 3 and 4; the resumed one re-ran them from 2
    assert json.loads((final / "training.json").read_text())["steps"] == 4
    assert torch.load(ckpt / "state.pt", weights_only=False)["step"] == 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
