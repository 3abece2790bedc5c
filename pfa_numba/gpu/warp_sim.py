"""The warp-level instructions of :mod:`.ptx` as Python, for the CUDA simulator.

The simulator (``NUMBA_ENABLE_CUDASIM=1``) runs each thread of a block as a Python thread and
knows shared memory and ``syncthreads`` but neither inline PTX nor warp shuffles. Here every
instruction the tensor-core kernel takes from :mod:`.ptx` has a form the simulator can run, so
the kernel's own source (its index arithmetic, its barriers, its masking) runs on a machine
without a GPU. :mod:`.ptx` binds these names in place of its intrinsics under the simulator.

A warp-collective instruction (``mma.sync``, ``ldmatrix``, ``shfl.sync``) is an exchange: each
lane of the calling warp leaves its operands and waits for the other lanes; the last to arrive
computes the warp's result through the lane maps of :mod:`.fragments` (the PTX ISA's layouts),
and each lane takes its registers from it. The products are exact in float64 and rounded once
to float32. ``cp.async`` copies at once (its
commit and wait do nothing): a kernel that reads a tile before its barrier is not caught here,
one that overwrites a tile other warps still read can be.
"""
import threading

import ml_dtypes
import numpy as np

from . import fragments as F

#: how long a lane waits for the rest of its warp before the simulation is declared stuck
WAIT_S = 120.0

_WARPS = {}
_WARPS_LOCK = threading.Lock()


class _Exchange:
    """The slots, the combined result and the barrier of one warp-collective step."""

    def __init__(self, lanes):
        self.slots = [None] * lanes
        self.combine = self.result = None
        self.barrier = threading.Barrier(lanes, action=self._combine, timeout=WAIT_S)

    def _combine(self):
        self.result = self.combine(self.slots)


def _exchanges_of(thread):
    """(the two alternating exchanges of the warp of ``thread``, its lane): warps are keyed by
    block and warp index, with as many lanes as the block gives that warp."""
    warp_index, lane = divmod(thread.thread_id, F.WARP)
    key = (id(thread._manager), warp_index)
    with _WARPS_LOCK:
        pair = _WARPS.get(key)
        if pair is None:
            block_threads = int(np.prod(thread._manager._block_dim))
            lanes = min(F.WARP, block_threads - warp_index * F.WARP)
            pair = _WARPS[key] = (_Exchange(lanes), _Exchange(lanes))
    return pair, lane


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


def _values(bits, kind):
    """float64 of 16-bit ``kind`` ("f16" / "bf16") bit patterns."""
    bits = np.asarray(bits, np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _scatter(regs, rows, cols, step, shape):
    """The 16-bit matrix of ``shape`` the (lane, register) values ``regs`` hold: the low half
    at (rows, cols), the high half one ``step`` (row, column) further."""
    m = np.zeros(shape, np.uint16)
    regs = np.asarray(regs, np.uint32)
    m[rows, cols] = regs & 0xFFFF
    m[rows + step[0], cols + step[1]] = regs >> 16
    return m


_A = F.lane_table(F.mma_a, F.A_REGS)
_B = F.lane_table(F.mma_b, F.B_REGS)
_C = F.lane_table(F.mma_c, F.C_REGS)


def _mma(kind):
    def product(slots):
        a = _scatter([s[0] for s in slots], *_A, (0, 1), (F.MMA_M, F.MMA_K))
        b = _scatter([s[1] for s in slots], *_B, (1, 0), (F.MMA_K, F.MMA_N))
        c = np.zeros((F.MMA_M, F.MMA_N), np.float64)
        c[_C] = np.array([s[2] for s in slots], np.float32)
        return (_values(a, kind) @ _values(b, kind) + c).astype(np.float32)[_C]

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        d, lane = _collective(((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)), product)
        return tuple(d[lane])

    mma.__name__ = f"mma_m16n8k16_{kind}"
    mma.__doc__ = f"mma.sync m16n8k16 ({kind}) as the simulator runs it (see :mod:`.ptx`)."
    return mma


mma_m16n8k16_f16 = _mma("f16")
mma_m16n8k16_bf16 = _mma("bf16")


def _ldmatrix(trans):
    # (row, column) inside each 8x8 matrix of the low / high value of every lane's registers
    low = F.lane_table(lambda lane, reg: F.ldsm_element(lane, 0, trans), 4)
    high = F.lane_table(lambda lane, reg: F.ldsm_element(lane, 1, trans), 4)
    matrix = np.broadcast_to(np.arange(4), (F.WARP, 4))

    def load(slots):
        smem = slots[0][0]
        rows = np.stack([smem[off:off + F.CHUNK] for _, off in slots]).reshape(4, 8, F.CHUNK)
        lo = rows[matrix, low[0], low[1]].astype(np.uint32)
        hi = rows[matrix, high[0], high[1]].astype(np.uint32)
        return lo | hi << 16

    def ldmatrix(smem, off):
        regs, lane = _collective((smem, int(off)), load)
        return tuple(regs[lane])

    ldmatrix.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
    ldmatrix.__doc__ = "ldmatrix .x4 as the simulator runs it (see :mod:`.ptx`)."
    return ldmatrix


ldmatrix_x4 = _ldmatrix(False)
ldmatrix_x4_trans = _ldmatrix(True)


def pack_f16x2(lo, hi):
    """cvt.rn.f16x2.f32: two float32 rounded to float16, ``lo`` in the low half."""
    bits = np.array([lo, hi], np.float32).astype(np.float16).view(np.uint16)
    return np.uint32(int(bits[0]) | int(bits[1]) << 16)


def pack_bf16x2(lo, hi):
    """cvt.rn.bf16x2.f32: two float32 rounded to bfloat16, ``lo`` in the low half."""
    bits = np.array([lo, hi], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.uint32(int(bits[0]) | int(bits[1]) << 16)


def cvt_f32_f16(h):
    """cvt.f32.f16 of the low 16 bits of ``h``."""
    return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))


def cp_async_16_zfill(dst, dst_off, src, src_off, src_bytes):
    """cp.async of 16 bytes, done at once: the first ``src_bytes`` from ``src``, zeros after."""
    n = int(src_bytes) // src.dtype.itemsize
    for e in range(16 // dst.dtype.itemsize):
        dst[dst_off + e] = src[src_off + e] if e < n else 0


def cp_async_16(dst, dst_off, src, src_off):
    """cp.async of 16 bytes, done at once."""
    cp_async_16_zfill(dst, dst_off, src, src_off, 16)


def cp_async_commit():
    """Nothing to close: every copy is done."""


def cp_async_wait(n):
    """Nothing to wait for: every copy is done."""


def exp2_approx(x):
    """2 ** x in float32."""
    return np.float32(np.exp2(np.float32(x)))


def shfl_xor_sync(mask, value, lane_mask):
    """The ``value`` of lane (this lane ^ ``lane_mask``) of the warp."""
    values, lane = _collective(value, list)
    return values[lane ^ lane_mask]
