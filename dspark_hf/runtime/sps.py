"""``SPSCurve``: the target's measured steps per second when verifying ``B`` tokens at once, per context length,
refined online from the verification times of real rounds (paper §3.2.2), and what a round costs besides the
verification (bookkeeping, the drafter's pass), learnt the same way, and its plot (:func:`plot_sps`). Measuring the
curve and caching it on disk is :mod:`dspark_hf.runtime.profiling`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 2  # 2 added context_curves, noisy, spread, observations, counts, online; later overhead_ms, draft_ms
# (with defaults: files without them load; version 1 files still load)
DEFAULT_CONTEXTS = (256, 1024, 2048, 4096)  # context lengths profiled by default (those that fit); others learnt online
REL_TOL = 0.05  # stop sweeping once every median is known to ±5 % (95 % confidence)
NOISY_SPREAD = 0.15  # a curve whose medians are still wider than ±15 % is marked noisy
ONLINE_WEIGHT = 0.1  # EMA weight of one observed verification time (in log-milliseconds)
# a size observed this often weighs its measured value < 10 % ((1 - ONLINE_WEIGHT) ** 22 = 0.098): see SPSCurve.healed
HEALED_AFTER = math.ceil(math.log(0.1) / math.log(1 - ONLINE_WEIGHT))
HEALED_SHARE = 0.05  # the sizes that count for healing: those of at least 5 % of the observed verifications
NEIGHBOUR_DECAY = 0.7  # an observation at B moves SPS(B ± d) with weight ONLINE_WEIGHT · NEIGHBOUR_DECAY**d
ENGINE_TABLES = ("sglang", "tensorrt-llm")  # SPSCurve.engine_table formats


class NoisySPSWarning(UserWarning):
    """The SPS curve was measured (or cached) with a spread too wide to trust; see :func:`profile_sps`."""


@dataclass
class SPSCurve:
    """A profiled capacity curve ``SPS(B)``, per context length, and what it was measured on (paper §3.2.2).

    Pass ``curve.at(context_len)`` (or ``curve.steps_per_s`` for the primary context) as the ``sps``
    argument of :mod:`dspark_hf.decoding.scheduler` functions.

    Attributes:
        steps_per_s: ``steps_per_s[B - 1]`` = target forward passes per second when verifying ``B``
            tokens with ``context_len`` tokens cached, for ``B = 1..max_tokens``; all ``> 0``.
        target_name: ``target.config._name_or_path`` (``""`` for a model built in memory).
        device_name: e.g. ``"NVIDIA H200"`` or ``"AMD EPYC AVX2 (2 cores, 1 torch threads)"``.
        dtype: parameter dtype without the ``torch.`` prefix, e.g. ``"float32"``.
        torch_version: ``torch.__version__`` at measurement time.
        context_len: tokens in the KV cache while timing ``steps_per_s`` (the primary row).
        n_params: number of target parameters (tells apart unnamed models of different sizes).
        linear_kernels: ``"stock"`` or ``"onednn-prepacked"`` (:func:`~dspark_hf.runtime.kernels.prepack_linears`
            flattens the CPU curve, so it is part of what a curve was measured on).
        smoothed: whether :meth:`smooth` has been applied.
        context_curves: further rows ``{context length: steps_per_s list}`` (same length as ``steps_per_s``),
            profiled or added by :meth:`observe`.
        noisy: the measurement's spread exceeded ``NOISY_SPREAD`` (re-profile on a quiet machine).
        spread: largest relative 95 % half-width of a median over all ``B`` and contexts (0: not measured here).
        observations: verification times folded in by :meth:`observe` since the curve was measured.
        counts: ``{context row: [observations of B = 1..max_tokens]}`` behind ``observations``.
        online: whether ``generate`` refines the curve with each round's verification time and learns the round
            costs below (``False`` keeps both fixed, so the scheduler's choices are reproducible run to run).
        overhead_ms: milliseconds every round spends outside the verification and the drafter's pass (appending
            the context features, planning, transformers' bookkeeping), learnt by :meth:`observe_round`; 0 until
            then.
        draft_ms: milliseconds of the drafter's pass in a round that drafts (a prompt-lookup round or a plain
            target step skips it), learnt by :meth:`observe_round`; 0 until then.
        device_type: ``"cpu"``, ``"cuda"``, ... (``""``: a curve stored before it was recorded; ``dspark profile
            --refresh`` records it).

    Raises:
        ValueError: empty curve, a non-positive / non-finite value, or a row of another length.
    """

    steps_per_s: list[float]  # index B - 1
    target_name: str
    device_name: str
    dtype: str
    torch_version: str
    context_len: int  # tokens in the KV cache while timing
    n_params: int
    linear_kernels: str = "stock"  # or "onednn-prepacked" (dspark_hf.runtime.kernels); older files: stock
    smoothed: bool = False  # running minimum applied (monotone non-increasing in B)
    context_curves: dict[int, list[float]] = field(default_factory=dict)  # other context lengths
    noisy: bool = False
    spread: float = 0.0
    observations: int = 0
    counts: dict[int, list[int]] = field(default_factory=dict)
    online: bool = True
    overhead_ms: float = 0.0
    draft_ms: float = 0.0
    device_type: str = ""

    def __post_init__(self) -> None:
        self.steps_per_s = [float(s) for s in self.steps_per_s]
        self.context_curves = {int(k): [float(s) for s in v] for k, v in self.context_curves.items()}
        self.counts = {int(k): [int(n) for n in v] for k, v in self.counts.items()}
        for row in (self.steps_per_s, *self.context_curves.values()):
            if not row or not all(0 < s < float("inf") for s in row):
                raise ValueError(f"steps_per_s must be a non-empty list of finite values > 0, got {row}.")
            if len(row) != len(self.steps_per_s):
                raise ValueError(f"every context row must cover B = 1..{len(self.steps_per_s)}, got {len(row)} values.")

    @property
    def max_tokens(self) -> int:
        """Largest ``B`` covered by the curve."""
        return len(self.steps_per_s)

    @property
    def healed(self) -> bool:
        """Whether online refinement has replaced the measurement where rounds use the curve: every size ``B``
        behind at least ``HEALED_SHARE`` of the observed verifications (all context rows together) was observed
        ``HEALED_AFTER`` times, so its measured value weighs < 10 % of the estimate (:meth:`observe`). A noisy
        curve that has healed no longer warns (:func:`~dspark_hf.runtime.profiling.load_or_profile_sps`)."""
        per_size = [sum(row[b] for row in self.counts.values()) for b in range(self.max_tokens)]
        used = [n for n in per_size if n > 0 and n >= HEALED_SHARE * self.observations]
        return bool(used) and min(used) >= HEALED_AFTER

    @property
    def rows(self) -> dict[int, list[float]]:
        """All rows ``{context length: steps_per_s}``, sorted by context (the lists are the curve's own)."""
        return dict(sorted({**self.context_curves, self.context_len: self.steps_per_s}.items()))

    def at(self, context_len: int) -> list[float]:
        """``SPS(B)`` for ``B = 1..max_tokens`` with ``context_len`` tokens cached (a new list).

        The cost in milliseconds is interpolated linearly in the context length between the two nearest
        rows and clamped to the first / last row outside them (attention cost is linear in the context).
        """
        rows = self.rows
        contexts = list(rows)
        if context_len <= contexts[0] or len(contexts) == 1:
            return list(rows[contexts[0]])
        if context_len >= contexts[-1]:
            return list(rows[contexts[-1]])
        hi = next(k for k in contexts if k >= context_len)
        lo = contexts[contexts.index(hi) - 1]
        w = (context_len - lo) / (hi - lo)
        return [1.0 / ((1 - w) / a + w / b) for a, b in zip(rows[lo], rows[hi])]

    def row_for(self, context_len: int) -> int:
        """The context row an observation at ``context_len`` refines (see :meth:`observe`)."""
        contexts = list(self.rows)
        if context_len <= contexts[0]:
            return contexts[0]
        nearest = min(contexts, key=lambda k: abs(math.log2(context_len / k)))
        if abs(math.log2(context_len / nearest)) <= 0.5:
            return nearest
        return 2 ** round(math.log2(context_len))

    def observe(self, n_tokens: int, context_len: int, seconds: float, weight: float = ONLINE_WEIGHT,
                decay: float = NEIGHBOUR_DECAY) -> None:
        """Fold one measured verification time into the curve (online refinement; in place).

        The row of :meth:`row_for` ``(context_len)`` (created from :meth:`at` when new) moves toward the
        observation by an exponential moving average of log-milliseconds,
        ``log ms(b) += weight_b · (log(1e3 · seconds) - log ms(b))`` for every size ``b``, with ``weight_B =
        weight`` for the observed size and ``weight · decay**|b - B| / (1 + n_b)`` for the others (``n_b``: times
        ``b`` itself was observed, :attr:`counts`). Sizes the scheduler never picks are pulled toward what
        their neighbours cost, so a size a bad curve made look too expensive soon looks affordable, gets
        verified and is then measured itself (after which its neighbours' pull fades): a curve wrong
        everywhere heals. An observation at ``B = 1`` moves ``B = 1`` only: the target's token alone is a
        different forward from a block's (a matrix-vector product: on a CPU the transposed single row, issue #23), so
        its time says nothing of what a block costs, and the long stretches of target-alone rounds of a prompt the
        drafter cannot follow would pull every block size toward a plain step's cost (issue #28: ``B = 2`` read at
        1.23× ``B = 1`` fell to 1.02× over 50 such rounds on a 2-core EPYC where it costs 1.40×; observations at
        ``B >= 2`` still pull ``B = 1``). In log space one spike of 10× moves the estimate by only ``10**weight``
        (1.26× at the default).

        Args:
            n_tokens: ``B``, tokens the target verified (``ℓ + 1``), in ``1..max_tokens``.
            context_len: tokens in the KV cache before the verification.
            seconds: measured wall-clock seconds of the verification, ``> 0``.
            weight: EMA weight in ``(0, 1]``.
            decay: neighbour weight factor per step of ``B`` in ``[0, 1]``.

        Raises:
            ValueError: ``n_tokens`` outside the curve, ``seconds <= 0``, ``weight``/``decay`` out of range.
        """
        if not 1 <= n_tokens <= self.max_tokens:
            raise ValueError(f"n_tokens must be in 1..{self.max_tokens} (the curve's B), got {n_tokens}.")
        if not (seconds > 0 and math.isfinite(seconds)) or not 0 < weight <= 1 or not 0 <= decay <= 1:
            raise ValueError(f"need seconds > 0, 0 < weight <= 1, 0 <= decay <= 1; got {seconds}, {weight}, {decay}.")
        key = self.row_for(context_len)
        if key not in self.rows:
            self.context_curves[key] = self.at(key)
        row = self.rows[key]
        counts = self.counts.setdefault(key, [0] * len(row))
        for b in range(len(row)) if n_tokens > 1 else (0,):  # row[b] = SPS(b + 1) = 1e3 / ms(b + 1)
            delta = math.log(seconds * row[b])  # log(observed ms / modelled ms of size b + 1)
            w = weight if b + 1 == n_tokens else weight * decay ** abs(b + 1 - n_tokens) / (1 + counts[b])
            row[b] *= math.exp(-w * delta)
        counts[n_tokens - 1] += 1
        self.observations += 1

    def observe_round(self, overhead_seconds: float, draft_seconds: float | None = None,
                      weight: float = ONLINE_WEIGHT) -> None:
        """Fold one round's measured costs outside the verification into :attr:`overhead_ms` / :attr:`draft_ms`.

        An exponential moving average of log-milliseconds (as :meth:`observe`); a cost still at 0 takes the first
        observation as it is.

        Args:
            overhead_seconds: the round's wall-clock seconds minus its verification and its drafter pass, ``>= 0``.
            draft_seconds: seconds of the round's drafter pass, or ``None`` for a round that did not draft.
            weight: EMA weight in ``(0, 1]``.

        Raises:
            ValueError: a negative or non-finite time, or ``weight`` out of range.
        """
        times = {"overhead_ms": overhead_seconds, "draft_ms": draft_seconds}
        if not 0 < weight <= 1 or not all(math.isfinite(t) and t >= 0 for t in times.values() if t is not None):
            raise ValueError(f"need times >= 0 and 0 < weight <= 1; got {overhead_seconds}, {draft_seconds}, {weight}.")
        for name, seconds in times.items():
            if seconds is None:
                continue
            ms, old = max(1e3 * seconds, 1e-3), getattr(self, name)
            setattr(self, name, ms if old <= 0 else old * (ms / old) ** weight)

    def round_rates(self, context_len: int, drafts: bool, max_tokens: int) -> list[float]:
        """Rounds per second of one request's round when the target verifies ``B = 1..max_tokens`` tokens, costs
        outside the verification included.

        ``rate(B) = 1 / (1 / SPS(B) + overhead + draft)``, the draft term only for ``drafts=True``. The paper's
        ``Θ = τ · SPS(B)`` (§3.2.2) counts the verification alone, right where drafting and bookkeeping are
        negligible next to the target's step; on a CPU they are ~10-25 % of a round, and a prompt-lookup round
        (no drafter pass) would otherwise be undervalued. With no costs learnt yet (or ``online=False``) this is
        :meth:`at`. The sizes are read as measured, with no shape imposed (issue #28): a 2-core AVX-512 EPYC at 1
        thread verifies ``B = 2`` at 1.40× ``B = 1`` but ``B = 3-6`` at 1.01-1.12× and ``B = 8`` at 1.23× (a 2-row
        GEMM is its slow shape), so a concave majorant (read here before) priced every block at ``B = 2``'s cost and
        a lookup of 2-5 tokens 20-30 % too dear, and a monotone reading would do the same; measured against it in
        lockstep (with :meth:`observe`'s rule that ``B = 1`` refines only itself), the default gained 4-8 % on the
        low-acceptance prompts it lost on (0.95 -> 0.99× plain) and on most others. A profile's noise (a size's median within ~7-9 % of ``B = 1`` over a few sweeps) is left to
        the online refinement (:meth:`observe`), which measures every size the rounds verify.

        Args:
            context_len: tokens in the target's KV cache before the verification.
            drafts: whether the round runs the drafter.
            max_tokens: the most tokens the round can verify (``γ + 1``; a lookup continuation of ``m > γ``
                tokens: ``m + 1``), ``1..self.max_tokens``.

        Returns:
            ``rate[B - 1]`` for ``B = 1..max_tokens``, rounds per second (pass it as the ``sps`` of
            :mod:`dspark_hf.decoding.scheduler` functions).

        Raises:
            ValueError: ``max_tokens`` outside ``1..self.max_tokens``.
        """
        extra = 1e-3 * (self.overhead_ms + (self.draft_ms if drafts else 0.0))
        return [1.0 / (1e-3 * m + extra) for m in self.round_ms(context_len, max_tokens)]

    def round_ms(self, context_len: int, max_tokens: int) -> list[float]:
        """ms per verification of ``B = 1..max_tokens`` tokens as one request's round reads them
        (:meth:`round_rates`; the concurrent engine's plan for a request alone in flight): the row at
        ``context_len`` cut to the sizes the round can verify.

        Raises:
            ValueError: ``max_tokens`` outside ``1..self.max_tokens``.
        """
        if not 1 <= max_tokens <= self.max_tokens:
            raise ValueError(f"max_tokens must be in 1..{self.max_tokens} (the curve's B), got {max_tokens}.")
        return [1e3 / s for s in self.at(context_len)[:max_tokens]]

    def smooth(self) -> SPSCurve:
        """Copy with every row made monotone non-increasing in ``B`` by a running minimum (paper §5.2:
        real curves are jagged)."""
        def running_min(row):
            out, low = [], float("inf")
            for s in row:
                low = min(low, s)
                out.append(low)
            return out

        return dataclasses.replace(self, steps_per_s=running_min(self.steps_per_s), smoothed=True,
                                   context_curves={k: running_min(v) for k, v in self.context_curves.items()})

    def table(self) -> str:
        """Plain-text table: milliseconds per verification step, one column per context row."""
        rows = self.rows
        head = "    B" + "".join(f"{f'ctx {k} ms':>13}" for k in rows)
        lines = [head] + [f"{b:5d}" + "".join(f"{1e3 / r[b - 1]:13.1f}" for r in rows.values())
                          for b in range(1, self.max_tokens + 1)]
        if self.noisy and self.healed:
            lines.append(f"measured noisy (±{100 * self.spread:.0f} %), healed since by {self.observations} online "
                         "refinements")
        elif self.noisy:
            lines.append(f"noisy: medians known only to ±{100 * self.spread:.0f} % (re-profile on a quieter machine)")
        return "\n".join(lines)

    def engine_table(self, engine: str) -> dict:
        """The curve as the cost table a serving engine reads (issue #11).

        ``B`` here is what the engines index by: tokens in one verification forward (bonus included).

        Args:
            engine: ``"sglang"``: the JSON of ``--speculative-dspark-sps-table-path``
                (``sample_batch_tokens`` = ``1..max_tokens``, ``sample_steps_per_sec``, ``max_batch_tokens``);
                ``"tensorrt-llm"``: the confidence-scheduler cost table (``token_counts``,
                ``step_time_ms`` = ``1000 / SPS(B)``, ``fixed_overhead_ms`` = 0: the steps were timed whole).

        Returns:
            A JSON-serialisable dict with exactly the keys that engine reads.

        Raises:
            ValueError: unknown ``engine``.
        """
        tokens = list(range(1, self.max_tokens + 1))
        if engine == "sglang":
            return {"sample_batch_tokens": tokens, "sample_steps_per_sec": list(self.steps_per_s),
                    "max_batch_tokens": self.max_tokens}
        if engine == "tensorrt-llm":
            return {"token_counts": tokens, "step_time_ms": [1e3 / s for s in self.steps_per_s], "fixed_overhead_ms": 0.0}
        raise ValueError(f"engine must be one of {ENGINE_TABLES}, got {engine!r}")

    def to_json(self) -> str:
        """JSON text with every field plus ``format_version``."""
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SPSCurve:
        """Inverse of :meth:`to_json` (also reads format 1, which had one context row). Fields this version does
        not know (written by a newer dspark-hf into a shared cache, all with defaults there) are left out, so an
        older install still reads the curve instead of failing in the constructor.

        Raises:
            ValueError: unknown ``format_version`` or malformed content.
        """
        payload = json.loads(text)
        version = payload.pop("format_version", None)
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"unsupported SPS curve format_version {version!r} (this dspark-hf reads 1 and "
                             f"{FORMAT_VERSION}); delete the file to re-profile.")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in payload.items() if k in known})


def plot_sps(curve: SPSCurve, path: str | os.PathLike) -> Path:
    """Write a PNG of ``curve``: milliseconds per verification step against ``B``, one line per context row.

    Needs matplotlib (imported here, not with the package). Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sizes = range(1, curve.max_tokens + 1)
    for context, row in curve.rows.items():
        ax.plot(sizes, [1e3 / s for s in row], marker="o", markersize=3, label=f"context {context}")
    ax.set_xlabel("B (tokens verified per target step)")
    ax.set_ylabel("ms per verification step")
    ax.set_ylim(bottom=0)
    note = f" · NOISY (±{100 * curve.spread:.0f} %)" if curve.noisy else ""
    ax.set_title(f"SPS curve · {curve.device_name}{note}", fontsize=9)
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
