"""The `dspark` command line: options every compute command shares, and bad inputs refused with a clear message
before any model loads (issue 15, class 4)."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama

from dspark_hf.cli import bench, calibrate, common, generate, profile
from dspark_hf.cli import demo as demo_cli
from dspark_hf.cli import main as cli
from dspark_hf.defaults import default_drafter


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("module", "name", "command"), [
    (generate, "run", ["generate", "hi"]), (profile, "run", ["profile"]),
    (bench, "run", ["bench"]), (demo_cli, "run", ["demo"]), (calibrate, "run", ["calibrate"]),
])
def test_threads_option_sets_torch_threads(module, name, command, monkeypatch, restore_threads):
    seen = []
    monkeypatch.setattr(module, name, lambda args: seen.append((args.threads, torch.get_num_threads())))
    torch.set_num_threads(2)
    cli.main([*command, "--threads", "1"])
    cli.main(command)  # the default is one thread, not one per core
    assert seen == [(1, 1), (common.DEFAULT_THREADS, common.DEFAULT_THREADS)] and common.DEFAULT_THREADS == 1


def test_threads_must_be_positive(monkeypatch, capsys):
    monkeypatch.setattr(profile, "run", lambda args: pytest.fail("must not run"))
    with pytest.raises(SystemExit):
        cli.main(["profile", "--threads", "0"])
    assert "--threads must be >= 1" in capsys.readouterr().err



@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("dspark_hf.runtime.targets.load_target", refuse)
    monkeypatch.setattr("dspark_hf.modeling.modeling_dspark.DSparkDrafter.from_pretrained", refuse)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--gamma", "0"], "--gamma: must be in 1..16"),
    (["generate", "hi", "--gamma", "17"], "--gamma: must be in 1..16"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be in 1.."),
    (["generate", "hi", "--temperature", "-1"], "--temperature: must be >= 0"),
    (["generate", "hi", "--temperature", "nan"], "--temperature: must be >= 0"),
    (["generate", "   "], "the prompt is empty"),
    (["calibrate", "--temperature", "-0.5"], "--temperature: must be >= 0"),
])
def test_bad_arguments_are_refused_by_the_parser(no_loading, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--drafter", "/nonexistent"], "--drafter /nonexistent: No drafter folder at '/nonexistent'"),
    (["generate", "hi", "--target", "./no/such/dir"], "--target ./no/such/dir: No target folder at './no/such/dir'"),
    (["generate", "hi", "--target", "bad id!"], "--target bad id!: no such folder, and not a Hub id"),
])
def test_missing_folders_are_named(no_loading, argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(argv)


def test_relative_path_with_an_existing_parent_is_named(no_loading, tmp_path, monkeypatch):
    """`drafters/typo` is also a valid Hub id; its parent existing here makes it a path: a message, no traceback."""
    (tmp_path / "drafters").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--drafter drafters/typo: No drafter folder at 'drafters/typo'"):
        cli.main(["generate", "hi", "--drafter", "drafters/typo"])


def offline(*args, **kwargs):
    raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
                  "cached files.")


def test_hub_id_offline_names_the_option(monkeypatch):
    """A Hub id that is not a folder here, with no network: one line naming the option and what to pass instead."""
    monkeypatch.setattr("dspark_hf.runtime.targets.load_target", offline)
    with pytest.raises(SystemExit, match=r"--target someorg/sometarget: not a folder here, so it was read as a Hub "
                                         r"id, and the Hub cannot be reached \(offline\?\). Pass the path of a local "
                                         r"model folder, or leave out --target"):
        cli.main(["generate", "hi", "--target", "someorg/sometarget"])
    monkeypatch.setattr(common, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr("dspark_hf.modeling.modeling_dspark.DSparkDrafter.from_pretrained", offline)
    with pytest.raises(SystemExit, match="--drafter someorg/somedrafter: not a folder here.*leave out --drafter for "
                                         "the shipped drafter"):
        cli.main(["generate", "hi", "--drafter", "someorg/somedrafter"])


def test_folder_that_is_not_a_drafter_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_cli_target", lambda args: (None, None))
    with pytest.raises(SystemExit, match=f"--drafter {tmp_path}: this folder holds no drafter"):
        cli.main(["generate", "hi", "--drafter", str(tmp_path)])


def test_target_folder_as_drafter_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_cli_target", lambda args: (None, None))
    tiny_llama(32, 16, 1).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=f"--drafter {tmp_path}: {tmp_path} is not a DSpark drafter"):
        cli.main(["generate", "hi", "--drafter", str(tmp_path)])


def test_gamma_help_states_the_limits(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "1..16" in help_text and "γ <= 7" in help_text


def fake_target(positions: int):
    return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(max_position_embeddings=positions)))


def test_prompt_longer_than_the_target_is_refused(monkeypatch):
    monkeypatch.setattr(generate, "load_models", lambda args: (fake_target(8192), None, None))
    monkeypatch.setattr(generate, "check_settings", lambda *args: None)  # no drafter here
    monkeypatch.setattr("dspark_hf.runtime.targets.chat_ids", lambda tokenizer, prompt: list(range(8190)))
    monkeypatch.setattr("dspark_hf.evaluation.runs.timed_generate", lambda *a, **k: pytest.fail("generate ran"))
    with pytest.raises(SystemExit, match="--max-new-tokens 128 with this 8190-token prompt needs 8318 positions, "
                                         "but the target handles 8192: pass --max-new-tokens 2 or less"):
        cli.main(["generate", "x" * 10, "--json"])
    common.check_prompt_fits(8064, 128, fake_target(8192))  # exactly fits: no exit
    with pytest.raises(SystemExit, match="--max-new-tokens 9000 with this 31-token prompt needs 9031 positions, but "
                                         "the target handles 8192: pass --max-new-tokens 8161 or less"):
        common.check_prompt_fits(31, 9000, fake_target(8192))  # never "shorten the prompt to -808 tokens"
    with pytest.raises(SystemExit, match="The prompt has 8192 tokens.*shorten the prompt to fewer than 8192 tokens"):
        common.check_prompt_fits(8192, 1, fake_target(8192))


def test_gamma_beyond_the_calibration_is_a_clean_error():
    """The shipped drafter (async mode, calibration fitted at γ = 7) with --gamma 8: a message, no traceback."""
    if not default_drafter().is_dir():
        pytest.skip("the shipped drafter is not in this checkout")
    with pytest.raises(SystemExit, match=r"--gamma 8 is beyond this drafter's calibration \(γ <= 7\).*pass --gamma 7 or "
                                         r"less, or --verify fixed") as exit_:
        cli.main(["generate", "hi", "--gamma", "8", "--max-new-tokens", "2", "--json"])
    assert "dspark_" not in str(exit_.value.code)


# ------------------------------------------------------------------------------------ start-up (issue 26)
def _actions(parser):
    """Every (command, action) of the ``dspark`` parser, the top level included."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((name, a) for a in sub._actions)
        else:
            yield "dspark", action


