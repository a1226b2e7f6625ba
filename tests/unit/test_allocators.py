"""launcher.allocator: which malloc CPU ranks run, the fallback chain, a user's own LD_PRELOAD, the ranks' env."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerorun import allocators, launcher
from zerorun.config import Allocator, compose

pytestmark = pytest.mark.unit

LIBS = {Allocator.tcmalloc: "/opt/lib/libtcmalloc_minimal.so.4", Allocator.jemalloc: "/opt/lib/libjemalloc.so.2",
        Allocator.mimalloc: "/opt/lib/libmimalloc.so.2"}


def finder(*installed):
    return lambda name: LIBS[name] if name in installed else ""


def test_auto_takes_tcmalloc_where_it_is_installed():
    r = allocators.resolve(Allocator.auto, {}, finder(Allocator.tcmalloc, Allocator.jemalloc))
    assert (r.name, r.library) == (Allocator.tcmalloc, LIBS[Allocator.tcmalloc])
    assert "fastest installed" in r.why


def test_without_tcmalloc_auto_falls_back_to_jemalloc_and_says_how_to_install_tcmalloc():
    r = allocators.resolve(Allocator.auto, {}, finder(Allocator.jemalloc))
    assert (r.name, r.library) == (Allocator.jemalloc, LIBS[Allocator.jemalloc])
    assert "tcmalloc is not installed" in r.why and "libtcmalloc-minimal4" in r.why


def test_with_neither_auto_runs_glibc_and_says_so():
    r = allocators.resolve(Allocator.auto, {}, finder(Allocator.mimalloc))  # mimalloc is never auto's pick
    assert (r.name, r.library) == (Allocator.glibc, "")
    assert r.why.startswith("glibc: tcmalloc is not installed")


def test_an_explicit_choice_runs_when_installed_and_falls_back_when_not():
    assert allocators.resolve(Allocator.mimalloc, {}, finder(Allocator.mimalloc, Allocator.tcmalloc)).name == \
        Allocator.mimalloc
    r = allocators.resolve(Allocator.jemalloc, {}, finder(Allocator.tcmalloc))
    assert r.name == Allocator.tcmalloc and "jemalloc is not installed" in r.why


def test_gpu_ranks_keep_glibc_unless_asked():
    assert allocators.resolve(Allocator.auto, {}, finder(*LIBS), gpu_ranks=True).name == Allocator.glibc
    assert allocators.resolve(Allocator.tcmalloc, {}, finder(*LIBS), gpu_ranks=True).name == Allocator.tcmalloc


def test_a_users_own_ld_preload_wins_and_the_gate_plans_for_what_it_loads():
    env = {"LD_PRELOAD": "/home/me/libjemalloc.so.2"}
    r = allocators.resolve(Allocator.tcmalloc, env, finder(*LIBS))
    assert (r.name, r.users_own) == (Allocator.jemalloc, True) and "your LD_PRELOAD" in r.why
    assert allocators.resolve(Allocator.auto, {"LD_PRELOAD": "/x/libfoo.so"}, finder(*LIBS)).name == Allocator.glibc


@pytest.mark.heavy
@given(choice=st.sampled_from(list(Allocator)), installed=st.sets(st.sampled_from(list(LIBS))),
       gpu=st.booleans())
def test_resolution_is_always_concrete_installed_and_one_line(choice, installed, gpu):
    r = allocators.resolve(choice, {}, finder(*installed), gpu_ranks=gpu)
    assert r.name != Allocator.auto
    assert r.name == Allocator.glibc or r.name in installed
    assert r.library == LIBS.get(r.name, "") and "\n" not in r.why
    if choice in installed:  # what you asked for runs when it is there
        assert r.name == choice


def test_rank_env_preloads_the_allocator_and_sets_glibc_knobs_only_for_glibc(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    tc = launcher.rank_env("cpu", 1, allocator="tcmalloc", allocator_library=LIBS[Allocator.tcmalloc])
    assert tc["LD_PRELOAD"] == LIBS[Allocator.tcmalloc] and not any(k.startswith("MALLOC_") for k in tc)
    assert tc["TCMALLOC_RELEASE_RATE"] == "0"  # returned spans would not coalesce with free ones (§5.4)
    je = launcher.rank_env("cpu", 1, allocator="jemalloc", allocator_library=LIBS[Allocator.jemalloc])
    assert je["MALLOC_CONF"] == allocators.JEMALLOC_CONF
    gl = launcher.rank_env("cpu", 1, 1 << 20)
    assert "LD_PRELOAD" not in gl and gl["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")  # yours wins, as PYTORCH_CUDA_ALLOC_CONF does
    assert "MALLOC_CONF" not in launcher.rank_env("cpu", 1, allocator="jemalloc", allocator_library="/x.so")
    monkeypatch.setenv("LD_PRELOAD", "/home/me/libtcmalloc.so")
    assert "LD_PRELOAD" not in launcher.rank_env("cpu", 1, allocator="tcmalloc", allocator_library="/x.so")
    monkeypatch.setenv("TCMALLOC_RELEASE_RATE", "1")
    assert "TCMALLOC_RELEASE_RATE" not in launcher.rank_env("cpu", 1, allocator="tcmalloc", allocator_library="/x.so")


def test_the_memory_mode_key_follows_tcmallocs_release_rate(monkeypatch):
    """Measurements at tcmalloc's default release rate (a more fragmented heap) are not reused at zerorun's 0."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(allocator="tcmalloc", mkl_fast_mm=False)
    monkeypatch.delenv("TCMALLOC_RELEASE_RATE", raising=False)
    monkeypatch.delenv("MKL_DISABLE_FAST_MM", raising=False)
    assert allocators.memory_mode(cfg, 1 << 20) == "tcmalloc-release0-mklmm0"
    monkeypatch.setenv("TCMALLOC_RELEASE_RATE", "1")
    assert allocators.memory_mode(cfg, 1 << 20) == "tcmalloc-release1-mklmm0"


