"""The demo's per-token transcript, without gradio: pairing streamed chunks with the rounds that produced them, and
the spans of the answer (accepted drafts, the target's bonus or correction token, rejected and pruned drafts).

How the colours are known. ``target.generate`` runs in a thread with a :class:`RoundStreamer`. Per
speculative round transformers calls, in this order: ``get_candidates`` (the DSpark candidate
generator appends a :class:`~dspark_hf.decoding.stats.RoundStats` with γ, ℓ and the confidences), the
target's verification, ``streamer.put(chunk)`` with the round's accepted tokens, then
``update_candidate_strategy`` (which fills ``RoundStats.accepted``). So at ``put`` time the newest
``RoundStats`` belongs to the chunk iff one was appended since the previous ``put``; the chunk is
``n`` accepted drafts followed by one target token (bonus if ``n = ℓ``, correction if ``n < ℓ``).
Steps with no round (the prefill step, or a last step with no room to draft) give one plain target
token. With ``RoundStats.draft_tokens`` (the γ drafted ids) the accepted prefix is matched
token by token (exact even when EOS cuts a block short) and the rejected (``d[n:ℓ]``) and unverified
(``d[ℓ:γ]``, pruned by the scheduler) drafts are shown; a ``RoundStats`` without the ids (an empty list)
gets the counts only.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from ..metrics import tau

# span kinds: text tokens, then the drafts that never made it into the text ("ghosts")
DRAFT, LOOKUP, BONUS, CORRECTION, TARGET, PLAIN = "draft", "lookup", "bonus", "correction", "target", "plain"
REJECTED, PRUNED = "rejected", "pruned"


# ------------------------------------------------------------------------------------ pairing
@dataclass
class RoundView:
    """What the demo knows about one speculative round (a copy taken when its chunk is streamed).

    ``accepted`` counts accepted drafts (bonus excluded); ``draft_tokens`` are the γ drafted ids when
    :class:`~dspark_hf.decoding.stats.RoundStats` provides them, else ``None``; the first ``lookup`` drafts came
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
        """HTML of the coloured answer: a ``.dspark-tokens`` div of ``.tok.tok-<kind>`` spans (the per-round table
        is :meth:`rounds_html`, shown in a row of its own). Special tokens (``<|im_end|>``…) keep their text but are
        drawn as a grey pill marked "special", since the decoded answer drops them.

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
            label = f"special token ({s.kind})" if s.special else s.kind
            parts.append(f'{lead}<span class="{cls}" title="{_title(s, label)}">{_esc(word)}</span>')
        body = "".join(parts) or f'<span class="placeholder">{html.escape(placeholder)}</span>'
        return show_ghosts(f'<div class="dspark-tokens">{body}</div>', show_drafts)

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
            timing = (f"{r.stats.draft_ms:.1f} / {r.stats.verify_ms:.1f}" if hasattr(r.stats, "verify_ms") else "–")
            rows.append(f"<tr><td>{r.index}</td><td>{r.drafted}</td><td>{r.scheduled}</td><td>{r.accepted}</td>"
                        f"<td>{target}</td><td>{confs}</td><td class=\"drafts\">{text}</td><td>{timing}</td></tr>")
        head = ("<tr><th>round</th><th>γ (drafted)</th><th>ℓ (verified)</th><th>accepted</th><th>target token</th>"
                "<th>confidence c_k per draft</th><th>drafts</th><th>draft / verify ms</th></tr>")
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
