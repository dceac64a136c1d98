"""The Gradio demo (issue 6): chunk/round pairing, token colouring, and the app in a real headless browser.

Everything is tiny, offline and CPU-only: a word-level tokenizer with a chat template built in memory,
a 2-layer llama target whose greedy next token usually follows a fixed cycle over the vocabulary, and
a "cheating" DSpark drafter that predicts that cycle with spread confidences, so rounds accept some
drafts, reject others and (threshold mode) leave some unverified. The browser test needs Debian's
chromium (``apt-get install chromium``) and the ``playwright`` package; it skips, saying so, without them.
"""

import os
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CYCLE, CYCLE_VOCAB, cycle_drafter, cycle_target, tiny_sps_curve
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import dspark_hf  # noqa: F401  (routes DSpark drafters through DSparkCandidateGenerator)
from dspark_hf import SequentialTemperatureScaling
from dspark_hf.decoding.stats import GenerationStats, RoundStats
from dspark_hf.demo.app import check_lookup, stream_generation
from dspark_hf.demo.render import confidence_curve, curve_counts, legend_html, stats_html
from dspark_hf.demo.transcript import (
    BONUS,
    CORRECTION,
    DRAFT,
    LOOKUP,
    PRUNED,
    REJECTED,
    TARGET,
    RoundStreamer,
    RoundView,
    Transcript,
    split_chunk,
)
from dspark_hf.runtime.targets import chat_ids

CHROMIUM = os.environ.get("DSPARK_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
WORDS = ("<unk> the a sea sky cat dog runs jumps over under blue green red small large quick slow bright dark "
         "river mountain forest city night day sun moon star wind rain snow fire stone tree bird fish song "
         "light shadow dream road home far near old new warm cold deep high low soft loud calm wild gold "
         "silver glass paper iron cloud storm wave").split()
assert len(WORDS) == CYCLE_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ fixtures
def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer over ``WORDS`` with a minimal chat template (no files, no network)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}the {% endif %}")
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    # two layers that leave the cycle ~20 % of the time; a markov drafter in threshold mode, not calibrated
    target = cycle_target(num_hidden_layers=2, alpha=0.02, name="tiny-cycle-llama")
    drafter = cycle_drafter(target, "markov", block_size=5, verification="threshold").bind(target)
    return SimpleNamespace(target=target, tokenizer=word_tokenizer(), drafter=drafter)


# ----------------------------------------------------------------------------- pure pairing
def test_split_chunk_without_and_with_draft_tokens():
    r = RoundStats(drafted=5, scheduled=3)
    assert split_chunk([7], None) == (0, None)
    assert split_chunk([4, 5, 9], r) == (2, None)  # no draft ids: every token but the last is a draft
    r.draft_tokens = [4, 5, 6, 1, 2]
    assert split_chunk([4, 5, 9], r) == (2, [4, 5, 6, 1, 2])  # correction at position 3
    assert split_chunk([4, 5, 6, 8], r) == (3, [4, 5, 6, 1, 2])  # all ℓ accepted + bonus
    assert split_chunk([4, 5], r) == (2, [4, 5, 6, 1, 2])  # EOS accepted as draft 2: no target token


