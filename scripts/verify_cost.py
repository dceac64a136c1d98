"""What verification costs at long contexts: target forward of B new tokens over a KV cache of ``ctx`` tokens,
transformers' stock kernels against this package's (``use_cpu_kernels``: prepacked linears, grouped-query SDPA,
O(new tokens) cache), plus plain greedy decoding per token at short and long prompts (issue 23).

Run under the shared CPU lock, one thread:

    flock /tmp/cpu.lock python scripts/verify_cost.py --threads 1 --repeats 7 --out docs/long/verify_cost.md

Timings interleave the two variants (stock, new, stock, new, ...) so that load bursts hit both alike; each cell
is the median of ``--repeats`` timings after one untimed warm-up. The cache is filled by one real prefill of 256
random tokens, then lengthened by repeating its keys/values (timings do not depend on their values).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark_hf.decoding.kv_cache import generation_cache
from dspark_hf.decoding.profiling import grow_cache, time_verify_step
from dspark_hf.decoding.targets import kernels_label, load_default_target


def filled_cache(model, ctx: int):
    """The cache ``model.generate`` would use, holding ``ctx`` positions (prefill 256, then repeated)."""
    cache = generation_cache(model)
    prompt = torch.randint(model.config.vocab_size, (1, min(ctx, 256)), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache, use_cache=True)
    grow_cache(model, cache, ctx)
    return cache


def forward_table(models: dict, contexts, sizes, repeats: int) -> dict:
    """``{(name, ctx, B): median ms}`` of one target forward of B tokens over ``ctx`` cached positions."""
    out = {}
    blocks = {b: torch.randint(1000, (1, b), generator=torch.Generator().manual_seed(b)) for b in sizes}
    for ctx in contexts:
        caches = {name: filled_cache(m, ctx) for name, m in models.items()}
        for b in sizes:
            times = {name: [] for name in models}
            for r in range(repeats + 1):
                for name, m in models.items():
                    t = time_verify_step(m, caches[name], blocks[b])
                    if r:  # the first round is the warm-up
                        times[name].append(t)
            for name in models:
                out[name, ctx, b] = 1e3 * statistics.median(times[name])
        del caches
    return out


@torch.inference_mode()
def decode_ms(model, prompt_len: int, new_tokens: int) -> float:
    """Milliseconds per token of plain greedy ``generate`` after a ``prompt_len``-token prompt (prefill excluded:
    the time of ``new_tokens + 1`` tokens minus that of 1, over ``new_tokens``)."""
    prompt = torch.randint(1000, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    settings = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n):
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **settings)
        return time.perf_counter() - start

    return 1e3 * (run(new_tokens + 1) - run(1)) / new_tokens


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 8, 32])
    p.add_argument("--decode-prompts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the markdown tables here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {"stock": load_default_target(stock_kernels=True)[0], "new": load_default_target()[0]}
    labels = {name: kernels_label(m) for name, m in models.items()}
    table = forward_table(models, args.contexts, args.sizes, args.repeats)
    lines = [f"Target forward of B new tokens over a KV cache of ctx tokens, ms (median of {args.repeats}, "
             f"{args.threads} thread(s)); stock = `{labels['stock']}`, new = `{labels['new']}`.", "",
             "| ctx | " + " | ".join(f"B={b} stock / new" for b in args.sizes) + " | B=8 / B=1 stock / new |",
             "|---" * (len(args.sizes) + 2) + "|"]
    for ctx in args.contexts:
        cells = [f"{table['stock', ctx, b]:.1f} / {table['new', ctx, b]:.1f}" for b in args.sizes]
        ratio = ""
        if 1 in args.sizes and 8 in args.sizes:
            ratio = " / ".join(f"{table[n, ctx, 8] / table[n, ctx, 1]:.2f}" for n in ("stock", "new"))
        lines.append(f"| {ctx} | " + " | ".join(cells) + f" | {ratio} |")
    decode = {}
    for prompt_len in args.decode_prompts:
        for name, m in models.items():
            decode[name, prompt_len] = []
        for _ in range(args.decode_repeats):
            for name, m in models.items():
                decode[name, prompt_len].append(decode_ms(m, prompt_len, args.decode_tokens))
    lines += ["", f"Plain greedy `generate`, ms per new token ({args.decode_tokens} tokens, prefill excluded, median "
              f"of {args.decode_repeats}):", "", "| prompt | stock | new |", "|---|---|---|"]
    for prompt_len in args.decode_prompts:
        lines.append(f"| {prompt_len} | " + " | ".join(f"{statistics.median(decode[n, prompt_len]):.1f}"
                                                      for n in ("stock", "new")) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
