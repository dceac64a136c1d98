"""Trainer throughput: draft positions per second of packing alone and of whole optimizer steps, on cached features.

Times the two halves of a training step of :func:`dspark_hf.training.trainer.train` separately, with the drafter of a
training config on the default target: packing (``FeatureBatcher.sample``: rows and anchors drawn, the batch built on
the device) and the step (forward, loss, backward, clip, AdamW; bf16 autocast where the config says so). Positions
are ``sequences × anchors × γ`` per step, as the learning curve counts them. Needs featurized shards, e.g.::

    dspark train --config configs/gpu-smoke.yaml --prepare-only --data-dir /tmp/data --target-tokens 52000 --threads 1
    python scripts/train_throughput.py --data-dir /tmp/data --threads 1 --pack-steps 30 --train-steps 5

Run it on an otherwise idle machine (or under the machine's CPU lock): the numbers are wall-clock.
"""

import argparse
import statistics
import time

import torch

from dspark_hf.runtime.targets import load_target
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.curve import positions_per_step
from dspark_hf.training.losses import position_weights
from dspark_hf.training.packing import FeatureBatcher, FeatureStore
from dspark_hf.training.trainer import build_drafter, train_step


def sync(device: torch.device):
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when they do
        torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/gpu-smoke.yaml")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--target", help="target model (Hub id or folder); default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sequences", type=int, help="sequences per step (default: the config's)")
    p.add_argument("--anchors", type=int, help="anchors per sequence (default: the config's)")
    p.add_argument("--pack-steps", type=int, default=30)
    p.add_argument("--train-steps", type=int, default=5, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the step (the shipped config's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    overrides = {k: v for k, v in (("sequences_per_step", args.sequences), ("anchors_per_sequence", args.anchors)) if v}
    cfg = TrainConfig.from_yaml(args.config, data_dir=[args.data_dir], **overrides)
    target, _ = load_target(args.target, prepack=False, threads=args.threads)
    target.to(device)
    rows = FeatureStore.from_shards(cfg.data_dir, "train", device)  # on the device, as `train` holds it
    drafter = build_drafter(target, cfg, rows).to(device).train()
    per_step = positions_per_step(cfg)
    batcher = FeatureBatcher(rows, drafter, cfg.block_size, torch.Generator().manual_seed(0), cfg.labels)

    def pack():
        return batcher.sample(cfg.sequences_per_step, cfg.anchors_per_sequence)

    pack()  # warm-up: first reads of the memory-mapped rows
    pack_s = []
    for _ in range(args.pack_steps):
        t0 = time.perf_counter()
        pack()
        sync(device)
        pack_s.append(time.perf_counter() - t0)
    weights = position_weights(cfg.block_size, cfg.decay)
    optimizer = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=1e-4)
    step_s = []
    for i in range(args.train_steps + 1 if args.train_steps else 0):  # the first is a warm-up
        batch = pack()
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, _ = train_step(drafter, batch, weights, cfg.loss_weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        sync(device)
        if i:
            step_s.append(time.perf_counter() - t0)
    pack_ms = statistics.median(pack_s) * 1e3
    print(f"{cfg.sequences_per_step}x{cfg.anchors_per_sequence}x{cfg.block_size} = {per_step} positions/step, "
          f"{len(rows)} train rows, device {device}, threads {args.threads}, bf16 {args.bf16}")
    print(f"pack: median {pack_ms:.1f} ms/step = {per_step / pack_ms * 1e3:,.0f} positions/s")
    if step_s:
        step_ms = statistics.median(step_s) * 1e3
        print(f"step: median {step_ms:.1f} ms/step = {per_step / step_ms * 1e3:,.0f} positions/s (forward+backward+AdamW)")
        print(f"whole: {pack_ms + step_ms:.1f} ms/step = {per_step / (pack_ms + step_ms) * 1e3:,.0f} positions/s, "
              f"packing {pack_ms / (pack_ms + step_ms):.0%} of it")

if __name__ == "__main__":
    main()
