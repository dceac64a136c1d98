"""Median ms of 1- and 8-token verification steps of the default target with 1 and 2 torch threads.

The measurement behind the `--threads 1` default (README, "SPS curve, threads and load"). Run it idle and
while the machine does other work: `python scripts/thread_check.py`.
"""

import statistics

import torch
from transformers import DynamicCache

import dspark_hf
from dspark_hf.runtime.profiling import time_verify_step


def main():
    target, _ = dspark_hf.load_default_target()
    kv = DynamicCache(config=target.config)
    with torch.inference_mode():
        target(input_ids=torch.randint(1000, (1, 256)), cache=kv, use_cache=True)  # context 256
    for threads in (1, 2, 1, 2):  # twice, interleaved: load changes while it runs
        torch.set_num_threads(threads)
        for b in (1, 8):
            ids = torch.randint(1000, (1, b))
            time_verify_step(target, kv, ids)  # warm-up
            ms = [time_verify_step(target, kv, ids) * 1e3 for _ in range(15)]
            q1, _, q3 = statistics.quantiles(ms, n=4)
            print(f"threads={threads} B={b} median={statistics.median(ms):.1f} ms "
                  f"q25={q1:.1f} q75={q3:.1f} max={max(ms):.1f}", flush=True)


if __name__ == "__main__":
    main()
