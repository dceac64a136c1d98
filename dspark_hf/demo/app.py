"""Gradio demo: DSpark speculative decoding streamed live, each token coloured by where it came from.

``dspark demo`` (or ``python demo/app.py``) serves it; :func:`build_app` and :func:`launch` are the API.

How the colours are known. ``target.generate`` runs in a thread with a :class:`RoundStreamer`. Per
speculative round transformers calls, in this order: ``get_candidates`` (the DSpark candidate
generator appends a :class:`~dspark_hf.generation.RoundStats` with γ, ℓ and the confidences), the
target's verification, ``streamer.put(chunk)`` with the round's accepted tokens, then
``update_candidate_strategy`` (which fills ``RoundStats.accepted``). So at ``put`` time the newest
``RoundStats`` belongs to the chunk iff one was appended since the previous ``put``; the chunk is
``n`` accepted drafts followed by one target token (bonus if ``n = ℓ``, correction if ``n < ℓ``).
Steps with no round (the prefill step, or a last step with no room to draft) give one plain target
token. With ``RoundStats.draft_tokens`` (the γ drafted ids) the accepted prefix is matched
token by token (exact even when EOS cuts a block short) and the rejected (``d[n:ℓ]``) and unverified
(``d[ℓ:γ]``, pruned by the scheduler) drafts are shown; a ``RoundStats`` without the ids (an empty list)
gets the counts only.

What is drawn. The accepted text flows as the decoded answer reads (incremental decoding of all ids, so
byte-level BPE pieces never show half a character) and lines up with the plain column. A round's rejected
and unverified drafts never take space in it: one zero-width anchor with a red / grey dot, whose hover box
lists them (decoded as a continuation of the accepted text, newlines shown as ``↵``), and a collapsed
per-round table (γ, ℓ, accepted, the target's token, confidences, drafts) sits under the answer.

Nothing here imports gradio at module level: ``import dspark_hf.demo`` stays cheap and the
``demo`` extra (``pip install 'dspark-hf[demo]'``) is needed only to build or launch the app.
"""

from __future__ import annotations

import html
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..metrics import tau
from ..modeling.configuration_dspark import MAX_BLOCK_SIZE, SCHEDULED_MODES, VERIFICATION_MODES
from ..training.data import chat_ids

# span kinds: text tokens, then the drafts that never made it into the text ("ghosts")
DRAFT, LOOKUP, BONUS, CORRECTION, TARGET, PLAIN = "draft", "lookup", "bonus", "correction", "target", "plain"
REJECTED, PRUNED = "rejected", "pruned"

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
.tok.special { font-style: italic; opacity: 0.8; }
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
.dspark-rounds { font-size: 12px; margin-top: 6px; max-width: 100%; max-height: 24em; overflow: auto; }
.dspark-rounds table { border-collapse: collapse; }
.dspark-rounds td, .dspark-rounds th { padding: 1px 6px; border-bottom: 1px solid #eceff3; text-align: left;
  font-family: ui-monospace, monospace; white-space: pre; }
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


# ------------------------------------------------------------------------------------ pairing
@dataclass
class RoundView:
    """What the demo knows about one speculative round (a copy taken when its chunk is streamed).

    ``accepted`` counts accepted drafts (bonus excluded); ``draft_tokens`` are the γ drafted ids when
    :class:`~dspark_hf.generation.RoundStats` provides them, else ``None``; the first ``lookup`` drafts came
    from prompt lookup (``dspark_lookup=True``).
    """

    index: int
    drafted: int
    scheduled: int
    accepted: int
    confidences: list[float]
    draft_tokens: list[int] | None
    stats: object = None  # the live RoundStats (its draft_ms / verify_ms are final after the round)
    lookup: int = 0


