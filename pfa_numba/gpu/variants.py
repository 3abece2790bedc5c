"""The CUDA kernel variants, in dispatch's order of preference: what each takes, which
fallbacks can change what runs, and its launches (:class:`.launch.Launch` queues them).

Imported by :mod:`pfa_numba.dispatch`; it imports nothing of numba-cuda until a kernel is
prepared."""
from ..variant import FLOATS, HALVES, Kernel
from . import HEAD_DIMS

#: the CUDA feature the mma.bf16 and cp.async instructions need
SM80 = "compute capability 8.0"


class CudaKernel(Kernel):
    """A CUDA kernel variant: prepared as a :class:`.launch.Launch` over the problem's
    :class:`.launch.Situation`."""
    device = "cuda"

    def prepare(self, problem, situation, staged=None):
        from . import launch
        return launch.prepare(problem, staged.meta if staged is not None else None, self,
                              situation)

    #: whether it reads query, key and value in 16-byte rows (their pointers must be aligned)
    reads_rows = True

    def launches(self, launch, t, views, outs, state, guard_id):
        """This kernel's (what, kernel, grid, block, arguments) launches of ``launch`` (after
        the guard's scans; see :meth:`.launch.Launch.run`)."""
        raise NotImplementedError

    def guard_scans(self, p):
        """[(tensor argument, limit)] the guard scans before this kernel runs planned problem
        ``p`` (none: it computes every input exactly)."""
        return []

    def plan(self, launch, args, situation):
        """What this kernel's launches need of ``launch`` beyond its arguments (``args``: its
        KernelArgs), set on it once, when it is made."""


class _Guarded(CudaKernel):
    """A tensor-core kernel: the guard's scans run first (:func:`.launch.guard_scans`), and
    where they find what it cannot compute exactly the portable kernel queued behind it
    computes the call instead."""

    def guard_scans(self, p):
        """Each scan writes the call's guard id where it finds what the portable kernel must
        compute: a value of V (and of a shared prefix's values) that is inf or NaN (limit
        None), or for an int8 cache its token planes beyond their limits
        (``guard.antiquant_limits``)."""
        from .guard import antiquant_limits, dequantizes
        if dequantizes(p):
            return antiquant_limits(p)
        return [("v", None)] + ([("vp", None)] if p.cache is not None and p.cache.P else [])

    def launches(self, launch, t, views, outs, state, guard_id):
        own = self.own_launches(launch, t, views, outs, state, guard_id)
        if guard_id:
            _, *portable = launch.portable_launch(t, views, outs, state, guard_id)
            own.append(("portable, should the guard find what it cannot compute", *portable))
        return own

    def fallbacks(self, problem, situation):
        scans = self.guard_scans(problem)
        if not scans:
            return []
        what = ", ".join("token planes beyond their limits" if limit is not None else
                         f"inf or NaN in {field}" for field, limit in scans)
        return [f"the guard scans for {what} first; where it finds any, the portable kernel "
                "queued behind computes the call instead (decided on the device)"]


class Decode(_Guarded):
    """Split-kv decode on tensor cores, its finish kernel merging the splits."""

    def conditions(self, problem, situation):
        from .launch import decode_reasons
        return decode_reasons(problem, situation)

    def guard_scans(self, p):
        """The guard's scans where the decode kernel's rows may drop different columns of a
        tile (``decode_kernel.needs_guard``) or its int8 cache has token planes."""
        from .decode_kernel import needs_guard
        from .guard import dequantizes
        return super().guard_scans(p) if dequantizes(p) or needs_guard(p) else []

    def plan(self, launch, args, situation):
        """The split of each kv range across the multiprocessors (decode_kernel.split_plan)."""
        from .decode_kernel import split_plan
        launch.splits, launch.per_split = split_plan(launch.p, args.lens, situation.sms)

    def own_launches(self, launch, t, views, outs, state, guard_id):
        return launch.decode_launches(t, views, outs, state, guard_id)


class TensorCore(_Guarded):
    """mma.sync tiles of 64 query rows; the specialisation walks paged or prefixed caches and
    dequantizes int8 ones where the call has them."""

    def conditions(self, problem, situation):
        from .launch import tensor_core_reasons
        return tensor_core_reasons(problem, situation)

    def own_launches(self, launch, t, views, outs, state, guard_id):
        return [launch.tensor_core_launch(t, views, outs, state, guard_id)]


class Portable(CudaKernel):
    """One thread a query row, every dtype and feature."""

    reads_rows = False

    def launches(self, launch, t, views, outs, state, guard_id):
        return [launch.portable_launch(t, views, outs, state, guard_id)]


#: every CUDA kernel, in dispatch's order of preference
KERNELS = (
    Decode("decode", "split-kv decode on tensor cores: one block a kv head's G x Sq <= 16 rows, "
           "its kv range split across the multiprocessors", dtypes=HALVES, head_dims=HEAD_DIMS,
           layouts=("BSH", "BNSD", "BSND", "BNSD_BSND"), features=(SM80,),
           switch="CUDA_TENSOR_CORES"),
    TensorCore("tensor-core", "mma.sync m16n8k16 tiles of 64 query rows x 64 keys, K / V "
               "through a cp.async pipeline", dtypes=HALVES, head_dims=HEAD_DIMS,
               features=(SM80,), switch="CUDA_TENSOR_CORES"),
    Portable("portable", "one thread a query row, every dtype and feature",
             dtypes=FLOATS + ("int8",)),
)