def test_tcmalloc_ranks_free_mkls_gemm_buffers_unless_asked_and_the_key_says_which(monkeypatch):
    """MKL's cached GEMM buffers cut the activations' freed spans on tcmalloc (launcher.mkl_fast_mm): its ranks turn
    the cache off, glibc's and GPU ranks leave it, an MKL_DISABLE_FAST_MM you set wins, and measurements taken with
    the cache are stored apart from those without it."""
    from types import SimpleNamespace

    for var in ("LD_PRELOAD", "MKL_DISABLE_FAST_MM", "TCMALLOC_RELEASE_RATE"):
        monkeypatch.delenv(var, raising=False)
    tc = dict(allocator="tcmalloc", allocator_library=LIBS[Allocator.tcmalloc])
    assert launcher.rank_env("cpu", 1, **tc)[allocators.MKL_FAST_MM_OFF] == "1"
    assert allocators.MKL_FAST_MM_OFF not in launcher.rank_env("cpu", 1, **tc, mkl_fast_mm=True)
    assert allocators.MKL_FAST_MM_OFF not in launcher.rank_env("cpu", 1, 1 << 20)  # glibc: mmap'd anew each call
    assert allocators.MKL_FAST_MM_OFF not in launcher.rank_env("cuda", 1, **tc)
    kept = SimpleNamespace(allocator="tcmalloc", mkl_fast_mm=True)
    assert allocators.memory_mode(kept, 1 << 20) == "tcmalloc-release0-mklmm1"
    monkeypatch.setenv("MKL_DISABLE_FAST_MM", "1")  # yours: the cache is off whatever the config says
    assert allocators.MKL_FAST_MM_OFF not in launcher.rank_env("cpu", 1, **tc)
    assert allocators.memory_mode(kept, 1 << 20) == "tcmalloc-release0-mklmm0"
    assert allocators.rank_env_args(kept)["mkl_fast_mm"] is True  # the probes run what the ranks will


def test_the_search_dirs_can_be_replaced(tmp_path, monkeypatch):
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert allocators.find_library(Allocator.jemalloc, [str(tmp_path)]) == str(tmp_path / "libjemalloc.so.2")
    assert allocators.find_library(Allocator.tcmalloc, [str(tmp_path)]) == ""
    monkeypatch.setenv(allocators.SEARCH_ENV, str(tmp_path))
    assert allocators.search_dirs() == [str(tmp_path)]


@pytest.mark.heavy
def test_the_allocator_key_separates_measurements_of_different_allocators():
    from zerorun.hardware import Hardware
    from zerorun.memory.priors import runtime_overhead_key

    hw = Hardware(accelerator="cpu", gpus_per_node=0, gpu_mem_bytes=0, host_mem_bytes=1 << 34, cpu_cores=2)
    keys = {runtime_overhead_key(compose([f"launcher.allocator={a}", "launcher.mmap_threshold_mib=1"]), hw, 2)
            for a in ("tcmalloc", "jemalloc", "glibc")}
    assert len(keys) == 3
    # and the loss a rank takes: fused (a CPU rank's default) or the model's own
    assert runtime_overhead_key(compose(["trainer.fused_loss=false"]), hw, 2) != runtime_overhead_key(compose([]), hw, 2)