def split_chunk(chunk: list[int], round_stats) -> tuple[int, list[int] | None]:
    """Number of accepted drafts at the start of ``chunk`` and the round's drafted ids (or ``None``).

    ``round_stats`` is the round's ``RoundStats`` or ``None`` (a step without drafts). With
    ``draft_tokens`` (all γ drafted ids) the accepted prefix is the common prefix of ``chunk`` and
    ``d[:ℓ]`` (a target token never equals the draft it replaces, in greedy or speculative sampling);
    without them, every token but the last is an accepted draft, as transformers counts them.
    """
    if round_stats is None:
        return 0, None
    drafts = getattr(round_stats, "draft_tokens", None)
    if not drafts or len(drafts) < round_stats.drafted:  # ids not recorded
        return max(len(chunk) - 1, 0), None
    drafts = [int(t) for t in drafts]
    n = 0
    while n < min(len(chunk), round_stats.scheduled) and chunk[n] == drafts[n]:
        n += 1
    return n, drafts


class RoundStreamer(BaseStreamer):
    """Streamer that pairs each accepted chunk with its round and hands ``(chunk, RoundView | None)``
    to ``on_chunk`` (called in the generation thread, inside ``streamer.put``).

    Args:
        drafter: the :class:`~dspark_hf.DSparkDrafter` (its ``last_stats`` is read at every ``put``), or
            ``None`` for plain ``generate``.
        on_chunk: ``callable(chunk: list[int], round: RoundView | None)``.
        on_end: called by ``end()``.
    """

    def __init__(self, drafter, on_chunk, on_end=None):
        self.drafter, self.on_chunk, self.on_end = drafter, on_chunk, on_end
        self._prompt_seen = False
        self._stats, self._seen = None, 0
        if drafter is not None:
            drafter.last_stats = None  # the candidate generator installs a fresh GenerationStats

    def put(self, value):
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        chunk = [int(t) for t in value.reshape(-1).tolist()]
        stats = getattr(self.drafter, "last_stats", None) if self.drafter is not None else None
        if stats is not self._stats:
            self._stats, self._seen = stats, 0
        rounds = stats.rounds if stats is not None else []
        view = None
        if len(rounds) > self._seen:  # a round was drafted since the last put: this chunk is its outcome
            r = rounds[-1]
            n, drafts = split_chunk(chunk, r)
            view = RoundView(index=len(rounds), drafted=r.drafted, scheduled=r.scheduled, accepted=n,
                             confidences=list(r.confidences), draft_tokens=drafts, stats=r,
                             lookup=getattr(r, "lookup", 0))
        self._seen = len(rounds)
        self.on_chunk(chunk, view)

    def end(self):
        if self.on_end is not None:
            self.on_end()


