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

    data_dir: list[str] = field(default_factory=lambda: ["runs/data"], metadata={"help": "data folders to train on, all of them; `dspark train` regenerates into the first"})
    out_dir: str = field(default="runs/drafter", metadata={"help": "folder for checkpoints, the log and the final drafter"})
    # drafter
    num_hidden_layers: int = field(default=2, metadata={"help": "drafter decoder layers"})
    sequential_head: str = field(default="markov", metadata={"help": "sequential head: none, markov or rnn (paper eqs. 4-6)"})
    sequential_rank: int = field(default=128, metadata={"help": "rank r of the sequential head's W1 / W2"})
    confidence_head: bool = field(default=True, metadata={"help": "train the confidence head c_k (paper eq. 7)"})
    block_size: int = field(default=7, metadata={"help": "block size γ: drafts per round"})
    num_context_layers: int = field(default=4, metadata={"help": "target layers whose hidden states feed the drafter (spread over the depth)"})
    draft_vocab_size: int | None = field(default=8192, metadata={"help": "draft over the N most frequent tokens of the target's responses (None: the full vocabulary)"})
    init_from_target_layers: list[int] | None = field(default=None, metadata={"help": "copy these target decoder layers into the drafter's (one each)"})
    init_from: str | None = field(default=None, metadata={"help": "warm start: a drafter folder whose weights (and draft vocabulary) training starts from"})
    # data
    target_tokens: int = field(default=300_000, metadata={"help": "response tokens to regenerate with the target"})
    gen_batch_size: int = field(default=48, metadata={"help": "prompts regenerated at once"})
    max_new_tokens: int = field(default=192, metadata={"help": "new tokens per regenerated reply"})
    tokens_file: str | None = field(default=None, metadata={"help": "committed token ids of past regenerations (data.export_tokens): featurized, not regenerated"})
    replies: str = field(default="target", metadata={"help": '"target": regenerated (paper §4.1); "dataset": ShareGPT\'s own replies, teacher-forced'})
    turns: str = field(default="first", metadata={"help": 'ShareGPT prompts: "first" user messages; "all": then every later one with its history (#22)'})
    max_prompt_tokens: int = field(default=320, metadata={"help": "longer chat-templated prompts are left out of the queue"})
    labels: str = field(default="data", metadata={"help": 'cross-entropy label: "data" (the next token of the row) or "target" (the target\'s top-1)'})
    # optimisation
    steps: int = field(default=3000, metadata={"help": "optimizer steps at most (training also stops at max_minutes)"})
    max_minutes: float = field(default=60.0, metadata={"help": "wall-clock minutes at most (training also stops at steps)"})
    sequences_per_step: int = field(default=8, metadata={"help": "sequences per optimizer step (the global batch, split over processes)"})
    anchors_per_sequence: int = field(default=24, metadata={"help": "anchors (blocks) trained per sequence"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the cosine schedule ends at min_lr_ratio * lr"})
    warmup_steps: int = field(default=100, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    decay: float | None = field(default=4.0, metadata={"help": "λ of the position weights w_k = exp(-(k-1)/λ): 4 as DeepSpec and speculators; None = block size (paper §3.3)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "v2 mask slots: target token id; None = reserved_mask_token(tokenizer)"})
    loss_weights: dict = field(default_factory=lambda: {"ce": 0.1, "tv": 0.9, "conf": 1.0}, metadata={"help": "weights of the cross-entropy, total-variation and confidence losses (paper eqs. 9-12), as JSON"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    eval_every: int = field(default=250, metadata={"help": "steps between validation evaluations"})
    save_every: int = field(default=250, metadata={"help": "steps between checkpoints"})
    val_sequences: int = field(default=32, metadata={"help": "validation rows per evaluation"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (None: torch's default)"})
    mixed_precision: str = field(default="no", metadata={"help": 'accelerate\'s: "bf16" runs the drafter\'s forward under bf16 autocast (fp32 weights)'})

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
