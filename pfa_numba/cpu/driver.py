"""Running a planned problem on the CPU: how its work divides (which the kernels' conditions
read), and the launch of the chosen kernel: its steps (a kernel's worker over some of the runs
of work items, :mod:`.launch`), their buffers and tile sizes, one parallel region at a time,
and a log record of what ran."""
import contextlib
import dataclasses
import logging
import math
import threading
from typing import Any, Optional

import numba
import numpy as np

from .. import config
from ..numerics.core import CODE_F16, CODE_F32
from ..numerics.dtypes import dtype_name
from ..numerics.kernel_args import (F_SINKS, F_SOFTCAP, kernel_args, output_scales,
                                    scale_factors, storage)
from . import _gemm
from ._amx import padded
from ._blas import sgemm_address
from .amx_pack import AMX_MAX_SCALE
from .block_int8 import INT8_MAX_KV_COLS
from .items import (item_row_counts, kv_head_runs, prefetch_next_keys, seg_rows, stream_rows,
                    streams, sub_rows, tile_shape, work_items)
from ..cache import Compiling
from .launch import Worker, rows
from .records import (AmxScratch, Extras, F32Scratch, Geometry, Inputs, Int8Scratch, Items,
                      MergeScratch, Outputs, StreamScratch, Tuning)
from .split_kv import partial_buffers, runs_wanted, split_work
from .threads import start_pool, threads_for

log = logging.getLogger("pfa_numba.cpu")


class _ParallelRegion:
    """One parallel region at a time in this process: Numba's thread pool and BLAS's thread
    limit are process-wide, and Numba's workqueue threading layer (where neither TBB nor
    OpenMP loads) aborts the process on concurrent launches. Every parallel kernel runs inside
    ``with parallel_region(blas)``; a region opened inside one already held by the same thread
    joins it. With ``blas``, the BLAS libraries are held to one thread while the region runs
    (cheap, cached)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._controller = None

    def held(self):
        """Whether the calling thread is inside a region."""
        return getattr(self._depth, "n", 0) > 0

    @contextlib.contextmanager
    def __call__(self, blas=False):
        start_pool()
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
            # the controller limits the libraries loaded when it is made: SciPy's BLAS, which
            # the kernels call, first
            from threadpoolctl import ThreadpoolController
            sgemm_address()
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
    """Why planned problem ``p``'s work items do not all stream their K / V rows."""
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
    runs: Any                        # (n, 2) [start, end) runs of items taken together
    unsplit_runs: int                # runs before split-kv cut them
    streams: bool                    # every item has few enough rows to stream its K / V rows
    streaming_runs: Any              # of each run, whether its items stream (float kernels)


