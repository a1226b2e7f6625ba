"""Issue 26's boundaries, read from the source: what a model family is lives in zerorun/arch, which imports nothing
of zerorun but the leaf cachedir.py (its pipeline adapters also the pipeline's shared layer base); config/ never
imports memory/ (the old circle through count_params) and hardware.py imports config/ only for type checking.
Outside arch/ no code names a family (docstrings and comments may)."""
import ast
import re
from pathlib import Path

import pytest

from zerorun.arch import DECODER_TYPES, FAMILIES, PIPELINE_ADAPTERS

pytestmark = pytest.mark.unit
PKG = Path(__file__).resolve().parents[2] / "zerorun"


def imports(path: Path, runtime_only: bool = True):
    """Every zerorun module ``path`` imports, at module level or inside functions (absolute names)."""
    tree = ast.parse(path.read_text())
    skip = set()
    if runtime_only:  # `if TYPE_CHECKING:` blocks import nothing at run time
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip |= {id(n) for n in ast.walk(node)}
    package = ".".join(("zerorun", *path.relative_to(PKG).with_suffix("").parts[:-1]))
    if path.name == "__init__.py":
        package = ".".join(("zerorun", *path.relative_to(PKG).parts[:-1]))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {n for n in out if n == "zerorun" or n.startswith("zerorun.")}


def test_arch_imports_nothing_of_zerorun_and_config_never_imports_memory():
    adapters = {PKG.parent / (name.replace(".", "/") + ".py") for name in PIPELINE_ADAPTERS}
    for f in (PKG / "arch").glob("*.py"):
        allowed = ("zerorun.arch", "zerorun.cachedir") + (("zerorun.pipeline.layers",) if f in adapters else ())
        assert {n for n in imports(f) if not n.startswith(allowed)} == set(), f
    assert imports(PKG / "cachedir.py") == set()  # the leaf arch/ may use: it imports nothing of zerorun
    for f in (PKG / "config").glob("*.py"):
        assert not {n for n in imports(f) if n.startswith("zerorun.memory")}, f
    assert not {n for n in imports(PKG / "hardware.py") if n.startswith("zerorun.config")}


@pytest.mark.heavy
def test_no_code_outside_arch_names_a_family():
    names = sorted({*FAMILIES, *DECODER_TYPES, "bert", "roberta"})
    # a family as a word ("bert", model.bert), or a transformers class named after one (GPT2LMHeadModel)
    pat = re.compile(r"(?i:\b(" + "|".join(names) + r")\b)|\b(" + "|".join(n.capitalize() for n in names)
                     + "|" + "|".join(n.upper() for n in names) + r")(?=[A-Z])")
    found = []
    for f in sorted(p for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] != "arch"):
        tree = ast.parse(f.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docs else getattr(node, "attr", None) or getattr(node, "id", None)
            if isinstance(text, str) and pat.search(text) and "+model=" not in text:
                found.append(f"{f.relative_to(PKG)}:{node.lineno}: {text[:80]!r}")
    assert not found, "\n".join(found)


@pytest.mark.heavy
def test_pipeline_recipes_are_the_families_that_say_they_have_one():
    from zerorun.pipeline import recipes

    assert {r.family for r in recipes().values()} == {n for n, t in FAMILIES.items() if t.pipeline}
