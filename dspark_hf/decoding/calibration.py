"""Confidence calibration: Sequential Temperature Scaling (STS) and the report that judges it.

The metrics themselves (ECE, Brier, ROC-AUC, survival labels) live in :mod:`dspark_hf.metrics` and are
re-exported here.

Implements paper §3.2.1 ("Post-hoc Calibration") and the diagnostics of §4 (ECE, ROC-AUC, reliability
diagram). Symbols follow the paper:

- ``c[k]``: conditional confidence of draft position ``k`` (shape symbol ``γ`` = positions per round).
- ``a[k] = prod_{i<=k} c[i]``: prefix survival probability, what the scheduler needs in absolute terms.
- A *round* is one speculative step verified with a FIXED length ``γ``, so every label is observed:
  ``accepted`` = draft tokens accepted in that round (``0..γ``, not counting the bonus token).
- Survival label of position ``k``: ``1[accepted >= k]``; it is the target of ``a[k]``.
- Conditional label of position ``k``: ``1[accepted >= k]``, defined only where ``accepted >= k - 1``
  (the prefix before ``k`` survived); it is the target of ``c[k]``.

STS rescales each position on the logit, ``c'[k] = sigmoid(logit(c[k]) / T[k])``, choosing ``T[k]`` left
to right by a 1-D grid search that minimises the ECE of ``a'[k]`` with ``T[1..k-1]`` held fixed.
Temperature scaling is order preserving, so the head's ranking (ROC-AUC) is unchanged.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..metrics import (  # the maths lives in .metrics
    _bin_sums,
    _check_probs,
    _check_rounds,
    _ece_columns,
    conditional_mask,
    prefix_survival_metrics,
    roc_auc,
    survival_labels,
)
from ..modeling.modeling_dspark import CALIBRATION_FILE

__all__ = [
    "DEFAULT_GRID",
    "OnlineCorrection",
    "SequentialTemperatureScaling",
    "reliability_diagram",
    "scale_temperature",
]

FORMAT_VERSION = 1
# Geometric grid of temperatures 0.1 .. 10 (201 points, ~2.3 % apart); contains T = 1 exactly.
DEFAULT_GRID = tuple(10.0 ** (k / 100) for k in range(-100, 101))


# ----------------------------------------------------------------------------- STS


def scale_temperature(confidences: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """Temperature scaling on the logit: ``sigmoid(logit(c) / T)`` (paper §3.2.1, STS).

    Exact 0 and 1 stay 0 and 1. ``T > 1`` softens over-confident scores; the map is strictly
    increasing in ``c`` for every ``T > 0`` (order preserving).

    Args:
        confidences: probabilities in ``[0, 1]``, any shape.
        temperature: positive scalar or tensor broadcastable against ``confidences``.

    Returns:
        Tensor of the broadcast shape, dtype of ``confidences``.
    """
    return torch.sigmoid(torch.logit(confidences) / temperature)


@dataclass
class SequentialTemperatureScaling:
    """Sequential Temperature Scaling (paper §3.2.1): one logit temperature per draft position.

    Attributes:
        temperatures: ``T[k]`` for positions ``k = 1..γ`` (index ``k - 1``), each ``> 0``; empty until
            :meth:`fit` or :meth:`load`.
        fit_report: the :meth:`report` of the data :meth:`fit` saw (``None`` when built by hand).

    Raises:
        ValueError: a temperature is not a finite positive number.
    """

    temperatures: list[float] = field(default_factory=list)  # T[k - 1]; 1.0 leaves position k unchanged
    fit_report: dict | None = None  # report on the fitting rounds, saved alongside the temperatures

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not all(math.isfinite(t) and t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be finite and > 0, got {self.temperatures}.")

    def fit(
        self, confidences: torch.Tensor, accepted: torch.Tensor, grid: Sequence[float] = DEFAULT_GRID, n_bins: int = 15
    ) -> SequentialTemperatureScaling:
        """Fit ``T[1..γ]`` left to right by grid search on the ECE of ``a[k]`` (paper §3.2.1).

        Args:
            confidences: raw conditional confidences ``c``, shape ``(N, γ)``, from fixed-length rounds.
            accepted: ``torch.LongTensor`` of shape ``(N,)``, draft tokens accepted per round (``0..γ``).
            grid: candidate temperatures (all ``> 0``); ties go to the first grid entry.
            n_bins: ECE bins.

        Returns:
            ``self``, with :attr:`temperatures` and :attr:`fit_report` set.

        Raises:
            ValueError: malformed rounds (shapes, ranges, dtypes) or an empty / non-positive grid.
        """
        c, n_acc = _check_rounds(confidences, accepted)
        temps = torch.as_tensor(list(grid), dtype=torch.float64)  # (G,)
        if temps.ndim != 1 or temps.numel() == 0 or not bool((temps > 0).all() & torch.isfinite(temps).all()):
            raise ValueError("grid must be a non-empty sequence of finite temperatures > 0.")
        labels = survival_labels(n_acc, c.shape[1])  # (N, γ)
        survival = torch.ones(c.shape[0], dtype=torch.float64)  # calibrated a[k-1], (N,)
        self.temperatures = []
        for k in range(c.shape[1]):
            candidates = survival[:, None] * scale_temperature(c[:, k : k + 1], temps)  # (N, G)
            best = int(_ece_columns(candidates, labels[:, k], n_bins).argmin())
            self.temperatures.append(temps[best].item())
            survival = candidates[:, best]
        self.fit_report = self.report(c, n_acc, n_bins)
        return self

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional confidences ``c'[k] = sigmoid(logit(c[k]) / T[k])``.

        Args:
            confidences: raw ``c`` of shape ``(γ,)`` or ``(N, γ)`` (any leading dims), ``γ <= len(temperatures)``.

        Returns:
            Tensor of the same shape, dtype and device; feed it to :func:`dspark_hf.decoding.scheduler.prefix_survival`.

        Raises:
            ValueError: not fitted, ``γ`` larger than the fitted positions, or values outside ``[0, 1]``.
        """
        if not self.temperatures:
            raise ValueError("SequentialTemperatureScaling has no temperatures; call fit() or load() first.")
        confidences = torch.as_tensor(confidences)
        if not confidences.is_floating_point():
            confidences = confidences.to(torch.float64)
        gamma = confidences.shape[-1] if confidences.ndim else 0
        if not 1 <= gamma <= len(self.temperatures):
            raise ValueError(f"confidences have γ = {gamma} positions but the calibration covers "
                             f"1..{len(self.temperatures)}; refit on rounds with at least this many draft tokens.")
        _check_probs(confidences, "confidences")
        temps = torch.tensor(self.temperatures[:gamma], dtype=confidences.dtype, device=confidences.device)
        return scale_temperature(confidences, temps)

    def report(self, confidences: torch.Tensor, accepted: torch.Tensor, n_bins: int = 15) -> dict:
        """Per-position calibration and discrimination of raw vs. calibrated scores (paper §4, Figure 6).

        Args:
            confidences: raw conditional confidences ``c``, shape ``(N, γ)``, fixed-length rounds.
            accepted: ``torch.LongTensor`` of shape ``(N,)``.
            n_bins: ECE bins.

        Returns:
            ``{"n_rounds", "mean_ece_before", "mean_ece_after", "positions": [...]}``; each position holds
            ``position`` (1-based), ``temperature``, ``survival_rate`` (mean of ``1[accepted >= k]``),
            ``ece_before``/``ece_after`` and ``brier_before``/``brier_after`` of ``a[k]`` against
            survival labels, ``roc_auc`` of ``c[k]`` against conditional labels on rounds with
            ``accepted >= k - 1`` (``None`` when one class is absent; unchanged by STS) and
            ``n_conditional`` (how many such rounds).

        Raises:
            ValueError: malformed rounds or ``γ`` beyond the fitted positions.
        """
        c, n_acc = _check_rounds(confidences, accepted)
        gamma = c.shape[1]
        labels, mask = survival_labels(n_acc, gamma), conditional_mask(n_acc, gamma)
        before = prefix_survival_metrics(c, n_acc, n_bins)
        after = prefix_survival_metrics(self.apply(c), n_acc, n_bins)
        positions = []
        for k, (raw, cal) in enumerate(zip(before["positions"], after["positions"])):
            auc = roc_auc(c[mask[:, k], k], labels[mask[:, k], k]) if bool(mask[:, k].any()) else math.nan
            positions.append({
                "position": k + 1,
                "temperature": self.temperatures[k],
                "survival_rate": raw["survival_rate"],
                "ece_before": raw["ece"],
                "ece_after": cal["ece"],
                "brier_before": raw["brier"],
                "brier_after": cal["brier"],
                "roc_auc": None if math.isnan(auc) else auc,
                "n_conditional": int(mask[:, k].sum()),
            })
        return {
            "n_rounds": c.shape[0],
            "mean_ece_before": before["ece"],
            "mean_ece_after": after["ece"],
            "positions": positions,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``{"format_version", "temperatures", "report"}`` as JSON.

        Args:
            path: a ``.json`` file, or a folder (created if needed) that receives ``calibration.json``.

        Returns:
            The path written.

        Raises:
            ValueError: nothing fitted yet.
        """
        if not self.temperatures:
            raise ValueError("nothing to save; call fit() first.")
        file = _calibration_file(path, create=True)
        payload = {"format_version": FORMAT_VERSION, "temperatures": self.temperatures, "report": self.fit_report}
        file.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
        return file

    @classmethod
    def load(cls, path: str | os.PathLike) -> SequentialTemperatureScaling:
        """Read a calibration written by :meth:`save` (a ``.json`` file or a folder holding ``calibration.json``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: unknown ``format_version``.
        """
        payload = json.loads(_calibration_file(path, create=False).read_text())
        if payload.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported calibration format_version {payload.get('format_version')!r}; "
                             f"this dspark-hf reads version {FORMAT_VERSION}. Refit and save again.")
        return cls(temperatures=payload["temperatures"], fit_report=payload.get("report"))


# ----------------------------------------------------------------------------- online correction

ONLINE_PRIOR = 1.0  # pseudo-count (in expected accepted drafts) that keeps the correction at 1 until rounds speak;
# a trade-off for the worst prompt, measured on recorded greedy rounds of the bench prompts, each round predicted from
# the earlier ones (scripts/online_prior.py, issue #28): in rounds 2-3 of the low-acceptance prompts, where a second
# failed block costs most, m = 1 scores 0.091 Brier against m = 2's 0.101; elsewhere m = 2 is at most 0.004 better


class OnlineCorrection:
    """A per-``generate`` correction of calibrated confidences, learnt from the rounds of the current generation.

    STS (paper §3.2.1) is calibrated over a whole calibration set; on one prompt the drafter may be much worse
    (or better) than on average. The correction is one factor ``f`` on the calibrated conditionals,
    ``c''[k] = min(1, f · c'[k])``, fitted by matching means over every VERIFIED draft position the target reached
    (drafts ``1..n+1`` of a round that accepted ``n`` of ``ℓ``): ``f = (accepted + m) / (Σ c'[k] + m)`` with the
    prior pseudo-count ``m`` (:data:`ONLINE_PRIOR`), so ``f = 1`` before any round and a prompt whose drafts keep
    failing falls to ``f = 0.5`` after ``m`` expected acceptances that did not come.

    Lossless: :meth:`observe` is called after a round is verified with that round's outcome, and :meth:`apply` is
    read before the next round drafts, so no decision depends on a draft of its own round (Appendix A).

    Args:
        prior: the pseudo-count ``m`` (> 0).
    """

    def __init__(self, prior: float = ONLINE_PRIOR):
        if not prior > 0:
            raise ValueError(f"prior must be > 0, got {prior}")
        self.prior = prior
        self.expected = 0.0  # Σ c'[k] over the verified positions reached
        self.accepted = 0  # accepted drafts among them

    @property
    def factor(self) -> float:
        """``f = (accepted + m) / (expected + m)``."""
        return (self.accepted + self.prior) / (self.expected + self.prior)

    def apply(self, calibrated: torch.Tensor | Sequence[float]) -> torch.Tensor | list[float]:
        """``min(1, f · c')`` of calibrated conditionals: a tensor ``(..., γ)`` (same shape, dtype, device), or a
        sequence of ``γ`` floats as a list (what the round planner reads every round, without torch ops; the same
        float64 products as a float64 tensor's)."""
        if isinstance(calibrated, torch.Tensor):
            return (calibrated * self.factor).clamp(max=1.0)
        factor = self.factor
        return [min(1.0, c * factor) for c in calibrated]

    def observe(self, calibrated: Sequence[float], accepted: int) -> None:
        """Fold in one verified round: ``calibrated`` = the (uncorrected) calibrated conditionals of the ℓ verified
        drafts, ``accepted`` = how many the target accepted (``0..ℓ``); positions ``1..min(accepted + 1, ℓ)`` count.

        Raises:
            ValueError: ``accepted`` outside ``0..len(calibrated)``.
        """
        if not 0 <= accepted <= len(calibrated):
            raise ValueError(f"accepted must be in 0..{len(calibrated)} (the verified drafts), got {accepted}")
        self.expected += float(sum(calibrated[: accepted + 1]))
        self.accepted += accepted

    def observe_round(self, calibrated: Sequence[float], forced: int, scheduled: int, accepted: int) -> None:
        """Fold in one verified round whose first ``forced`` drafts were prompt-lookup tokens (a hybrid round;
        ``0``: a DSpark round): ``calibrated`` = the round's block's calibrated conditionals (``γ`` values, forced
        positions included), ``scheduled`` = ℓ, ``accepted`` = drafts accepted. Only the drafter's own verified
        drafts ``forced + 1..ℓ`` count, and only when the ``forced`` ones were all accepted (the target reached
        them); a round with none of them verified is not heard from (:meth:`observe`)."""
        if scheduled > forced and accepted >= forced:
            self.observe(calibrated[forced:scheduled], accepted - forced)


class CorrectedCalibration:
    """STS followed by the generation's online correction: what the verification policies see of a block's
    confidences while a call learns its prompt (``c'' = min(1, f · STS(c))``), so the round's ℓ is planned on the
    same estimates as the round planner's Θ (:mod:`dspark_hf.decoding.lookup`).

    Lossless as the correction itself: ``f`` is read before the round drafts and changes only after a round is
    verified (Appendix A).

    Args:
        calibration: the drafter's :class:`SequentialTemperatureScaling`.
        correction: the call's :class:`OnlineCorrection`.
    """

    def __init__(self, calibration: SequentialTemperatureScaling, correction: OnlineCorrection):
        self.calibration, self.correction = calibration, correction

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        """Corrected calibrated conditionals of raw ``confidences`` ``(..., γ)`` (same shape)."""
        return self.correction.apply(self.calibration.apply(confidences))


def _calibration_file(path: str | os.PathLike, create: bool) -> Path:
    """``path`` itself when it names a ``.json`` file, else ``path / calibration.json``."""
    path = Path(path)
    if path.suffix == ".json":
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        return path
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path / CALIBRATION_FILE


# ----------------------------------------------------------------------------- plots


def reliability_diagram(
    confidences: torch.Tensor,
    accepted: torch.Tensor,
    calibration: SequentialTemperatureScaling,
    path: str | os.PathLike,
    pooled: bool = False,
    n_bins: int = 15,
) -> Path:
    """Reliability diagram of ``a[k]`` before and after STS, as a PNG (paper §4, Figure 6).

    Plots mean predicted survival against the empirical survival rate per equal-width bin (empty bins
    skipped) with the diagonal for reference; one panel per position, or one panel pooling all
    positions when ``pooled``.

    Args:
        confidences: raw conditional confidences ``c``, shape ``(N, γ)``, fixed-length rounds.
        accepted: ``torch.LongTensor`` of shape ``(N,)``.
        calibration: a fitted :class:`SequentialTemperatureScaling`.
        path: PNG file to write (parent folders are created).
        pooled: one panel for all positions instead of one per position.
        n_bins: number of bins.

    Returns:
        The path written.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the message names the install command).
        ValueError: malformed rounds, or ``calibration`` not fitted / too short.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        from ..defaults import install_hint

        raise ModuleNotFoundError(f"reliability_diagram needs matplotlib: {install_hint('data')}") from err
    c, n_acc = _check_rounds(confidences, accepted)
    gamma = c.shape[1]
    labels = survival_labels(n_acc, gamma)  # (N, γ)
    before, after = torch.cumprod(c, 1), torch.cumprod(calibration.apply(c), 1)  # (N, γ)
    if pooled:
        panels = [("all positions", before.reshape(-1, 1), after.reshape(-1, 1), labels.reshape(-1))]
    else:
        panels = [(f"position {k + 1}", before[:, k : k + 1], after[:, k : k + 1], labels[:, k]) for k in range(gamma)]
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(3.2 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, p_before, p_after, y) in enumerate(panels):
        _reliability_panel(fig.add_subplot(nrows, ncols, i + 1), title, p_before, p_after, y, n_bins)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out


def _reliability_panel(ax, title: str, p_before: torch.Tensor, p_after: torch.Tensor, y: torch.Tensor, n_bins: int):
    """One panel of :func:`reliability_diagram`: mean predicted against empirical survival per non-empty bin, raw
    and STS (``p_before`` / ``p_after`` float64 ``(N, 1)``, ``y`` float64 ``(N,)``), with the diagonal."""
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    for name, probs in (("raw", p_before), ("STS", p_after)):
        counts, sum_p, sum_y = (t[0] for t in _bin_sums(probs, y, n_bins))
        seen = counts > 0
        ece = _ece_columns(probs, y, n_bins).item()
        ax.plot(sum_p[seen] / counts[seen], sum_y[seen] / counts[seen], marker="o", markersize=3,
                label=f"{name} (ECE {100 * ece:.1f}%)")
    ax.set(title=title, xlim=(0, 1), ylim=(0, 1), xlabel="predicted survival a_k", ylabel="empirical survival")
    ax.legend(fontsize="small", loc="upper left")