def divide(p):
    """The :class:`Work` of planned problem ``p``."""
    q_rows, kv_cols = tile_shape(p)
    if p.dtype == np.int8:
        kv_cols = min(kv_cols, INT8_MAX_KV_COLS)
    rows_per_head = max(1, q_rows // p.G)
    empty = not (p.B and math.prod(p.out_shape))
    items = np.zeros((0, 6), np.int64) if empty else work_items(p, rows_per_head)
    groups = np.zeros((0, 5), np.int64)
    # pieces and runs of several items are the float kernels'; runs of kv heads come first
    # (as many as split-kv wants), pieces of kv columns only where they are too few
    f32 = p.dtype != np.int8
    runs = kv_head_runs(items, p.qlen, p.G, rows_per_head, stream_rows() if f32 else 0,
                        items.shape[0] // max(1, runs_wanted(work_threads())))
    unsplit = runs.shape[0]
    if f32:
        items, groups, runs = split_work(p, items, runs, rows_per_head, work_threads())
    streaming = np.zeros(runs.shape[0], bool)
    if f32 and runs.shape[0]:
        streaming = item_row_counts(items[runs[:, 0]], p.qlen, p.G, rows_per_head) \
            <= stream_rows()
    return Work(rows_per_head, kv_cols, items, groups, runs, unsplit,
                f32 and streams(p, rows_per_head), streaming)


#: every CPU kernel's worker, by its module and function (imported at the first use)
_WORKERS = {"avx512-tiles": (".float_tiles", "avx512_tiles"),
            "blas-tiles": (".float_tiles", "blas_tiles"),
            "streaming": (".streaming", "streaming"),
            "merge": (".tile", "merge"),
            "amx": (".block_amx", "amx"),
            "int8": (".block_int8", "int8"),
            "quantize-output": (".quantize", "quantize")}
_worker_objects = {}


def worker(name):
    """The :class:`.launch.Worker` of the CPU kernel step ``name`` (:data:`_WORKERS`)."""
    if name not in _worker_objects:
        import importlib
        module, function = _WORKERS[name]
        _worker_objects[name] = Worker(getattr(importlib.import_module(module, __package__),
                                               function))
    return _worker_objects[name]


def prepare(p, kernel, work):
    """The :class:`Launch` of planned problem ``p`` on ``kernel`` (a CPU kernel of
    ``dispatch.KERNELS``) over its :class:`Work`."""
    quant = p.quant
    int8_out = quant is not None and quant.out_dtype == np.int8
    # int8 output is quantized from the float16 (or float32) result in a second pass
    direct_dtype = np.float16 if (p.dtype == np.int8 or (int8_out and p.dtype != np.float32)) \
        else p.dtype
    if not work.items.shape[0]:
        return Launch(p, None, direct_dtype, int8_out)
    # the output arrays' shapes and strides are all the arguments take of them
    a = kernel_args(p, np.empty(p.out_shape, direct_dtype), np.empty(p.lse_shape, np.float32),
                    flags=int8_out, rows=work.rows_per_head, cols=work.kv_cols)
    return Launch(p, kernel, direct_dtype, int8_out, a, work)


@dataclasses.dataclass
class Launch:
    """A planned problem's run on a CPU kernel, ready to run: every argument but the query,
    key and value storage (which :meth:`run` may take anew, of the planned geometry) and the
    results (new at each run). The kernel's ``launch`` takes its :class:`Steps`; what ran is
    kept in :attr:`ran` and recorded by the ``pfa_numba.cpu`` log."""
    p: Any
    kernel: Any                      # the dispatch kernel; None: no work item (zeros)
    direct_dtype: Any                # the dtype the kernel writes (float16 before int8 output)
    int8_out: bool
    args: Any = None                 # the KernelArgs
    work: Optional[Work] = None
    ran: list = dataclasses.field(default_factory=list)

    def run(self, q=None, k=None, v=None):
        """(out, lse or None): the problem over flat query / key / value storage q, k, v (the
        planned problem's where None), each laid out as the planned one (``flat_view``)."""
        p = self.p
        out = np.zeros(p.out_shape, dtype=self.direct_dtype)
        lse = np.full(p.lse_shape, -np.inf, dtype=np.float32)
        flags = np.zeros(p.lse_shape if self.int8_out else 1, dtype=np.uint8)
        steps = None
        with parallel_region(self.kernel is not None and self.kernel.uses_blas(self)):
            if self.kernel is not None:
                steps = Steps(self, self.records(out, lse, flags, q, k, v))
                self.kernel.launch(steps)
            if self.int8_out:
                out = quantize_output(p, out, flags)
        self.ran = steps.ran if steps is not None else []
        if self.ran:
            log.info("cpu %s ran %s: %s", self.kernel.name, self.storage(),
                     "; ".join(f"{name} ({n} {'run' if n == 1 else 'runs'})"
                               for name, n in self.ran))
        return out, (lse if p.want_lse else None)

    def compile(self):
        """Compile (or load from Numba's cache) the kernels this launch runs, without running
        them (a kernel that runs only where a step finds a work item it must take, like AMX's
        float32 tiles, is not compiled)."""
        p = self.p
        out, lse = np.zeros(p.out_shape, self.direct_dtype), np.zeros(p.lse_shape, np.float32)
        flags = np.zeros(p.lse_shape if self.int8_out else 1, dtype=np.uint8)
        if self.kernel is not None:
            self.kernel.launch(Steps(self, self.records(out, lse, flags), compile_only=True))
        if self.int8_out:
            quantize_output(p, out, flags, compile_only=True)

    def records(self, out, lse, flags, q=None, k=None, v=None):
        """The kernels' (ins, outs, extras, geo) records over these results and flat query /
        key / value storage (the planned problem's where None)."""
        a = self.args
        ins = Inputs(a.q if q is None else q, a.k if k is None else k, a.v if v is None else v,
                     a.kp, a.vp, _readonly(a.table), _readonly(a.channel), *a.tokens)
        outs = Outputs(out.reshape(-1).view(a.out.dtype), lse.reshape(-1), flags.reshape(-1))
        # the softcap and the sink logits: views of the kernel arguments' fparams slots
        fparams = _readonly(a.fparams)
        return (ins, outs, Extras(a.mask8, a.mask16, a.pse, fparams[F_SOFTCAP:F_SOFTCAP + 1],
                                  fparams[F_SINKS:]),
                Geometry(_readonly(a.strides), _readonly(a.boff), _readonly(a.lens),
                         _readonly(a.params), fparams))

    def storage(self):
        """The call's storage, in words (what its kernels are compiled for)."""
        p = self.p
        q, kv = dtype_name(p.dtype), dtype_name(p.k.dtype)
        return f"{q} query, key and value" if q == kv else f"{q} query, {kv} key and value"


class Steps:
    """What a kernel's launch takes in one run: each step runs one CPU kernel's worker over
    some runs of the work items (:meth:`tiles`, :meth:`streaming`, :meth:`merge`,
    :meth:`amx`, :meth:`int8`) and notes it in :attr:`ran` ((kernel name, runs taken))."""

    def __init__(self, launch, records, compile_only=False):
        self.launch, self.p, self.work = launch, launch.p, launch.work
        self.compile_only = compile_only
        self.records = records
        self.register = use_register_blocks()
        # the sums' (and V tiles') row length of the float32 tiles, streaming and the merge
        # alike (split-kv's pieces are any of theirs): value's head dim
        self.ld = _gemm.vector_width.py_func(self.p.Dv) if self.register else self.p.Dv
        self.parts = partial_buffers(self.work.groups, self.p.G * self.work.rows_per_head,
                                     self.ld)
        self.ran = []

    def tiles(self, runs):
        """The float32 tiles over ``runs`` (rows of the work's runs): on the AVX-512 register
        blocks where the host has them, else on BLAS."""
        name = "avx512-tiles" if self.register else "blas-tiles"
        tuning = self._tuning(seg_rows(False))
        threads = threads_for(len(runs))
        self._run(name, threads, tuning, self._items(self.work.items, runs),
                  f32_scratch(threads, self.p, tuning))

    def streaming(self, runs):
        """The streaming kernel over ``runs``."""
        tuning = self._tuning(seg_rows(False))
        threads = threads_for(len(runs))
        longest = int((runs[:, 1] - runs[:, 0]).max(initial=1))
        self._run("streaming", threads, tuning, self._items(self.work.items, runs),
                  stream_scratch(threads, self.p, tuning, longest))

    def merge(self):
        """split-kv's merge of the pieces of every split item."""
        groups = self.work.groups
        tuning = self._tuning(seg_rows(False))
        threads = threads_for(groups.shape[0])
        n = self.p.G * self.work.rows_per_head
        scratch = MergeScratch(rows(threads, (n * tuning.ld,), np.float32),
                               *(rows(threads, (n,), np.float32) for _ in range(3)),
                               rows(threads, (_row_width(self.p),), np.float32))
        self._run("merge", threads, tuning, self._items(groups, np.zeros((groups.shape[0], 2),
                                                                         np.int64)), scratch)

    def amx(self, runs):
        """The AMX kernel over ``runs``; returns the runs of the items it left to the float32
        tiles."""
        tuning = self._tuning(seg_rows(True))
        threads = threads_for(len(runs))
        items = self._items(self.work.items, runs)
        self._run("amx", threads, tuning, items, amx_scratch(threads, self.p, tuning))
        left = np.flatnonzero(items.flags).astype(np.int64)
        return np.stack([left, left + 1], axis=1)

    def int8(self, runs):
        """The int8 kernel over ``runs``."""
        tuning = self._tuning(seg_rows(False))
        threads = threads_for(len(runs))
        self._run("int8", threads, tuning, self._items(self.work.items, runs),
                  int8_scratch(threads, self.p, tuning))

    def _run(self, name, threads, tuning, items, scratch):
        worker(name).run(threads, (*self.records, tuning, items, scratch, self.parts),
                         Compiling("CPU", name, self.launch.storage(), self.p.layout),
                         self.compile_only)
        self.ran.append((name, int(max(items.runs.shape[0], 1) if name != "merge"
                                   else items.work.shape[0])))

    def _items(self, work, runs):
        return Items(work, np.ascontiguousarray(runs, np.int64), np.zeros(1, np.int64),
                     np.zeros(max(work.shape[0], 1), np.uint8))

    def _tuning(self, seg):
        """A step's :class:`.records.Tuning`: register-block products read and write up to
        MR - 1 rows past a segment's last and whole K^T panels; BLAS and the other products
        touch exactly the data."""
        p, work = self.p, self.work
        rows_, cols = p.G * work.rows_per_head, work.kv_cols
        if self.register:
            rows_, cols = rows_ + _gemm.MR, _gemm.panels.py_func(cols) * _gemm.PANEL
        return Tuning(sub_rows(), seg, self.ld, rows_, cols, sgemm_address(), stream_rows(),
                      int(prefetch_next_keys()))


def quantize_output(p, out, flags, compile_only=False):
    """contract 'Quantization' output quantization of the float result ``out`` (float16 or
    float32, in the output layout) into a new int8 array; rows that are structural zeros
    (flags 0) stay 0. Inside the caller's parallel region (``compile_only``: see
    :meth:`.launch.Worker.run`)."""
    s2, o2 = output_scales(p.quant)
    code = CODE_F16 if out.dtype == np.float16 else CODE_F32
    y = np.zeros(p.out_shape, dtype=np.int8)
    o = p.out_view(out).view(np.uint16 if code == CODE_F16 else np.float32)
    worker("quantize-output").run(
        threads_for(p.B), (o, flags, s2, o2, p.out_view(y), np.zeros(1, np.int64), np.int64(code)),
        Compiling("CPU", "quantize-output", "int8 output", p.layout), compile_only)
    return y


def f32_scratch(threads, p, tuning):
    """The float32 tiles' :class:`.records.F32Scratch` of ``threads`` threads."""
    D, ld, n, cols = max(p.D, 1), tuning.ld, tuning.rows, tuning.cols
    f32 = np.float32
    return F32Scratch(rows(threads, (n * D,), f32, zero=True),    # rows past an item's: finite
                      rows(threads, (n * cols,), f32),
                      rows(threads, (16 * _row_width(p),), f32),
                      rows(threads, (n * ld,), f32), rows(threads, (cols * D,), f32),
                      rows(threads, (cols * ld,), f32), rows(threads, (n,), np.int32),
                      rows(threads, (4, cols), np.int64), rows(threads, (4, cols), f32),
                      *(rows(threads, (n,), f32) for _ in range(3)), *_blas_scratch(threads),
                      rows(threads, (1, 2, 1), np.uint16))


def _row_width(p):
    """The length of a scratch row that holds a query, key or value row."""
    return max(p.D, p.Dv, 1)


def stream_scratch(threads, p, tuning, longest):
    """The streaming kernel's :class:`.records.StreamScratch` of ``threads`` threads, each
    head's part of at most tuning.stream rows, for runs of ``longest`` heads."""
    D, ld, cols = max(p.D, 1), tuning.ld, tuning.cols
    n = longest * max(1, min(tuning.stream, p.G * max(1, tuning.rows // max(p.G, 1))))
    f32, kv = np.float32, storage(p.k.dtype)
    return StreamScratch(rows(threads, (n * D,), f32), rows(threads, (n * ld,), f32),
                         *(rows(threads, (n,), f32) for _ in range(3)),
                         rows(threads, (4, n), f32), rows(threads, (n * cols,), f32),
                         rows(threads, (16 * _row_width(p),), f32),
                         rows(threads, (cols * D,), kv), rows(threads, (cols * max(p.Dv, 1),), kv),
                         rows(threads, (n,), np.int32),
                         rows(threads, (4, cols), np.int64), rows(threads, (4, cols), f32),
                         rows(threads, (1, 2, 1), np.uint16))


def amx_scratch(threads, p, tuning):
    """The AMX kernel's :class:`.records.AmxScratch` of ``threads`` threads."""
    from ._amx import tile_config
    Rp, Cp, Dp = padded(tuning.rows), padded(tuning.cols), padded(max(p.D, 1))
    parts = 2 if p.code == CODE_F16 else 1      # float16: bf16 hi and lo parts
    cfg = rows(threads, (64,), np.uint8)
    cfg[:] = tile_config()
    return AmxScratch(cfg, rows(threads, (parts * Rp * Dp,), np.uint16),
                      rows(threads, (parts * Cp * Dp,), np.uint16),
                      rows(threads, (parts * Cp * Dp,), np.uint16),
                      rows(threads, (16 * Dp,), np.uint32), rows(threads, (Rp * Cp,), np.float32),
                      rows(threads, (2 * Rp * Cp,), np.uint16),
                      rows(threads, (Rp * Dp,), np.float32),
                      rows(threads, (3, tuning.cols), np.int64),
                      rows(threads, (4, tuning.cols), np.float32),
                      rows(threads, (16 * max(p.D, 1),), np.float32),
                      *(rows(threads, (tuning.rows,), np.float32) for _ in range(3)),
                      rows(threads, (1,), np.int32))


def int8_scratch(threads, p, tuning):
    """The int8 kernel's :class:`.records.Int8Scratch` of ``threads`` threads."""
    D, W, n, cols = max(p.D, 1), _row_width(p), tuning.rows, tuning.cols
    f32 = np.float32
    return Int8Scratch(rows(threads, (n * D,), f32), rows(threads, (n * cols,), f32),
                       rows(threads, (max(n, 1) * W,), f32), rows(threads, (n * W,), np.float64),
                       rows(threads, (cols * D,), f32), rows(threads, (cols * W,), f32),
                       rows(threads, (n,), f32), rows(threads, (n,), f32),
                       *_blas_scratch(threads))


def _blas_scratch(threads):
    """BLAS's per-thread arguments (:func:`._blas.gemm_rm`): six ints, two floats, 'N' 'T'."""
    chars = rows(threads, (2,), np.uint8)
    chars[:, :2] = (ord("N"), ord("T"))
    return rows(threads, (6,), np.int32), rows(threads, (2,), np.float32), chars


def _readonly(x):
    """x as a read-only view (the kernels take their inputs as read-only arrays, one
    specialisation whichever the caller's were)."""
    if not x.flags.writeable:
        return x
    x = x.view()
    x.flags.writeable = False
    return x
