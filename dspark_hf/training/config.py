"""``TrainConfig``: everything that determines a training run, read from ``configs/*.yaml`` and overridden by
``dspark train`` flags (both through ``HfArgumentParser``). Light to import: the CLI builds its flags from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import HfArgumentParser


@dataclass
class TrainConfig:
    """Everything that determines a training run (read from a YAML file by ``dspark train``).

    Budget: training stops at ``steps`` optimizer steps or ``max_minutes`` of wall time, whichever
    comes first, so drafters compared in benchmarks can share one budget.
    """

    data_dir: list[str] = field(default_factory=lambda: ["runs/data"])  # train on all; `dspark train` fills the first
    out_dir: str = "runs/drafter"
    # drafter
    num_hidden_layers: int = 2
    sequential_head: str = "markov"
    sequential_rank: int = 128
    confidence_head: bool = True
    block_size: int = 7
    num_context_layers: int = 4
    draft_vocab_size: int | None = 8192
    init_from_target_layers: list[int] | None = None  # copy these target decoder layers into the drafter's (one each)
    init_from: str | None = None  # warm start: a drafter folder whose weights (and draft vocabulary) training starts from
    # data
    target_tokens: int = 300_000
    gen_batch_size: int = 48
    max_new_tokens: int = 192
    tokens_file: str | None = None  # committed token ids of past regenerations (data.export_tokens): featurized, not regenerated
    replies: str = "target"  # "target": regenerated (paper §4.1); "dataset": ShareGPT's own replies, teacher-forced
    turns: str = "first"  # ShareGPT prompts: "first" user messages; "all": then every later one with its history (#22)
    max_prompt_tokens: int = 320  # longer chat-templated prompts are left out of the queue
    labels: str = "data"  # cross-entropy label: "data" (the next token of the row) or "target" (the target's top-1)
    # optimisation
    steps: int = 3000
    max_minutes: float = 60.0
    sequences_per_step: int = 8
    anchors_per_sequence: int = 24
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    decay: float | None = 4.0  # λ of w_k = exp(-(k-1)/λ): 4 as DeepSpec and speculators; None = block size (paper §3.3)
    mask_token_id: int | None = None  # v2 mask slots: target token id; None = reserved_mask_token(tokenizer)
    loss_weights: dict = field(default_factory=lambda: {"ce": 0.1, "tv": 0.9, "conf": 1.0})
    seed: int = 0
    eval_every: int = 250
    save_every: int = 250
    val_sequences: int = 32
    threads: int | None = None  # torch CPU threads (None: torch's default)
    mixed_precision: str = "no"  # accelerate's: "bf16" runs the drafter's forward under bf16 autocast (fp32 weights)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Read a YAML mapping of :class:`TrainConfig` fields, then ``overrides`` (the ``dspark train`` flags given);
        unknown keys raise ``ValueError``. Parsed by ``HfArgumentParser``, which also makes the flags."""
        values = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"Unknown training config keys in {path}: {sorted(unknown)}")
        (config,) = HfArgumentParser(cls).parse_dict({**values, **overrides})
        return config

    def __post_init__(self):
        if isinstance(self.data_dir, (str, Path)):  # one folder, as most configs write it
            self.data_dir = [str(self.data_dir)]
        for key, allowed in (("replies", ("target", "dataset")), ("labels", ("data", "target")), ("turns", ("first", "all")),
                             ("mixed_precision", ("no", "bf16", "fp16"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
