"""The CPU's kernel variants, in dispatch's order of preference: what each takes, which
fallbacks can change what runs, and its launch (the steps of :class:`.driver.Steps` it takes,
each one kernel's own compiled worker, run only when some work item needs it).

Imported by :mod:`pfa_numba.dispatch`; it loads no compiler until a kernel is prepared."""
import numpy as np

from .. import config
from ..variant import FLOATS, HALVES, Kernel

#: the CPU feature the register-block products need
AVX512 = "AVX-512"


class CpuKernel(Kernel):
    """A CPU kernel variant: prepared as a :class:`.driver.Launch` over the problem's
    :class:`.driver.Work` (its situation)."""
    device = "cpu"

    def prepare(self, problem, situation, staged=None):
        from . import driver
        return driver.prepare(problem, self, situation)

    def uses_blas(self, launch):
        """Whether a step of the launch calls BLAS (held to one thread while it runs)."""
        from .driver import use_register_blocks
        return not use_register_blocks()

    def launch(self, steps):
        """Run the launch's steps (:class:`.driver.Steps`)."""
        raise NotImplementedError

    def fallbacks(self, problem, work):
        if problem.quant is not None and problem.quant.out_dtype == np.int8:
            return ["the quantize-output kernel rounds the result to int8 (contract "
                    "'Quantization')"]
        return []


class FloatTiles(CpuKernel):
    """The float32 tiles (register blocks or BLAS by the host), with the streaming kernel for
    runs of items few enough rows to stream (a call's last block of rows, a short batch)."""

    def launch(self, steps):
        runs, streaming = steps.work.runs, steps.work.streaming_runs
        if (~streaming).any():
            steps.tiles(runs[~streaming])
        if streaming.any():
            steps.streaming(runs[streaming])

    def fallbacks(self, problem, work):
        n = int(work.streaming_runs.sum())
        if not n:
            return super().fallbacks(problem, work)
        return [f"{n} of its {work.runs.shape[0]} runs of work items have at most "
                f"config.CPU_STREAM_ROWS = {config.CPU_STREAM_ROWS} rows: the streaming kernel "
                "runs them"] + super().fallbacks(problem, work)


class SplitKv(FloatTiles):
    """The float32 tiles (and streaming) over pieces of the kv range, then the merge."""

    def conditions(self, problem, work):
        from .driver import split_kv_reasons
        return split_kv_reasons(problem, work)

    def launch(self, steps):
        super().launch(steps)
        steps.merge()

    def fallbacks(self, problem, work):
        tiles = "avx512-tiles" if _register_blocks() else "blas-tiles"
        n, pieces = int(work.streaming_runs.sum()), work.runs.shape[0]
        return [f"its {pieces} pieces run on the streaming kernel" if n == pieces else
                f"its pieces run on {tiles}" + (f" ({n} of {pieces} on the streaming kernel)"
                                               if n else ""),
                f"the merge kernel combines the pieces of {work.groups.shape[0]} items"] + \
            CpuKernel.fallbacks(self, problem, work)


class Streaming(CpuKernel):
    """Every run of items on the streaming kernel."""

    def conditions(self, problem, work):
        from .driver import streaming_reasons
        return streaming_reasons(problem, work)

    def uses_blas(self, launch):
        return False

    def launch(self, steps):
        steps.streaming(steps.work.runs)


class Amx(CpuKernel):
    """Every item on AMX, and those AMX could get wrong on the float32 tiles afterwards."""

    def conditions(self, problem, work):
        from .driver import amx_reasons
        return amx_reasons(problem, work)

    def launch(self, steps):
        left = steps.amx(steps.work.runs)
        if left.shape[0]:
            steps.tiles(left)

    def fallbacks(self, problem, work):
        tiles = "avx512-tiles" if _register_blocks() else "blas-tiles"
        return [f"an item whose inputs AMX could get wrong (values it would flush: subnormal "
                f"or tiny, or non-finite float16) runs on {tiles} instead"] + \
            super().fallbacks(problem, work)