def test_streamer_pairs_chunks_with_rounds():
    """Prompt skipped; prefill chunk has no round; each later chunk takes the round appended before it."""
    stats = GenerationStats(verification="threshold")
    drafter = SimpleNamespace(last_stats=None)
    got = []
    streamer = RoundStreamer(drafter, lambda chunk, view: got.append((chunk, view)))
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    drafter.last_stats = stats
    streamer.put(torch.tensor([10]))  # prefill step: no round
    stats.rounds.append(RoundStats(drafted=4, scheduled=2, confidences=[0.9, 0.8, 0.3, 0.2]))
    stats.rounds[-1].draft_tokens = [11, 12, 13, 14]
    streamer.put(torch.tensor([11, 12, 20]))  # both scheduled drafts accepted + bonus
    stats.rounds[-1].accepted = 2
    stats.rounds.append(RoundStats(drafted=4, scheduled=0, confidences=[0.1] * 4))
    streamer.put(torch.tensor([21]))  # ℓ = 0: the target's token only
    stats.rounds.append(RoundStats(drafted=4, scheduled=4, confidences=[0.9] * 4))
    streamer.put(torch.tensor([22, 30]))  # one accepted, correction (no draft ids: counts only)
    streamer.put(torch.tensor([31]))  # no room to draft: no new round
    assert [c for c, _ in got] == [[10], [11, 12, 20], [21], [22, 30], [31]]
    views = [v for _, v in got]
    assert views[0] is None and views[4] is None
    assert [(v.index, v.accepted, v.scheduled) for v in views[1:4]] == [(1, 2, 2), (2, 0, 0), (3, 1, 4)]

    tokenizer = word_tokenizer()
    transcript = Transcript(tokenizer)
    for chunk, view in got:
        transcript.add_chunk(chunk, view)
    kinds = [s.kind for s in transcript.spans]
    # round 1 has draft ids (one ghost per draft); rounds 2-3 have none (one badge counting the drafts)
    assert kinds == [TARGET, DRAFT, DRAFT, BONUS, PRUNED, PRUNED, BONUS, PRUNED, DRAFT, CORRECTION, REJECTED, TARGET]
    assert [s.count for s in transcript.spans if s.kind in (PRUNED, REJECTED)] == [1, 1, 4, 3]
    assert [s.token_id for s in transcript.spans if s.kind == PRUNED][:2] == [13, 14]
    assert transcript.new_tokens == 8 and transcript.tau() == pytest.approx((3 + 1 + 2) / 3)
    assert transcript.text == tokenizer.decode([10, 11, 12, 20, 21, 22, 30, 31])
    html = transcript.render(show_drafts=True)
    assert html.count('class="tok tok-draft"') == 3
    # one zero-width anchor per round with ghosts: red when something was rejected, grey when only pruned
    assert html.count('class="ghost pruned-only"') == 2 and html.count('class="ghost has-rejected"') == 1
    assert "hide-ghosts" in transcript.render(show_drafts=False)
    table = transcript.rounds_html()  # the per-round table, in a row of its own on the page (issue 26)
    assert "<details" not in html and table.count("<tr><td>") == 3 and "what happened each round (3 rounds)" in table
    assert "γ (drafted)" in table and "draft / verify ms" in table  # labelled columns and units
    # position k counted where reached and verified; accepted iff n >= k
    curve = confidence_curve(transcript.rounds)
    rows = {(r["series"], r["position"]): r for r in curve}
    assert rows["acceptance rate", 1]["value"] == pytest.approx(1.0) and rows["acceptance rate", 1]["rounds"] == 2
    assert "k=1: 2 · k=2: 2" in curve_counts(curve) and "rest on fewer than 5 rounds" in curve_counts(curve)
    assert rows["acceptance rate", 2]["value"] == pytest.approx(0.5)
    assert rows["confidence c_k", 1]["value"] == pytest.approx(0.9)


def test_special_tokens_are_marked_and_the_header_shows_no_absolute_path(tmp_path):
    """Issue 26: `<|im_end|>` read as part of the answer; the header showed the drafter's absolute path."""
    from dspark_hf.demo.app import display_name

    tokenizer = word_tokenizer()
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    assert unk in tokenizer.all_special_ids
    transcript = Transcript(tokenizer)
    transcript.add_chunk([tokenizer.convert_tokens_to_ids("sea"), unk], None)
    html = transcript.render()
    assert 'class="tok tok-target special" title="special token (target)' in html
    assert ".tok.special::before" in legend_html() and "special" in legend_html()
    folder = tmp_path / "my-drafter"
    folder.mkdir()
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(folder)))
    assert display_name(model) == "my-drafter (local folder)"
    assert display_name(SimpleNamespace(config=SimpleNamespace(_name_or_path="org/name"))) == "org/name"

def test_ghost_drafts_never_break_lines_and_keep_their_spaces():
    """A rejected newline draft is drawn as ↵ inside its zero-width anchor, never as a line break."""
    tokenizer = word_tokenizer()
    transcript = Transcript(tokenizer)
    sea, sky = tokenizer.convert_tokens_to_ids(["sea", "sky"])
    transcript.add_chunk([sea], None)
    transcript._continuation = lambda context, drafts: ["\n", " sky", "\t"]  # what a byte-level BPE can draft
    r = RoundStats(drafted=3, scheduled=2, draft_tokens=[sky, sky, sky], confidences=[0.9, 0.5, 0.2])
    view = RoundView(index=1, drafted=3, scheduled=2, accepted=0, confidences=r.confidences,
                     draft_tokens=r.draft_tokens)
    transcript.add_chunk([sea], view)
    html = transcript.render()
    tokens_div, ghost = html, html[html.index('<span class="ghost'):]
    assert tokens_div.count("\n") == 0  # no line break anywhere in the answer: accepted "sea sea" has none
    assert "↵" in ghost and " sky" in ghost and "⇥" in ghost


