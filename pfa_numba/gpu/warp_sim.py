"""The warp-level instructions of :mod:`.ptx` as Python, for the CUDA simulator.

The simulator (``NUMBA_ENABLE_CUDASIM=1``) runs each thread of a block as a Python thread and
knows shared memory and ``syncthreads`` but neither inline PTX nor warp shuffles. Here every
instruction the tensor-core kernel takes from :mod:`.ptx` has a form the simulator can run, so
the kernel's own source (its index arithmetic, its barriers, its masking) runs on a machine
without a GPU. :mod:`.ptx` binds these names in place of its intrinsics under the simulator.

A warp-collective instruction (``mma.sync``, ``ldmatrix``, ``shfl.sync``) is an exchange: each
lane of the calling warp leaves its operands and waits for the other lanes; the last to arrive
computes the warp's result, and each lane takes its registers from it. The results are those of
the NumPy warp model, the kernel's specification (:func:`.warp_model.mma`, ``ldmatrix_x4``,
``pack``: the PTX ISA's lane maps of :mod:`.fragments`). ``cp.async`` copies at once (its
commit and wait do nothing): a kernel that reads a tile before its barrier is not caught here,
one that overwrites a tile other warps still read can be.
"""
import threading

import numpy as np

from ..numerics.core import max_nan
from . import fragments as F
from . import warp_model as M

#: how long a lane waits for the rest of its warp before the simulation is declared stuck
WAIT_S = 120.0

_LOCK = threading.Lock()
_TINY = np.finfo(np.float32).tiny        # the smallest normal float32


class _Exchange:
    """The slots, the combined result and the barrier of one warp-collective step."""

    def __init__(self, lanes):
        self.slots = [None] * lanes
        self.combine = self.result = None
        self.barrier = threading.Barrier(lanes, action=self._combine, timeout=WAIT_S)

    def _combine(self):
        self.result = self.combine(self.slots)


def _exchanges_of(thread):
    """(the two alternating exchanges of the warp of ``thread``, its lane), kept on the
    simulator's manager of the thread's block, with as many lanes as the block gives that
    warp."""
    warp_index, lane = divmod(thread.thread_id, F.WARP)
    block = thread._manager
    with _LOCK:
        warps = block.__dict__.setdefault("warp_sim_exchanges", {})
        if warp_index not in warps:
            lanes = min(F.WARP, int(np.prod(block._block_dim)) - warp_index * F.WARP)
            warps[warp_index] = (_Exchange(lanes), _Exchange(lanes))
    return warps[warp_index], lane


def _collective(value, combine):
    """(``combine`` of every lane's ``value`` in lane order, computed once for the warp, this
    lane) for the calling thread's warp. Consecutive steps alternate between two exchanges: a
    lane can refill one only after every lane has passed the step between, so has read it."""
    thread = threading.current_thread()
    pair, lane = _exchanges_of(thread)
    step = getattr(thread, "warp_sim_steps", 0)
    thread.warp_sim_steps = step + 1
    ex = pair[step & 1]
    ex.slots[lane] = value
    ex.combine = combine
    ex.barrier.wait()              # the last lane to arrive combines
    return ex.result, lane


def _mma(dtype, name):
    def product(slots):
        a, b, c = (np.array([lane[x] for lane in slots]) for x in range(3))
        return M.mma(a.astype(np.uint32), b.astype(np.uint32), c.astype(np.float32), dtype)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        d, lane = _collective(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), product)
        return tuple(d[lane])

    mma.__name__ = f"mma_m16n8k16_{name}"
    mma.__doc__ = f"mma.sync m16n8k16 ({name}) as the simulator runs it: warp_model.mma."
    return mma


mma_m16n8k16_f16 = _mma(M.DTYPES[0], "f16")
mma_m16n8k16_bf16 = _mma(M.DTYPES[1], "bf16")


