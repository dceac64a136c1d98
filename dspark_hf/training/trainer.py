"""Drafter training (paper §3.3, eqs. 8-12) on cached target features.

Each step samples sequences, draws many anchors per sequence and packs every anchor's γ-token block
into one dense forward (anchor-bounded packing: block ``b`` sees context positions ``< a_b`` only).
The target is never run here: its context-layer features and top-K next-token distributions were
cached by :mod:`dspark_hf.training.data` while it regenerated the responses.

Under ``accelerate launch`` (DDP) the N processes split each step's global batch of
``sequences_per_step`` sequences, all-reduce the gradients and take the same optimizer step as one
process would; only the main process evaluates and writes logs and checkpoints.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast
from tqdm.auto import tqdm

from ..modeling.configuration_dspark import DSparkConfig
from ..modeling.modeling_dspark import DSparkDrafter
from .checkpoint import MAX_SHARD_SIZE, recover_checkpoint, save_checkpoint
from .config import TrainConfig
from .curve import positions_per_step, run_curve
from .losses import dspark_loss, expected_tau, greedy_survival, position_weights
from .packing import FeatureBatcher, FeatureStore

TRIM_EVERY = 10  # steps between release_free_memory() calls (glibc malloc_trim: a few ms each)


def choose_draft_vocab(store: FeatureStore, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent response tokens of the store's rows (target ids ``[size]``, sorted, on the CPU)."""
    counts = torch.bincount(store.response_tokens().cpu(), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def reserved_mask_token(tokenizer, draft_vocab: torch.Tensor | None = None) -> int:
    """The default v2 ``mask_token_id`` for a target's tokenizer (issue #11).

    Rule: the tokenizer's own ``mask_token_id`` if it has one; else the highest-id added (reserved)
    token that is not one of its special tokens in use (bos/eos/pad/unk, ``all_special_ids``) and not
    in ``draft_vocab`` (``[V']`` target ids; the drafter never drafts its mask token). SmolLM2 gives 16
    (``<empty_output>``).

    Raises:
        ValueError: no such token; set ``mask_token_id`` in the training config.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    taken = set(tokenizer.all_special_ids) | set(draft_vocab.tolist() if draft_vocab is not None else ())
    free = [i for i in tokenizer.added_tokens_decoder if i not in taken]
    if not free:
        raise ValueError("The tokenizer has no reserved token outside the draft vocabulary for the mask slots: "
                         "set mask_token_id in the training config (a target token id the drafter never drafts).")
    return max(free)


# ----------------------------------------------------------------------------------- training
def check_rows(train_rows: FeatureStore, val_rows: FeatureStore, cfg: TrainConfig) -> None:
    """Refuse data folders without a training row before anything is built from them.

    The prompt queue serves the held-out conversations' prompts first (:mod:`dspark_hf.sources.prompt_queue`), so a
    small ``target_tokens`` can fill every shard with validation rows.

    Raises:
        ValueError: ``train_rows`` or ``val_rows`` is empty (the message names the folders, the rows found and the
            fix); validation scores every logged step and the final drafter, so it cannot be skipped.
    """
    folders = ', '.join(map(str, cfg.data_dir))
    if len(train_rows) == 0:
        raise ValueError(
            f"No training rows in {folders} ({len(val_rows)} validation rows): the prompt queue serves the held-out "
            "prompts first, so a small data run holds validation rows only. Generate more data (a larger "
            "--target_tokens) and train again.")
    if len(val_rows) == 0:
        raise ValueError(
            f"No validation rows in {folders} ({len(train_rows)} training rows): training scores the drafter on "
            "held-out rows. Add a folder that holds them to --data_dir (the first shards of a data run do: the "
            "prompt queue serves the held-out prompts first).")


def build_drafter(target, cfg: TrainConfig, train_rows: FeatureStore, tokenizer=None) -> DSparkDrafter:
    """A fresh v2 drafter for ``target``; its draft vocabulary is chosen from the training responses (``train_rows``).

    The mask token is ``cfg.mask_token_id``, else :func:`reserved_mask_token` of ``tokenizer``.

    Raises:
        ValueError: neither ``cfg.mask_token_id`` nor a ``tokenizer`` is given (the message names the
            config key), or as :class:`DSparkConfig`.
    """
    vocab = target.get_output_embeddings().weight.shape[0]
    draft_vocab_size = min(cfg.draft_vocab_size, vocab) if cfg.draft_vocab_size else None
    draft_vocab = choose_draft_vocab(train_rows, draft_vocab_size, vocab) if draft_vocab_size else None
    mask_token_id = cfg.mask_token_id
    if mask_token_id is None:
        if tokenizer is None:
            raise ValueError("Set mask_token_id in the training config (a reserved target token outside the draft "
                             "vocabulary, e.g. 16 = <empty_output> for SmolLM2), or pass the target's tokenizer.")
        mask_token_id = reserved_mask_token(tokenizer, draft_vocab)
    config = DSparkConfig.for_target(
        target,
        num_context_layers=cfg.num_context_layers,
        num_hidden_layers=cfg.num_hidden_layers,
        sequential_head=cfg.sequential_head,
        sequential_rank=cfg.sequential_rank,
        confidence_head=cfg.confidence_head,
        block_size=cfg.block_size,
        draft_vocab_size=draft_vocab_size,
        verification="scheduler" if cfg.confidence_head else "fixed",
        mask_token_id=mask_token_id,
    )
    drafter = DSparkDrafter(config)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab)
    if cfg.init_from_target_layers:
        init_layers_from_target(drafter, target, cfg.init_from_target_layers)
    return drafter.bind(target)


def warm_start(target, cfg: TrainConfig) -> DSparkDrafter:
    """The drafter of ``cfg.init_from``, to train further (its weights and draft vocabulary; the optimizer, the
    schedule and the step count start afresh; the calibration is dropped: it no longer fits once trained).

    Raises:
        ValueError: the folder's drafter differs from ``cfg`` in architecture (the message names the fields).
    """
    drafter = DSparkDrafter.from_pretrained(cfg.init_from)
    c = drafter.config
    differ = [f"{name}: {have} in {cfg.init_from}, {want} in the config" for name, have, want in (
        ("num_hidden_layers", c.num_hidden_layers, cfg.num_hidden_layers),
        ("sequential_head", c.sequential_head, cfg.sequential_head),
        ("sequential_rank", c.sequential_rank, cfg.sequential_rank),
        ("confidence_head", c.confidence_head, cfg.confidence_head),
        ("block_size", c.block_size, cfg.block_size),
        ("num_context_layers", len(c.target_layer_ids), cfg.num_context_layers),
    ) if have != want]
    if differ:
        raise ValueError("init_from must hold a drafter of the configured architecture; set the config to match or "
                         "drop init_from:\n- " + "\n- ".join(differ))
    drafter.calibration = None
    return drafter.bind(target)


def init_layers_from_target(drafter: DSparkDrafter, target, layer_ids: list[int]):
    """Start drafter layer ``j`` as a copy of target decoder layer ``layer_ids[j]`` (attention, MLP, norms).

    The drafter's layers use transformers' Llama parameter names and the target's shapes, so the copy is a
    ``load_state_dict``; parameters the target layer lacks (e.g. QK-norm weights on a Llama target) keep
    their fresh initialisation.

    Raises:
        ValueError: not one target layer per drafter layer, or a layer id outside the target.
    """
    layers = target.model.layers
    if len(layer_ids) != len(drafter.layers) or any(not 0 <= i < len(layers) for i in layer_ids):
        raise ValueError(
            f"init_from_target_layers needs {len(drafter.layers)} ids in 0..{len(layers) - 1}, got {layer_ids}"
        )
    for layer, i in zip(drafter.layers, layer_ids):
        result = layer.load_state_dict(layers[i].state_dict(), strict=False)
        if result.unexpected_keys:
            raise ValueError(f"target layer {i} has parameters the drafter layer lacks: {result.unexpected_keys}")


def learning_rate(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` over the budget.

    Progress is the larger of ``step / steps`` and ``elapsed / max_minutes``, so a run stopped by its
    wall-clock budget still finishes its schedule.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(step / cfg.steps, elapsed_s / (60 * cfg.max_minutes)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(drafter, batch, weights, loss_weights):
    """Forward + loss on one packed batch; returns ``(loss, parts)`` (no optimizer step)."""
    out = drafter(batch["features"], batch["anchors"], batch["tokens"])
    flat = lambda t: t.flatten(0, 1) if t is not None else None  # noqa: E731
    loss, parts = dspark_loss(
        flat(out.logits), flat(out.confidence_logits), flat(batch["labels"]), flat(batch["target_ids"]),
        flat(batch["target_probs"]), flat(batch["valid"]), weights, loss_weights,
    )
    parts["greedy"] = greedy_survival(flat(out.logits).detach(), flat(batch["target_ids"]), flat(batch["valid"]))
    return loss, parts


@torch.no_grad()
def evaluate(drafter, batches, weights, loss_weights) -> dict:
    """Mean loss parts, per-position acceptance estimate c*_k and τ estimate on fixed batches."""
    drafter.eval()
    sums, accept, greedy = {}, 0, 0
    for batch in batches:
        loss, parts = train_step(drafter, batch, weights, loss_weights)
        for k, v in parts.items():
            if k not in ("accept", "greedy"):
                sums[k] = sums.get(k, 0.0) + float(v)
        sums["loss"] = sums.get("loss", 0.0) + float(loss)
        accept, greedy = accept + parts["accept"], greedy + parts["greedy"]
    drafter.train()
    accept, greedy = accept / len(batches), greedy / len(batches)
    return {**{k: v / len(batches) for k, v in sums.items()}, "accept": accept.tolist(), "tau": expected_tau(accept),
            "greedy_survival": greedy.tolist(), "greedy_tau": 1.0 + float(greedy.sum())}


def train(target, cfg: TrainConfig, progress: bool = True, command: str | None = None) -> Path:
    """Train a drafter for ``target`` on the folders of ``cfg.data_dir``; checkpoints and resumes in ``cfg.out_dir``.

    Returns the folder of the final drafter (``out_dir/final``), loadable with
    ``DSparkDrafter.from_pretrained`` (safetensors shards of at most :data:`~dspark_hf.training.checkpoint.MAX_SHARD_SIZE`). A
    ``log.jsonl`` records training and validation metrics; ``final/training.json`` the budget used, the draft
    positions trained per second of the loop (``positions_per_s``), the number of processes, the config, the final
    validation, ``command`` and the learning curve (:func:`~dspark_hf.training.curve.run_curve`, a warm start's
    included). Batches are packed on the target's device (:mod:`~dspark_hf.training.packing`).

    Training runs on the target's device. Under ``accelerate launch`` each process calls this with the
    target on its own ``accelerator.device``; the processes split every global batch of
    ``sequences_per_step`` sequences and take identical optimizer steps (gradients all-reduced), and only
    the main process evaluates and writes ``out_dir``. Every process returns the final folder.

    Raises:
        ValueError: ``sequences_per_step`` is not a multiple of the number of processes, or the target is
            not on this process's device.
    """
    run = _prepare(target, cfg)
    step, validated, trained_s = _loop(run, progress)
    final = run.out / "final"
    if run.accelerator.is_main_process:
        _write_final(run, final, step, validated, trained_s, command)
    run.accelerator.wait_for_everyone()  # the final folder exists for every process that returns it
    return final


@dataclass
class _Run:
    """What the phases of one :func:`train` call share (built by :func:`_prepare`)."""

    cfg: TrainConfig
    accelerator: Accelerator
    device: torch.device
    out: Path
    drafter: DSparkDrafter  # the unwrapped drafter: evaluated and saved
    model: torch.nn.Module  # `drafter` itself, or its DDP wrapper: trained
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    generator: torch.Generator  # the batch sampler's, saved in checkpoints
    batcher: FeatureBatcher
    val_batches: list[dict]
    weights: torch.Tensor  # position weights (γ,)
    step: int  # optimizer steps taken (a resumed run's included)
    elapsed: float  # seconds trained before this call (a resumed run's)
    start: float = 0.0  # perf_counter() of the loop's (virtual) start, `elapsed` before it; set by _loop

    def clock(self) -> float:
        """Seconds since the start by the main process's clock: all processes agree on LR and stop."""
        now = torch.tensor([time.perf_counter() - self.start], dtype=torch.float64, device=self.device)
        return float(broadcast(now))


def _prepare(target, cfg: TrainConfig) -> _Run:
    """Phase 1 of :func:`train`: checks, ``out_dir`` and its config, the data, the drafter and optimizer (a
    checkpoint's, a warm start's or fresh) prepared by accelerate, and the validation batches."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # the only process, or this one of `accelerate launch`
    accelerator = Accelerator(cpu=target.device.type == "cpu", mixed_precision=cfg.mixed_precision)
    world = accelerator.num_processes
    if cfg.sequences_per_step % world:
        raise ValueError(f"sequences_per_step ({cfg.sequences_per_step}) is the global batch of all {world} processes: "
                         f"make it a multiple of {world}.")
    device = torch.empty(0, device=accelerator.device).device  # "cpu:0" (a multi-CPU run's) is "cpu"
    if target.device != device:
        raise ValueError(f"The target is on {target.device} but this process trains on {device}: move it there first.")
    out = Path(cfg.out_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
        recover_checkpoint(out)  # one process repairs an interrupted save before any reads the checkpoint
    accelerator.wait_for_everyone()
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    # the rows stay where the batches are built: memory-mapped on a CPU, in an accelerator's memory
    train_rows, val_rows = (FeatureStore.from_shards(cfg.data_dir, split, device) for split in ("train", "validation"))
    check_rows(train_rows, val_rows, cfg)
    ckpt = recover_checkpoint(out)
    if ckpt is not None:
        drafter = DSparkDrafter.from_pretrained(ckpt).bind(target)
    elif cfg.init_from:
        drafter = warm_start(target, cfg)
    else:
        drafter = build_drafter(target, cfg, train_rows)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, elapsed = 0, 0.0
    if ckpt is not None:
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step, elapsed = state["step"], state["elapsed"]
    model, optimizer = accelerator.prepare(drafter, optimizer)  # model: `drafter` itself, or its DDP wrapper
    val_batcher = FeatureBatcher(val_rows, drafter, cfg.block_size, torch.Generator().manual_seed(1), cfg.labels)
    val = val_batcher.usable(cfg.val_sequences)
    val_batches = [val_batcher.pack(val[i : i + 8], cfg.anchors_per_sequence) for i in range(0, len(val), 8)]
    return _Run(cfg, accelerator, device, out, drafter, model, optimizer, params, generator,
                FeatureBatcher(train_rows, drafter, cfg.block_size, generator, cfg.labels), val_batches,
                position_weights(cfg.block_size, cfg.decay), step, elapsed)


def _optimizer_step(run: _Run, now: float) -> tuple[torch.Tensor, dict]:
    """One optimizer step on this process's share of a global batch; returns the global batch's ``(loss, parts)``."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.device
    rank, world = accelerator.process_index, accelerator.num_processes
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(cfg, run.step, now)
    batch = run.batcher.sample(cfg.sequences_per_step, cfg.anchors_per_sequence, rank, world)  # built on `device`
    loss, parts = train_step(run.model, batch, run.weights, cfg.loss_weights)
    # the loss is a mean over this process's weighted positions (dspark_loss's Σ w): weighted by their share
    # of the global batch's, DDP's average of the processes' gradients is the one-process gradient
    total = (run.weights.to(device) * batch["valid"]).sum()
    share = world * total / accelerator.reduce(total, "sum")  # 1.0 for one process
    run.optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss * share)
    accelerator.clip_grad_norm_(run.params, cfg.grad_clip)
    run.optimizer.step()
    # the log's metrics are the global batch's: the processes' share-weighted means
    return accelerator.reduce((loss.detach() * share, {k: v * share for k, v in parts.items()}), "mean")


