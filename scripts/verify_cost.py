"""What verification costs at long contexts: target forward of B new tokens over a KV cache of ``ctx`` tokens,
transformers' stock kernels, prepacked linears only (before issue 23) and this package's (``use_cpu_kernels``: prepacked linears, grouped-query SDPA,
O(new tokens) cache), plus plain greedy decoding per token at short and long prompts, and the drafter's context
extension over a long prompt against the target's prefill (issue 23).

Run under the shared CPU lock, one thread:

    flock /tmp/cpu.lock python scripts/verify_cost.py --threads 1 --repeats 7 --out docs/long/verify_cost.md

Timings interleave the three variants (stock, prepacked, new, stock, ...) so that load bursts hit both alike; each cell
is the median of ``--repeats`` timings after one untimed warm-up. The cache is filled by one real prefill of 256
random tokens, then lengthened by repeating its keys/values (timings do not depend on their values).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from dspark_hf import DSparkDrafter
from dspark_hf.defaults import default_drafter
from dspark_hf.runtime.capture import LayerCapture
from dspark_hf.runtime.kernels import prepack_linears
from dspark_hf.runtime.kv_cache import generation_cache
from dspark_hf.runtime.profiling import grow_cache, time_verify_step
from dspark_hf.runtime.targets import kernels_label, load_default_target


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


class _Clock(BaseStreamer):
    """Records when ``generate`` hands over each token (the prompt first, then one put per new token)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def decode_steps_ms(model, prompt_len: int, new_tokens: int) -> list[float]:
    """Milliseconds of each plain greedy decoding step after a ``prompt_len``-token prompt (the prefill step
    excluded): the intervals between consecutive tokens of one ``generate`` call.

    The prompt comes with the all-ones attention mask a tokenizer gives: without one, ``generate`` takes the random
    prompt's 0 tokens for padding (``pad_token_id=0``) and masks them, so one prompt length ran the masked
    attention path and another not (the 2,048-token prompt had two 0s, the 256-token one none; issue 23)."""
    prompt = torch.randint(1000, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    clock = _Clock()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    return [1e3 * (b - a) for a, b in zip(clock.times[1:], clock.times[2:])]


@torch.inference_mode()
def prefill_vs_extension_ms(model, drafter, prompt_len: int, repeats: int) -> tuple[float, float]:
    """Median ms of the target's prefill of ``prompt_len`` tokens (capturing the drafter's feature layers, as
    DSpark's first forward does) and of the drafter's context extension over the same positions (issue 23, item 4:
    the first round that drafts appends every prompt position at once)."""
    prompt = torch.randint(1000, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    prefill, extension = [], []
    for r in range(repeats + 1):
        with LayerCapture(model, drafter.config.target_layer_ids) as capture:
            start = time.perf_counter()
            model(input_ids=prompt, cache=generation_cache(model), use_cache=True, logits_to_keep=1)
            middle = time.perf_counter()
            drafter.extend_context(drafter.new_context(), capture.features())  # features (1, L, m·d)
            end = time.perf_counter()
        if r:  # the first round is the warm-up
            prefill.append(middle - start)
            extension.append(end - middle)
    return 1e3 * statistics.median(prefill), 1e3 * statistics.median(extension)


@torch.inference_mode()
def capture_cost_ms(model, layer_ids: list[int], ctx: int, repeats: int) -> tuple[float, float]:
    """Median ms of a 1-token forward over ``ctx`` cached positions without and with the drafter's feature layers
    ``layer_ids`` recorded (:class:`~dspark_hf.runtime.capture.LayerCapture`, what a DSpark call opens around its
    rounds), interleaved (issue 28)."""
    cache = filled_cache(model, ctx)
    token = torch.tensor([[42]])
    times = {False: [], True: []}
    for r in range(repeats + 1):
        for capture in (False, True):
            with LayerCapture(model, layer_ids) if capture else contextlib.nullcontext():
                start = time.perf_counter()
                model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
                elapsed = time.perf_counter() - start
            cache.crop(-1)
            if r:  # the first round is the warm-up
                times[capture].append(elapsed)
    return 1e3 * statistics.median(times[False]), 1e3 * statistics.median(times[True])


def _median_seconds(fn, repeats: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls after one untimed warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def machine_rates(model, ctx: int, block: int, repeats: int) -> tuple[float, float]:
    """What one core reaches, for the roofline: ``(read GB/s, score-GEMM GFLOP/s)``.

    Read: summing K/V-shaped storage of ``max(ctx, 4096)`` positions for every layer (189 MB for SmolLM2-135M,
    more than the last-level cache holds, so from memory). GEMM: one layer's score product of a ``block``-token block with the query heads of each K/V
    head folded into rows (``[H_kv, g·block, D] @ [H_kv, D, ctx]``), operands in cache: what the attention's
    arithmetic could run at."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    storage = torch.randn(2 * config.num_hidden_layers, kv_heads, max(ctx, 4096), dim)
    read = storage.numel() * storage.element_size() / _median_seconds(storage.sum, repeats)
    q, k = torch.randn(kv_heads, heads // kv_heads * block, dim), torch.randn(kv_heads, dim, ctx)
    gemm = 2 * q.shape[0] * q.shape[1] * dim * ctx / _median_seconds(lambda: torch.matmul(q, k), 10 * repeats)
    return read / 1e9, gemm / 1e9


def roofline_lines(model, table: dict, contexts, repeats: int) -> list[str]:
    """Markdown: each context's measured growth of a B = 1 and a B = 8 forward over ctx ``contexts[0]`` against the
    least the attention could add at the machine's rates (:func:`machine_rates`), and the B = 8 / B = 1 ratio a
    kernel at those rates would give. Attention of ``B`` queries over ``n`` positions: ``4·L·H·B·n·D`` FLOPs and
    ``2·L·H_kv·n·D`` K/V values read; its floor is the larger of FLOPs / GEMM rate and bytes / read rate."""
    config = model.config
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    read, gemm = machine_rates(model, max(contexts), 8, repeats)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    base = contexts[0]

    def floor_ms(b, n):  # attention's least time for b queries over n positions
        return 1e3 * max(4 * layers * heads * b * n * dim / (gemm * 1e9), 2 * layers * kv_heads * n * dim * 4 / (read * 1e9))

    lines = ["", f"Roofline (`new` kernels; machine rates on this core: reading memory {read:.1f} GB/s, the folded "
             f"B = 8 score GEMM in cache {gemm:.0f} GFLOP/s; the weights, {weights / 1e6:.0f} MB, stream at "
             f"{weights / 1e6 / table['new', base, 1]:.1f} GB/s in a B = 1 step at ctx {base}). Growth of a forward "
             f"over ctx {base}, measured / least at these rates (ms), and the B = 8 / B = 1 ratio measured / with an "
             "attention kernel at these rates:", "",
             "| ctx | K/V read MB | B=1 growth | B=8 attention GFLOP | B=8 growth | B=8 kernel GFLOP/s | B=8 / B=1 |",
             "|---|---|---|---|---|---|---|"]
    for n in contexts[1:]:
        grow = {b: table["new", n, b] - table["new", base, b] for b in (1, 8)}
        least = {b: floor_ms(b, n) - floor_ms(b, base) for b in (1, 8)}
        flops = 4 * layers * heads * 8 * (n - base) * dim
        ideal = (table["new", base, 8] + least[8]) / (table["new", base, 1] + least[1])
        lines.append(f"| {n} | {2 * layers * kv_heads * n * dim * 4 / 1e6:.0f} | {grow[1]:.1f} / {least[1]:.1f} | "
                     f"{4 * layers * heads * 8 * n * dim / 1e9:.2f} | {grow[8]:.1f} / {least[8]:.1f} | "
                     f"{flops / grow[8] / 1e6:.0f} | {table['new', n, 8] / table['new', n, 1]:.2f} / {ideal:.2f} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timings per forward-cost cell, median taken (default 7; the capture table takes 4x)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096], help="KV-cache lengths ctx (default 256 1024 2048 4096)")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 8, 32], help="new tokens B per forward (default 1 2 8 32)")
    p.add_argument("--decode-prompts", type=int, nargs="+", default=[256, 2048], help="prompt lengths of the plain-decoding table (default 256 2048)")
    p.add_argument("--decode-tokens", type=int, default=32, help="new tokens per plain-decoding call (default 32)")
    p.add_argument("--decode-repeats", type=int, default=3, help="plain-decoding calls per prompt length (default 3)")
    p.add_argument("--prefill-prompts", type=int, nargs="+", default=[1024, 2048, 3072], help="prompt lengths of the prefill table (default 1024 2048 3072)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="prefills per prompt length (default 3)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown tables here")
    args = p.parse_args()
    models = {"stock": load_default_target(stock_kernels=True)[0],  # what transformers gives
              "prepacked": prepack_linears(load_default_target(stock_kernels=True)[0]),  # before issue 23
              "new": load_default_target()[0]}
    torch.set_num_threads(args.threads)  # after loading: load_target sets its own default
    labels = {name: kernels_label(m) for name, m in models.items()}
    table = forward_table(models, args.contexts, args.sizes, args.repeats)
    lines = [f"Target forward of B new tokens over a KV cache of ctx tokens, ms (median of {args.repeats}, "
             f"{args.threads} thread(s)); each cell: " + " / ".join(f"{n} (`{label}`)" for n, label in labels.items()) + ".", "",
             "| ctx | " + " | ".join(f"B={b}" for b in args.sizes) + " | B=8 / B=1 |",
             "|---" * (len(args.sizes) + 2) + "|"]
    for ctx in args.contexts:
        cells = [" / ".join(f"{table[n, ctx, b]:.1f}" for n in models) for b in args.sizes]
        ratio = ""
        if 1 in args.sizes and 8 in args.sizes:
            ratio = " / ".join(f"{table[n, ctx, 8] / table[n, ctx, 1]:.2f}" for n in models)
        lines.append(f"| {ctx} | " + " | ".join(cells) + f" | {ratio} |")
    if 1 in args.sizes and 8 in args.sizes and len(args.contexts) > 1:
        lines += roofline_lines(models["new"], table, args.contexts, args.repeats)
    decode = {}
    for prompt_len in args.decode_prompts:
        for name, m in models.items():
            decode[name, prompt_len] = []
        for _ in range(args.decode_repeats):
            for name, m in models.items():
                decode[name, prompt_len] += decode_steps_ms(m, prompt_len, args.decode_tokens)
    lines += ["", f"Plain greedy `generate`, ms per decoding step (median over {args.decode_repeats} calls × "
              f"{args.decode_tokens - 1} steps, prefill excluded):", "", "| prompt | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for prompt_len in args.decode_prompts:
        lines.append(f"| {prompt_len} | " + " | ".join(f"{statistics.median(decode[n, prompt_len]):.1f}"
                                                      for n in models) + " |")
    drafter = DSparkDrafter.from_pretrained(default_drafter()).bind(models["new"])
    prepack_linears(drafter)  # as generate does for a prepacked target
    lines += ["", f"Prefill of a long prompt (`new` kernels, median of {args.prefill_repeats}): the target's forward over "
              "the prompt (the drafter's feature layers captured) against the drafter's context extension over the "
              "same positions (paid once, in the first round that drafts):", "",
              "| prompt | target prefill ms | drafter extension ms | extension / prefill |", "|---|---|---|---|"]
    for prompt_len in args.prefill_prompts:
        prefill, extension = prefill_vs_extension_ms(models["new"], drafter, prompt_len, args.prefill_repeats)
        lines.append(f"| {prompt_len} | {prefill:.0f} | {extension:.0f} | {extension / prefill:.3f} |")
    layer_ids = drafter.config.target_layer_ids
    lines += ["", f"A 1-token forward (`new` kernels, median of {4 * args.repeats}, interleaved) without / with the "
              f"drafter's {len(layer_ids)} feature layers {layer_ids} recorded (`LayerCapture`, as a DSpark call "
              "records them):", "", "| ctx | plain ms | captured ms | ratio |", "|---|---|---|---|"]
    for ctx in args.decode_prompts:
        plain, captured = capture_cost_ms(models["new"], layer_ids, ctx, 4 * args.repeats)
        lines.append(f"| {ctx} | {plain:.1f} | {captured:.1f} | {captured / plain:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