def _ldmatrix(trans):
    def load(slots):
        return M.ldmatrix_x4(slots[0][0], [off for _, off in slots], trans)

    def ldmatrix(smem, off):
        regs, lane = _collective((smem, int(off)), load)
        return tuple(regs[lane])

    ldmatrix.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
    ldmatrix.__doc__ = "ldmatrix .x4 as the simulator runs it: warp_model.ldmatrix_x4."
    return ldmatrix


ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4_trans = _ldmatrix(True)


def pack_f16x2(lo, hi):
    """cvt.rn.f16x2.f32: warp_model.pack."""
    return M.pack(lo, hi, M.DTYPES[0])[()]


def pack_bf16x2(lo, hi):
    """cvt.rn.bf16x2.f32: warp_model.pack."""
    return M.pack(lo, hi, M.DTYPES[1])[()]


def cvt_f32_f16(h):
    """cvt.f32.f16 of the low 16 bits of ``h``."""
    return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))


def cp_async_16_zfill(dst, dst_off, src, src_off, src_bytes):
    """cp.async of 16 bytes, done at once: the first ``src_bytes`` from ``src``, zeros after
    (bytes as they lie: 16 int8 values land in 8 uint16 words)."""
    n = int(src_bytes) // src.dtype.itemsize
    data = np.zeros(16 // src.dtype.itemsize, src.dtype)
    for e in range(n):
        data[e] = src[src_off + e]
    for e, word in enumerate(data.view(dst.dtype)):
        dst[dst_off + e] = word


def cp_async_16(dst, dst_off, src, src_off):
    """cp.async of 16 bytes, done at once."""
    cp_async_16_zfill(dst, dst_off, src, src_off, 16)


def cp_async_commit():
    """Nothing to close: every copy is done."""


def cp_async_wait(n):
    """Nothing to wait for: every copy is done."""


def st_shared_u32(smem, off, value):
    """st.shared.b32: the low half at ``off``, the high half at ``off + 1``."""
    smem[off], smem[off + 1] = int(value) & 0xFFFF, int(value) >> 16


def copy_16_shared_to_global(dst, dst_off, smem, smem_off):
    """ld.shared.v4 + st.global.v4: 8 values of 16 bits."""
    for e in range(8):
        dst[dst_off + e] = smem[smem_off + e]


def syncwarp():
    """bar.warp.sync: every lane of the warp arrives before any goes on."""
    _collective(None, lambda slots: None)


def exp2_approx(x):
    """2 ** x in float32."""
    return np.float32(np.exp2(np.float32(x)))


def exp2_approx_ftz(x):
    """2 ** x in float32, subnormal inputs and results flushed to 0."""
    x = np.float32(x)
    y = np.exp2(np.float32(0.0) if abs(x) < _TINY else x)
    return np.float32(0.0) if abs(y) < _TINY else y


def rcp_approx_ftz(x):
    """1 / x in float32, subnormal inputs and results flushed to 0 (to signed zero and inf)."""
    x = np.float32(x)
    if abs(x) < _TINY:
        x = np.copysign(np.float32(0.0), x)
    with np.errstate(divide="ignore"):
        y = np.float32(1.0) / x
    return np.copysign(np.float32(0.0), y) if abs(y) < _TINY else y


def fma_f32(a, b, c):
    """fma.rn.f32: the float32 product is exact in float64, then one rounding of the sum
    (a second rounding only in ties far below what the tests resolve)."""
    wide = np.float64(np.float32(a)) * np.float64(np.float32(b)) + np.float64(np.float32(c))
    return np.float32(wide)


def load_u16_if(arr, off, pred):
    """ld.global.nc.u16 where ``pred``, else 0 (the element is then not read)."""
    return np.uint32(arr[off]) if pred else np.uint32(0)


load_u8_if = load_u16_if


def max_nan_f32(a, b):
    """max.NaN.f32: numerics.core.max_nan."""
    return max_nan(a, b)


def shfl_xor_sync(mask, value, lane_mask):
    """The ``value`` of lane (this lane ^ ``lane_mask``) of the warp."""
    values, lane = _collective(value, list)
    return values[lane ^ lane_mask]
