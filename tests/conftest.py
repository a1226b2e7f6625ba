"""Test tiers by directory: tests/unit (pure, in-process, no subprocess: `make test-fast`),
tests/integration (engines or tools in-process or in one subprocess), tests/e2e (real multi-rank jobs).
Marks are strict (pyproject: --strict-markers); `slow` and `gpu` are set by the tests themselves, `heavy` by a
unit test itself or, for a whole module, by HEAVY_MODULES below."""
import subprocess
import sys
from pathlib import Path

import os

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

# `make test` draws the same examples on every run and every machine (derandomize: a seed from each test's name;
# no example database carried between runs), so a pass or a failure is the code's, never the draw's.
# `make test-explore` (HYPOTHESIS_PROFILE=explore) draws new ones, to look for bugs; a failure it finds prints
# its seed (@seed / --hypothesis-seed replays it), and the example becomes a fixed test.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

TIERS = ("unit", "integration", "e2e")

# Unit modules heavy as a whole (`heavy`: `make test` runs them, `make test-fast` skips them): they build, trace or
# run torch models, or each of their tests searches or composes many configs. A heavy test among fast ones carries
# @pytest.mark.heavy itself. Importing torch and transformers is ~6 CPU-s of its own, so where the -m expression
# leaves out every unit test that is heavy (`make test-fast`), these modules are not even imported.
HEAVY_MODULES = frozenset({
    "test_arch.py", "test_bound.py", "test_dropout_masks.py", "test_fused_loss.py", "test_memory_report.py",
    "test_pipeline.py", "test_pipeline_decoder.py", "test_qlora.py", "test_traced.py",
})


def _heavy_module(path) -> bool:
    return path.parent.name == "unit" and path.name in HEAVY_MODULES


def pytest_ignore_collect(collection_path, config):
    """Skip importing a heavy module when -m deselects its tests (marked unit and heavy) whatever their other marks."""
    if not config.option.markexpr or not _heavy_module(Path(collection_path)):
        return None
    try:
        from _pytest.mark.expression import Expression  # the parser -m itself uses

        expr = Expression.compile(config.option.markexpr)
        selects = [expr.evaluate(lambda name, /, **kw: (name in ("unit", "heavy") and not kw) or other)
                   for other in (False, True)]
    except Exception:  # noqa: BLE001 (another pytest's parser: collect the module and let -m deselect)
        return None
    return True if not any(selects) else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name in TIERS:
            item.add_marker(getattr(pytest.mark, path.parent.name))
        if _heavy_module(path):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A unit test that starts a process fails: the fast tier must stay in-process."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test started a subprocess: {args[:1]}; mark it integration or e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenized-data cache for the whole session: runs after the first reuse it."""
    import helpers

    path = tmp_path_factory.mktemp("zerorun-cache")
    helpers.SESSION_CACHE[:] = [path]
    return path


@pytest.fixture(scope="session")
def zero2_reference(tmp_path_factory, cache_dir):
    """helpers.ZERO2_RUN, uninterrupted, once a session: the faults and the optimizer tests compare with it."""
    from helpers import ZERO2_RUN, read_metrics, run_zerorun

    run = tmp_path_factory.mktemp("reference") / "zero2"
    proc = run_zerorun(ZERO2_RUN, run, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return {"run": run, "metrics": read_metrics(run)}
