"""Training: each loss term against hand-computed values, position weights, packing, a smoke run."""

import copy
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from conftest import tiny_llama
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast
from transformers.utils.hub import convert_file_size_to_int

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDrafter, SequentialTemperatureScaling
from dspark_hf.cli.main import main as cli_main
from dspark_hf.modeling.configuration_dspark import spread_layer_ids
from dspark_hf.runtime.targets import chat_ids, load_default_target
from dspark_hf.sources.prompt_queue import reply_ids
from dspark_hf.training import checkpoint as checkpoints
from dspark_hf.training import trainer as training
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.curve import inherited_curve, run_curve
from dspark_hf.training.data import export_tokens, load_shards, prepare_data, shard_dirs
from dspark_hf.training.losses import dspark_loss, expected_tau, greedy_survival, position_weights, tv_distance
from dspark_hf.training.packing import FeatureBatcher, FeatureStore
from dspark_hf.training.trainer import init_layers_from_target, reserved_mask_token, train


def test_position_weights_follow_the_references():
    w = position_weights(3)  # λ = 4 (DeepSpec, speculators)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-1 / 4), math.exp(-2 / 4)]))
    torch.testing.assert_close(position_weights(3, decay=None), torch.tensor([1.0, math.exp(-1 / 3), math.exp(-2 / 3)]))
    torch.testing.assert_close(position_weights(2, decay=1.0), torch.tensor([1.0, math.exp(-1.0)]))
    assert TrainConfig().decay == 4.0


def test_tv_distance_on_topk_support():
    p_d = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    # target top-2: token 1 (0.6) and token 0 (0.3); 0.1 of its mass is elsewhere
    ids, probs = torch.tensor([[1, 0]]), torch.tensor([[0.6, 0.3]])
    # |0.3-0.6| + |0.5-0.3| + |(1-0.8) - 0.1| = 0.3 + 0.2 + 0.1
    torch.testing.assert_close(tv_distance(p_d, ids, probs), torch.tensor([0.6]))
    # a target token outside the draft vocabulary (-1) counts fully: 0.6 + |0.5-0.3| + |0.5-0.1|
    torch.testing.assert_close(tv_distance(p_d, torch.tensor([[-1, 0]]), probs), torch.tensor([1.2]))


