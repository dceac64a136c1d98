"""Export a v2 drafter to the checkpoint formats the serving engines load, and import theirs (issue #11).

Two formats, both a ``config.json`` + ``model.safetensors`` folder:

* ``"speculators"`` (vLLM ``method: "dspark"``; ``speculators`` 0.9.0 ``DSparkDraftModel``): a
  ``DSparkSpeculatorConfig`` (``speculators_model_type: "dspark"``, ``transformer_layer_config``, the
  verifier's name, ``aux_hidden_state_layer_ids`` in HF ``hidden_states`` indices = ours + 1,
  ``sample_from_anchor: true``); a reduced draft vocabulary is ``t2d``/``d2t`` plus the target's
  lm_head rows for it (``lm_head.weight``, sorted by target id), ``markov_w1`` covers the full vocabulary.
* ``"deepspec"`` (the DeepSpec/DFlash layout that SpecForge's ``DSparkDraftModel`` and SGLang read):
  a Qwen3 config with ``block_size``, ``num_target_layers`` and ``dflash_config`` (0-based
  ``target_layer_ids`` as ours, ``mask_token_id``, Markov/confidence settings); the lm_head and the
  embeddings are the target's full ones. A reduced draft vocabulary is kept exact in effect by one
  extra Markov rank: ``W1[:, r] = 1`` and ``W2[:, r] = -1e4`` on tokens outside it (0 inside), so the
  engine never drafts them (``exp(-1e4)`` is 0 in fp32/bf16); its index is recorded as
  ``dflash_config["dspark_hf_vocab_rank"]`` and removed again on import.

Shared by both: ``fc`` = ``W_c`` (eq. 2), ``hidden_norm`` = its RMSNorm, ``layers.*`` unchanged (same
names as ours), ``markov_head.markov_w1/markov_w2`` = ``W1``/``W2`` (eq. 5), ``markov_head.joint_proj``
= the RNN head's projection (eq. 6), ``confidence_head.proj`` = eq. 7's ``w`` and bias. A drafter
without a sequential head but with a confidence head exports a vanilla Markov head with ``W2 = 0``
(the references feed ``W1`` to the confidence head through their Markov head). Fields the formats
have no place for (verification mode, threshold, which head we had) travel in a ``dspark_hf`` entry
of ``config.json``, and ``calibration.json`` is copied, so export -> import gives back the same drafter.

Only v2 drafters export: the engines have no learned mask vector and apply QK-norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.utils.hub import cached_file

from ..decoding.calibration import SequentialTemperatureScaling
from ..modeling.configuration_dspark import DSparkConfig
from ..modeling.modeling_dspark import CALIBRATION_FILE, DSparkDrafter

FORMATS = ("speculators", "deepspec")
OUTSIDE_LOGIT = -1e4  # deepspec: Markov bias on tokens outside a reduced draft vocabulary
VOCAB_RANK_KEY = "dspark_hf_vocab_rank"
SPECULATORS_VERSION = "0.9.0"
WEIGHTS_FILE = "model.safetensors"
MARKOV_HEAD_TYPES = {"none": "vanilla", "markov": "vanilla", "rnn": "rnn"}  # ours -> the formats' (none: W2 = 0)


# ------------------------------------------------------------------------------------------ export
def export_drafter(drafter: DSparkDrafter | str | Path, out: str | Path, format: str = "speculators",
                   verifier_name_or_path: str | None = None) -> Path:
    """Write ``drafter`` (a v2 :class:`DSparkDrafter` or its folder) to ``out`` in an engine format.

    Args:
        drafter: the drafter; the speculators format with a reduced draft vocabulary stores the target's
            lm_head rows, so the drafter must then be bound to its target (``drafter.bind(target)``).
        out: output folder (created; existing files of the same names are replaced).
        format: ``"speculators"`` or ``"deepspec"`` (see the module docstring).
        verifier_name_or_path: speculators only: the verifier's Hub id or folder, from which the
            engine loads the embedding (default ``config.target_name_or_path``).

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: unknown ``format``; a v1 drafter (the message says to retrain as v2); a sequential head the
            formats lack (registered heads beyond markov and rnn); a reduced
            vocabulary for speculators on an unbound drafter; no verifier name for speculators.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not isinstance(drafter, DSparkDrafter):
        drafter = DSparkDrafter.from_pretrained(drafter)
    config = drafter.config
    if config.dspark_version < 2:
        raise ValueError("This is a v1 drafter (learned mask vector, no QK-norm): no serving engine runs that "
                         "architecture. Retrain it as v2 with `dspark train` (new drafters are v2), then export.")
    if config.sequential_head not in MARKOV_HEAD_TYPES:
        raise ValueError(f"The {config.sequential_head!r} sequential head has no counterpart in the serving formats "
                         f"(their heads: {', '.join(MARKOV_HEAD_TYPES)}).")
    heads = _heads(drafter)
    if format == "speculators":
        tensors, cfg = _to_speculators(drafter, heads, verifier_name_or_path or config.target_name_or_path)
    else:
        tensors, cfg = _to_deepspec(drafter, heads)
    cfg["dspark_hf"] = {"verification": config.verification, "confidence_threshold": config.confidence_threshold,
                        "sequential_head": config.sequential_head, "sequential_rank": config.sequential_rank,
                        "target_name_or_path": config.target_name_or_path,
                        "target_num_layers": config.target_num_layers}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = drafter.context_proj.weight.dtype
    save_file({k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous() for k, v in tensors.items()},
              out / WEIGHTS_FILE, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if drafter.calibration is not None:
        drafter.calibration.save(out)
    return out


def _heads(drafter: DSparkDrafter) -> dict:
    """The reference heads' tensors in OUR draft-row order: ``w1`` ``[V, r]`` over the full vocabulary,
    ``w2`` ``[V', r]``, ``joint`` (RNN weight, bias), ``conf`` (weight ``[1, d + r]``, bias ``[1]``)."""
    config, heads = drafter.config, {}
    if drafter.token_table is None:
        return heads
    table = drafter.token_table.weight
    heads["w1"] = table if config.full_token_table else table[drafter._vocab_index()]
    rank, rows = config.sequential_rank, drafter.draft_vocab.numel()
    heads["w2"] = drafter.sequential.w2.weight if drafter.sequential is not None else table.new_zeros(rows, rank)
    if config.sequential_head == "rnn":
        heads["joint"] = (drafter.sequential.gates.weight, drafter.sequential.gates.bias)
    if drafter.confidence is not None:
        heads["conf"] = (drafter.confidence.proj.weight, drafter.confidence.proj.bias)
    return heads


def _body(drafter: DSparkDrafter) -> dict:
    state = drafter.state_dict()
    body = {"fc.weight": state["context_proj.weight"], "hidden_norm.weight": state["context_norm.weight"],
            "norm.weight": state["norm.weight"]}
    return body | {k: v for k, v in state.items() if k.startswith("layers.")}


def _layer_config(config: DSparkConfig) -> dict:
    """The drafter's decoder layers as a Qwen3 config (QK-norm, no attention bias, SwiGLU): its shapes
    (:meth:`~dspark_hf.modeling.configuration_dspark.DSparkConfig.layer_config`) and the Qwen3 constants."""
    return {
        "model_type": "qwen3", **config.layer_config(), "hidden_act": "silu", "attention_bias": False,
        "layer_types": ["full_attention"] * config.num_hidden_layers, "tie_word_embeddings": False,
    }


def _to_speculators(drafter: DSparkDrafter, heads: dict, verifier: str):
    config = drafter.config
    if not verifier:
        raise ValueError("The speculators format names the verifier: pass verifier_name_or_path (config.target_name_or_path is empty).")
    ids = drafter.draft_vocab
    order = ids.argsort()  # speculators keeps the draft vocabulary sorted by target id
    reduced = ids.numel() != config.vocab_size
    tensors = _body(drafter)
    if reduced:
        drafter._require_bound()
        rows = drafter.bound.rows  # the target's lm_head rows of the draft vocabulary
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids.cpu()] = True
        sorted_ids = ids[order].cpu()
        tensors |= {"lm_head.weight": rows[order], "t2d": t2d, "d2t": sorted_ids - torch.arange(ids.numel())}
    if heads:
        tensors["markov_head.markov_w1.weight"] = heads["w1"]
        tensors["markov_head.markov_w2.weight"] = heads["w2"][order]
        if "joint" in heads:
            tensors["markov_head.joint_proj.weight"], tensors["markov_head.joint_proj.bias"] = heads["joint"]
    if "conf" in heads:
        tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"] = heads["conf"]
    cfg = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(drafter.bound.model.config, "architectures", None) or [])
                         if drafter.is_bound else []},
        },
        "transformer_layer_config": _layer_config(config),
        "draft_vocab_size": ids.numel(),
        "block_size": config.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],  # HF hidden_states indices
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,  # slot k of [anchor, mask, ...] predicts token a+k+1, as ours
        "markov_rank": config.sequential_rank if heads else 0,
        "markov_head_type": MARKOV_HEAD_TYPES[config.sequential_head],
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head,
    }
    return tensors, cfg


