"""Running a planned problem on the CPU: how its work divides (and so which of the kernels
``dispatch`` declares can take it), buffers, tile sizes, one parallel region at a time."""
import contextlib
import dataclasses
import math
from typing import Any, Optional

import numba
import numpy as np
import threading
from numba import njit, prange
from .. import config
from ..numerics.core import CODE_F16, CODE_F32, quantize_output, widen
from ..numerics.kernel_args import F_SINKS, F_SOFTCAP, kernel_args, output_scales, scale_factors
from . import _gemm
from ._blas import sgemm_address
from .amx_pack import AMX_MAX_SCALE
from .block_amx import attention_amx
from .block_f32 import attention, f32_widths, merge_split
from .block_int8 import INT8_MAX_KV_COLS, attention_int8
from .items import (work_items, kv_head_runs, prefetch_next_keys, seg_rows, stream_rows, streams,
                    sub_rows, tile_shape)
from .records import Extras, Geometry, Inputs, Outputs, Tuning
from .split_kv import partial_buffers, runs_wanted, split_work


class _ParallelRegion:
    """One parallel region at a time in this process: Numba's thread pool and BLAS's thread
    limit are process-wide, and Numba's workqueue threading layer (where neither TBB nor
    OpenMP loads) aborts the process on concurrent launches. Every ``parallel=True`` kernel
    runs inside ``with parallel_region(blas)``; a region opened inside one already held by the
    same thread joins it. With ``blas``, the BLAS libraries are held to one thread while the
    region runs (cheap, cached)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._controller = None

    def held(self):
        """Whether the calling thread is inside a region."""
        return getattr(self._depth, "n", 0) > 0

    @contextlib.contextmanager
    def __call__(self, blas=False):
        with self._lock:
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                with self._blas_limited(blas):
                    yield
            finally:
                self._depth.n -= 1

    @contextlib.contextmanager
    def _blas_limited(self, blas):
        if not blas:
            yield
            return
        if self._controller is None:
            from threadpoolctl import ThreadpoolController
            self._controller = ThreadpoolController()
        limit = self._controller.limit(limits=1, user_api="blas")
        try:
            yield
        finally:
            limit.restore_original_limits()


parallel_region = _ParallelRegion()


def work_threads():
    """The threads a call's work is divided for (config.CPU_WORK_THREADS; None: the process's
    thread pool), not the threads it runs on: split-kv's pieces, and so the order of its
    additions, are the same whatever number of threads computes them."""
    return max(1, int(config.CPU_WORK_THREADS or numba.config.NUMBA_NUM_THREADS))


def use_register_blocks():
    """The float32 tile products run on _gemm's register blocks where the host has AVX-512
    (config.CPU_AVX512_GEMM), else on BLAS."""
    return bool(config.CPU_AVX512_GEMM) and _gemm.available()


def amx_reasons(p, work):
    """Why the AMX kernel cannot take planned problem ``p`` beyond what dispatch declares of it
    (its dtypes, caches, machine feature and switch): its softmax takes a single scale factor."""
    _, scale2, post_e = scale_factors(p.scale)
    if scale2 != 1 or post_e != 0 or abs(p.scale) > AMX_MAX_SCALE:
        return [f"scale_value {p.scale!r}: the AMX softmax folds the scale into one float32 "
                "factor of at most 2^64"]
    return []


def split_kv_reasons(p, work):
    """Why planned problem ``p``'s kv ranges are not split (:func:`.split_kv.split_work`)."""
    if work.groups.shape[0]:
        return []
    threads, want = work_threads(), runs_wanted(work_threads())
    if not want:
        return ["config.CPU_SPLIT_KV_ITEMS is 0"]
    if work.unsplit_runs >= want:
        return [f"{work.unsplit_runs} runs of work keep {threads} threads busy "
                f"(config.CPU_SPLIT_KV_ITEMS = {config.CPU_SPLIT_KV_ITEMS} a thread)"]
    return ["kv ranges too short to split (pieces of at least config.CPU_SPLIT_KV_MIN_COLS = "
            f"{config.CPU_SPLIT_KV_MIN_COLS} columns)"]


