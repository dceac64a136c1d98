"""Gradio demo: DSpark speculative decoding streamed live, each token coloured by where it came from.

``dspark demo`` (or ``python demo/app.py``) serves it; :func:`build_app` and :func:`launch` are the API. The
transcript is :mod:`dspark_hf.demo.transcript`, its rendering :mod:`dspark_hf.demo.render`.

Nothing here imports gradio at module level: ``import dspark_hf.demo`` stays cheap and the
``demo`` extra (``pip install -e '.[demo]'`` in a clone) is needed only to build or launch the app.
"""

from __future__ import annotations

import html
import os
import queue
import threading
import time
from pathlib import Path

from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..decoding.lookup import lookup_enabled
from ..decoding.verification import runnable_modes, unmet_need
from ..modeling.limits import MAX_BLOCK_SIZE, VERIFICATION_MODES
from ..runtime.targets import chat_ids
from .render import PLOT_COLORS, POSITION_ORDER, confidence_curve, curve_counts, gamma_limits, legend_html, stats_html
from .transcript import RoundStreamer, StopOnEvent, Transcript, show_ghosts


# ------------------------------------------------------------------------------------ running
def available_modes(drafter) -> list[str]:
    """Verification modes this drafter supports (:func:`~dspark_hf.decoding.verification.runnable_modes`:
    ``scheduler``/``async`` need calibration, every non-fixed mode needs a confidence head)."""
    return runnable_modes(drafter)


def default_mode(drafter) -> str:
    """The drafter's configured mode if it can run, else ``fixed``."""
    modes = available_modes(drafter)
    return drafter.config.verification if drafter.config.verification in modes else "fixed"


def check_mode(drafter, mode: str, gamma: int | None = None) -> str | None:
    """A message, in the demo's control names, saying why ``mode`` cannot run with ``drafter`` at block size
    ``gamma`` (the γ slider), or ``None``."""
    need = unmet_need(drafter, mode, gamma)
    if need == "mode":
        return f"Unknown verification mode {mode!r}."
    if need == "confidence":
        return f"This drafter has no confidence head, so {mode!r} verification is unavailable: use 'fixed'."
    if need == "calibration":
        return (f"This drafter has no calibration.json, so {mode!r} verification is unavailable: use 'fixed' or "
                "'threshold', or fit one with `dspark calibrate`.")
    if need == "calibration_length":
        covered = len(drafter.calibration.temperatures)
        return (f"'{mode}' verification needs calibrated confidences at every draft position, and this drafter's "
                f"calibration covers γ ≤ {covered}: move the γ slider to {covered} or less, or pick 'fixed' or "
                "'threshold' verification (any γ).")
    return None


