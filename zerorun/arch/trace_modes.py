"""The dispatch modes a shape-only trace runs under (arch/traced.py): answers for data-dependent ops, and a watch on
each layer's forward blocks. Kept apart so that the trace's bookkeeping and what it observes read separately."""
from __future__ import annotations


def balanced_mode(experts: int):
    """Data-dependent answers for a shape-only trace: ``nonzero`` gives every expert its equal share of the
    tokens (and every expert a hit), ``.item()`` answers "False" for a check (there is padding: the mask is
    materialised) and counts through the experts for an index."""
    import itertools

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class Balanced(TorchDispatchMode):
        count = itertools.count()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.nonzero.default:
                x = args[0]
                n = x.numel() if not experts or x.numel() == experts else x.numel() // experts
                return torch.zeros((n, x.dim()), dtype=torch.long, device=x.device)
            if func is aten._local_scalar_dense.default:
                x = args[0]
                if x.dtype == torch.bool:
                    return False
                return 0.0 if x.is_floating_point() else (next(self.count) % experts if experts else 0)
            return func(*args, **(kwargs or {}))

    return Balanced()


def layer_blocks_mode(skip: frozenset = frozenset(), cpu_kernels: bool = True):
    """A dispatch mode that watches each layer's forward (``enter``/``leave``, from module hooks): the largest block
    an op allocates there (the weights' own aside, ``skip``: a transposed weight is a view of it), and the
    transient, how far the live bytes rise above what the layer leaves alive at its end. Storages are followed by
    weak reference, as torch.distributed._tools.mem_tracker does; a CPU kernel's own scratch is added where known
    (``cpu_kernels``)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    gather = torch.ops.aten.gather.default

    class LayerBlocks(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.skip, self.largest, self.transient = skip, 0, 0
            self.inside, self.live, self.now, self.peak = False, {}, 0, 0

        def enter(self, *_):
            self.inside, self.peak = True, self.now

        def leave(self, *_):
            self.inside = False
            self.transient = max(self.transient, self.peak - self.now)

        def _gone(self, key):
            self.now -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            scratch = 0
            for t in tree_leaves(out):
                st = t.untyped_storage() if isinstance(t, torch.Tensor) else None
                if st is None or st._cdata in self.skip:
                    continue
                if id(st) not in self.live:
                    self.live[id(st)] = st.nbytes()
                    self.now += st.nbytes()
                    weakref.finalize(st, self._gone, id(st))
                if self.inside:
                    self.largest = max(self.largest, st.nbytes())
                if cpu_kernels and func is gather and t.dtype in (torch.bfloat16, torch.float16):
                    # CPU's gather of a 16-bit tensor makes an fp32 copy of its output while it runs (logged with
                    # bigalloc: DeBERTa's c2p and p2c gathers at 11 x 4 x 384², 24.75 MiB each, freed at return)
                    scratch = max(scratch, 4 * t.numel())
            if self.inside:
                self.largest = max(self.largest, scratch)
                self.peak = max(self.peak, self.now + scratch)
            return out

    return LayerBlocks()