def test_ghost_text_is_decoded_in_context_with_a_byte_level_tokenizer():
    """A character split over several byte-level draft tokens shows whole, as the final text would."""
    from transformers import AutoTokenizer

    from dspark_hf.defaults import default_target_dir

    if not (default_target_dir() / "tokenizer.json").is_file():
        pytest.skip("the default target is not converted yet (dspark_hf.load_default_target() does it)")
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    context, drafts = tokenizer.encode("The sea"), tokenizer.encode(" 🌊 waves")
    assert any("\ufffd" in tokenizer.decode([t]) for t in drafts)  # one token at a time: broken bytes
    pieces = Transcript(tokenizer)._continuation(context, drafts)
    assert len(pieces) == len(drafts) and "".join(pieces) == " 🌊 waves"


# -------------------------------------------------------------------------- real generation
def test_stream_generation_matches_plain_generate(tiny):
    """Streamed DSpark tokens equal plain greedy generate; rounds agree with drafter.last_stats."""
    ids = chat_ids(tiny.tokenizer, "the quick cat runs over the river")
    runs = list(stream_generation(tiny.target, tiny.tokenizer, ids, 24, 0.0, tiny.drafter, interval=0.0,
                                  dspark_verification="threshold", dspark_block_size=5, dspark_threshold=0.5))
    run = runs[-1]
    assert run.error is None and run.seconds is not None
    ref = tiny.target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert run.ids == ref
    stats = tiny.drafter.last_stats
    assert [(r.accepted, r.scheduled) for r in run.rounds] == [(r.accepted, r.scheduled) for r in stats.rounds]
    assert run.tau() == pytest.approx(stats.tau)
    kinds = {s.kind for s in run.spans}
    assert {DRAFT, TARGET} <= kinds and kinds & {BONUS, CORRECTION}
    plain = list(stream_generation(tiny.target, tiny.tokenizer, ids, 24, 0.0, None, interval=0.0))[-1]
    assert plain.ids == ref and {s.kind for s in plain.spans} == {"plain"}


def test_stream_generation_sampling_and_stop(tiny):
    """Sampling streams every token with its round; a set stop event ends the run after the first step."""
    import threading

    ids = chat_ids(tiny.tokenizer, "a small bird")
    run = list(stream_generation(tiny.target, tiny.tokenizer, ids, 16, 0.8, tiny.drafter, interval=0.0,
                                 dspark_verification="fixed", dspark_block_size=4))[-1]
    assert run.error is None and run.new_tokens == 16
    steps = sum(s.kind == TARGET for s in run.spans)  # the prefill step, and maybe a last no-room-to-draft step
    assert steps in (1, 2) and sum(r.accepted + 1 for r in run.rounds) + steps == 16
    stop = threading.Event()
    stop.set()
    run = list(stream_generation(tiny.target, tiny.tokenizer, ids, 16, 0.0, tiny.drafter, stop, interval=0.0,
                                 dspark_verification="fixed"))[-1]
    assert run.error is None and run.new_tokens == 1


def test_lookup_tokens_are_coloured_as_lookup(tiny):
    """dspark_lookup=True: the text is still plain greedy generate's, and accepted lookup drafts get their own kind."""
    assert "dspark calibrate" in check_lookup(tiny.drafter, True, 5)  # no calibration: explained, not run
    assert check_lookup(tiny.drafter, False, 5) is None
    drafter = cycle_drafter(tiny.target, "markov", block_size=5).bind(tiny.target)
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 5)
    drafter.set_sps_curve(tiny_sps_curve())
    stretch = [63]
    for _ in range(23):
        stretch.append(int(CYCLE[stretch[-1]]))
    ids = [3, 9] + stretch + [3, 63]  # the anchor 63 occurred before, followed by the cycle the target follows
    run = list(stream_generation(tiny.target, tiny.tokenizer, ids, 24, 0.0, drafter, interval=0.0,
                                 dspark_verification="scheduler", dspark_lookup=True))[-1]
    assert run.error is None
    ref = tiny.target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert run.ids == ref
    from_lookup = drafter.last_stats.token_sources()["lookup"]
    assert from_lookup > 0 and sum(s.kind == LOOKUP for s in run.spans) == from_lookup
    assert 'data-stat="from_lookup"' in stats_html(run)
    assert 'class="tok tok-lookup"' in run.render()
    assert all(row["rounds"] > 0 for row in confidence_curve(run.rounds, drafter.calibration))