def test_every_option_and_argument_has_help():
    missing = [f"{command} {action.option_strings or action.dest}" for command, action in _actions(cli.full_parser())
               if not action.help and action.dest != "command"]
    assert not missing, f"options without help text: {missing}"


def test_settings_flags_list_the_dash_spelling_first():
    """A new user's trial: `dspark bench --help` listed --max_new_tokens first where the README and every other
    command write dashes. Both spellings still parse."""
    firsts = [(command, action.option_strings) for command, action in _actions(cli.full_parser())
              if len(action.option_strings) > 1 and "_" in action.option_strings[0]]
    assert not firsts, firsts
    parser = cli.full_parser()
    for spelling in ("--max-new-tokens", "--max_new_tokens"):
        assert parser.parse_args(["bench", spelling, "12"]).max_new_tokens == 12


def test_version(capsys):
    from dspark_hf.defaults import __version__

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dspark-hf {__version__}"


STARTUP = """
import sys
from dspark_hf.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as exit_:
    print("EXIT", exit_.code, "torch" in sys.modules, "transformers" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize(("argv", "code"), [
    (["--help"], 0), (["--version"], 0), (["generate", "--help"], 0), (["generate", "hi", "--gamma", "99"], 2),
    (["generate", "   "], 2), (["bogus"], 2), (["demo", "--port", "x"], 2),
])
def test_help_version_and_argument_errors_import_neither_torch_nor_transformers(argv, code):
    """What makes `dspark --help` print in a fraction of a second: nothing heavy is imported before a command runs."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STARTUP, *argv], capture_output=True, text=True, timeout=60)
    assert proc.stderr.splitlines()[-1] == f"EXIT {code} False False", proc.stderr