def _loop(run: _Run, progress: bool) -> tuple[int, tuple, float]:
    """Phase 2 of :func:`train`: optimizer steps until ``cfg.steps`` or ``cfg.max_minutes``; the main process logs
    every step to ``log.jsonl``, validates every ``eval_every`` and checkpoints every ``save_every`` steps.

    Returns:
        ``(step, (validated_step, validation), trained_s)``: the last validation (``(None, None)`` if none ran in
        the loop) and the loop's wall time, evaluations and checkpoints included.
    """
    cfg, main, validated = run.cfg, run.accelerator.is_main_process, (None, None)
    log = (run.out / "log.jsonl").open("a") if main else None
    if run.step == 0 and main:
        log.write(json.dumps({"step": 0, "validation": evaluate(run.drafter, run.val_batches, run.weights,
                                                                 cfg.loss_weights)}) + "\n")
    bar = tqdm(total=cfg.steps, initial=run.step, desc="train", disable=not (progress and main))
    run.start = time.perf_counter() - run.elapsed
    while run.step < cfg.steps and (now := run.clock()) < 60 * cfg.max_minutes:
        loss, parts = _optimizer_step(run, now)
        run.step += 1
        if not main:  # only the main process logs, evaluates and saves
            continue
        bar.update(1)
        bar.set_postfix({k: f"{float(v):.3f}" for k, v in parts.items() if k not in ("accept", "greedy")}
                        | {"tau": f"{expected_tau(parts['accept']):.2f}"})
        record = _step_record(run, loss, parts)
        if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
            record["validation"] = evaluate(run.drafter, run.val_batches, run.weights, cfg.loss_weights)
            validated = (run.step, record["validation"])  # the final validation when the loop ends here
        log.write(json.dumps(record) + "\n")
        log.flush()
        if run.step % cfg.save_every == 0:
            save_checkpoint(run.drafter, run.optimizer, run.generator, run.step, time.perf_counter() - run.start,
                            run.out / "checkpoint")
        if run.step % TRIM_EVERY == 0:
            release_free_memory()
    bar.close()
    if log is not None:
        log.close()
    return run.step, validated, time.perf_counter() - run.start


