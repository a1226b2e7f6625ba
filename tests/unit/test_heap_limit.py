"""launcher.heap_limit_mib: the ceiling a CPU rank puts on its tcmalloc heap, from the gate's bound for that rank."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerorun.config import compose
from zerorun.config.errors import UserError
from zerorun.config.fields import field_problems
from zerorun.train import heap_limit
from zerorun.train.memory_report import rank_figures

pytestmark = pytest.mark.unit
MIB = 2**20

ESTIMATE = {"per_rank_peak_bytes": 900 * MIB, "per_rank_bound_bytes": 1000 * MIB,
            "other_ranks_peak_bytes": 800 * MIB, "other_ranks_bound_bytes": 880 * MIB,
            "pipeline_stages": [{"per_rank_peak_bytes": 500 * MIB, "per_rank_bound_bytes": 560 * MIB},
                                {"per_rank_peak_bytes": 700 * MIB, "per_rank_bound_bytes": 790 * MIB}]}


def test_each_rank_gets_its_own_figures():
    flat = {k: v for k, v in ESTIMATE.items() if k != "pipeline_stages"}
    assert rank_figures(flat, 0) == (900 * MIB, 1000 * MIB)  # rank 0 writes the export
    assert rank_figures(flat, 1) == (800 * MIB, 880 * MIB)
    assert rank_figures(ESTIMATE, 3, stage=1) == (700 * MIB, 790 * MIB)  # a pipeline rank: its stage's
    assert rank_figures(flat, 1, stage=-1) == (800 * MIB, 880 * MIB)  # -1: not a pipeline (gather_memory's)
    # a pipeline stage's first replica sends its stage to the export: it is held to the export's figure
    sender = dict(ESTIMATE["pipeline_stages"][1], exporting_rank=2, other_ranks_peak_bytes=600 * MIB,
                  other_ranks_bound_bytes=650 * MIB)
    piped = dict(ESTIMATE, pipeline_stages=[ESTIMATE["pipeline_stages"][0], sender])
    assert rank_figures(piped, 2, stage=1) == (700 * MIB, 790 * MIB)
    assert rank_figures(piped, 3, stage=1) == (600 * MIB, 650 * MIB)


def test_the_ceiling_is_the_ranks_share_of_host_ram_never_below_its_bound_less_what_is_outside_the_heap():
    # 1,000 MiB bound, 4,000 MiB of host RAM per rank; 700 resident of which 450 in the heap: 250 outside.
    assert heap_limit.ceiling_bytes(-1, 1000 * MIB, 4000 * MIB, 700 * MIB, 450 * MIB) == 3750 * MIB
    # gate=warn let the bound past the capacity: the ceiling is the bound (no rank is held below its own figure)
    assert heap_limit.ceiling_bytes(-1, 1000 * MIB, 800 * MIB, 700 * MIB, 450 * MIB) == 750 * MIB
    assert heap_limit.ceiling_bytes(0, 1000 * MIB, 4000 * MIB, 700 * MIB, 450 * MIB) == 0  # off
    assert heap_limit.ceiling_bytes(300, 1000 * MIB, 4000 * MIB, 700 * MIB, 450 * MIB) == 300 * MIB  # the user's
    assert heap_limit.ceiling_bytes(-1, None, 0, 700 * MIB, 450 * MIB) == 0  # nothing to hold it at


@given(bound=st.integers(0, 2**40), capacity=st.integers(0, 2**40), resident=st.integers(0, 2**40),
       heap=st.integers(0, 2**40))
def test_the_ceiling_holds_the_resident_set_at_the_larger_of_bound_and_capacity(bound, capacity, resident, heap):
    limit = heap_limit.ceiling_bytes(-1, bound, capacity, resident, heap)
    target, outside = max(bound, capacity), max(0, resident - heap)
    if not target:
        assert limit == 0
        return
    assert limit >= MIB  # 0 would mean no limit to tcmalloc
    assert limit + outside == max(target, MIB + outside)  # never more than the target, never below the bound


def test_off_where_tcmalloc_is_not_what_runs_or_the_user_set_a_limit():
    # This test process runs glibc's malloc.
    assert heap_limit.apply(-1, ESTIMATE, 0, environ={})["why"] == "tcmalloc is not this rank's allocator"
    assert heap_limit.apply(-1, ESTIMATE, 0, environ={"TCMALLOC_HEAP_LIMIT_MB": "4096"})["limit_bytes"] == 0
    assert heap_limit.apply(0, ESTIMATE, 0, environ={})["why"] == "launcher.heap_limit_mib=0"


@pytest.mark.heavy
def test_a_bad_heap_limit_is_refused_naming_the_key_and_the_fix():
    (problem,) = field_problems(compose(["launcher.heap_limit_mib=-2"]))
    assert str(problem).startswith("launcher.heap_limit_mib=-2: must be at least -1. Fix: launcher.heap_limit_mib=-1")
    for value in ("1.5", "lots"):  # not an integer: Hydra's own message, naming the override
        with pytest.raises(UserError, match="launcher.heap_limit_mib"):
            compose([f"launcher.heap_limit_mib={value}"])


@pytest.mark.heavy
def test_the_default_holds_each_rank_at_its_bound():
    assert compose([]).launcher.heap_limit_mib == -1


@pytest.mark.heavy
def test_an_explicit_ceiling_below_the_tensors_is_refused_before_launch_with_a_ceiling_that_clears_them():
    from helpers import CPU2, CPU_HOST
    from zerorun.config import make_plan
    from zerorun.memory import gate

    def decide(*overrides):
        cfg = compose(["+model=gpt2", "data.seq_len=256", "trainer.micro_batch_size=2", "launcher.allocator=tcmalloc",
                       *overrides])
        return gate(cfg, make_plan(cfg, CPU2), CPU_HOST)

    low = decide("launcher.heap_limit_mib=100")
    assert not low.ok and low.message.startswith("launcher.heap_limit_mib=100 holds each CPU rank's tcmalloc heap")
    suggested = low.message.split("Fix: ")[1].split()[0]
    assert decide(suggested).ok  # the ceiling it names clears the tensors
    assert decide("launcher.heap_limit_mib=-1").ok and decide("launcher.heap_limit_mib=0").ok
    glibc = decide("launcher.heap_limit_mib=100", "launcher.allocator=glibc")
    assert glibc.ok  # no tcmalloc heap to hold: the setting does nothing there


def test_a_ceiling_applies_to_cpu_ranks_on_tcmalloc_only_and_not_over_the_users_own():
    assert heap_limit.applies(-1, "cpu", "tcmalloc", environ={})
    assert heap_limit.applies(300, "cpu", "tcmalloc", environ={})
    assert not heap_limit.applies(0, "cpu", "tcmalloc", environ={})
    assert not heap_limit.applies(-1, "cuda", "tcmalloc", environ={})
    assert not heap_limit.applies(-1, "cpu", "glibc", environ={})
    assert not heap_limit.applies(-1, "cpu", "tcmalloc", environ={"TCMALLOC_HEAP_LIMIT_MB": "4096"})
