"""The test suite's wall time by tier (unit / integration / e2e) and its slowest tests: a figure, not a test.

    python benchmarks/suite_time.py                 # runs the whole suite once (as `make test` does), then reports
    python benchmarks/suite_time.py --from r.xml    # reports a JUnit XML file pytest wrote (--junitxml=r.xml)
    python benchmarks/suite_time.py -- -m e2e       # extra pytest arguments after --

Each test's time is pytest's own (setup + call + teardown, from the JUnit report); a tier's seconds are the sum
over its tests, so with pytest-xdist workers (`make test` runs two) the tiers add up to more than the wall time.
The wall time is this script's clock around pytest, or the report's own session time (--from). The target
(issue 24): `make test` under 25 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e")


def tier_of(classname: str) -> str:
    parts = classname.split(".")
    return next((p for p in parts if p in TIERS), "other")


def session_seconds(report: Path) -> float | None:
    """The pytest session's wall time as the report records it (its testsuite element's time)."""
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time")) if suite is not None and suite.get("time") else None


def read(report: Path):
    """(tier, test id, seconds, outcome) for every test case in a JUnit XML report."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        rows.append((tier_of(case.get("classname", "")), f"{case.get('classname')}::{case.get('name')}",
                     float(case.get("time", 0)), outcome))
    return rows


def summarize(rows, wall: float | None, slowest: int = 15) -> list[str]:
    by_tier = collections.defaultdict(lambda: [0, 0.0])
    for tier, _, secs, _ in rows:
        by_tier[tier][0] += 1
        by_tier[tier][1] += secs
    lines = [f"{'tier':12s} {'tests':>6s} {'test s':>9s} {'min:s':>7s}"]
    for tier in (*TIERS, "other"):
        if tier in by_tier:
            n, secs = by_tier[tier]
            lines.append(f"{tier:12s} {n:6d} {secs:9.1f} {int(secs // 60):4d}:{int(secs % 60):02d}")
    total = sum(s for _, _, s, _ in rows)
    lines.append(f"{'all tests':12s} {len(rows):6d} {total:9.1f} {int(total // 60):4d}:{int(total % 60):02d}")
    if wall is not None:
        lines.append(f"pytest wall time: {wall:.0f} s ({wall / 60:.1f} min)")
    if slowest:
        lines.append(f"slowest {slowest}:")
        lines += [f"  {secs:7.1f} s  {name}" for _, name, secs, _ in sorted(rows, key=lambda r: -r[2])[:slowest]]
    outcomes = collections.Counter(o for *_, o in rows)
    # Last, in the plain form any CI reads as a test run's closing line.
    lines.append(f"{outcomes['passed']} passed, {outcomes['failed']} failed, {outcomes['skipped']} skipped")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="report", type=Path, help="a JUnit XML report to read instead of running pytest")
    ap.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list (0: none)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    wall = None
    report = args.report
    if report is None:
        report = Path(tempfile.mkdtemp()) / "junit.xml"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--timeout=1800", f"--junitxml={report}",
                               *args.pytest_args, "tests"], cwd=ROOT)
        wall = time.perf_counter() - t0
        if not report.is_file():
            return proc.returncode or 1
    else:
        wall = session_seconds(report)
    print("\n".join(summarize(read(report), wall, args.slowest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