class StopOnEvent(StoppingCriteria):
    """Stops ``generate`` once ``event`` is set (the Stop button)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


# --------------------------------------------------------------------------------- transcript
@dataclass
class TokenSpan:
    """One piece of the rendered answer: a generated token, or a ghost (rejected / unverified draft)."""

    text: str
    kind: str
    token_id: int | None = None
    round: int | None = None
    position: int | None = None  # 1-based draft position within the round
    confidence: float | None = None
    special: bool = False
    count: int = 1  # ghosts without token ids: how many drafts the badge stands for


@dataclass
class Transcript:
    """The tokens of one generation, coloured by origin, with per-round records and timing."""

    tokenizer: object
    spans: list[TokenSpan] = field(default_factory=list)
    rounds: list[RoundView] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    seconds: float | None = None  # set when the generation ends
    error: str | None = None
    _text: str = ""

    def _piece(self, token_id: int) -> str:
        """Incremental decoding: the text this token adds (empty while a UTF-8 character is incomplete)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if full.endswith("\ufffd"):
            return ""
        piece = full[len(self._text):]  # decoding is prefix-stable except around incomplete characters
        self._text = full
        return piece

    def add_chunk(self, chunk: list[int], view: RoundView | None, plain: bool = False):
        """Append one streamed chunk; ``view`` is its round (``None``: a step without drafts)."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        n = view.accepted if view is not None else 0
        for i, t in enumerate(chunk):
            if plain:
                kind, pos, conf = PLAIN, None, None
            elif view is None:
                kind, pos, conf = TARGET, None, None
            elif i < n:
                kind, pos = (LOOKUP if i < view.lookup else DRAFT), i + 1
                conf = view.confidences[i] if i < len(view.confidences) else None
            else:
                kind, pos, conf = (BONUS if n == view.scheduled else CORRECTION), None, None
            self.spans.append(TokenSpan(self._piece(t), kind, t, view.index if view else None, pos, conf, t in special))
        if view is not None:
            self.rounds.append(view)
            self._add_ghosts(view, has_target=len(chunk) > n)

    def _add_ghosts(self, view: RoundView, has_target: bool):
        """Spans for the round's rejected (``d[n:ℓ]``) and unverified (``d[ℓ:γ]``) drafts, decoded as a
        continuation of the accepted text before the round's target token (so byte-level pieces of one
        character join up, and a tokenizer that drops a lone token's leading space keeps it)."""
        n, ell = view.accepted, view.scheduled
        rejected = range(n, ell) if has_target else range(0)  # EOS inside the block: nothing was rejected
        pruned = range(ell, view.drafted)
        if view.draft_tokens is None:
            for kind, positions in ((REJECTED, rejected), (PRUNED, pruned)):
                if positions:
                    self.spans.append(TokenSpan("", kind, round=view.index, position=positions[0] + 1,
                                                count=len(positions)))
            return
        context = self.ids[: len(self.ids) - int(has_target)]  # accepted text the drafts continued
        pieces = self._continuation(context, view.draft_tokens[n : view.drafted])
        for k, text in zip(range(n, view.drafted), pieces):
            if k in rejected or k in pruned:
                conf = view.confidences[k] if k < len(view.confidences) else None
                kind = REJECTED if k in rejected else PRUNED
                self.spans.append(TokenSpan(text, kind, view.draft_tokens[k], view.index, k + 1, conf))

    def _continuation(self, context: list[int], drafts: list[int]) -> list[str]:
        """Text each of ``drafts`` adds after ``context`` (``""`` while a UTF-8 character is incomplete; a
        character left incomplete at the end shows as ``\ufffd``)."""
        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)

        previous, pieces = decode(context), []
        for k in range(1, len(drafts) + 1):
            full = decode(context + drafts[:k])
            if k < len(drafts) and full.endswith("\ufffd"):  # the next draft may complete the character
                pieces.append("")
                continue
            # decoding is prefix-stable except around incomplete characters; if not, the token on its own
            pieces.append(full[len(previous):] if full.startswith(previous) else decode(drafts[k - 1 : k]))
            previous = full
        return pieces

    # ---------------------------------------------------------------------------- read-outs
    @property
    def text(self) -> str:
        return self._text

    @property
    def new_tokens(self) -> int:
        return len(self.ids)

    def elapsed(self) -> float:
        return self.seconds if self.seconds is not None else time.perf_counter() - self.start

    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.elapsed(), 1e-9)

    def tau(self) -> float | None:
        """Mean tokens per round τ (accepted drafts + the target token), :func:`dspark_hf.metrics.tau`;
        ``None`` before the first round."""
        return tau([r.accepted for r in self.rounds])

    def render(self, show_drafts: bool = True, placeholder: str = "") -> str:
        """HTML of the coloured answer: a ``.dspark-tokens`` div of ``.tok.tok-<kind>`` spans, then the
        per-round table (:meth:`rounds_html`).

        The accepted text flows as text, exactly as the decoded answer reads. Each round's rejected and
        unverified drafts become one zero-width ``.ghost`` anchor after the round's target token: a red
        (some rejected) or grey (only unverified) dot whose hover box lists the drafts with newlines and
        tabs as visible symbols, so they never change the layout of the accepted text.
        ``show_drafts=False`` adds the ``hide-ghosts`` class that hides the dots (see :func:`show_ghosts`).
        """
        parts, group, views = [], [], {r.index: r for r in self.rounds}
        for s in [*self.spans, None]:
            if s is not None and s.kind in (REJECTED, PRUNED) and (not group or group[0].round == s.round):
                group.append(s)
                continue
            if group:
                parts.append(self._ghost_html(group, views.get(group[0].round)))
                group = []
            if s is None:
                break
            if s.kind in (REJECTED, PRUNED):
                group.append(s)
                continue
            cls = f"tok tok-{s.kind}" + (" special" if s.special else "")
            word = s.text.lstrip(" ") or s.text  # leading spaces stay uncoloured (no empty boxes at line ends)
            lead = s.text[: len(s.text) - len(word)]
            parts.append(f'{lead}<span class="{cls}" title="{_title(s, s.kind)}">{_esc(word)}</span>')
        body = "".join(parts) or f'<span class="placeholder">{html.escape(placeholder)}</span>'
        return show_ghosts(f'<div class="dspark-tokens">{body}</div>', show_drafts) + self.rounds_html()

    @staticmethod
    def _ghost_html(group: list[TokenSpan], view: RoundView | None) -> str:
        """One round's ghost drafts: the zero-width anchor with its dot and hover box."""
        n_rejected = sum(s.count for s in group if s.kind == REJECTED)
        n_pruned = sum(s.count for s in group if s.kind == PRUNED)
        head = f"round {group[0].round}"
        if view is not None:
            head += f": γ={view.drafted} ℓ={view.scheduled} accepted {view.accepted}"
        lines = [html.escape(head), html.escape(f"{n_rejected} rejected, {n_pruned} not verified")]
        if all(s.token_id is not None for s in group):
            tokens = "".join(f'<span class="tok tok-{s.kind}" title="{_title(s, s.kind)}">{_visible(s.text)}</span>'
                             for s in group)
            lines.append(tokens)
        cls = "has-rejected" if n_rejected else "pruned-only"
        return f'<span class="ghost {cls}"><span class="dot"></span><span class="pop">{"<br>".join(lines)}</span></span>'

    def rounds_html(self) -> str:
        """A collapsed ``<details class="dspark-rounds">`` table, one row per round: γ, ℓ, accepted drafts,
        the target's token, the confidences and the drafts (accepted green, rejected red, unverified grey)."""
        if not self.rounds:
            return ""
        ghosts: dict[int, list[TokenSpan]] = {}
        accepted_spans: dict[int, list[TokenSpan]] = {}
        for s in self.spans:
            if s.round is not None:
                (ghosts if s.kind in (REJECTED, PRUNED) else accepted_spans).setdefault(s.round, []).append(s)
        rows = []
        for r in self.rounds:
            outcome = next((s for s in accepted_spans.get(r.index, []) if s.kind in (BONUS, CORRECTION)), None)
            status = [("accepted" if k < r.accepted else "rejected" if k < r.scheduled else "pruned")
                      for k in range(r.drafted)]
            confs = " ".join(f'<span class="c-{st}">{c:.2f}</span>' for c, st in zip(r.confidences, status))
            drafts = [s for s in accepted_spans.get(r.index, []) if s.kind == DRAFT] + ghosts.get(r.index, [])
            text = "".join(f'<span class="c-{"accepted" if s.kind == DRAFT else s.kind}">{_visible(s.text)}</span>'
                           for s in drafts if s.token_id is not None)
            target = f"{outcome.kind}: {_visible(outcome.text)}" if outcome is not None else "(EOS or budget)"
            rows.append(f"<tr><td>{r.index}</td><td>{r.drafted}</td><td>{r.scheduled}</td><td>{r.accepted}</td>"
                        f"<td>{target}</td><td>{confs}</td><td>{text}</td></tr>")
        head = "<tr><th>round</th><th>γ</th><th>ℓ</th><th>accepted</th><th>target token</th><th>c_k</th><th>drafts</th></tr>"
        return (f'<details class="dspark-rounds"><summary>what happened each round ({len(self.rounds)} rounds)</summary>'
                f"<table>{head}{''.join(rows)}</table></details>")


