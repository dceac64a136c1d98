"""Every dotted ``dspark_hf.`` name the package shows a reader resolves (issue 27, item 2).

Docstrings, comments, error messages and templates are read from the source files; argparse help texts are read as
``dspark COMMAND --help`` prints them (some are assembled at run time). A name resolves when its longest importable
prefix is a module of the package and the rest is an attribute chain on it (``import dspark_hf`` is lazy, PEP 562, so
the module is imported through importlib rather than looked up on the package).
"""

import importlib
import re
from pathlib import Path

from dspark_hf.cli import main as cli

PACKAGE = Path(__file__).resolve().parent.parent / "dspark_hf"
DOTTED = re.compile(r"\bdspark_hf(?:\.[A-Za-z_]\w*)+")


def resolves(name: str) -> bool:
    """Whether ``name`` (``dspark_hf.a.b.C.meth``) is an importable module or an attribute chain on one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and name.startswith(error.name):  # the referenced module is missing, not a dep
                continue
            raise
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _source_references() -> dict[str, list[str]]:
    """``{dotted name: ["path:line", ...]}`` over every text file of the package."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".md"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in DOTTED.findall(line):
                found.setdefault(name, []).append(f"{path.relative_to(PACKAGE.parent)}:{number}")
    return found


def _help_texts() -> dict[str, str]:
    """``{"dspark COMMAND": its --help text}``, the top level included."""
    parser = cli.full_parser()
    texts = {"dspark": parser.format_help()}
    for action in parser._subparsers._group_actions:
        for command, subparser in action.choices.items():
            texts[f"dspark {command}"] = subparser.format_help()
    return texts


def test_the_resolver_tells_a_missing_name_from_a_present_one():
    assert resolves("dspark_hf.decoding.scheduler.prefix_survival")
    assert resolves("dspark_hf.modeling.modeling_dspark.DSparkDrafter.mask_vector")
    assert resolves("dspark_hf.SPSCurve")  # a lazy public name (dspark_hf.__getattr__)
    assert not resolves("dspark_hf.scheduler.prefix_survival")  # the module moved under decoding/
    assert not resolves("dspark_hf.decoding.scheduler.no_such_function")


def test_every_dotted_name_in_the_source_resolves():
    references = _source_references()
    assert len(references) > 50  # the scan sees the package (a broken pattern would find nothing and pass)
    broken = {name: where for name, where in references.items() if not resolves(name)}
    assert not broken, "references to names that do not exist:\n" + "\n".join(
        f"  {name}  ({', '.join(where)})" for name, where in sorted(broken.items()))


def test_every_dotted_name_in_the_help_texts_resolves():
    texts = _help_texts()
    assert len(texts) == len(cli.COMMANDS) + 1
    broken = sorted({(command, name) for command, text in texts.items()
                     for name in DOTTED.findall(" ".join(text.split())) if not resolves(name)})
    assert not broken, f"help texts naming what does not exist: {broken}"