def _to_deepspec(drafter: DSparkDrafter, heads: dict):
    config = drafter.config
    ids = drafter.draft_vocab
    V, r = config.vocab_size, config.sequential_rank
    reduced = ids.numel() != V
    tensors = _body(drafter)
    rank = (r if heads else 0) + int(reduced)
    if rank:
        w1 = heads["w1"] if heads else torch.zeros(V, 0)
        w2_draft = heads["w2"] if heads else torch.zeros(ids.numel(), 0)
        like = drafter.context_proj.weight
        w2 = like.new_zeros(V, w2_draft.shape[1])
        w2[ids] = w2_draft.to(like)
        if reduced:  # the extra "vocabulary" rank
            outside = like.new_full((V, 1), OUTSIDE_LOGIT)
            outside[ids] = 0.0
            w1 = torch.cat([w1.to(like), like.new_ones(V, 1)], dim=1)
            w2 = torch.cat([w2, outside], dim=1)
        tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1, w2
        if "joint" in heads:
            weight, bias = heads["joint"]
            if reduced:
                weight, bias = _grow_joint(weight, bias, r, config.hidden_size)
            tensors["markov_head.joint_proj.weight"], tensors["markov_head.joint_proj.bias"] = weight, bias
    if "conf" in heads:
        weight, bias = heads["conf"]
        if reduced:
            weight = torch.cat([weight, weight.new_zeros(1, 1)], dim=1)
        tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"] = weight, bias
    dflash = {
        "target_layer_ids": list(config.target_layer_ids),  # 0-based decoder layers: hidden_states[i + 1], as ours
        "mask_token_id": config.mask_token_id,
        "projector_type": "dspark",
        "block_size": config.block_size,
        "markov_rank": rank,
        "markov_head_type": MARKOV_HEAD_TYPES[config.sequential_head],
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head,
        "attention_mode": "gqa" if config.num_key_value_heads < config.num_attention_heads else "mha",
    }
    if reduced:
        dflash[VOCAB_RANK_KEY] = rank - 1
    cfg = {"architectures": ["DSparkDraftModel"], **_layer_config(config), "block_size": config.block_size,
           "num_target_layers": config.target_num_layers, "dflash_config": dflash}
    return tensors, cfg