def streaming_reasons(p, work):
    """Why planned problem ``p``'s work items do not stream their K / V rows."""
    if work.streams:
        return []
    rows = p.G * min(work.rows_per_head, int(p.qlen.max(initial=0)))
    return [f"{rows} query rows a kv head (its G heads' rows) > config.CPU_STREAM_ROWS = "
            f"{stream_rows()}: tiles of rows share each K / V tile"]


@dataclasses.dataclass
class Work:
    """How a planned problem's work divides on the CPU: what the kernels' conditions read and
    the launch runs."""
    rows_per_head: int               # query positions of a work item
    kv_cols: int                     # kv columns of a tile
    items: Any                       # the work items (split-kv's pieces where it splits)
    groups: Any                      # split-kv's groups of pieces to merge (none: no split)
    runs: Any                        # starts of the runs of items taken together, and the end
    unsplit_runs: int                # runs before split-kv cut them
    streams: bool                    # items of few rows stream their K / V rows


def divide(p):
    """The :class:`Work` of planned problem ``p``."""
    q_rows, kv_cols = tile_shape(p)
    if p.dtype == np.int8:
        kv_cols = min(kv_cols, INT8_MAX_KV_COLS)
    rows_per_head = max(1, q_rows // p.G)
    empty = not (p.B and math.prod(p.out_shape))
    items = np.zeros((0, 6), np.int64) if empty else work_items(p, rows_per_head)
    groups = np.zeros((0, 5), np.int64)
    # pieces and runs of several items are the float32 kernel's; runs of kv heads come
    # first (as many as split-kv wants), pieces of kv columns only where they are too few
    f32 = p.dtype != np.int8
    runs = kv_head_runs(items, p.qlen, p.G, rows_per_head, stream_rows() if f32 else 0,
                        items.shape[0] // max(1, runs_wanted(work_threads())))
    unsplit = runs.shape[0] - 1
    if f32:
        items, groups, runs = split_work(p, items, runs, rows_per_head, work_threads())
    return Work(rows_per_head, kv_cols, items, groups, runs, unsplit,
                f32 and streams(p, rows_per_head))


def prepare(p, kernel, work):
    """The :class:`Launch` of planned problem ``p`` on the declared CPU kernel named
    ``kernel`` (``dispatch.KERNELS``) over its :class:`Work`."""
    quant = p.quant
    int8_out = quant is not None and quant.out_dtype == np.int8
    # int8 output is quantized from the float16 (or float32) result in a second pass
    direct_dtype = np.float16 if (p.dtype == np.int8 or (int8_out and p.dtype != np.float32)) \
        else p.dtype
    if not work.items.shape[0]:
        return Launch(p, direct_dtype, int8_out)
    # the output arrays' shapes and strides are all the arguments take of them
    a = kernel_args(p, np.empty(p.out_shape, direct_dtype), np.empty(p.lse_shape, np.float32),
                    flags=int8_out, rows=work.rows_per_head, cols=work.kv_cols)
    tuning = _tuning(kernel, work)
    parts = partial_buffers(work.groups, p.G * work.rows_per_head,
                            f32_widths(a.params, tuning.gemm)[0])
    return Launch(p, direct_dtype, int8_out, kernel, a, tuning, work.items, work.groups,
                  work.runs, parts)


def _tuning(kernel, work):
    """The :class:`.records.Tuning` of the declared CPU kernel named ``kernel`` over ``work``."""
    amx = kernel == "amx"
    threads = max(1, int(config.CPU_THREADS or numba.get_num_threads()))
    own = use_register_blocks()
    blas = kernel == "int8" or not own          # the int8 kernel's products are BLAS
    return Tuning(threads=min(threads, work.items.shape[0] if amx else work.runs.shape[0] - 1),
                  sub=sub_rows(), seg=seg_rows(amx), gemm=int(own),
                  blas=sgemm_address() if blas else 0, stream=stream_rows(),
                  next_keys=int(prefetch_next_keys()))


@dataclasses.dataclass
class Launch:
    """A planned problem's kernel call, ready to run: every argument but the query, key and
    value storage (which :meth:`run` may take anew, of the planned geometry) and the results
    (new at each run)."""
    p: Any
    direct_dtype: Any                # the dtype the kernel writes (float16 before int8 output)
    int8_out: bool
    kernel: Optional[str] = None     # the declared kernel's name; None: no work item (zeros)
    args: Any = None                 # the KernelArgs
    tuning: Any = None               # the records.Tuning
    work: Any = None
    groups: Any = None
    runs: Any = None
    parts: Any = None                # split-kv pieces' scratch, used inside the parallel region

    @property
    def blas(self):
        """Whether the kernel's products call BLAS (held to one thread while it runs)."""
        return self.tuning is not None and self.tuning.blas != 0

    def run(self, q=None, k=None, v=None):
        """(out, lse or None): the problem over flat query / key / value storage q, k, v (the
        planned problem's where None), each laid out as the planned one (``flat_view``)."""
        p = self.p
        out = np.zeros(p.out_shape, dtype=self.direct_dtype)
        lse = np.full(p.lse_shape, -np.inf, dtype=np.float32)
        flags = np.zeros(p.lse_shape if self.int8_out else 1, dtype=np.uint8)
        with parallel_region(self.blas):
            if self.kernel is not None:
                self._call(out, lse, flags, q, k, v)
            if self.int8_out:
                out = quantize_int8_output(p, out, flags)
        return out, (lse if p.want_lse else None)

    def records(self, out, lse, flags, q=None, k=None, v=None):
        """The kernels' (ins, outs, extras, geo) records over these results and flat query /
        key / value storage (the planned problem's where None)."""
        a = self.args
        ins = Inputs(a.q if q is None else q, a.k if k is None else k, a.v if v is None else v,
                     a.kp, a.vp, a.table, a.channel, *a.tokens)
        outs = Outputs(out.reshape(-1).view(a.out.dtype), lse.reshape(-1), flags.reshape(-1))
        # the softcap and the sink logits: views of the kernel arguments' fparams slots
        return (ins, outs, Extras(a.mask8, a.mask16, a.pse, a.fparams[F_SOFTCAP:F_SOFTCAP + 1],
                                  a.fparams[F_SINKS:]),
                Geometry(a.strides, a.boff, a.lens, a.params))

    def _call(self, out, lse, flags, q, k, v):
        """The kernels, inside the caller's parallel region."""
        ins, outs, extras, geo = self.records(out, lse, flags, q, k, v)
        if self.kernel == "int8":
            attention_int8(ins, outs, extras, geo, self.tuning, self.work, self.args.fparams)
        elif self.kernel == "amx":
            attention_amx(ins, outs, extras, geo, self.tuning, self.work, self.args.fparams)
        else:
            attention(ins, outs, extras, geo, self.tuning, self.work, self.args.fparams,
                      self.parts, self.runs)
            if self.groups.shape[0]:
                merge_split(ins, outs, extras, geo, self.tuning, self.groups, self.parts)


@njit(parallel=True, cache=True)
def _quantize_rows(o, code, flags, scale2, offset2, y):
    """y[b, n, i, :] = numerics.core.quantize_output of the rows computed (flags 1); the others stay 0.
    o, y: (B, N, Sq, D) views; scale2/offset2: float16-rounded, 1 or N*D values."""
    B, N, S, D = o.shape
    per_channel = scale2.size > 1
    for b in prange(B):
        for n in range(N):
            for i in range(S):
                if flags[b, n, i, 0] == 0:
                    continue
                for d in range(D):
                    c = n * D + d if per_channel else 0
                    y[b, n, i, d] = np.int8(quantize_output(widen(o[b, n, i, d], code),
                                                            scale2[c], offset2[c]))


def quantize_int8_output(p, o, flags):
    """contract 'Quantization' output quantization of the float result ``o`` (float16 or float32, in
    the output layout) into a new int8 array; rows that are structural zeros (flags 0) stay 0.
    A parallel kernel: call it inside :data:`parallel_region`."""
    s2, o2 = output_scales(p.quant)
    code = CODE_F16 if o.dtype == np.float16 else CODE_F32
    y = np.zeros(p.out_shape, dtype=np.int8)
    _quantize_rows(p.out_view(o).view(np.uint16 if code == CODE_F16 else np.float32), code,
                   flags, s2, o2, p.out_view(y))
    return y
