"""``BenchSettings``: what one bench run does (``dspark bench`` flags through ``HfArgumentParser``)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))  # 0, 0.1, ..., 0.9 (paper Fig. 5)


@dataclass
class BenchSettings:
    """What one bench run does: ``dspark bench`` flags of the same names (``HfArgumentParser``, see
    :mod:`dspark_hf.cli.bench`)."""

    gamma: int = field(default=7, metadata={"help": "drafts per round γ (default: 7, as paper Table 1)"})
    max_new_tokens: int = field(default=96, metadata={"help": "new tokens per generation (default: 96; 32 with --limit)"})
    limit: int = field(default=4, metadata={  # the default run (3 suites, 3 drafters) takes ~12 min on 2 CPU cores
        "help": "prompts per suite; giving it makes a quick run at 32 new tokens unless --max-new-tokens is given "
                "too (default: the full run, 4 prompts per suite at 96 tokens)"})
    max_prompt_tokens: int = field(default=320, metadata={  # the training data used <= 320
        "help": "skip longer chat-formatted prompts (default: 320)"})
    thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_THRESHOLDS), metadata={
        "help": "static thresholds of the sweep (paper Fig. 5; default 0, 0.1, ..., 0.9)"})
    sampling_temperature: float = field(default=1.0, metadata={"help": "temperature of the sampled τ pass (the T = 1 "
                                                                       "protocol of paper §4.1)"})
    prompt_lookup_num_tokens: int = field(default=7, metadata={
        "aliases": ["--prompt-lookup"],  # transformers' PromptLookupCandidateGenerator baseline
        "help": "prompt_lookup_num_tokens of the prompt-lookup baseline (default: 7)"})
    warmup_tokens: int = field(default=8, metadata={"help": "one untimed generation of this length per method before "
                                                            "pass 2 (default 8)"})
    repeats: int = field(default=1, metadata={
        "help": "wall-clock runs of every method per prompt (passes 2 and 3), interleaved with the order rotated each "
                "time; a prompt's time per method is the median of its runs (default 1)"})
    lockstep: bool = field(default=False, metadata={
        "help": "passes 2 and 3: run every method but plain in lockstep with a plain generate of the same prompt (one "
                "target forward of each in turn, each timed on its own turns: dspark_hf.bench.lockstep), --repeats "
                "such pairs per prompt; a prompt's speedup is the median of its pairs' ratios, so the machine's "
                "drift from minute to minute hits both sides of each ratio; the floor pass (pass 4) likewise runs "
                "each floor run in lockstep with a plain generate of its own and compares it with those partners "
                "(default: off, methods interleaved)"})
    floor_repeats: int = field(default=2, metadata={
        "help": "the floor pass (pass 4, the floor table): each prompt this many times with the default method's drafting forced "
                "off, interleaved with plain generate, or with --lockstep each run in lockstep with a plain generate of its own "
                "(default 2; 0 skips it)"})

    def __post_init__(self):
        for name, value, least in (("gamma", self.gamma, 1), ("max_new_tokens", self.max_new_tokens, 2),
                                   ("limit", self.limit, 1), ("repeats", self.repeats, 1), ("floor_repeats", self.floor_repeats, 0)):
            if value < least:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= {least}, got {value}")