def show_ghosts(rendered: str, show: bool) -> str:
    """Toggle the ghost drafts of HTML made by :meth:`Transcript.render`."""
    hidden, shown = '<div class="dspark-tokens hide-ghosts">', '<div class="dspark-tokens">'
    return rendered.replace(hidden, shown, 1) if show else rendered.replace(shown, hidden, 1)


def _esc(text: str) -> str:
    return html.escape(text).replace("\n", "↵\n")  # make newline tokens visible


def _visible(text: str) -> str:
    """HTML of a draft's text on one line: newline ``↵``, tab ``⇥``, carriage return ``␍``; ``∅`` if empty."""
    symbols = str.maketrans({"\n": "↵", "\t": "⇥", "\r": "␍"})
    return html.escape(text.translate(symbols)) or "∅"


def _title(s: TokenSpan, label: str) -> str:
    bits = [label]
    if s.round is not None:
        bits.append(f"round {s.round}")
    if s.position is not None:
        bits.append(f"draft position {s.position}")
    if s.confidence is not None:
        bits.append(f"c={s.confidence:.2f}")
    if s.token_id is not None:
        bits.append(f"id {s.token_id}")
    return html.escape(" · ".join(bits), quote=True)


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
        cards += [_stat("verified", verified, "verified ℓ/γ"), _stat("acceptance", accepted, "accepted / verified")]
        if any(r.lookup for r in rounds):
            cards.append(_stat("from_lookup", sum(min(r.accepted, r.lookup) for r in rounds), "tokens from lookup"))
        if run.seconds is not None:  # timings are final once the generation has ended
            draft = sum(getattr(r.stats, "draft_ms", 0.0) for r in rounds)
            verify = sum(getattr(r.stats, "verify_ms", 0.0) for r in rounds)
            cards += [_stat("draft_ms", draft, "draft ms"), _stat("verify_ms", verify, "verify ms")]
    if baseline is not None:
        cards.append(_stat("baseline_tokens_per_s", baseline.tokens_per_s(), "tokens / s (plain)"))
        if baseline.seconds is not None and run.seconds is not None:
            cards.append(_stat("speedup", run.tokens_per_s() / max(baseline.tokens_per_s(), 1e-9), "speedup ×"))
            if greedy:
                same = "yes" if run.ids == baseline.ids else "no"
                cards.append(_stat("identical", same, "same tokens as plain"))
    return '<div class="dspark-stats">' + "".join(cards) + "</div>"


