"""The typed ``dspark bench`` result: the committed ``benchmarks.json`` files load and round-trip byte for byte, and
the report and the model card read the same values from the typed result as from its JSON."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from dspark_hf.bench.report import markdown_report
from dspark_hf.bench.settings import BenchSettings
from dspark_hf.evaluation.bench_result import (
    BenchResult,
    MethodSummary,
    PositionCalibration,
    RunSettings,
    SweepPoint,
    as_bench_result,
)
from dspark_hf.hub import sections

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = [ROOT / "docs" / "benchmarks.json", ROOT / "docs" / "lookup" / "benchmarks.json"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_results_round_trip_exactly(path):
    text = path.read_text()
    result = BenchResult.load(path)
    assert result.to_json() == json.loads(text)
    assert result.dumps() == text  # same keys, same order, same numbers
    assert BenchResult.from_json(json.loads(result.dumps())) == result
    # typed all the way down
    suite = next(iter(result.suites))
    method = result.wall_clock.suites[suite]["plain"]
    assert isinstance(method, MethodSummary) and method.per_prompt[0].identical in (True, False)
    confidence = result.confidence["dspark"]
    assert isinstance(confidence.suites["all"].calibration.positions[0], PositionCalibration)
    assert isinstance(confidence.suites["all"].threshold_sweep[0], SweepPoint)
    assert result.settings.gamma == len(result.conditional_acceptance["greedy"][suite]["dspark"])


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_report_and_card_read_the_typed_result_as_the_json(path):
    """Typed result and raw JSON give the same report and card sections, and those hold the file's values."""
    data = json.loads(path.read_text())
    result = BenchResult.from_json(data)
    assert markdown_report(result) == markdown_report(data)
    assert sections.speed_section(result) == sections.speed_section(data)
    assert sections.bench_records(result) == sections.bench_records(data)
    assert sections.measured_on_cpu(result) is True and result.machine.cuda is None
    # and what they show is the file's numbers, read here from the raw JSON (not through the code under test)
    report, speed, records = markdown_report(result), sections.speed_section(result), sections.bench_records(result)
    for suite, methods in data["wall_clock"]["suites"].items():
        for method, row in methods.items():
            assert f"| {method} | {row['median_tokens_per_s']:.2f} | {row['median_speedup']:.2f} |" in report
            assert records["speedup"][method][suite] == row["median_speedup"]
    for mode, drafters in data["tau"].items():
        for drafter, per_suite in drafters.items():
            assert records["tau"][mode][drafter] == per_suite
            assert f"| {drafter} | " + " | ".join(f"{v:.2f}" for v in per_suite.values()) + " |" in speed


def test_a_key_absent_from_an_old_file_stays_absent():
    """``token_sources`` (added later) and ``modelled_tokens_per_s`` (only with an SPS curve) are written back only
    when the loaded file had them; unknown keys are kept."""
    old = {"median_tokens_per_s": 20.0, "median_speedup": 1.0, "speedup_of_medians": 1.0, "tau": None,
           "mismatches": 0, "per_prompt": [], "future_key": {"x": 1}}
    summary = MethodSummary.from_json(old)
    assert summary.token_sources is None and summary.to_json() == old
    assert list(summary.to_json()) == list(old)
    summary.token_sources = {"lookup": 1, "dspark": 2, "target": 3}  # set after loading: written
    assert summary.to_json()["token_sources"] == {"lookup": 1, "dspark": 2, "target": 3}
    assert MethodSummary.from_json({**old, "token_sources": None}).to_json()["token_sources"] is None
    point = {"threshold": 0.1, "rounds": 0, "accepted_per_step": None, "rejected_per_step": None,
             "verified_per_step": None, "acceptance_rate": None, "draft_acceptance_rate": None}
    assert SweepPoint.from_json(point).to_json() == point


def test_partial_result_loads_and_non_finite_floats_become_null():
    partial = {"schema_version": 1, "wall_clock": {"methods": ["plain"], "mismatches_total": 0, "suites": {}},
               "tau": {"greedy": {"d": {"s": float("nan")}}}}
    result = as_bench_result(partial)
    assert result.machine is None and result.plots is None
    assert result.to_json() == {**partial, "tau": {"greedy": {"d": {"s": None}}}}
    assert math.isnan(result.tau["greedy"]["d"]["s"]) and result.strict().tau["greedy"]["d"]["s"] is None
    assert as_bench_result({"tau": 2.0}) is None and as_bench_result(result) is result


def test_run_settings_mirror_bench_settings():
    """Every ``BenchSettings`` field is recorded, in its order (the runner builds ``RunSettings`` from them)."""
    names = [f.name for f in dataclasses.fields(RunSettings)]
    assert names == [f.name for f in dataclasses.fields(BenchSettings)] + ["math_filter"]


def test_report_says_how_many_runs_a_prompt_had_and_that_the_floor_was_skipped():
    result = BenchResult.load(COMMITTED[0])  # an older file: no repeats, no floor pass recorded
    report = markdown_report(result)
    assert "runs of each per prompt" not in report and "was skipped" not in report
    settings = dataclasses.replace(result.settings, repeats=3, floor_repeats=0, limit=1)
    report = markdown_report(dataclasses.replace(result, settings=settings))
    assert ("## Wall clock (greedy; methods interleaved per prompt; 3 runs of each per prompt, a prompt's figures are "
            "those of each method's median run by wall time)") in report
    assert "**The floor** (pass 4) was skipped (`--floor-repeats 0`)." in report
    assert "up to 1 prompt per suite" in report
    settings = dataclasses.replace(result.settings, repeats=1, lockstep=True)
    report = markdown_report(dataclasses.replace(result, settings=settings))
    assert "in lockstep with a plain `generate` of its own" in report and "1 such pair per prompt" in report


def test_report_says_the_floor_pass_ran_in_lockstep():
    """With --lockstep the floor table says each floor run had a plain partner of its own (issue #28)."""
    result = BenchResult.load(ROOT / "docs" / "floor" / "benchmarks.json")  # a floor pass, 2 runs per prompt
    assert result.floor_pass and not result.settings.lockstep
    floor = markdown_report(result).split("**The floor** (pass 4)")[1]
    assert "interleaved with plain `generate` on the same prompts, 2 runs of each per prompt;" in floor
    settings = dataclasses.replace(result.settings, lockstep=True)
    floor = markdown_report(dataclasses.replace(result, settings=settings)).split("**The floor** (pass 4)")[1]
    assert ("each run in lockstep with a plain `generate` of its own on the same prompt (one target forward of each "
            "in turn, each timed on its own turns: `--lockstep`), 2 such pairs per prompt, a floor run's rounds "
            "against its partners' steps;") in floor
    assert "interleaved with plain" not in floor.split("\n\n")[0]