def _step_record(run: _Run, loss: torch.Tensor, parts: dict) -> dict:
    """The ``log.jsonl`` record of the step just taken (global-batch loss parts, τ estimates, LR, time)."""
    record = {"step": run.step, "time_s": time.perf_counter() - run.start, "loss": float(loss),
              "lr": run.optimizer.param_groups[0]["lr"]}
    record |= {k: float(v) for k, v in parts.items() if k not in ("accept", "greedy")}
    return record | {"tau_est": expected_tau(parts["accept"]), "greedy_tau": 1.0 + float(parts["greedy"].sum())}


def _write_final(run: _Run, final: Path, step: int, validated: tuple, trained_s: float, command: str | None):
    """Phase 3 of :func:`train` (main process): the final drafter and its ``training.json``."""
    cfg = run.cfg
    run.drafter.save_pretrained(final, max_shard_size=MAX_SHARD_SIZE)
    validation = validated[1] if validated[0] == step else evaluate(run.drafter, run.val_batches, run.weights,
                                                                    cfg.loss_weights)
    (final / "training.json").write_text(
        json.dumps({"command": command, "processes": run.accelerator.num_processes, "steps": step,
                    "minutes": (time.perf_counter() - run.start) / 60,
                    "positions_per_s": step * positions_per_step(cfg) / max(trained_s, 1e-9), "config": asdict(cfg),
                    "validation": validation, "curve": run_curve(run.out / "log.jsonl", cfg, (step, validation))},
                   indent=2)
    )


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``); ``False`` where there is no glibc.

    A CPU training process otherwise grows by heap fragmentation: rows and packed batches of a different size every
    step leave freed holes that glibc keeps (measured: +1.3 GB of anonymous memory per 100 steps, 8-11 GB after
    ~750, until the OOM killer ended a run). Trimming every :data:`TRIM_EVERY` steps keeps it flat.
    """
    trim = _malloc_trim()
    return trim is not None and trim(0) is not None


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``), or ``None``."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