def legend_html() -> str:
    items = "".join(
        f'<span title="{html.escape(tip, quote=True)}"><span class="tok tok-{kind}">{name}</span></span>'
        for kind, name, tip in LEGEND
    )
    rows = "".join(f"<li><b>{name}</b>: {html.escape(tip)}</li>" for _, name, tip in LEGEND)
    return (f"<style>{CSS}</style><div class=\"dspark-legend\">{items}</div>"
            f'<details style="font-size:12px;color:#444"><summary>what the colours mean</summary><ul>{rows}</ul>'
            "<p>Hover a token for its round, draft position and confidence. Ghost drafts are drawn small and"
            " raised, right after the target token of their round.</p></details>")


# ------------------------------------------------------------------------------------ running
def available_modes(drafter) -> list[str]:
    """Verification modes this drafter supports (``scheduler``/``async`` need calibration, every
    non-fixed mode needs a confidence head)."""
    return [m for m in VERIFICATION_MODES if check_mode(drafter, m) is None]


def default_mode(drafter) -> str:
    """The drafter's configured mode if it can run, else ``fixed``."""
    modes = available_modes(drafter)
    return drafter.config.verification if drafter.config.verification in modes else "fixed"


def check_mode(drafter, mode: str) -> str | None:
    """A message saying why ``mode`` cannot run with ``drafter``, or ``None``."""
    if mode not in VERIFICATION_MODES:
        return f"Unknown verification mode {mode!r}."
    if mode != "fixed" and drafter.confidence is None:
        return f"This drafter has no confidence head, so {mode!r} verification is unavailable: use 'fixed'."
    if mode in SCHEDULED_MODES and drafter.calibration is None:
        return (f"This drafter has no calibration.json, so {mode!r} verification is unavailable: use 'fixed' or "
                "'threshold', or fit one with `dspark calibrate`.")
    return None


def check_lookup(drafter, lookup: bool, gamma: int) -> str | None:
    """Why ``dspark_lookup`` cannot run with this drafter and γ (the message of :func:`~dspark_hf.lookup.lookup_enabled`),
    or ``None``."""
    from ..decoding.lookup import lookup_enabled

    try:
        lookup_enabled(bool(lookup), drafter, gamma)
    except ValueError as err:
        return str(err)
    return None


