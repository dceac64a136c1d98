"""A scripted mutation check of the numerical core: do the tests fail when the code is wrong?

Applies one small AST mutant at a time (flipped comparison, swapped arithmetic operator, off-by-one constant,
``min`` <-> ``max``, ``and`` <-> ``or``, a dropped ``not`` / unary minus, a return that drops its last term) to a
scratch copy of the package, runs the module's tests in a forked interpreter (heavy imports are loaded once in
the parent, the package itself fresh in every child), and reports killed / survived per module. A mutant is
killed when the tests fail, error or time out. The goal of issue #27 is >= 90 % killed per module.

Usage::

    OMP_NUM_THREADS=1 flock /tmp/cpu.lock python scripts/mutation_check.py [--module metrics] [--list] [--json out.json]

Docstrings, error-message strings and ``raise`` statements are not mutated (a mutant there changes only text).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# module -> the tests that guard it (kept small so the whole check runs in minutes on one thread)
MODULES = {
    "metrics": ("dspark_hf/metrics.py", ["tests/test_metrics.py", "tests/test_calibration.py"]),  # hand examples there
    "scheduler": ("dspark_hf/decoding/scheduler.py", ["tests/test_scheduler.py"]),
    "calibration": ("dspark_hf/decoding/calibration.py", ["tests/test_calibration.py"]),
}
COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
               ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv}


@dataclass(frozen=True)
class Mutant:
    """One mutation site: ``index``-th candidate in walk order, its line and a human description."""

    index: int
    line: int
    description: str


def _skipped(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, ``raise`` statements, f-strings and ``__all__``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.update(id(n) for n in ast.walk(body[0]))
        if isinstance(node, (ast.Raise, ast.JoinedStr)) or (
                isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _candidates(node: ast.AST) -> list[tuple[str, callable]]:
    """The mutations that apply to ``node``: ``(description, apply)`` where ``apply`` edits the node in place."""
    out = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAPS:
                new = COMPARE_SWAPS[type(op)]
                out.append((f"{type(op).__name__} -> {new.__name__}",
                            lambda n, i=i, new=new: n.ops.__setitem__(i, new())))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAPS:
        new = BINOP_SWAPS[type(node.op)]
        out.append((f"{type(node.op).__name__} -> {new.__name__}", lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"{type(node.op).__name__} -> {new.__name__}", lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out.append((f"constant {node.value!r} -> {node.value + 1!r}", lambda n: setattr(n, "value", n.value + 1)))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        new = "max" if node.func.id == "min" else "min"
        out.append((f"{node.func.id} -> {new}", lambda n, new=new: setattr(n.func, "id", new)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"drop {type(node.op).__name__}", "unwrap"))
    elif isinstance(node, ast.Return) and isinstance(node.value, ast.BinOp):
        out.append(("return drops its right operand", lambda n: setattr(n, "value", n.value.left)))
    return out


class _Unwrap(ast.NodeTransformer):
    """Replace the node with id ``target`` (a unary op) by its operand."""

    def __init__(self, target: int):
        self.target = target

    def visit_UnaryOp(self, node):  # noqa: N802 - ast.NodeTransformer's naming
        self.generic_visit(node)
        return node.operand if id(node) == self.target else node


def mutants(source: str) -> list[tuple[Mutant, str]]:
    """Every mutant of ``source`` as ``(Mutant, mutated source)``, in a deterministic walk order."""
    tree = ast.parse(source)
    original = ast.unparse(tree)
    out = []
    n_sites = sum(len(_candidates(n)) for n in ast.walk(tree) if id(n) not in _skipped(tree))
    for index in range(n_sites):
        mutated = copy.deepcopy(tree)
        skip = _skipped(mutated)
        sites = [(node, desc, fn) for node in ast.walk(mutated) if id(node) not in skip
                 for desc, fn in _candidates(node)]
        node, desc, fn = sites[index]
        line = node.lineno
        if fn == "unwrap":
            mutated = _Unwrap(id(node)).visit(mutated)
        else:
            fn(node)
        text = ast.unparse(ast.fix_missing_locations(mutated))
        if text != original:
            out.append((Mutant(index, line, desc), text))
    return out


def _run_tests(scratch: Path, tests: list[str], timeout: float, quiet: bool = True) -> str:
    """Run ``tests`` in a forked child (fresh ``dspark_hf`` import); ``"passed"``, ``"failed"`` or ``"timeout"``."""
    pid = os.fork()
    if pid == 0:  # child
        if quiet:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        signal.alarm(int(timeout))
        import pytest

        code = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(scratch)])
        os._exit(int(code))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "timeout" if os.WTERMSIG(status) == signal.SIGALRM else "failed"
    return "passed" if os.WEXITSTATUS(status) == 0 else "failed"


def _scratch_copy() -> Path:
    """A copy of the package, tests and pytest config without bytecode; the mutants are written here."""
    scratch = Path(tempfile.mkdtemp(prefix="dspark-mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "drafters")
    shutil.copytree(ROOT / "dspark_hf", scratch / "dspark_hf", ignore=ignore)
    if (ROOT / "dspark_hf" / "drafters").exists():
        (scratch / "dspark_hf" / "drafters").symlink_to(ROOT / "dspark_hf" / "drafters")
    shutil.copytree(ROOT / "tests", scratch / "tests", ignore=ignore)
    shutil.copytree(ROOT / "metrics", scratch / "metrics", ignore=ignore)  # the `evaluate` modules test_metrics loads
    shutil.copy(ROOT / "pyproject.toml", scratch / "pyproject.toml")
    return scratch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", choices=sorted(MODULES), action="append", help="default: all three")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant before it counts as killed")
    parser.add_argument("--json", type=Path, help="write the per-mutant results here")
    args = parser.parse_args(argv)
    names = args.module or list(MODULES)
    if args.list:
        for name in names:
            for m, _ in mutants((ROOT / MODULES[name][0]).read_text()):
                print(f"{name}:{m.line} #{m.index} {m.description}")
        return 0
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    for heavy in ("torch", "numpy", "transformers", "sklearn.metrics", "matplotlib.figure", "hypothesis", "pytest"):
        __import__(heavy)  # loaded once here, inherited by every forked child; dspark_hf is NOT imported
    scratch = _scratch_copy()
    os.chdir(scratch)
    sys.path.insert(0, str(scratch))
    sys.path.insert(0, str(scratch / "tests"))
    results, table = {}, []
    try:
        for name in names:
            rel, tests = MODULES[name]
            target = scratch / rel
            source = target.read_text()
            start = time.perf_counter()
            if _run_tests(scratch, tests, args.timeout, quiet=False) != "passed":
                raise SystemExit(f"{name}: the unmutated tests do not pass; fix them first.")
            rows = []
            for m, text in mutants(source):
                target.write_text(text)
                outcome = _run_tests(scratch, tests, args.timeout)
                rows.append({"line": m.line, "index": m.index, "mutation": m.description, "outcome": outcome})
                print(f"{name}:{m.line} #{m.index} {m.description}: {outcome}", flush=True)
            target.write_text(source)
            killed = sum(r["outcome"] != "passed" for r in rows)
            table.append((name, len(rows), killed, time.perf_counter() - start))
            results[name] = rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n| module | mutants | killed | killed % | seconds |\n|---|---|---|---|---|")
    for name, total, killed, seconds in table:
        print(f"| {name} | {total} | {killed} | {100 * killed / max(total, 1):.1f} | {seconds:.0f} |")
    for name, rows in results.items():
        for r in rows:
            if r["outcome"] == "passed":
                print(f"survived: {name}:{r['line']} {r['mutation']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(killed >= 0.9 * total for _, total, killed, _ in table) else 1


if __name__ == "__main__":
    sys.exit(main())