def test_unavailable_scheduler_is_explained(tiny):
    from dspark_hf.demo.app import available_modes, check_mode, default_mode

    assert tiny.drafter.calibration is None
    assert available_modes(tiny.drafter) == ["fixed", "threshold"]
    assert default_mode(tiny.drafter) == "threshold"
    assert "calibration" in check_mode(tiny.drafter, "scheduler")
    assert "calibration" in check_mode(tiny.drafter, "async")


def test_gamma_beyond_the_calibration_names_the_controls(tiny):
    """γ = 8 with a calibration fitted at γ = 5: the message names the γ slider and the verification choice, and the
    Python argument names (dspark_block_size, dspark_lookup) do not appear."""
    from dspark_hf.demo.app import check_mode

    drafter = cycle_drafter(tiny.target, "markov", block_size=5).bind(tiny.target)
    drafter.calibration = SequentialTemperatureScaling(temperatures=[1.0] * 5)
    message = check_mode(drafter, "scheduler", 8)
    assert "γ slider to 5 or less" in message and "'fixed'" in message and "dspark_" not in message
    assert check_mode(drafter, "scheduler", 5) is None and check_mode(drafter, "fixed", 8) is None
    lookup = check_lookup(drafter, True, 8)
    assert "γ slider to 5 or less" in lookup and "untick 'prompt lookup'" in lookup and "dspark_" not in lookup


def test_cli_registers_demo(monkeypatch):
    from dspark_hf.cli import demo
    from dspark_hf.cli import main as cli

    seen = {}
    monkeypatch.setattr(demo, "run", lambda args: seen.update(vars(args)))
    # add_parser looks run up when main() builds the parser
    cli.main(["demo", "--port", "7999", "--share", "false", "--drafter", "x"])
    assert seen["port"] == 7999 and seen["share"] is False and seen["drafter"] == "x"


# ------------------------------------------------------------------------------------ browser
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser_page(tiny):
    """The demo served on a free port and opened in headless Chromium: ``(page, expect)``."""
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's `chromium` package (CI does) to run the browser test")
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[demo]'")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download needed)")
    from dspark_hf.demo.app import launch

    port = _free_port()
    app = launch(tiny.target, tiny.tokenizer, tiny.drafter, port=port, prevent_thread_lock=True, max_new_tokens=40,
                 interval=0.05)
    pw = sync_api.sync_playwright().start()
    try:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector("#dspark-prompt textarea", timeout=60_000)
        yield page, sync_api.expect
        browser.close()
    finally:
        pw.stop()
        app.close()