def stream_generation(target, tokenizer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                      drafter=None, stop: threading.Event | None = None, interval: float = 0.1, seed: int = 0,
                      **settings):
    """Run ``generate`` in a thread and yield the growing :class:`Transcript` (at most every ``interval`` s).

    With ``drafter`` the run is DSpark (``settings``: ``dspark_block_size``, ``dspark_verification``,
    ``dspark_threshold``); without, plain ``generate`` (tokens kind ``plain``). The last transcript
    yielded has ``seconds`` set (and ``error`` if ``generate`` raised). Setting ``stop`` ends the run early.
    """
    from ..evaluation.runs import timed_generate

    events: queue.Queue = queue.Queue()
    transcript = Transcript(tokenizer)
    stop = stop or threading.Event()
    streamer = RoundStreamer(drafter, lambda chunk, view: events.put((chunk, view)))

    def work():
        try:
            kwargs = dict(settings, stopping_criteria=StoppingCriteriaList([StopOnEvent(stop)]))
            transcript.start = time.perf_counter()
            run = timed_generate(target, prompt_ids, max_new_tokens, temperature, drafter, streamer, seed, **kwargs)
            events.put(("done", run.seconds))
        except Exception as err:  # shown in the app instead of killing the server thread
            events.put(("error", f"{type(err).__name__}: {err}"))

    thread = threading.Thread(target=work, name="dspark-demo-generate", daemon=True)
    thread.start()
    finished = False
    try:
        last = 0.0
        while True:
            item = events.get()
            if item[0] in ("done", "error"):
                finished = True
                if item[0] == "done":
                    transcript.seconds = item[1]
                else:
                    transcript.seconds, transcript.error = transcript.elapsed(), item[1]
                yield transcript
                return
            transcript.add_chunk(item[0], item[1], plain=drafter is None)
            if time.perf_counter() - last >= interval and events.empty():
                last = time.perf_counter()
                yield transcript
    finally:
        if not finished:  # the generator was closed early (client gone): end the generation too
            stop.set()
        thread.join()


# ---------------------------------------------------------------------------------------- app
def _name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__