def _grow_joint(weight: torch.Tensor, bias: torch.Tensor, r: int, d: int):
    """RNN projection ``[3r, 2r + d]`` -> ``[3(r+1), 2(r+1) + d]`` for the extra vocabulary rank.

    The new rank reads nothing (zero columns for its state and ``W1`` entries), keeps a zero state
    (gate and candidate rows 0) and outputs ``tanh(20) = 1`` (fp32), so ``B`` gains ``W2[:, r]``.
    """
    R = r + 1
    new_w, new_b = weight.new_zeros(3 * R, 2 * R + d), bias.new_zeros(3 * R)
    for part in range(3):  # gate, candidate, output rows
        rows_old, rows_new = slice(part * r, (part + 1) * r), slice(part * R, part * R + r)
        new_w[rows_new, :r] = weight[rows_old, :r]  # state
        new_w[rows_new, R:R + r] = weight[rows_old, r:2 * r]  # W1[x_{k-1}]
        new_w[rows_new, 2 * R:] = weight[rows_old, 2 * r:]  # h_k
        new_b[rows_new] = bias[rows_old]
    new_b[3 * R - 1] = 20.0
    return new_w, new_b


# ------------------------------------------------------------------------------------------ import
def checkpoint_format(config_dict: dict) -> str | None:
    """``"speculators"``, ``"deepspec"`` or ``None`` (a dspark-hf folder or something else)."""
    if config_dict.get("speculators_model_type") == "dspark":
        return "speculators"
    if "DSparkDraftModel" in (config_dict.get("architectures") or []) and "dflash_config" in config_dict:
        return "deepspec"
    return None


def import_checkpoint(path: str | Path, config_dict: dict, hub_kwargs: dict) -> DSparkDrafter | None:
    """:func:`import_drafter` for a checkpoint whose ``config.json`` is ``config_dict``, ``None`` for a dspark-hf
    folder (``DSparkDrafter.from_pretrained`` calls it through ``modeling_dspark.EXTENSIONS``)."""
    return import_drafter(path, **hub_kwargs) if checkpoint_format(config_dict) is not None else None