@pytest.mark.heavy
def test_autofit_gives_up_the_fast_allocator_only_when_memory_is_short_and_says_what_it_costs():
    import dataclasses

    from helpers import CPU2, CPU_HOST
    from zerorun.config import make_plan
    from zerorun.memory import autofit, estimate

    cfg = compose(["+model=gpt2", "data.seq_len=256", "trainer.micro_batch_size=2", "zero=stage2",
                   "launcher.allocator=tcmalloc"])
    plan = make_plan(cfg, CPU2)
    fast, slow = estimate(cfg, plan, CPU_HOST), estimate(
        dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, allocator=Allocator.glibc,
                                                              mmap_threshold_mib=1)), plan, CPU_HOST)
    assert slow.bound_bytes < fast.bound_bytes  # glibc at 1 MiB holds less: the memory-saving fallback
    between = dataclasses.replace(CPU_HOST, host_mem_bytes=int((slow.bound_bytes + fast.bound_bytes) / 2 * 2))
    found = autofit(cfg, plan, between)
    assert found is not None
    change = next(c for c in found.changes if c.key == "launcher.allocator")
    assert change.new == Allocator.glibc and "slower" in change.why and change.override() == "launcher.allocator=glibc"
    roomy = dataclasses.replace(CPU_HOST, host_mem_bytes=int(fast.bound_bytes * 2 * 1.2))
    assert autofit(cfg, plan, roomy) is None or not any(c.key == "launcher.allocator" for c in autofit(cfg, plan, roomy).changes)


@pytest.mark.heavy
@pytest.mark.parametrize("allocator,width", [("tcmalloc", "heap retention (tcmalloc)"),
                                             ("jemalloc", "heap (jemalloc, not validated)"),
                                             ("mimalloc", "heap (mimalloc, not validated)")])
def test_the_figure_is_for_the_allocator_that_runs(allocator, width):
    from helpers import CPU2, CPU_HOST
    from zerorun.config import make_plan
    from zerorun.memory import estimate
    from zerorun.memory.priors import PAGE_HEAP_TERM

    def est(*ovs):
        cfg = compose(["+model=gpt2", "data.seq_len=256", "trainer.micro_batch_size=2", *ovs])
        return estimate(cfg, make_plan(cfg, CPU2), CPU_HOST)

    glibc, pre = est("launcher.allocator=glibc", "launcher.mmap_threshold_mib=1"), est(f"launcher.allocator={allocator}")
    assert PAGE_HEAP_TERM not in glibc.components and pre.components[PAGE_HEAP_TERM] > 0
    assert pre.per_rank_peak_bytes > glibc.per_rank_peak_bytes and width in pre.bound_widths
    assert pre.to_json()["config"]["allocator"] == allocator
    # Validated (tcmalloc) is narrower than a second copy of the tensors; the unvalidated ones get that copy.
    counted = pre.per_rank_peak_bytes - sum(v for k, v in pre.components.items() if k in
                                            ("process runtime", "heap retention", PAGE_HEAP_TERM,
                                             "allocator and runtime overhead"))
    assert (pre.bound_widths[width] < 0.5 * counted) == (allocator == "tcmalloc")


@pytest.mark.heavy
def test_tcmalloc_keeps_no_more_small_blocks_than_its_thread_caches_hold():
    # glibc's arena keeps ~2 x the small saved tensors one micro-batch frees (measured 1.4-2.5); tcmalloc keeps them in
    # its thread caches, at most tcmalloc.max_total_thread_cache_bytes (32 MiB), and returns the rest to its page heap.
    # Rate-0 sets: a config.json Qwen3-MoE pair (ZeRO-1, bf16, micro 10 x 464, no checkpointing) read +25% at 2 x churn,
    # MiniLM bf16 at micro 14 x 96 (ZeRO-1, 2 ranks) +6.8/+12.3%; every rank whose term was above 5% read over.
    from helpers import CPU2, CPU_HOST
    from zerorun.config import make_plan
    from zerorun.memory import estimate
    from zerorun.memory.priors import DEFAULT_CALIBRATION

    def retained(*ovs):
        cfg = compose(["+model=minilm", "precision=bf16", "data.seq_len=96", "trainer.micro_batch_size=14",
                       "trainer.activation_checkpointing=false", *ovs])
        return estimate(cfg, make_plan(cfg, CPU2), CPU_HOST).components["heap retention"]

    glibc = retained("launcher.allocator=glibc", "launcher.mmap_threshold_mib=1")
    assert glibc > 2 * DEFAULT_CALIBRATION.tcmalloc_thread_caches
    assert retained("launcher.allocator=tcmalloc") == DEFAULT_CALIBRATION.tcmalloc_thread_caches == 32 * 2**20
    small = retained("launcher.allocator=glibc", "launcher.mmap_threshold_mib=1", "trainer.micro_batch_size=1",
                     "data.seq_len=32")
    assert 0 < small < 2**25 and retained("launcher.allocator=tcmalloc", "trainer.micro_batch_size=1",
                                          "data.seq_len=32") == small