def build_app(target, tokenizer, drafter, *, title: str = "DSpark speculative decoding", max_new_tokens: int = 128,
              interval: float = 0.1):
    """The Gradio Blocks app (not launched).

    Args:
        target: a HF causal LM (the verifier), in eval mode.
        tokenizer: its tokenizer; prompts go through its chat template (:func:`dspark_hf.data.chat_ids`).
        drafter: a :class:`~dspark_hf.DSparkDrafter` for ``target`` (bound here).
        title: page heading.
        max_new_tokens: initial value of the max-new-tokens slider.
        interval: minimum seconds between two streamed updates of the page.

    Returns:
        ``gradio.Blocks``. Element ids for scripting: ``dspark-prompt``, ``dspark-run``, ``dspark-stop``,
        ``dspark-max-new``, ``dspark-temperature``, ``dspark-gamma``, ``dspark-mode``, ``dspark-threshold``,
        ``dspark-side``, ``dspark-ghosts``, ``dspark-output``, ``dspark-baseline``, ``dspark-stats`` (cards
        ``[data-stat=tau|tokens_per_s|rounds|speedup|...] .v``), ``dspark-plot``, ``dspark-status``.
    """
    import gradio as gr

    drafter = drafter.bind(target).eval()
    modes, mode0 = available_modes(drafter), default_mode(drafter)
    stop = threading.Event()  # one model, one generation at a time (concurrency_limit=1)
    note = ""
    if drafter.calibration is None:
        note = ("This drafter has no calibration.json, so the confidence scheduler is unavailable; "
                f"verification defaults to **{mode0}**.")
    drafter_name = html.escape(str(drafter.name_or_path or "in-memory"))
    info = (f"Target **{html.escape(_name(target))}** · drafter **{drafter_name}**"
            f" (γ={drafter.config.block_size}, {drafter.config.sequential_head} head,"
            f" calibration: {'yes' if drafter.calibration is not None else 'no'})")

    plot_title = ("calibrated confidence" if drafter.calibration is not None else "raw confidence") + \
        " vs acceptance per draft position (rounds reaching k)"

    def run(prompt, max_new, temperature, gamma, mode, threshold, side_by_side, show_drafts, lookup=False):
        """Stream (output, output with ghosts, baseline, stats, plot, status) while generating."""
        greedy = float(temperature) <= 0
        idle = '<div class="dspark-tokens"><i>side-by-side is off</i></div>'

        def frame(result, base, plot, status):
            full = result.render(True) if result is not None else ""
            shown = show_ghosts(full, show_drafts)
            base_html = base.render() if base is not None else ("" if side_by_side else idle)
            return shown, full, base_html, stats_html(result, base, greedy), plot, status

        problem = (check_mode(drafter, mode) or check_lookup(drafter, lookup, int(gamma))
                   or (None if prompt and prompt.strip() else "Type a prompt first."))
        if problem:
            yield frame(None, None, _plot_frame([]), f"⚠️ {problem}")
            return
        stop.clear()
        ids = chat_ids(tokenizer, prompt)
        settings = dict(dspark_block_size=int(gamma), dspark_verification=mode, dspark_threshold=float(threshold),
                        dspark_lookup=bool(lookup))
        status = f"Generating with DSpark ({mode}, γ={int(gamma)})…"
        yield frame(Transcript(tokenizer), None, _plot_frame([]), status)
        last_plot, result = 0.0, None
        for result in stream_generation(target, tokenizer, ids, int(max_new), float(temperature), drafter, stop,
                                        interval, **settings):
            plot = gr.skip()
            if time.perf_counter() - last_plot > 1.0 or result.seconds is not None:  # plots are slow to redraw
                plot, last_plot = _plot_frame(confidence_curve(result.rounds, drafter.calibration)), time.perf_counter()
            yield frame(result, None, plot, status)
        if result.error:
            yield frame(result, None, gr.skip(), f"❌ {result.error}")
            return
        done = f"DSpark: {result.new_tokens} tokens in {result.seconds:.2f} s."
        if not side_by_side or stop.is_set():
            yield frame(result, None, gr.skip(), done)
            return
        status, base = done + " Running plain `generate` for comparison…", None
        for base in stream_generation(target, tokenizer, ids, int(max_new), float(temperature), None, stop, interval):
            yield frame(result, base, gr.skip(), status)
        final = done + f" Plain `generate`: {base.new_tokens} tokens in {base.seconds:.2f} s."
        yield frame(result, base, gr.skip(), final + (f" ❌ {base.error}" if base.error else ""))

    def rerender(rendered, show_drafts):
        return show_ghosts(rendered, show_drafts) if rendered else gr.skip()

    def halt():
        stop.set()

    with gr.Blocks(title=title, analytics_enabled=False) as app:
        gr.Markdown(f"## {html.escape(title)}\n{info}")
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                prompt = gr.Textbox(label="Prompt (sent as one user turn under the chat template)", lines=4,
                                    elem_id="dspark-prompt", value="Explain speculative decoding in two sentences.")
                with gr.Row():
                    go = gr.Button("Generate", variant="primary", elem_id="dspark-run")
                    halt_btn = gr.Button("Stop", elem_id="dspark-stop")
                max_new = gr.Slider(1, 1024, value=max_new_tokens, step=1, label="max new tokens", elem_id="dspark-max-new")
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                        elem_id="dspark-temperature")
                gamma = gr.Slider(1, MAX_BLOCK_SIZE, value=drafter.config.block_size, step=1,
                                  label="γ (dspark_block_size): drafts per round", info=gamma_limits(drafter),
                                  elem_id="dspark-gamma")
                mode = gr.Radio(list(VERIFICATION_MODES), value=mode0, label="verification (dspark_verification)",
                                info="available with this drafter: " + ", ".join(modes), elem_id="dspark-mode")
                threshold = gr.Slider(0.0, 1.0, value=drafter.config.confidence_threshold, step=0.01,
                                      label="threshold (threshold mode: verify while c_k ≥ threshold)",
                                      elem_id="dspark-threshold")
                side = gr.Checkbox(value=False, label="side by side: also run plain generate (speedup)",
                                   elem_id="dspark-side")
                ghosts = gr.Checkbox(value=True, label="show rejected and unverified drafts", elem_id="dspark-ghosts")
                lookup = gr.Checkbox(value=False, label="prompt lookup (dspark_lookup): n-gram drafts from the text",
                                     elem_id="dspark-lookup")
                gr.Examples([["Write a haiku about the sea."], ["What is 17 * 23? Think step by step."],
                             ["Write a Python function that reverses a string."]], inputs=[prompt])
            with gr.Column(scale=2):
                gr.HTML(legend_html(), elem_id="dspark-legend")
                status = gr.Markdown(note, elem_id="dspark-status")
                stats = gr.HTML(stats_html(None), elem_id="dspark-stats")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**DSpark**")
                        output = gr.HTML(Transcript(tokenizer).render(placeholder="the answer appears here"),
                                         elem_id="dspark-output")
                    with gr.Column():
                        gr.Markdown("**plain `generate`** (side by side)")
                        baseline = gr.HTML("", elem_id="dspark-baseline")
                plot = gr.LinePlot(_plot_frame([]), x="position", y="value", color="series", y_lim=[0, 1],
                                   color_map=PLOT_COLORS,  # fixes the colour domain (the first frame is empty)
                                   sort=POSITION_ORDER,
                                   x_title="draft position k", y_title="probability",
                                   title=plot_title, elem_id="dspark-plot",
                                   height=260)
        state = gr.State(None)
        outputs = [output, state, baseline, stats, plot, status]
        inputs = [prompt, max_new, temperature, gamma, mode, threshold, side, ghosts, lookup]
        go.click(run, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
        prompt.submit(run, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
        halt_btn.click(halt, None, None, queue=False)
        ghosts.change(rerender, [state, ghosts], [output], queue=False)
    return app


def _plot_frame(rows: list[dict]):
    """``rows`` of :func:`confidence_curve` as the LinePlot's DataFrame.

    The browser builds the chart's axis types and colour domain from the FIRST value only (later values
    replace the data), so the empty frame has numeric dtypes and one null point per series.
    """
    import pandas as pd

    rows = rows or [dict(position=1, value=float("nan"), series=name, rounds=0) for name in PLOT_COLORS]
    frame = pd.DataFrame(rows, columns=["position", "value", "series", "rounds"])
    frame = frame.astype({"position": "str", "value": "float64", "series": "str", "rounds": "int64"})
    return frame  # positions are categories ("1".."16", ordered by POSITION_ORDER): integer ticks only


def launch(target=None, tokenizer=None, drafter=None, *, port: int | None = None, share: bool = False,
           server_name: str | None = None, prevent_thread_lock: bool = False, **app_kwargs):
    """Build and serve the demo; returns the launched ``gradio.Blocks`` (``.close()`` stops it).

    Args:
        target: a model, a Hub id / folder, or ``None`` for the bundled default target
            (:func:`~dspark_hf.target.load_target`); ``tokenizer`` is required with a model.
        drafter: a :class:`~dspark_hf.DSparkDrafter`, a folder / Hub id, or ``None`` for the shipped
            one (:func:`~dspark_hf.defaults.default_drafter`).
        port: server port (default ``$GRADIO_SERVER_PORT``, else 7860).
        share: ask Gradio for a public share link (needs network).
        server_name: interface to bind (default ``$GRADIO_SERVER_NAME``, else 127.0.0.1).
        prevent_thread_lock: return at once, serving from a background thread (tests).
        app_kwargs: passed to :func:`build_app`.
    """
    from ..decoding.targets import load_target
    from ..modeling.modeling_dspark import DSparkDrafter

    if target is None or isinstance(target, (str, os.PathLike)):
        target, tokenizer = load_target(target)
    elif tokenizer is None:
        raise ValueError("launch(target=<model>) needs its tokenizer too.")
    if drafter is None:
        from ..defaults import default_drafter

        drafter = default_drafter()
        if not drafter.is_dir():
            raise FileNotFoundError(f"No drafter at {drafter}; pass drafter=<folder, Hub id or DSparkDrafter>.")
    if isinstance(drafter, (str, os.PathLike)):
        drafter = DSparkDrafter.from_pretrained(drafter)
    if port is None and os.environ.get("GRADIO_SERVER_PORT"):
        port = int(os.environ["GRADIO_SERVER_PORT"])
    app = build_app(target, tokenizer, drafter, **app_kwargs)
    app.queue(default_concurrency_limit=1)
    app.launch(server_name=server_name, server_port=port, share=share, prevent_thread_lock=prevent_thread_lock,
               show_error=True, footer_links=[])
    return app