def test_loss_terms_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.8, 0.1]]]))  # N=1 block, γ=2, V'=3
    labels = torch.tensor([[0, 1]])
    target_ids = torch.tensor([[[0, 1, 2], [1, 0, 2]]])
    target_probs = torch.tensor([[[0.5, 0.3, 0.2], [0.4, 0.5, 0.1]]])  # position 2: |0.8-0.4|+|0.1-0.5| = 0.8
    conf_logits = torch.zeros(1, 2)  # c = 0.5
    valid = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([1.0, 0.5])
    loss, parts = dspark_loss(logits, conf_logits, labels, target_ids, target_probs, valid, w, {"ce": 0.1, "tv": 0.9, "conf": 1.0})
    # per weighted token: Σ w ℓ / Σ w, with Σ w = 1.5
    ce = -(math.log(0.5) + 0.5 * math.log(0.8)) / 1.5
    tv = (0.0 + 0.5 * 0.8) / 1.5
    c_star = torch.tensor([1.0, 0.6])  # 1 - ½ L1
    bce = -(c_star * math.log(0.5) + (1 - c_star) * math.log(0.5))
    conf = float(bce[0] + 0.5 * bce[1]) / 1.5
    assert parts["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert parts["tv"].item() == pytest.approx(tv, rel=1e-5)
    assert parts["conf"].item() == pytest.approx(conf, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * ce + 0.9 * tv + conf, rel=1e-5)
    torch.testing.assert_close(parts["accept"], c_star)
    assert expected_tau(parts["accept"]) == pytest.approx(1 + 1.0 + 0.6)


def test_invalid_positions_and_oov_labels_do_not_count():
    logits = torch.zeros(1, 2, 3)
    valid = torch.tensor([[True, False]])
    ids = torch.tensor([[[0, 1, 2], [0, 1, 2]]])
    probs = torch.full((1, 2, 3), 1 / 3)
    _, parts = dspark_loss(logits, None, torch.tensor([[-1, 2]]), ids, probs, valid, torch.ones(2), {"ce": 1, "tv": 1})
    assert parts["ce"].item() == 0.0  # position 1 out of the draft vocabulary, position 2 invalid
    assert parts["tv"].item() == pytest.approx(0.0, abs=1e-6)
    assert "conf" not in parts


def test_loss_is_a_mean_per_weighted_token_over_blocks_of_any_length():
    """Two blocks, the second cut after one position: each valid position weighs w_k, whatever its block."""
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]], [[0.2, 0.8], [0.5, 0.5]]]))  # N=2, γ=2, V'=2
    labels = torch.tensor([[0, 0], [1, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    ids = torch.tensor([[0, 1]]).expand(2, 2, 2)
    probs = torch.tensor([[1.0, 0.0]]).expand(2, 2, 2)
    w = torch.tensor([1.0, 0.25])
    _, parts = dspark_loss(logits, None, labels, ids, probs, valid, w, {"ce": 1, "tv": 1})
    ce = -(math.log(0.5) + 0.25 * math.log(0.9) + math.log(0.8)) / 2.25
    tv = (1.0 + 0.25 * 0.2 + 1.6) / 2.25
    assert parts["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert parts["tv"].item() == pytest.approx(tv, rel=1e-5)


def test_reserved_mask_token_rule():
    tokenizer = SimpleNamespace(mask_token_id=None, all_special_ids=[0, 1, 2], added_tokens_decoder={i: None for i in range(17)})
    assert reserved_mask_token(tokenizer) == 16
    assert reserved_mask_token(tokenizer, torch.tensor([16, 40])) == 15
    assert reserved_mask_token(SimpleNamespace(**{**vars(tokenizer), "mask_token_id": 5})) == 5
    with pytest.raises(ValueError, match="set mask_token_id in the training config"):
        reserved_mask_token(tokenizer, torch.arange(3, 17))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = tiny_llama(48, 32, 6, bos_token_id=1, pad_token_id=None)
    with torch.no_grad():  # a peaked, learnable target: logits follow the input token
        target.lm_head.weight.mul_(8)
    prompts = torch.randint(3, 48, (48, 6)).tolist()
    queue = [(f"r{i}_0", "validation" if i % 8 == 0 else "train", p) for i, p in enumerate(prompts)]
    out = tmp_path_factory.mktemp("data")
    datasets.disable_progress_bars()
    prepare_data(target, SimpleNamespace(pad_token_id=0), out, spread_layer_ids(6, 2), target_tokens=10_000, batch_size=16,
                 max_new_tokens=24, topk=8, sampling=dict(do_sample=True, temperature=1.0), queue=queue)
    return target, out


def test_prepared_rows_are_aligned(tiny_data):
    target, out = tiny_data
    row = load_shards(out, "train")[0]
    n, p = len(row["input_ids"]), int(row["prompt_len"])
    assert row["features"].shape == (n - 1, 2 * 32)
    assert row["topk_ids"].shape == (n - p - 1, 8)
    with torch.no_grad():
        logits = target(row["input_ids"][None].long()).logits[0]
    # top-1 of the recorded distribution at response position j is the target's argmax there
    assert torch.equal(row["topk_ids"][:, 0].long(), logits[p : n - 1].argmax(-1))


def test_dataset_replies_are_featurized_as_written(tmp_path):
    """``replies="dataset"`` rows hold the queue's prompt + reply tokens unchanged, with the target's features and
    next-token distribution over the reply, as one regenerated the same tokens would."""
    target = tiny_llama(48, 32, 6, bos_token_id=1, pad_token_id=None)
    items = [(f"d{i}_0", "train", torch.randint(3, 48, (5,)).tolist(), torch.randint(3, 48, (n,)).tolist())
             for i, n in enumerate((2, 9, 30))]
    datasets.disable_progress_bars()
    prepare_data(target, None, tmp_path / "data", spread_layer_ids(6, 2), batch_size=2, topk=8, queue=items, replies="dataset")
    rows = load_shards(tmp_path / "data", "train")
    assert [r["input_ids"].tolist() for r in rows] == [p + r for _, _, p, r in items]
    for row, (_, _, prompt, reply) in zip(rows, items):
        ids = row["input_ids"][None].long()
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
        assert row["features"].shape == (len(prompt) + len(reply) - 1, 2 * 32)
        first = spread_layer_ids(6, 2)[0] + 1  # the first context layer's output
        torch.testing.assert_close(row["features"][:, :32].float(), out.hidden_states[first][0, :-1], atol=2e-3, rtol=1e-3)
        probs = out.logits[0, len(prompt) : -1].softmax(-1)
        assert torch.equal(row["topk_ids"][:, 0].long(), probs.argmax(-1))
        torch.testing.assert_close(row["topk_probs"][:, 0].float(), probs.max(-1).values, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match='replies must be "target" or "dataset"'):
        prepare_data(target, None, tmp_path / "x", [1], queue=items, replies="sharegpt")


def test_reply_ids_follow_the_chat_template():
    """A ShareGPT reply becomes the assistant turn the template would write, through its end-of-turn token."""
    tokenizer = load_default_target()[1]
    prompt_ids = chat_ids(tokenizer, "hi")
    whole = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"}],
                                          tokenize=True, return_dict=False)
    reply = reply_ids(tokenizer, "hi", "Hello there!", prompt_ids, max_tokens=512)
    assert prompt_ids + reply == whole[: len(prompt_ids) + len(reply)] and reply[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(reply) == "Hello there!<|im_end|>"
    assert reply_ids(tokenizer, "hi", "Hello there!", prompt_ids, max_tokens=2) == reply[:2]
    assert reply_ids(tokenizer, "hi", "Hello there!", prompt_ids, max_tokens=1) is None  # under two tokens


def test_target_labels_are_the_targets_top1(tiny_data):
    """``labels="target"``: the cross-entropy label of each draft position is the target's top-1 (draft-vocab row),
    not the row's next token; everything else is packed as with ``labels="data"``."""
    target, out = tiny_data
    rows = FeatureStore.from_shards([out], "train")
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=1, block_size=4,
                                                    mask_token_id=0))
    data, top1 = (FeatureBatcher(rows, drafter, 4, torch.Generator().manual_seed(5), labels).sample(6, 3)
                  for labels in ("data", "target"))
    for key in ("anchors", "tokens", "valid", "target_ids", "target_probs", "features"):
        torch.testing.assert_close(top1[key], data[key])
    valid = data["valid"]
    assert torch.equal(top1["labels"][valid], data["target_ids"][..., 0][valid])
    assert torch.equal(data["labels"][valid], data["tokens"][..., 1:][valid])  # no draft vocabulary: rows = ids
    assert not torch.equal(top1["labels"][valid], data["labels"][valid])  # T = 1 samples are not all the argmax
    with pytest.raises(ValueError, match="labels must be one of"):
        TrainConfig(labels="argmax")


def _golden_rows():
    """Three hand-built rows (n = 9, 12, 5 tokens after prompts of 3, 4, 2): features count positions (+100 per
    row), the target's top-2 after token k are (next token, next token + 1) with probabilities (0.5..0.9, 0.05)."""
    rows = []
    for i, (n, p) in enumerate([(9, 3), (12, 4), (5, 2)]):
        ids = (torch.arange(n) * 5 + 3 * i) % 11
        nxt = ids[p + 1 :]
        rows.append(dict(input_ids=ids, prompt_len=p, features=(torch.arange(n - 1.0) + 100 * i)[:, None].repeat(1, 2).half(),
                         topk_ids=torch.stack([nxt, (nxt + 1) % 11], -1).int(),
                         topk_probs=torch.stack([torch.linspace(0.5, 0.9, n - p - 1), torch.full((n - p - 1,), 0.05)], -1).half()))
    return rows


@pytest.mark.parametrize(("device", "resident"), [("cpu", False), ("cpu", True), pytest.param(
    "cuda", None, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_packing_matches_the_golden_batch(device, resident):
    """Drop-in: the vectorised packer gives, for seed 5, the batch the per-anchor packer before issue #22 gave
    (recorded from it on these rows), on any device: the same rows and anchors drawn, zeros past a row's end and in
    the missing third anchor of the 5-token row, token ids mapped to draft-vocabulary rows (-1 outside)."""
    drafter = SimpleNamespace(vocab_index=torch.tensor([2, 0, 5, 1, 5, 5, 3, 4, 5, 5, 5]), draft_vocab=torch.arange(5))
    store = FeatureStore(_golden_rows(), device, resident=resident)
    batch = FeatureBatcher(store, drafter, 3, torch.Generator().manual_seed(5)).sample(4, 3)
    assert {t.device.type for t in batch.values()} == {device}  # built where the drafter trains
    batch = {k: t.cpu() for k, t in batch.items()}
    assert batch["anchors"].tolist() == [[2, 3, 0], [3, 4, 7], [5, 6, 8], [5, 6, 7]]  # rows 2, 0, 1, 0
    assert batch["features"][..., 0].tolist() == [[200, 201, 202, 203, 0, 0, 0, 0], list(range(8)),
                                                  list(range(100, 108)), list(range(8))]
    assert batch["tokens"].tolist() == [
        [[5, 10, 4, 0], [10, 4, 0, 0], [0, 0, 0, 0]], [[4, 9, 3, 8], [9, 3, 8, 2], [2, 7, 0, 0]],
        [[6, 0, 5, 10], [0, 5, 10, 4], [10, 4, 9, 3]], [[3, 8, 2, 7], [8, 2, 7, 0], [2, 7, 0, 0]]]
    T, F = True, False
    assert batch["valid"].tolist() == [[[T, T, F], [T, F, F], [F, F, F]], [[T, T, T], [T, T, T], [T, F, F]],
                                       [[T, T, T], [T, T, T], [T, T, T]], [[T, T, T], [T, T, F], [T, F, F]]]
    assert batch["labels"].tolist() == [
        [[-1, -1, 2], [-1, 2, 2], [2, 2, 2]], [[-1, 1, -1], [1, -1, -1], [4, 2, 2]],
        [[2, -1, -1], [-1, -1, -1], [-1, -1, 1]], [[-1, -1, 4], [-1, 4, 2], [4, 2, 2]]]
    assert batch["target_ids"].tolist() == [
        [[[-1, 2], [-1, -1], [2, 2]], [[-1, -1], [2, 2], [2, 2]], [[2, 2], [2, 2], [2, 2]]],
        [[[-1, -1], [1, -1], [-1, -1]], [[1, -1], [-1, -1], [-1, 1]], [[4, -1], [2, 2], [2, 2]]],
        [[[2, 0], [-1, 3], [-1, 2]], [[-1, 3], [-1, 2], [-1, -1]], [[-1, -1], [-1, -1], [1, -1]]],
        [[[-1, -1], [-1, 1], [4, -1]], [[-1, 1], [4, -1], [2, 2]], [[4, -1], [2, 2], [2, 2]]]]
    half = lambda *xs: torch.tensor(xs).half().float().tolist()  # noqa: E731 (the stored fp16 values)
    assert batch["target_probs"][..., 0].tolist() == [
        [half(0.5, 0.9, 0), half(0.9, 0, 0), half(0, 0, 0)], [half(0.5, 0.6, 0.7), half(0.6, 0.7, 0.8), half(0.9, 0, 0)],
        [half(0.5 + 0.4 / 6, 0.5 + 0.8 / 6, 0.7), half(0.5 + 0.8 / 6, 0.7, 0.5 + 1.6 / 6), half(0.5 + 1.6 / 6, 0.5 + 2 / 6, 0.9)],
        [half(0.7, 0.8, 0.9), half(0.8, 0.9, 0), half(0.9, 0, 0)]]
    assert batch["target_probs"][..., 1][batch["valid"]].eq(torch.tensor(0.05).half().float()).all()
    assert batch["target_probs"][..., 1][~batch["valid"]].eq(0).all()


def test_the_store_views_the_shard_files(tiny_data):
    """``FeatureStore.from_shards`` reads the shards through zero-copy views of their Arrow files: the same rows,
    in the same order, as the ``datasets`` split; and the response tokens are the rows' tokens after their prompts."""
    _, out = tiny_data
    rows = load_shards(out, "train")
    store = FeatureStore.from_shards([out, out], "train")  # a folder twice: its rows twice
    assert len(store) == 2 * len(rows) and store.n == [len(r["input_ids"]) for r in rows] * 2
    for r, row in enumerate(rows):
        assert torch.equal(store.features[r], row["features"]) and torch.equal(store.features[r + len(rows)], row["features"])
        start, k = int(store.topk_start[r]), len(row["topk_ids"])
        assert torch.equal(store.topk_ids[start : start + k], row["topk_ids"])
        assert torch.equal(store.topk_probs[start : start + k], row["topk_probs"])
    responses = torch.cat([r["input_ids"][int(r["prompt_len"]) :] for r in rows]).long()
    assert torch.equal(store.response_tokens(), torch.cat([responses, responses]))
    resident = FeatureStore.from_shards([out], "train", resident=True)  # an accelerator's layout: one flat tensor
    assert all(torch.equal(a, b) for a, b in zip(resident.features, store.features))
    assert resident.features[1].data_ptr() == resident.features[0].data_ptr() + 2 * resident.features[0].numel()
    with pytest.raises(ValueError, match="expected n - 1 and n - prompt_len - 1"):
        FeatureStore([{**_golden_rows()[0], "prompt_len": 2}])


@pytest.mark.parametrize(("mixed_precision", "device"), [("no", "cpu"), ("bf16", "cpu"), pytest.param(
    "bf16", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_smoke_training_lowers_validation_loss(tiny_data, tmp_path, mixed_precision, device):
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process, as under `dspark train`
    target, out = tiny_data
    target = copy.deepcopy(target).to(device)  # training runs, and packs, on the target's device
    cfg = TrainConfig(data_dir=[str(out)], out_dir=str(tmp_path / "run"), num_hidden_layers=1, sequential_rank=8,
                      block_size=4, num_context_layers=2, draft_vocab_size=None, mask_token_id=0, mixed_precision=mixed_precision,
                      steps=60, sequences_per_step=4, anchors_per_sequence=6, lr=3e-3, warmup_steps=5,
                      eval_every=60, save_every=30, val_sequences=6)
    final = train(target, cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first, last = log[0]["validation"], log[-1]["validation"]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["tau"] > first["tau"]
    assert (final / "model.safetensors").is_file() and (tmp_path / "run" / "checkpoint" / "state.pt").is_file()
    record = json.loads((final / "training.json").read_text())
    assert 60 * 4 * 6 * 4 / (60 * record["minutes"]) <= record["positions_per_s"] < 60 * 4 * 6 * 4 / log[-1]["time_s"]
    AcceleratorState._reset_state(reset_partial_state=True)


def test_drafter_overfits_its_training_prompts(tmp_path):
    """The whole pipeline agrees with itself: regenerate (hooks) -> pack -> train -> draft in `generate`.

    A drafter trained long enough on four greedy regenerations must reproduce them: at inference, on the same
    prompts, nearly every first draft survives and τ approaches γ + 1. A misaligned feature, label or position
    anywhere between `data.py`, `training.py` and the candidate generator caps this far below.
    """
    torch.manual_seed(0)
    target = tiny_llama(48, 32, 6, bos_token_id=1, pad_token_id=None)
    with torch.no_grad():  # peaked, so that matching the target's distribution also means matching its argmax
        target.lm_head.weight.mul_(40)
    prompts = torch.randint(3, 48, (4, 6)).tolist()
    queue = [(f"r{i}_0", "train", p) for i, p in enumerate(prompts)] + [("v0_0", "validation", prompts[0])]
    datasets.disable_progress_bars()
    prepare_data(target, SimpleNamespace(pad_token_id=0), tmp_path / "data", spread_layer_ids(6, 2), target_tokens=10_000,
                 batch_size=8, max_new_tokens=32, topk=8, sampling=dict(do_sample=False), queue=queue)
    cfg = TrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "run"), num_hidden_layers=1, sequential_rank=8,
                      block_size=4, num_context_layers=2, draft_vocab_size=None, mask_token_id=0, steps=300, sequences_per_step=4,
                      anchors_per_sequence=16, lr=3e-3, warmup_steps=10, loss_weights={"ce": 1.0, "tv": 0.9, "conf": 1.0},
                      eval_every=300, save_every=300, val_sequences=1)
    drafter = DSparkDrafter.from_pretrained(train(target, cfg, progress=False)).eval()
    first, accepted, drafted = [], 0, 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        plain = target.generate(ids, max_new_tokens=32, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=32, do_sample=False, dspark_verification="fixed")
        assert torch.equal(out, plain)
        rounds = [r for r in drafter.last_stats.rounds if r.drafted]  # the budget may leave a last round no draft
        first += [r.accepted >= 1 for r in rounds[:-1]]
        accepted, drafted = accepted + sum(r.accepted for r in rounds), drafted + sum(r.drafted for r in rounds)
    assert sum(first) / len(first) >= 0.95
    assert accepted / drafted >= 0.9  # nearly every draft survives: τ near γ + 1


def test_greedy_survival_by_hand():
    # 2 blocks, γ = 3, V' = 4; block 0 hits, misses, hits (survival stops at k = 2); block 1 has k = 3 invalid
    logits = torch.eye(4)[torch.tensor([[0, 1, 2], [3, 3, 0]])]
    top1 = torch.tensor([[0, 2, 2], [3, 3, 1]])[..., None]
    valid = torch.tensor([[True, True, True], [True, True, False]])
    torch.testing.assert_close(greedy_survival(logits, top1, valid), torch.tensor([1.0, 0.5, 0.0]))


def test_init_layers_from_target_copies_weights():
    target = tiny_llama(48, 32, 6)
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=2, mask_token_id=0))
    init_layers_from_target(drafter, target, [4, 5])
    for layer, i in zip(drafter.layers, [4, 5]):
        for name, tensor in target.model.layers[i].state_dict().items():
            assert torch.equal(layer.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="needs 2 ids"):
        init_layers_from_target(drafter, target, [5])


def test_two_regeneration_workers_make_the_shards_of_one(tmp_path):
    target = tiny_llama(48, 32, 4, bos_token_id=1, pad_token_id=None)
    queue = [(f"r{i}_0", "train", p) for i, p in enumerate(torch.randint(3, 48, (10, 5)).tolist())]
    datasets.disable_progress_bars()
    kwargs = dict(layer_ids=[1], target_tokens=10_000, batch_size=3, max_new_tokens=6, topk=4,
                  sampling=dict(do_sample=True, temperature=1.0), queue=queue)
    prepare_data(target, SimpleNamespace(pad_token_id=0), tmp_path / "one", **kwargs)
    for k in (1, 0):
        prepare_data(target, SimpleNamespace(pad_token_id=0), tmp_path / "two", worker=(k, 2), **kwargs)
    names = sorted(d.name for d in (tmp_path / "one").glob("shard-*"))
    assert names == sorted(d.name for d in (tmp_path / "two").glob("shard-*")) == [f"shard-{i:05d}" for i in range(4)]
    for name in names:  # same prompts, same seeded samples
        assert datasets.load_from_disk(str(tmp_path / "one" / name))["input_ids"] == \
            datasets.load_from_disk(str(tmp_path / "two" / name))["input_ids"]


def test_exported_tokens_rebuild_the_same_shards(tiny_data, tmp_path):
    target, out = tiny_data
    assert export_tokens(out, tmp_path / "tokens.jsonl.gz") == sum(len(load_shards(out, s)) for s in ("train", "validation"))
    prepare_data(target, SimpleNamespace(pad_token_id=0), tmp_path / "rebuilt", spread_layer_ids(6, 2), target_tokens=10_000,
                 batch_size=16, max_new_tokens=24, topk=8, queue=[], tokens_file=tmp_path / "tokens.jsonl.gz")
    for split in ("train", "validation"):
        a, b = load_shards(out, split), load_shards(tmp_path / "rebuilt", split)
        assert a["record_id"] == b["record_id"] and len(a) > 0
        for x, y in zip(a, b):  # KV-cached decoding vs one prefill: the same numbers up to fp16 rounding
            assert torch.equal(x["input_ids"], y["input_ids"])
            torch.testing.assert_close(x["features"].float(), y["features"].float(), atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(x["topk_probs"].float(), y["topk_probs"].float(), atol=2e-3, rtol=1e-2)
            assert torch.equal(x["topk_ids"][:, 0], y["topk_ids"][:, 0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
    """`accelerate launch -m dspark_hf.cli train` with 2 CPU processes (gloo), each packing half of every global
    batch, takes the same optimizer steps as one `dspark train` on the whole batch (which also resumes here).

    Responses end at a random EOS, so the two halves of a batch hold different numbers of positions.
    """
    target = tiny_llama(48, 32, 6, bos_token_id=1, pad_token_id=None, eos_token_id=2)
    prompts = torch.randint(3, 48, (32, 6), generator=torch.Generator().manual_seed(0)).tolist()
    queue = [(f"r{i}_0", "validation" if i % 8 == 0 else "train", p) for i, p in enumerate(prompts)]
    datasets.disable_progress_bars()
    prepare_data(target, SimpleNamespace(pad_token_id=0), tmp_path / "data", spread_layer_ids(6, 2), target_tokens=10_000,
                 batch_size=16, max_new_tokens=24, topk=8, sampling=dict(do_sample=True, temperature=1.0), queue=queue)
    lengths = [len(r["input_ids"]) for r in load_shards(tmp_path / "data", "train")]
    assert min(lengths) < 6 + 14 < max(lengths)  # some responses too short for 14 anchors
    target.save_pretrained(tmp_path / "target")  # with a word-level tokenizer, as `dspark train --target` loads it
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({str(i): i for i in range(48)}, unk_token="0"))) \
        .save_pretrained(tmp_path / "target")
    base = dict(data_dir=str(tmp_path / "data"), num_hidden_layers=1, sequential_rank=8, block_size=4,
                num_context_layers=2, draft_vocab_size=None, mask_token_id=0, sequences_per_step=4, anchors_per_sequence=14, lr=3e-3,
                warmup_steps=10, eval_every=100, val_sequences=4, threads=1)  # steps 1-4 in warmup: LR ignores `steps`

    def config(name, **values):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(base | values))
        return ["train", "--config", str(tmp_path / f"{name}.yaml"), "--target", str(tmp_path / "target"), "--train-only"]

    cli_main(config("one-2", out_dir=str(tmp_path / "one"), steps=2, save_every=2))  # 2 steps and a checkpoint,
    cli_main(config("one-4", out_dir=str(tmp_path / "one"), steps=4, save_every=100))  # then resumed to step 4
    # `--multi_gpu` is accelerate's flag for its torchrun launcher; without a GPU it runs CPU processes over gloo
    package_root = str(Path(dspark_hf.__file__).parent.parent)  # the processes import the dspark_hf under test
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--main_process_port", str(_free_port()), "-m", "dspark_hf.cli",
                          *config("two", out_dir=str(tmp_path / "two"), steps=4, save_every=100)],
                         capture_output=True, text=True,
                         env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": package_root})
    assert run.returncode == 0, run.stderr[-4000:]
    logs = {run: [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()] for run in ("one", "two")}
    record = json.loads((tmp_path / "two" / "final" / "training.json").read_text())
    assert record["processes"] == 2
    assert record["command"].startswith("dspark train --config ") and record["command"].endswith(" --train-only")
    assert [r["step"] for r in logs["one"]] == [r["step"] for r in logs["two"]] == [0, 1, 2, 3, 4]  # main process alone logs
    for a, b in zip(logs["one"][1:], logs["two"][1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    final_one, final_two = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("one", "two"))
    at_step_2 = load_file(tmp_path / "one" / "checkpoint" / "model.safetensors")
    for name, weight in final_one.items():
        torch.testing.assert_close(final_two[name], weight, rtol=1e-5, atol=1e-6)
    assert max(float((final_one[k] - at_step_2[k]).abs().max()) for k in final_one) > 1e-3  # steps 3-4 moved weights


def test_processes_pack_disjoint_shares_of_one_batch(tiny_data):
    """With the same generator state, rank r of N packs rows r::N of exactly the batch one process packs."""
    target, out = tiny_data
    rows = FeatureStore(load_shards(out, "train"))
    drafter = DSparkDrafter(DSparkConfig.for_target(target, num_context_layers=2, num_hidden_layers=1, block_size=4,
                                                    mask_token_id=0))

    def sample(rank, world):
        return FeatureBatcher(rows, drafter, 4, torch.Generator().manual_seed(5)).sample(6, 3, rank, world)

    whole, shares = sample(0, 1), [sample(r, 3) for r in range(3)]
    for key in ("anchors", "tokens", "valid", "labels", "target_ids", "target_probs"):
        for r, share in enumerate(shares):
            torch.testing.assert_close(share[key], whole[key][r::3])
    n = shares[0]["features"].shape[1]
    torch.testing.assert_close(shares[0]["features"], whole["features"][0::3, :n])


def test_saved_drafters_are_sharded_load_and_resume(tiny_data, tmp_path, monkeypatch):
    """Final drafter and checkpoint are safetensors shards of at most MAX_SHARD_SIZE (16 MB, under 16 MiB);
    both load completely, and training resumes from the sharded checkpoint."""
    assert convert_file_size_to_int(checkpoints.MAX_SHARD_SIZE) <= 16 * 2**20
    for module in (training, checkpoints):  # the final save and the checkpoint's
        monkeypatch.setattr(module, "MAX_SHARD_SIZE", "20KB")  # the tiny drafter (~100 kB) then takes several shards
    target, out = tiny_data
    cfg = TrainConfig(data_dir=str(out), out_dir=str(tmp_path / "run"), num_hidden_layers=1, sequential_rank=8,
                      block_size=4, num_context_layers=2, draft_vocab_size=None, mask_token_id=0, steps=2, sequences_per_step=2,
                      anchors_per_sequence=4, warmup_steps=2, eval_every=100, save_every=2, val_sequences=2)
    final = train(target, cfg, progress=False)
    checkpoint = tmp_path / "run" / "checkpoint"
    for folder in (final, checkpoint):
        shards = sorted(folder.glob("*.safetensors"))
        assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
        assert all(f.stat().st_size <= 20_000 + 1024 for f in shards)  # + the safetensors header
    loaded, info = DSparkDrafter.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in DSparkDrafter.from_pretrained(checkpoint).state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    train(target, TrainConfig(**{**asdict(cfg), "steps": 3}), progress=False)  # resumes at step 2
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3]


def test_warm_start_continues_from_a_drafter_folder(tiny_data, tmp_path):
    """init_from: training starts from the folder's weights (the step-0 validation is the source's final one), with
    a fresh optimizer and step count, and drops the calibration; another architecture is refused, naming the field."""
    target, out = tiny_data
    base = dict(data_dir=str(out), num_hidden_layers=1, sequential_rank=8, block_size=4, num_context_layers=2,
                draft_vocab_size=None, mask_token_id=0, sequences_per_step=2, anchors_per_sequence=4, warmup_steps=2,
                eval_every=100, save_every=100, val_sequences=4)
    source = train(target, TrainConfig(**base, out_dir=str(tmp_path / "a"), steps=3), progress=False)
    SequentialTemperatureScaling(temperatures=[1.0] * 4).save(source)
    final = train(target, TrainConfig(**base, out_dir=str(tmp_path / "b"), steps=2, init_from=str(source)), progress=False)
    first = json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    assert first["validation"] == json.loads((source / "training.json").read_text())["validation"]
    assert not (final / "calibration.json").exists()
    # the learning curve goes on from the source's: positions and steps count on, step 0 is not repeated
    per_step = 2 * 4 * 4
    source_curve = json.loads((source / "training.json").read_text())["curve"]
    curve = json.loads((final / "training.json").read_text())["curve"]
    assert [(p["step"], p["positions"]) for p in source_curve] == [(0, 0), (3, 3 * per_step)]
    assert [(p["step"], p["positions"]) for p in curve] == [(0, 0), (3, 3 * per_step), (5, 5 * per_step)]
    assert curve[-1]["greedy_tau"] == json.loads((final / "training.json").read_text())["validation"]["greedy_tau"]
    with pytest.raises(ValueError, match="block_size: 4 in .*, 5 in the config"):
        train(target, TrainConfig(**{**base, "block_size": 5}, out_dir=str(tmp_path / "c"), init_from=str(source)),
              progress=False)


def test_a_drafter_without_a_curve_passes_on_its_final_validation(tmp_path):
    """Drafters trained before training.json carried a curve: a warm start inherits their last point only."""
    config = {"sequences_per_step": 4, "anchors_per_sequence": 48, "block_size": 7}
    validation = {"greedy_tau": 1.48, "greedy_survival": [0.33, 0.1]}
    (tmp_path / "training.json").write_text(json.dumps({"steps": 1500, "config": config, "validation": validation}))
    assert inherited_curve(tmp_path) == [{"positions": 1500 * 1344, "step": 1500, "greedy_tau": 1.48,
                                          "greedy_survival_1": 0.33}]
    assert inherited_curve(None) == [] and inherited_curve(tmp_path / "missing") == []


def test_the_curve_ends_at_the_final_validation(tmp_path):
    """A run that max_minutes stopped between two evaluations: its final validation is the curve's last point;
    one stopped at an evaluation step is not counted twice."""
    val = lambda tau: {"greedy_tau": tau, "greedy_survival": [tau - 1.0]}  # noqa: E731
    log = [{"step": 0, "validation": val(1.1)}, {"step": 1}, {"step": 2, "validation": val(1.2)}, {"step": 3}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    cfg = TrainConfig(sequences_per_step=2, anchors_per_sequence=3, block_size=4)
    taus = lambda points: [(p["step"], p["positions"], p["greedy_tau"]) for p in points]  # noqa: E731
    assert taus(run_curve(tmp_path / "log.jsonl", cfg, (3, val(1.3)))) == [(0, 0, 1.1), (2, 48, 1.2), (3, 72, 1.3)]
    assert taus(run_curve(tmp_path / "log.jsonl", cfg, (2, val(1.2)))) == [(0, 0, 1.1), (2, 48, 1.2)]
    assert taus(run_curve(tmp_path / "log.jsonl", cfg)) == [(0, 0, 1.1), (2, 48, 1.2)]


def test_training_without_a_training_row_stops_with_the_fix(tiny_data, tmp_path):
    """A data folder whose shards hold validation rows only (a small run: the queue serves held-out prompts first)
    is refused by name before a drafter is built from no rows (which failed inside ``torch.bincount``)."""
    target, out = tiny_data
    held_out = tmp_path / "data"
    for shard in shard_dirs(out):  # the fixture's shards, their validation rows only
        rows = datasets.load_from_disk(str(shard)).filter(lambda s: s == "validation", input_columns="split")
        rows.save_to_disk(str(held_out / shard.name))
    n_val = len(FeatureStore.from_shards([held_out], "validation"))
    assert n_val == len(FeatureStore.from_shards([out], "validation")) > 0
    cfg = TrainConfig(data_dir=[str(held_out)], out_dir=str(tmp_path / "run"), num_hidden_layers=1, sequential_rank=8,
                      block_size=4, num_context_layers=2, draft_vocab_size=16, mask_token_id=0, steps=1)
    with pytest.raises(ValueError, match=rf"No training rows in .*data \({n_val} validation rows\).*--target_tokens"):
        train(target, cfg, progress=False)
    trained = tmp_path / "train-only"  # and the reverse: training rows without a held-out one (the GPU job's rehearsal)
    for shard in shard_dirs(out):
        rows = datasets.load_from_disk(str(shard)).filter(lambda s: s == "train", input_columns="split")
        rows.save_to_disk(str(trained / shard.name))
    cfg.data_dir = [str(trained)]
    with pytest.raises(ValueError, match=r"No validation rows in .*train-only \(\d+ training rows\).*--data_dir"):
        train(target, cfg, progress=False)