def check_lookup(drafter, lookup: bool, gamma: int) -> str | None:
    """Why the 'prompt lookup' box cannot be ticked with this drafter and γ (see
    :func:`~dspark_hf.decoding.lookup.lookup_enabled`), in the demo's control names, or ``None``."""
    try:
        lookup_enabled(bool(lookup), drafter, gamma, "async")  # the mode does not matter when asked for by name
    except ValueError:
        covered = len(drafter.calibration.temperatures) if drafter.calibration is not None else 0
        fix = f"move the γ slider to {covered} or less, or " if drafter.confidence is not None and covered else ""
        return (f"Prompt lookup compares drafts by calibrated confidence, which this drafter lacks at γ = {gamma}: "
                f"{fix}untick 'prompt lookup'"
                + (" (or fit a calibration with `dspark calibrate`)." if drafter.confidence is not None and not covered else "."))
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
            # a ValueError is a refused setting, whose message names the fix; anything else is a failure to report
            events.put(("error", str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"))

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
def display_name(model) -> str:
    """How the page names a model: its Hub id, or for a local folder the folder's name (never an absolute path)."""
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")
    if not name:
        return type(model).__name__
    path = Path(name).expanduser()
    return f"{path.name} (local folder)" if path.is_absolute() or path.is_dir() else name


def build_app(target, tokenizer, drafter, *, title: str = "DSpark speculative decoding", max_new_tokens: int = 128,
              interval: float = 0.1):
    """The Gradio Blocks app (not launched).

    Args:
        target: a HF causal LM (the verifier), in eval mode.
        tokenizer: its tokenizer; prompts go through its chat template (:func:`dspark_hf.runtime.targets.chat_ids`).
        drafter: a :class:`~dspark_hf.DSparkDrafter` for ``target`` (bound here).
        title: page heading.
        max_new_tokens: initial value of the max-new-tokens slider.
        interval: minimum seconds between two streamed updates of the page.

    Returns:
        ``gradio.Blocks``. Element ids for scripting: ``dspark-prompt``, ``dspark-run``, ``dspark-stop``,
        ``dspark-max-new``, ``dspark-temperature``, ``dspark-gamma``, ``dspark-mode``, ``dspark-threshold``,
        ``dspark-side``, ``dspark-ghosts``, ``dspark-output``, ``dspark-baseline``, ``dspark-stats`` (cards
        ``[data-stat=tau|tokens_per_s|rounds|speedup|...] .v``), ``dspark-plot``, ``dspark-plot-counts``,
        ``dspark-rounds`` (the per-round table, in a row of its own), ``dspark-status``.
    """
    import gradio as gr

    drafter = drafter.bind(target).eval()
    mode0 = default_mode(drafter)
    stop = threading.Event()  # one model, one generation at a time (concurrency_limit=1)
    note = ""
    if drafter.calibration is None:
        note = ("This drafter has no calibration.json, so the confidence scheduler is unavailable; "
                f"verification defaults to **{mode0}**.")
    info = (f"Target **{html.escape(display_name(target))}** · drafter **{html.escape(display_name(drafter))}**"
            f" (γ={drafter.config.block_size}, {drafter.config.sequential_head} head,"
            f" calibration: {'yes' if drafter.calibration is not None else 'no'})")
    run = _generation_handler(target, tokenizer, drafter, stop, interval)

    def rerender(rendered, show_drafts):
        return show_ghosts(rendered, show_drafts) if rendered else gr.skip()

    def halt():
        stop.set()

    with gr.Blocks(title=title, analytics_enabled=False) as app:
        gr.Markdown(f"## {html.escape(title)}\n{info}")
        with gr.Row():
            prompt, go, halt_btn, ghosts, inputs = _controls(drafter, max_new_tokens, mode0)
            output, baseline, stats, plot, status, counts = _output_column(tokenizer, drafter, note)
        with gr.Row():  # the whole page width: every column of the per-round table readable
            rounds = gr.HTML("", elem_id="dspark-rounds")
        state = gr.State(None)
        outputs = [output, state, baseline, stats, plot, status, rounds, counts]
        go.click(run, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
        prompt.submit(run, inputs, outputs, concurrency_limit=1, concurrency_id="generate")
        halt_btn.click(halt, None, None, queue=False)
        ghosts.change(rerender, [state, ghosts], [output], queue=False)
    return app


def _generation_handler(target, tokenizer, drafter, stop: threading.Event, interval: float):
    """The Generate button's handler: a generator of page updates, DSpark first, then (side by side) plain
    ``generate``; each update is ``(output, output with ghosts, baseline, stats, plot, status, rounds table,
    plot counts)``."""
    import gradio as gr

    def run(prompt, max_new, temperature, gamma, mode, threshold, side_by_side, show_drafts, lookup=False):
        """Stream (output, output with ghosts, baseline, stats, plot, status) while generating."""
        greedy = float(temperature) <= 0
        idle = '<div class="dspark-tokens"><i>side-by-side is off</i></div>'

        def frame(result, base, curve, status):
            """One update of the outputs; ``curve``: rows of :func:`confidence_curve`, or ``None`` to keep the plot."""
            full = result.render(True) if result is not None else ""
            shown = show_ghosts(full, show_drafts)
            base_html = base.render() if base is not None else ("" if side_by_side else idle)
            table = result.rounds_html() if result is not None else ""
            plot, counts = (gr.skip(), gr.skip()) if curve is None else (_plot_frame(curve), curve_counts(curve))
            return shown, full, base_html, stats_html(result, base, greedy), plot, status, table, counts

        problem = (check_mode(drafter, mode, int(gamma)) or check_lookup(drafter, lookup, int(gamma))
                   or (None if prompt and prompt.strip() else "Type a prompt first."))
        if problem:
            yield frame(None, None, [], f"⚠️ {problem}")
            return
        stop.clear()
        ids = chat_ids(tokenizer, prompt)
        settings = dict(dspark_block_size=int(gamma), dspark_verification=mode, dspark_lookup=bool(lookup))
        if mode == "threshold":  # the slider is read by that mode only (other modes warn that they ignore it)
            settings["dspark_threshold"] = float(threshold)
        status = f"Generating with DSpark ({mode}, γ={int(gamma)})…"
        yield frame(Transcript(tokenizer), None, [], status)
        last_plot, result = 0.0, None
        for result in stream_generation(target, tokenizer, ids, int(max_new), float(temperature), drafter, stop,
                                        interval, **settings):
            curve = None
            if time.perf_counter() - last_plot > 1.0 or result.seconds is not None:  # plots are slow to redraw
                curve, last_plot = confidence_curve(result.rounds, drafter.calibration), time.perf_counter()
            yield frame(result, None, curve, status)
        if result.error:
            yield frame(result, None, None, f"❌ {result.error}")
            return
        done = f"DSpark: {result.new_tokens} tokens in {result.seconds:.2f} s."
        if not side_by_side or stop.is_set():
            yield frame(result, None, None, done)
            return
        status, base = done + " Running plain `generate` for comparison…", None
        for base in stream_generation(target, tokenizer, ids, int(max_new), float(temperature), None, stop, interval):
            yield frame(result, base, None, status)
        final = done + f" Plain `generate`: {base.new_tokens} tokens in {base.seconds:.2f} s."
        yield frame(result, base, None, final + (f" ❌ {base.error}" if base.error else ""))

    return run


def _controls(drafter, max_new_tokens: int, mode0: str) -> tuple:
    """The left column (inside a ``gr.Row``): prompt, buttons and settings.

    Returns:
        ``(prompt, generate button, stop button, ghosts checkbox, inputs)``; ``inputs`` in the order of the handler's arguments
        (prompt, max new, temperature, γ, mode, threshold, side by side, ghosts, lookup).
    """
    import gradio as gr

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
                        info="available with this drafter: " + ", ".join(available_modes(drafter)),
                        elem_id="dspark-mode")
        threshold = gr.Slider(0.0, 1.0, value=drafter.config.confidence_threshold, step=0.01,
                              label="threshold (threshold mode: verify while c_k ≥ threshold)",
                              elem_id="dspark-threshold")
        side = gr.Checkbox(value=False, label="side by side: also run plain generate (speedup)",
                           elem_id="dspark-side")
        ghosts = gr.Checkbox(value=True, label="show rejected and unverified drafts", elem_id="dspark-ghosts")
        lookup = gr.Checkbox(value=lookup_enabled(None, drafter, drafter.config.block_size, mode0),
                             label="prompt lookup (dspark_lookup): n-gram drafts from the text",
                             elem_id="dspark-lookup")
        gr.Examples([["Write a haiku about the sea."], ["What is 17 * 23? Think step by step."],
                     ["Write a Python function that reverses a string."]], inputs=[prompt])
    return prompt, go, halt_btn, ghosts, [prompt, max_new, temperature, gamma, mode, threshold, side, ghosts, lookup]


def _output_column(tokenizer, drafter, note: str) -> tuple:
    """The right column (inside a ``gr.Row``): legend, status, stats cards, both transcripts, the plot.

    Returns:
        ``(output, baseline, stats, plot, status, plot counts)``.
    """
    import gradio as gr

    plot_title = ("calibrated confidence" if drafter.calibration is not None else "raw confidence") + \
        " vs acceptance per draft position (rounds reaching k)"
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
        counts = gr.HTML(curve_counts([]), elem_id="dspark-plot-counts")
    return output, baseline, stats, plot, status, counts


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
            (:func:`~dspark_hf.runtime.targets.load_target`); ``tokenizer`` is required with a model.
        drafter: a :class:`~dspark_hf.DSparkDrafter`, a folder / Hub id, or ``None`` for the shipped
            one (:func:`~dspark_hf.defaults.default_drafter`).
        port: server port (default ``$GRADIO_SERVER_PORT``, else 7860).
        share: ask Gradio for a public share link (needs network).
        server_name: interface to bind (default ``$GRADIO_SERVER_NAME``, else 127.0.0.1).
        prevent_thread_lock: return at once, serving from a background thread (tests).
        app_kwargs: passed to :func:`build_app`.
    """
    from ..modeling.modeling_dspark import DSparkDrafter
    from ..runtime.targets import load_target

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