def test_demo_in_headless_browser(browser_page):
    """Serve the app, type a prompt in Chromium, see coloured token spans and live stats; screenshot it."""
    page, expect = browser_page  # auto-waiting assertions: components mount and update one by one
    expect(page.locator("#dspark-legend .tok-draft")).to_have_count(1, timeout=30_000)  # the legend
    page.fill("#dspark-prompt textarea", "the quick cat runs over the river")
    page.locator("#dspark-side input[type=checkbox]").check()
    page.click("#dspark-run")
    page.wait_for_selector("#dspark-output .tok-draft", timeout=60_000)
    # side by side: the plain run finishes last and the speedup card appears
    page.wait_for_selector('#dspark-stats [data-stat="speedup"]', timeout=60_000)
    rounds = int(page.inner_text('#dspark-stats [data-stat="rounds"] .v'))
    assert rounds > 0
    assert float(page.inner_text('#dspark-stats [data-stat="tau"] .v')) > 1.0
    expect(page.locator('#dspark-stats [data-stat="identical"] .v')).to_have_text("yes")
    assert page.locator("#dspark-output .dspark-tokens > .tok").count() >= 40
    assert page.locator("#dspark-output .tok-bonus, #dspark-output .tok-correction").count() > 0
    expect(page.locator("#dspark-baseline .tok-plain")).to_have_count(40)
    page.wait_for_selector("#dspark-plot canvas, #dspark-plot svg", timeout=30_000)
    # the ghost toggle hides rejected / unverified drafts
    page.locator("#dspark-ghosts input[type=checkbox]").uncheck()
    page.wait_for_selector("#dspark-output .dspark-tokens.hide-ghosts", timeout=30_000)
    page.locator("#dspark-ghosts input[type=checkbox]").check()
    page.wait_for_selector("#dspark-output .dspark-tokens:not(.hide-ghosts)", timeout=30_000)
    # a round's drafts are one hover away, the per-round table one click away
    ghost = page.locator("#dspark-output .ghost").first
    ghost.locator(".dot").hover()  # the anchor itself has zero width
    expect(ghost.locator(".pop")).to_be_visible()
    expect(ghost.locator(".pop")).to_contain_text("round ")
    page.locator("#dspark-rounds details.dspark-rounds summary").click()
    expect(page.locator("#dspark-rounds details.dspark-rounds tr")).to_have_count(rounds + 1)  # + header
    # issue 26: the table has the page's width to itself, and every column fits in it without scrolling
    width = page.evaluate("() => [document.querySelector('#dspark-rounds .dspark-rounds').scrollWidth, "
                          "document.querySelector('#dspark-rounds .dspark-rounds').clientWidth, window.innerWidth]")
    assert width[0] <= width[1] and width[1] > 0.8 * width[2], width
    expect(page.locator("#dspark-plot-counts")).to_contain_text("k=1: ")  # how many rounds each point averages
    assert page.locator("#dspark-plot .role-legend").get_attribute("aria-label").endswith(
        "2 values: acceptance rate, confidence c_k")  # both curves drawn
    time.sleep(0.5)  # let the plot finish drawing for the screenshot
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    # no calibration: the scheduler is refused with a clear message, nothing runs
    page.locator("#dspark-mode input[value=scheduler]").check()
    page.click("#dspark-run")
    page.wait_for_selector("#dspark-status:has-text('no calibration.json')", timeout=30_000)


# the answer's text and, per token, its box relative to the column (ghost anchors removed from the text)
COLUMN_JS = """sel => {
  const box = document.querySelector(sel + ' .dspark-tokens');
  const copy = box.cloneNode(true);
  copy.querySelectorAll('.ghost').forEach(g => g.remove());
  const origin = box.getBoundingClientRect();
  const boxes = Array.from(box.querySelectorAll(':scope > .tok')).map(t => {
    const r = t.getBoundingClientRect();
    return [Math.round(r.left - origin.left), Math.round(r.top - origin.top), Math.round(r.width)];
  });
  return {text: copy.textContent, boxes: boxes};
}"""


def test_demo_columns_show_the_same_text_in_the_same_layout(browser_page, tiny):
    """Greedy side by side: the DSpark column reads exactly as the plain one, token for token in the same
    place, and showing or hiding the rejected / unverified drafts moves nothing."""
    page, expect = browser_page
    page.fill("#dspark-prompt textarea", "a small bird over the blue sea")
    page.locator("#dspark-mode input[value=threshold]").check()
    page.locator("#dspark-side input[type=checkbox]").check()
    page.locator("#dspark-ghosts input[type=checkbox]").check()
    page.click("#dspark-run")
    expect(page.locator("#dspark-status")).to_contain_text("Plain generate:", timeout=120_000)  # markdown: no backticks
    dspark, plain = page.evaluate(COLUMN_JS, "#dspark-output"), page.evaluate(COLUMN_JS, "#dspark-baseline")
    ids = chat_ids(tiny.tokenizer, "a small bird over the blue sea")
    reference = tiny.target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):]
    assert dspark["text"] == plain["text"] == tiny.tokenizer.decode(reference)
    assert page.locator("#dspark-output .ghost").count() > 0  # there were drafts that did not make it
    assert dspark["boxes"] == plain["boxes"]  # the columns line up token for token
    page.locator("#dspark-ghosts input[type=checkbox]").uncheck()
    page.wait_for_selector("#dspark-output .dspark-tokens.hide-ghosts", timeout=30_000)
    assert page.evaluate(COLUMN_JS, "#dspark-output") == dspark  # hiding the drafts moves nothing
