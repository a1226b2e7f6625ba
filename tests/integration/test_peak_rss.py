"""A rank's peak RSS is its own: the kernel's VmHWM, not getrusage's ru_maxrss, which Linux carries across exec from
the process that spawned it. The calibration probe is spawned by the gate's process (~450 MiB resident): with
ru_maxrss a micro rank whose own peak was 398 MiB read 446, and its runtime overhead 73 MiB instead of 25."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

CHILD = """
import json, resource
from zerorun.telemetry import peak_rss_bytes
print(json.dumps({"peak": peak_rss_bytes(), "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's /proc/self/status")
def test_a_spawned_process_reads_its_own_peak_not_its_parents():
    held = bytearray(384 * 2**20)  # the parent's resident set: 384 MiB, touched
    out = subprocess.run([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(held) and child["ru_maxrss"] >= 384 * 2**20  # the kernel's carry-over this guards against
    assert child["peak"] < 256 * 2**20, f"the child read {child['peak'] / 2**20:.0f} MiB: its parent's peak, not its own"
