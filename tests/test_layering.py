"""The package's layers, made executable: imports point one way (issue 12).

modeling ← runtime ← {decoding, sources} ← {training, evaluation} ← {bench, hub, demo} ← cli, with ``defaults``
(paths and ids) and ``metrics`` (pure maths) below every layer but ``modeling``; ``runtime`` (target loading, the
machine, kernels, the KV cache, the SPS curve and its profile) sits under the decoding hot path; ``sources`` (ShareGPT, HumanEval, the prompt
queue) sits under every reader of data (issue #27); ``dspark_hf/__init__.py`` wires the top. Every import
counts, lazy ones inside functions included.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dspark_hf"
LAYER = {"modeling": 0, "defaults": 1, "metrics": 1, "runtime": 2, "decoding": 3, "sources": 3, "training": 4,
         "evaluation": 4, "bench": 5, "hub": 5, "demo": 5, "cli": 6}
MAX_LINES = 430  # "no module over ~400 lines"
# the two places that wire the package (``dspark_hf.wire``, on the first use of a public name) from below it
WIRING = {"cli/main.py": "the entry point, once a command runs",
          "modeling/modeling_dspark.py": "the remote copy's bootstrap (trust_remote_code) wires the installed package"}


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if (p.name != "__init__.py" or p.parent != PACKAGE) and "templates" not in p.parts)


def _unit(path: Path) -> str:
    """The layer unit of a module: its sub-package, or its own name at the top."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imported_units(path: Path) -> set[str]:
    """Layer units of ``dspark_hf`` that ``path`` imports (relative or absolute, at any depth of the code)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0: dspark_hf/x.py, 1: dspark_hf/sub/x.py
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = list(path.relative_to(PACKAGE).parts[:depth])[: max(0, depth - (node.level - 1))]
                if node.level - 1 > depth:
                    raise AssertionError(f"{path}: relative import beyond the package")
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names] if not node.module else [target]
            elif node.module and node.module.split(".")[0] == "dspark_hf":
                target = node.module.split(".")[1:]
                names = [target + [a.name] for a in node.names] if not target else [target]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "dspark_hf"]
            units |= {"<root>" for n in names if not n}
        for name in names:
            units.add(name[0] if name and name[0] in LAYER else "<root>")
    return units


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    unit = _unit(path)
    layer = LAYER[unit]
    for other in _imported_units(path) - {unit}:
        if other == "<root>" and path.relative_to(PACKAGE).as_posix() in WIRING:
            continue
        assert other != "<root>", f"{path.name} imports the package root (dspark_hf/__init__.py), the top layer"
        assert LAYER[other] < layer, f"{unit}/{path.name} (layer {layer}) imports {other} (layer {LAYER[other]})"


def test_modeling_is_torch_and_transformers_only():
    """``modeling/`` is the remote code of a Hub repo: nothing of the package outside it, no third party but torch
    and transformers."""
    allowed = {"torch", "transformers", "dspark_hf"}  # dspark_hf: the remote copy's bootstrap imports modeling/ itself
    for path in (PACKAGE / "modeling").glob("*.py"):
        assert _imported_units(path) - ({"<root>"} if path.name == "modeling_dspark.py" else set()) <= {"modeling"}, path
        for node in ast.walk(ast.parse(path.read_text())):
            roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                     else [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for root in roots:
                assert root in allowed or root in STDLIB, f"{path.name} imports {root}"


STDLIB = {"__future__", "json", "warnings", "dataclasses", "pathlib", "typing", "numbers", "math", "sys", "os",
          "threading", "weakref"}


def test_gradio_is_never_imported_at_module_level():
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("gradio", "matplotlib", "pandas") for n in names), path


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path} is over ~400 lines: split it by concept"


def test_verification_policies_cover_the_config_modes():
    from dspark_hf.decoding.verification import POLICIES
    from dspark_hf.modeling.limits import VERIFICATION_MODES

    assert tuple(POLICIES) == VERIFICATION_MODES
    assert {m for m, p in POLICIES.items() if p.needs_calibration} == {"scheduler", "async"}  # the one table of needs
    assert [m for m, p in POLICIES.items() if not p.needs_confidence] == ["fixed"]
