"""The demo's HTML and plot data, without gradio: the legend and CSS, the stats line, the confidence-vs-acceptance
curve. The accepted text flows as the decoded answer reads and lines up with the plain column; a round's rejected
and unverified drafts never take space in it: one zero-width anchor with a red / grey dot, whose hover box lists
them (newlines shown as ``↵``)."""

from __future__ import annotations

import html

import torch

from ..modeling.limits import MAX_BLOCK_SIZE
from .transcript import BONUS, CORRECTION, DRAFT, LOOKUP, PRUNED, REJECTED, TARGET, RoundView, Transcript

LEGEND = (
    (DRAFT, "accepted draft", "drafted by DSpark, verified and accepted by the target"),
    (LOOKUP, "accepted lookup", "copied by prompt lookup (dspark_lookup) from the prompt or the text so far, accepted"),
    (BONUS, "target: bonus", "the target's own token after every scheduled draft was accepted"),
    (CORRECTION, "target: correction", "the target's token replacing the first rejected draft"),
    (TARGET, "target step", "a step with no drafts (the prefill step, or no room left to draft)"),
    (REJECTED, "rejected draft", "verified by the target and rejected: a red dot after the round; hover it"),
    (PRUNED, "not verified", "drafted but cut by the scheduler / threshold before verification: a grey dot"),
)

CSS = """
.dspark-tokens { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 14px;
  line-height: 1.9; white-space: pre-wrap; word-break: break-word; min-height: 3em; padding: 8px;
  border: 1px solid #d0d4da; border-radius: 6px; background: #fff; color: #111; }
.dspark-tokens .tok { border-radius: 3px; padding: 1px 0; }
.tok-draft { background: #b7ebc0; }
.tok-lookup { background: #f3e38a; }
.tok-bonus { background: #b9d4ff; }
.tok-correction { background: #ffc98f; }
.tok-target { background: #dcdff5; }
.tok-plain { background: #eceff3; }
.tok.special { font-size: 11px; color: #4a4f57; background: #eef0f3 !important; border: 1px solid #9aa0a8;
  border-radius: 8px; padding: 0 5px; }
.tok.special::before { content: "special "; font-style: italic; color: #7a7f87; }
.dspark-tokens.hide-ghosts .ghost { display: none; }
/* a round's rejected / unverified drafts: a zero-width anchor, so they never move the answer's text */
.ghost { position: relative; display: inline-block; width: 0; height: 1em; vertical-align: baseline; }
.ghost .dot { position: absolute; left: -3px; top: -0.55em; width: 6px; height: 6px; border-radius: 3px;
  cursor: help; }
.ghost.has-rejected .dot { background: #d32f2f; }
.ghost.pruned-only .dot { background: #9aa0a8; }
.ghost .pop { display: none; position: absolute; left: 0; top: 1.1em; z-index: 20; min-width: 14em;
  background: #fff; color: #111; border: 1px solid #b8bec7; border-radius: 6px; padding: 4px 8px;
  box-shadow: 0 2px 8px rgba(0, 0, 0, .15); font-size: 12px; line-height: 1.6; white-space: pre; }
.ghost:hover .pop { display: block; }
.tok-rejected { color: #c62828; text-decoration: line-through; background: #fde3e3; }
.tok-pruned { color: #7a7f87; border: 1px dashed #a8adb5; background: #f5f6f8; }
.dspark-rounds { font-size: 12px; margin-top: 6px; max-width: 100%; max-height: 32em; overflow: auto; }
.dspark-rounds summary { font-size: 13px; cursor: pointer; }
.dspark-plot-counts { font-size: 12px; color: #444; }
.dspark-rounds table { border-collapse: collapse; width: 100%; }
.dspark-rounds td, .dspark-rounds th { padding: 1px 6px; border-bottom: 1px solid #eceff3; text-align: left;
  font-family: ui-monospace, monospace; white-space: pre; }
.dspark-rounds td.drafts { white-space: pre-wrap; word-break: break-word; }  /* the one wide column wraps */
.dspark-rounds .c-accepted { color: #1b7a33; }
.dspark-rounds .c-rejected { color: #c62828; text-decoration: line-through; }
.dspark-rounds .c-pruned { color: #7a7f87; }
.dspark-legend { display: flex; flex-wrap: wrap; gap: 6px 14px; font-size: 13px; color: #333; }
.dspark-legend .tok { padding: 1px 6px; font-family: ui-monospace, monospace; border-radius: 3px; }
.dspark-stats { display: flex; flex-wrap: wrap; gap: 8px; }
.dspark-stats .stat { border: 1px solid #d0d4da; border-radius: 6px; padding: 4px 10px; min-width: 84px;
  background: #fafbfc; color: #111; }
.dspark-stats .v { display: block; font-size: 20px; font-weight: 600; }
.dspark-stats .k { display: block; font-size: 11px; color: #555; }
"""