class Int8(CpuKernel):
    """Every item on the int8 kernel (its products on BLAS)."""

    def uses_blas(self, launch):
        return True

    def launch(self, steps):
        steps.int8(steps.work.runs)


class Backward(CpuKernel):
    """The SDPA drop-in's gradients: a kv pass (dK, dV) and a query pass (dQ), each tile's P
    and dS formed again from the forward's lse (:mod:`.backward`)."""
    operation = "backward"
    #: the kv pass takes whole (batch, kv head)s and adds dQ too (no query pass)
    whole_heads = False

    def conditions(self, problem, work):
        from .backward import unsupported
        return unsupported(problem)

    def gradients(self, p, out, dout, lse, want_dbias):
        """(dq, dk, dv, dbias or None, dsinks or None) of planned problem ``p``
        (:func:`.backward.attention_gradients`); the ``pfa_numba.cpu`` log says it ran."""
        from .backward import attention_gradients
        results = attention_gradients(p, out, dout, lse, want_dbias, self.whole_heads)
        from .driver import log
        log.info("cpu %s ran float32 gradients: %s", self.name,
                 "kv pass with dQ" if self.whole_heads else "kv pass; query pass")
        return results


class BackwardHeads(Backward):
    """One pass, an item a (batch, kv head) owning its dK, dV and its query heads' dQ rows."""
    whole_heads = True

    def conditions(self, problem, work):
        from .backward import owns_whole_heads
        reasons = super().conditions(problem, work)
        if not reasons and not owns_whole_heads(problem):
            import numba
            reasons.append(f"{problem.B * problem.Nkv} (batch, kv head)s, fewer than the "
                           f"{numba.get_num_threads()} threads: each would own dQ rows alone")
        return reasons


def _register_blocks():
    from .driver import use_register_blocks
    return use_register_blocks()


#: every CPU kernel, in dispatch's order of preference (the forward's, then the backward's)
KERNELS = (
    Int8("int8", "int8 query, key and value: int8 products on BLAS, the softmax quantized "
         "against its row max", dtypes=("int8",), caches=(), extensions=(),
         own_value_head_dim=True),
    SplitKv("split-kv", "the float32 tiles over pieces of the kv range, run side by side and "
            "merged by the online-softmax rule: calls with fewer runs of work than threads",
            dtypes=FLOATS, own_value_head_dim=True),
    Streaming("streaming", "items of few query rows (decode: a kv head's G heads at one "
              "position) read each K / V row once, as it streams", dtypes=FLOATS,
              own_value_head_dim=True),
    Amx("amx", "float16 / bfloat16 tile products on AMX tiles", dtypes=HALVES,
        caches=("paged", "prefix"), features=("AMX",), switch="CPU_AMX"),
    FloatTiles("avx512-tiles", "tiles of query rows x kv columns, every float storage widened "
               "to float32, the products on AVX-512 register blocks", dtypes=FLOATS,
               features=(AVX512,), switch="CPU_AVX512_GEMM", own_value_head_dim=True),
    FloatTiles("blas-tiles", "tiles of query rows x kv columns, every float storage widened to "
               "float32, the products on BLAS sgemm", dtypes=FLOATS, own_value_head_dim=True),
    BackwardHeads("backward-heads", "gradients in one pass over whole (batch, kv head)s, dQ "
                  "added by each; products on BLAS sgemm", dtypes=FLOATS, layouts=("BNSD",),
                  caches=(), own_value_head_dim=True),
    Backward("backward-tiles", "gradients in a kv pass (dK, dV) and a query pass (dQ) over "
             "(query tile, kv tile) pairs; products on BLAS sgemm", dtypes=FLOATS,
             layouts=("BNSD",), caches=(), own_value_head_dim=True),
)