def test_import_dspark_hf_is_cheap_and_first_use_wires_it():
    import subprocess
    import sys

    code = ("import sys, dspark_hf; heavy = 'torch' in sys.modules; "
            "from transformers import GenerationMixin; from dspark_hf.decoding import routing; "
            "before = GenerationMixin._get_candidate_generator is routing._get_candidate_generator; "
            "dspark_hf.DSparkDrafter; from transformers import AutoConfig; "
            "print(heavy, before, GenerationMixin._get_candidate_generator is routing._get_candidate_generator, "
            "type(AutoConfig.for_model('dspark')).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False", "True", "DSparkConfig"], proc.stderr[-2000:]

    # a drafter whose class was imported from its module (dspark_hf.demo.app, scripts) wires the package when built
    code = ("from transformers import GenerationMixin; from dspark_hf.decoding import routing; "
            "from dspark_hf.modeling.configuration_dspark import DSparkConfig; "
            "from dspark_hf.modeling.modeling_dspark import EXTENSIONS, DSparkDrafter; "
            "before = GenerationMixin._get_candidate_generator is routing._get_candidate_generator; "
            "DSparkDrafter(DSparkConfig(vocab_size=64, hidden_size=32, target_num_layers=6, target_layer_ids=[1, 3], "
            "num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=1, "
            "sequential_rank=8, mask_token_id=0)); "
            "print(before, GenerationMixin._get_candidate_generator is routing._get_candidate_generator, "
            "EXTENSIONS.load_calibration is not None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "True", "True"], proc.stderr[-2000:]


def test_concurrency_repeats_reach_the_bench_and_zero_is_refused_before_loading(no_loading, monkeypatch, capsys):
    with pytest.raises(SystemExit, match="--concurrency-repeats must be >= 1, got 0"):
        cli.main(["bench", "--concurrency", "1", "--concurrency-repeats", "0"])
    seen = []
    monkeypatch.setattr(bench, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr("dspark_hf.bench.loading.load_drafters", lambda *args: ({"dspark": None}, {}, []))
    monkeypatch.setattr("dspark_hf.bench.suites.suite_texts", lambda *args: {})
    monkeypatch.setattr("dspark_hf.bench.suites.encode_suites", lambda *args: ({"chat": [("a", [1, 2])]}, {}))
    monkeypatch.setattr("dspark_hf.bench.concurrency.run_concurrency", lambda *args, repeats, arms, paired, **kwargs:
                        seen.append((repeats, arms, paired)) or {"rows": [], "settings": {}})
    cli.main(["bench", "--concurrency", "1", "--limit", "1"])
    cli.main(["bench", "--concurrency", "1", "--limit", "1", "--concurrency-repeats", "3", "--concurrency-arms",
              "plain,async", "--concurrency-paired"])
    assert seen == [(2, ("plain", "fixed", "best_fixed", "threshold", "scheduler", "async"), False),
                    (3, ("plain", "async"), True)]


@pytest.mark.parametrize(("arms", "message"), [("plain,sched", "unknown arms"),
                                               ("scheduler,async", "needs plain and another arm")])
def test_concurrency_arms_are_checked_before_loading(no_loading, arms, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", "--concurrency", "1", "--concurrency-arms", arms, "--concurrency-paired"])


def test_bench_notes_count_prompts_in_the_right_number(no_loading, monkeypatch):
    """One prompt skipped and one left of --limit 2: the notes say "1 prompt", not "1 prompts"."""
    class Ran(Exception):
        pass

    def run_bench(*args, notes, **kwargs):
        raise Ran(notes)

    monkeypatch.setattr(bench, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr("dspark_hf.bench.loading.load_drafters", lambda *args: ({"dspark": None}, {}, []))
    monkeypatch.setattr("dspark_hf.bench.suites.suite_texts", lambda *args: {})
    monkeypatch.setattr("dspark_hf.bench.suites.encode_suites", lambda *args: ({"chat": [("a", [1, 2])]}, {"chat": 1}))
    monkeypatch.setattr("dspark_hf.bench.runner.run_bench", run_bench)
    with pytest.raises(Ran) as ran:
        cli.main(["bench", "--limit", "2", "--suites", "chat", "--max-new-tokens", "8"])
    assert ran.value.args[0] == ["suite 'chat': 1 prompt longer than 320 tokens skipped.",
                                 "suite 'chat' has only 1 prompt (limit 2)."]


@pytest.mark.parametrize(("levels", "message"), [("0", "must be in 1.., got 0"), ("2,x", "expected an integer, got 'x'"),
                                                 ("1,,2", "expected an integer, got ''")])
def test_bad_concurrency_levels_are_refused_while_parsing(no_loading, capsys, levels, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--concurrency", levels])
    assert exit_.value.code == 2
    assert f"argument --concurrency: {message}" in capsys.readouterr().err


def test_concurrency_bench_takes_the_suites_prompts_in_turn(no_loading, monkeypatch, capsys):
    """Levels reach the bench parsed; a shorter suite drops out of the turn instead of cutting the others short."""
    seen = []
    monkeypatch.setattr(bench, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr("dspark_hf.bench.loading.load_drafters", lambda *args: ({"dspark": None}, {}, []))
    monkeypatch.setattr("dspark_hf.bench.suites.suite_texts", lambda *args: {})
    suites = {"code": [("c1", [1]), ("c2", [2]), ("c3", [3])], "chat": [("h1", [4])]}
    monkeypatch.setattr("dspark_hf.bench.suites.encode_suites", lambda *args: (suites, {}))
    monkeypatch.setattr("dspark_hf.bench.concurrency.run_concurrency", lambda target, drafter, prompts, levels, *args,
                        **kwargs: seen.append((prompts, levels)) or {"rows": [], "settings": {}})
    cli.main(["bench", "--concurrency", "1,4", "--limit", "3", "--suites", "code,chat"])
    assert seen == [([[1], [4], [2], [3]], [1, 4])]


def test_concurrency_bench_notes_reach_stderr_and_its_files(no_loading, monkeypatch, capsys, tmp_path):
    """The command's notes and the bench's own go to stderr before the run, and into concurrency.json and .md."""
    from test_bench_concurrency import scripted_arm

    monkeypatch.setattr(bench, "load_cli_target", lambda args: (None, None))
    monkeypatch.setattr("dspark_hf.bench.loading.load_drafters", lambda *args: ({"dspark": None}, {}, []))
    monkeypatch.setattr("dspark_hf.bench.suites.suite_texts", lambda *args: {})
    monkeypatch.setattr("dspark_hf.bench.suites.encode_suites", lambda *args: ({"chat": [("a", [1, 2])]}, {"chat": 0}))
    monkeypatch.setattr("dspark_hf.bench.concurrency.run_arm", scripted_arm([]))
    cli.main(["bench", "--concurrency", "1", "--limit", "2", "--suites", "chat", "--concurrency-arms", "plain",
              "--concurrency-repeats", "1", "--out", str(tmp_path)])
    notes = ["Quick run (--limit): 32 new tokens per generation; add --max-new-tokens 96 for the full-length protocol.",
             "suite 'chat' has only 1 prompt (limit 2).",
             "R = 1: the closed loop serves 2·R requests from 1 distinct prompt, taken in turn and repeated; a larger "
             "--limit (prompts per suite) gives more distinct ones (2 for R = 1)."]
    out, err = capsys.readouterr()
    assert err.splitlines()[:3] == notes
    assert json.loads((tmp_path / "concurrency.json").read_text())["notes"] == notes
    head = "**Notes**\n\n" + "".join(f"- {note}\n" for note in notes) + "\n| R | arm |"
    assert (tmp_path / "concurrency.md").read_text().startswith(head) and out.startswith(head)