# ------------------------------------------------------------------------- confidence vs acceptance
ACCEPTANCE, CONFIDENCE = "acceptance rate", "confidence c_k"
PLOT_COLORS = {ACCEPTANCE: "#2e9d4a", CONFIDENCE: "#1f5fbf"}
POSITION_ORDER = [str(k) for k in range(1, MAX_BLOCK_SIZE + 1)]


def confidence_curve(rounds: list[RoundView], calibration=None) -> list[dict]:
    """Per draft position k: mean confidence c_k and the empirical acceptance rate, over reached rounds.

    c_k is a conditional survival probability (paper eq. 7): P(d_k accepted | d_1..d_{k-1} accepted).
    Its empirical counterpart at position k uses the rounds where k was verified (k <= ℓ) and every
    earlier draft was accepted (n >= k-1); d_k is accepted iff n >= k. ``calibration`` (an STS) maps
    raw confidences to calibrated ones first (skipped when γ exceeds its fitted positions). Returns rows
    ``{position, value, series, rounds}`` (series ``"acceptance rate"`` and, with a confidence head,
    ``"confidence c_k"``). Rounds that proposed prompt-lookup tokens are left out (their first drafts are not
    the drafter's).
    """
    rounds = [r for r in rounds if not r.lookup]
    sums: dict[int, list[float]] = {}
    gamma = max((len(r.confidences) for r in rounds), default=0)
    if calibration is not None and gamma > len(calibration.temperatures or []):
        calibration = None  # γ beyond the fitted positions: plot the raw confidences
    for r in rounds:
        conf = r.confidences
        if conf and calibration is not None:
            conf = calibration.apply(torch.tensor(conf, dtype=torch.float32)).tolist()
        for k in range(min(r.scheduled, r.accepted + 1)):  # 0-based positions reached and verified
            acc = sums.setdefault(k + 1, [0.0, 0.0, 0])
            acc[0] += float(r.accepted > k)
            acc[1] += conf[k] if k < len(conf) else float("nan")
            acc[2] += 1
    rows = []
    for k in sorted(sums):
        accepted, conf, count = sums[k]
        rows.append(dict(position=k, value=accepted / count, series=ACCEPTANCE, rounds=count))
        if conf == conf:  # not NaN: the drafter has a confidence head
            rows.append(dict(position=k, value=conf / count, series=CONFIDENCE, rounds=count))
    return rows


def curve_counts(rows: list[dict]) -> str:
    """HTML under the confidence plot: how many rounds each position's points average (a rate from one or two
    rounds is mostly noise)."""
    counts = {r["position"]: r["rounds"] for r in rows if r["series"] == ACCEPTANCE}
    if not counts:
        return '<div class="dspark-plot-counts">No verified drafts yet.</div>'
    shown = " · ".join(f"k={k}: {n}" for k, n in sorted(counts.items()))
    few = sorted(k for k, n in counts.items() if n < 5)
    warn = (f" Position{'s' * (len(few) > 1)} {', '.join(map(str, few))} rest{'s' * (len(few) == 1)} on fewer than 5 "
            "rounds." if few else "")
    return f'<div class="dspark-plot-counts">Rounds behind each point (verified position k reached): {shown}.{warn}</div>'