def import_drafter(path: str | Path, **hub_kwargs) -> DSparkDrafter:
    """Load a speculators- or DeepSpec-format DSpark checkpoint (folder or Hub id) as a :class:`DSparkDrafter`.

    Exact: the drafter computes the same draft logits and confidences as the reference model. A
    reduced draft vocabulary whose ``markov_w1`` rows differ outside it gets ``full_token_table``.
    Without a ``dspark_hf`` entry in ``config.json`` the verification mode is ``"scheduler"`` when a
    ``calibration.json`` is present, else ``"fixed"`` (run ``dspark calibrate`` for the scheduler).
    ``hub_kwargs``: ``cache_dir``, ``revision``, ``token``, ``local_files_only`` for Hub ids.

    Raises:
        ValueError: not a DSpark checkpoint of either format, or a variant dspark-hf cannot run
            exactly (gated Markov head, ``sample_from_anchor: false``, the embedding as a context
            layer, no ``mask_token_id``); the message says which.
    """
    cfg = json.loads(Path(cached_file(path, "config.json", **hub_kwargs)).read_text())
    fmt = checkpoint_format(cfg)
    if fmt is None:
        raise ValueError(f"{path} is neither a speculators nor a DeepSpec DSpark checkpoint (config.json has no "
                         "speculators_model_type 'dspark' nor architectures ['DSparkDraftModel'] + dflash_config)")
    tensors = load_file(cached_file(path, WEIGHTS_FILE, **hub_kwargs))
    spec = _from_speculators(cfg, tensors) if fmt == "speculators" else _from_deepspec(cfg, tensors)
    calibration = cached_file(path, CALIBRATION_FILE, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    return _build(cfg.get("dspark_hf") or {}, spec, tensors, calibration)


def _check_heads(markov_type: str, with_markov: bool, confidence: bool, mask_token_id):
    if markov_type == "gated":
        raise ValueError("The gated Markov head has no dspark-hf equivalent (heads: none, markov, rnn).")
    if confidence and not with_markov:
        raise ValueError("A confidence head without the Markov embedding (confidence_head_with_markov: false) "
                         "has no dspark-hf equivalent (eq. 7 reads W1[x_{k-1}]).")
    if mask_token_id is None:
        raise ValueError("The checkpoint has no mask_token_id; dspark-hf v2 drafters need one.")


def _from_speculators(cfg: dict, tensors: dict) -> dict:
    if not cfg.get("sample_from_anchor", False):
        raise ValueError("sample_from_anchor: false (the anchor slot does not draft) is the DFlash convention; "
                         "dspark-hf drafts from the anchor slot: only sample_from_anchor: true checkpoints import.")
    layer_ids = [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]
    if min(layer_ids) < 0:
        raise ValueError("aux_hidden_state_layer_ids contains 0 (the embedding output): dspark-hf reads decoder "
                         "layer outputs only.")
    _check_heads(cfg.get("markov_head_type", "vanilla"), cfg.get("confidence_head_with_markov", True),
                 cfg.get("enable_confidence_head", True), cfg.get("mask_token_id"))
    shapes = DSparkConfig.layer_shapes(cfg["transformer_layer_config"])
    V, V_draft = shapes["vocab_size"], cfg["draft_vocab_size"]
    ids = (tensors["d2t"] + torch.arange(V_draft)) if V_draft != V else torch.arange(V)
    return dict(shapes=shapes, layer_ids=layer_ids, block_size=cfg["block_size"], mask_token_id=cfg["mask_token_id"],
                rank=cfg.get("markov_rank", 0), markov_type=cfg.get("markov_head_type", "vanilla"),
                confidence=cfg.get("enable_confidence_head", True), draft_ids=ids,
                target_name=cfg["speculators_config"]["verifier"]["name_or_path"], num_target_layers=None,
                w2_draft=tensors.get("markov_head.markov_w2.weight"))


def _from_deepspec(cfg: dict, tensors: dict) -> dict:
    dflash = cfg["dflash_config"]
    markov_type, confidence = dflash.get("markov_head_type", "vanilla"), dflash.get("enable_confidence_head", False)
    _check_heads(markov_type, dflash.get("confidence_head_with_markov", False), confidence, dflash.get("mask_token_id"))
    shapes = DSparkConfig.layer_shapes(cfg)
    rank, V = int(dflash.get("markov_rank", 0) or 0), shapes["vocab_size"]
    ids, w2 = torch.arange(V), tensors.get("markov_head.markov_w2.weight")
    extra = dflash.get(VOCAB_RANK_KEY)
    if extra is not None:  # our reduced-vocabulary rank: read the vocabulary back, then drop the rank
        ids = (w2[:, extra] == 0).nonzero()[:, 0]
        keep = [j for j in range(rank) if j != extra]
        tensors["markov_head.markov_w1.weight"] = tensors["markov_head.markov_w1.weight"][:, keep]
        w2 = w2[:, keep]
        if "markov_head.joint_proj.weight" in tensors:
            weight, bias = tensors["markov_head.joint_proj.weight"], tensors["markov_head.joint_proj.bias"]
            rows = [p * rank + j for p in range(3) for j in keep]
            cols = keep + [rank + j for j in keep] + list(range(2 * rank, weight.shape[1]))
            tensors["markov_head.joint_proj.weight"], tensors["markov_head.joint_proj.bias"] = weight[rows][:, cols], bias[rows]
        if "confidence_head.proj.weight" in tensors:
            weight = tensors["confidence_head.proj.weight"]
            d = shapes["hidden_size"]
            tensors["confidence_head.proj.weight"] = weight[:, list(range(d)) + [d + j for j in keep]]
        rank -= 1
    return dict(shapes=shapes, layer_ids=list(dflash["target_layer_ids"]), block_size=cfg["block_size"],
                mask_token_id=dflash["mask_token_id"], rank=rank, markov_type=markov_type, confidence=confidence,
                draft_ids=ids, target_name="", num_target_layers=cfg.get("num_target_layers"),
                w2_draft=None if w2 is None else w2[ids])


def _build(ours: dict, spec: dict, tensors: dict, calibration_file) -> DSparkDrafter:
    shapes, ids, rank = spec["shapes"], spec["draft_ids"], spec["rank"]
    V, reduced = shapes["vocab_size"], ids.numel() != shapes["vocab_size"]
    w1 = tensors.get("markov_head.markov_w1.weight")
    head = {"rnn": "rnn"}.get(spec["markov_type"], "markov") if rank else "none"
    if ours.get("sequential_head") == "none" and head == "markov":  # exported with W2 = 0 for the confidence head
        head = "none"
    full_table = False
    if w1 is not None and reduced:
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        rest = w1[outside]
        full_table = bool(rest.numel()) and not bool((rest == rest[:1]).all())
    calibration = SequentialTemperatureScaling.load(calibration_file) if calibration_file else None
    num_layers = spec["num_target_layers"] or ours.get("target_num_layers") or max(spec["layer_ids"]) + 1
    config = DSparkConfig(
        **shapes, target_name_or_path=ours.get("target_name_or_path", spec["target_name"]), target_num_layers=num_layers,
        target_layer_ids=spec["layer_ids"], block_size=spec["block_size"], sequential_head=head,
        sequential_rank=rank or ours.get("sequential_rank", 1), confidence_head=spec["confidence"],
        draft_vocab_size=ids.numel() if reduced else None, mask_token_id=spec["mask_token_id"],
        full_token_table=full_table,
        verification=ours.get("verification", "scheduler" if calibration is not None and spec["confidence"] else "fixed"),
        confidence_threshold=ours.get("confidence_threshold", 0.4),
    )
    drafter = DSparkDrafter(config)
    dtype = tensors["fc.weight"].dtype
    state = {"context_proj.weight": tensors["fc.weight"], "context_norm.weight": tensors["hidden_norm.weight"],
             "norm.weight": tensors["norm.weight"]}
    state |= {k: v for k, v in tensors.items() if k.startswith("layers.")}
    if reduced:
        state["draft_vocab"] = ids
    if drafter.token_table is not None:
        if full_table:
            state["token_table.weight"] = w1
        else:
            rows = w1[ids] if w1 is not None else torch.zeros(ids.numel(), 1, dtype=dtype)
            shared = w1[~torch.isin(torch.arange(V), ids)][:1] if reduced else rows.new_zeros(1, rows.shape[1])
            state["token_table.weight"] = torch.cat([rows, shared], dim=0)
    if head != "none":
        state["sequential.w2.weight"] = spec["w2_draft"]
    if head == "rnn":
        state["sequential.gates.weight"] = tensors["markov_head.joint_proj.weight"]
        state["sequential.gates.bias"] = tensors["markov_head.joint_proj.bias"]
    if drafter.confidence is not None:
        state["confidence.proj.weight"] = tensors["confidence_head.proj.weight"]
        state["confidence.proj.bias"] = tensors["confidence_head.proj.bias"]
    drafter.load_state_dict(state, strict=True)
    drafter.to(dtype)
    drafter.vocab_index = drafter._vocab_index()
    drafter.calibration = calibration
    return drafter.eval()