def gamma_limits(drafter) -> str:
    """Which γ each verification mode accepts with ``drafter`` (scheduler/async: at most its calibrated positions)."""
    calibrated = len(drafter.calibration.temperatures) if drafter.calibration is not None else 0
    scheduled = f"scheduler/async: γ ≤ {calibrated} (its calibration)" if calibrated else "scheduler/async: need a calibration"
    return f"1..{MAX_BLOCK_SIZE} in fixed/threshold mode; {scheduled}"


def _stat(key: str, value, label: str) -> str:
    shown = "–" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
    return f'<div class="stat" data-stat="{key}"><span class="v">{shown}</span><span class="k">{label}</span></div>'


def stats_html(run: Transcript | None, baseline: Transcript | None = None, greedy: bool = False) -> str:
    """The live statistics cards: τ, tokens/s, rounds, new tokens, ℓ/γ, timings, baseline and speedup."""
    if run is None:
        return '<div class="dspark-stats"></div>'
    rounds = run.rounds
    cards = [
        _stat("tau", run.tau(), "τ (tokens / round)"),
        _stat("tokens_per_s", run.tokens_per_s(), "tokens / s (DSpark)"),
        _stat("rounds", len(rounds), "rounds"),
        _stat("new_tokens", run.new_tokens, "new tokens"),
    ]
    if rounds:
        verified = sum(r.scheduled for r in rounds) / max(sum(r.drafted for r in rounds), 1)
        accepted = sum(r.accepted for r in rounds) / max(sum(r.scheduled for r in rounds), 1)
        cards += [_stat("verified", verified, "share verified (ℓ / γ)"),
                  _stat("acceptance", accepted, "share accepted (of verified)")]
        if any(r.lookup for r in rounds):
            cards.append(_stat("from_lookup", sum(min(r.accepted, r.lookup) for r in rounds), "tokens from lookup"))
        if run.seconds is not None:  # timings are final once the generation has ended
            draft = sum(getattr(r.stats, "draft_ms", 0.0) for r in rounds)
            verify = sum(getattr(r.stats, "verify_ms", 0.0) for r in rounds)
            cards += [_stat("draft_ms", draft, "ms drafting (all rounds)"),
                      _stat("verify_ms", verify, "ms verifying (all rounds)")]
    if baseline is not None:
        cards.append(_stat("baseline_tokens_per_s", baseline.tokens_per_s(), "tokens / s (plain)"))
        if baseline.seconds is not None and run.seconds is not None:
            cards.append(_stat("speedup", run.tokens_per_s() / max(baseline.tokens_per_s(), 1e-9), "speedup ×"))
            if greedy:
                same = "yes" if run.ids == baseline.ids else "no"
                cards.append(_stat("identical", same, "same tokens as plain"))
    return '<div class="dspark-stats">' + "".join(cards) + "</div>"


SPECIAL_ITEM = ("<li><b>special</b> (grey pill): a special token such as <code>&lt;|im_end|&gt;</code>, the end of "
                "the answer; the decoded text leaves it out</li>")


def legend_html() -> str:
    items = "".join(
        f'<span title="{html.escape(tip, quote=True)}"><span class="tok tok-{kind}">{name}</span></span>'
        for kind, name, tip in LEGEND
    )
    rows = "".join(f"<li><b>{name}</b>: {html.escape(tip)}</li>" for _, name, tip in LEGEND)
    return (f"<style>{CSS}</style><div class=\"dspark-legend\">{items}</div>"
            f'<details style="font-size:12px;color:#444"><summary>what the colours mean</summary><ul>{rows}{SPECIAL_ITEM}</ul>'
            "<p>Hover a token for its round, draft position and confidence. Ghost drafts are drawn small and"
            " raised, right after the target token of their round.</p></details>")
