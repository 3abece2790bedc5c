"""What one CUDA call and one planned CUDA call do on the device, counted without a GPU.

``pfa_numba.gpu.device`` is the one module where a call reaches numba-cuda's runtime; here a
shim replaces its functions, counting allocations, copies, synchronisations and launches and
recording each launch's kernel and arguments, while the inputs are CUDA arrays of no library
(objects with a ``__cuda_array_interface__`` over made-up device pointers) and no kernel runs.
The budgets are those of a launch path without host round trips: for CUDA inputs, no
synchronisation and no device-to-host copy; a whole call one host-to-device copy (its packed
small arguments) and no allocation but its results; a planned call no copy at all; the
tensor-core route three launches (the V scan, the tensor-core kernel, the portable kernel
guarded behind it), every other call one.
"""
import logging

import numpy as np
import pytest

pytest.importorskip("numba.cuda", reason="numba-cuda comes with the test extra")

from pfa_numba import (FiaPlan, PfaPlan, config, dispatch, explain,  # noqa: E402
                       fused_infer_attention_score as fia, prompt_flash_attention as pfa)
from pfa_numba.gpu import device, launch as L, tc_kernel as T  # noqa: E402

class FakeCuda:
    """A CUDA array of no library: metadata and a device pointer, no memory."""
    _next = 1 << 40

    def __init__(self, shape, dtype, offset=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = tuple(int(s) for s in np.empty(0, self.dtype).itemsize *
                             np.cumprod((1,) + self.shape[:0:-1])[::-1])
        FakeCuda._next += 1 << 30
        self.ptr = FakeCuda._next + offset
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str,
                                         "data": (self.ptr, False), "version": 3,
                                         "strides": None}


class Span:
    """What device.span returns: device memory read in place."""

    def __init__(self, ptr, n, dtype):
        self.ptr, self.size, self.dtype = ptr, n, np.dtype(dtype)


class Stream:
    def __init__(self, handle):
        self.handle = handle


class Shim:
    """device.* replaced: counts, and the launches made."""

    def __init__(self, monkeypatch):
        self.counts = dict(allocations=0, h2d=0, d2h=0, syncs=0, launches=0, events=0)
        self.launches = []
        for name in ("compute_capability", "multiprocessor_count", "library_device", "select",
                     "caller_stream", "span", "as_device", "empty", "upload", "copy_in", "download", "synchronize",
                     "launch", "mark", "done"):
            monkeypatch.setattr(device, name, getattr(self, name))
        monkeypatch.setattr(dispatch.CudaTarget, "environment_problems",
                            lambda self, machine=None: [])
        monkeypatch.setattr(L, "_STREAMS", type(L._STREAMS)())

    def reset(self):
        self.counts = dict.fromkeys(self.counts, 0)
        self.launches = []

    def compute_capability(self):
        return (9, 0)

    def multiprocessor_count(self):
        return 132

    def library_device(self, like):
        return None

    def select(self, ordinal):
        pass

    def caller_stream(self, like):
        return Stream(7)

    def span(self, ptr, n, dtype):
        return Span(ptr, n, dtype)

    def as_device(self, x):
        return x

    def empty(self, n, dtype, stream):
        self.counts["allocations"] += 1
        return np.zeros(n, dtype)

    def upload(self, host, stream):
        self.counts["allocations"] += 1
        self.counts["h2d"] += 1
        return np.array(host)

    def copy_in(self, device_array, host, stream):
        self.counts["h2d"] += 1
        device_array[:host.size] = host

    def download(self, device_array, host, stream):
        self.counts["d2h"] += 1

    def synchronize(self, stream):
        self.counts["syncs"] += 1

    def launch(self, kernel, grid, block, stream, args):
        self.counts["launches"] += 1
        self.launches.append((kernel, grid, block, args))

    def mark(self, stream):
        self.counts["events"] += 1
        return object()

    def done(self, event):
        return True


@pytest.fixture
def shim(monkeypatch):
    monkeypatch.setattr(config, "CUDA_TENSOR_CORES", True)
    return Shim(monkeypatch)


def _qkv(dtype, b=2, n=8, nkv=2, sq=256, skv=256, d=128):
    return (FakeCuda((b, n, sq, d), dtype), FakeCuda((b, nkv, skv, d), dtype),
            FakeCuda((b, nkv, skv, d), dtype))


KW = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale_value=0.088,
          sparse_mode=3, attn_mask=FakeCuda((2048, 2048), np.bool_))   # causal (never read)


def _kernel_names(shim):
    return [getattr(k, "py_func", k).__name__ for k, *_ in shim.launches]


def _budget(shim, launches, h2d, results=1):
    assert shim.counts == dict(allocations=results, h2d=h2d, d2h=0, syncs=0,
                               launches=launches, events=0), shim.counts


def test_a_whole_tensor_core_call(shim):
    """fp16 causal GQA: after the first call on a stream (which makes its buffers), a call
    copies its packed small arguments once, allocates its output only, never synchronises, and
    launches the scan, the tensor-core kernel and the guarded portable kernel, all reading the
    caller's memory in place and sharing one guard id that no other call has."""
    q, k, v = _qkv(np.float16)
    pfa(q, k, v, **KW)
    ids = set()
    for _ in range(2):
        shim.reset()
        out = pfa(q, k, v, **KW)
        _budget(shim, launches=3, h2d=1)
        assert _kernel_names(shim) == ["nonfinite", "attention_tc", "attention"]
        (scan, _, _, sargs), (_, _, tc_block, targs), (_, _, _, pargs) = shim.launches
        assert tc_block == T.THREADS
        assert sargs[0].ptr == v.ptr and [a.ptr for a in targs[:3]] == [q.ptr, k.ptr, v.ptr]
        assert sargs[1] is targs[16] is pargs[16] and sargs[2] == targs[17] == pargs[17] != 0
        ids.add(sargs[2])
        assert out.shape == q.shape
    assert len(ids) == 2


def test_a_planned_call_copies_nothing(shim):
    """A PfaPlan on CUDA arrays: a call on another layer's arrays copies nothing, allocates its
    output only, does not synchronise, and reads the new arrays' memory."""
    q, k, v = _qkv(np.float16)
    plan = PfaPlan(q, k, v, **KW)
    plan(q, k, v)
    q2, k2, v2 = _qkv(np.float16)
    for _ in range(2):
        shim.reset()
        plan(q2, k2, v2)
        _budget(shim, launches=3, h2d=0)
        assert [a.ptr for a in shim.launches[1][3][:3]] == [q2.ptr, k2.ptr, v2.ptr]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_portable_kernel_launches_once(shim, dtype):
    """float32 (and fp16 at a head dim the tensor-core kernel lacks): one launch, guard id 0
    (it always computes), the same copy budget."""
    q, k, v = _qkv(dtype, d=96 if dtype == np.float16 else 128)
    pfa(q, k, v, **KW)
    shim.reset()
    pfa(q, k, v, **KW)
    _budget(shim, launches=1, h2d=1)
    assert _kernel_names(shim) == ["attention"] and shim.launches[0][3][17] == 0


def test_an_fia_decode_step_and_its_plan(shim):
    """fused_infer_attention_score's decode on CUDA arrays, whole and planned: the split-kv
    decode kernel and the finish kernel behind it read the caller's key and value in place
    and the stream's workspace (made by the first call only); the lse and its placeholder (a
    Numba array here, zeroed on the stream by a fill launch) come from the call, with no
    copy; one decode row a head needs no guard (every row keeps the same columns)."""
    q, k, v = _qkv(np.float16, sq=1, skv=512)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.088)
    fia(q, k, v, **kw)
    shim.reset()
    out, lse = fia(q, k, v, **kw)
    _budget(shim, launches=3, h2d=1, results=2)       # the output and the placeholder lse
    assert _kernel_names(shim) == ["decode_split", "decode_finish", "fill_kernel"]
    (_, grid, block, args), (_, fgrid, _, fargs) = shim.launches[:2]
    assert [a.ptr for a in args[:3]] == [q.ptr, k.ptr, v.ptr] and block == 128
    assert args[14] is fargs[0] and args[-1] == fargs[-1] == 0       # workspace; no guard
    assert grid[1] == 2 and grid[0] % 2 == 0 and fgrid == (2, 2)
    plan = FiaPlan(q, k, v, **kw, softmax_lse_flag=True)
    plan(q, k, v)
    shim.reset()
    out, lse = plan(q, k, v)
    _budget(shim, launches=2, h2d=0, results=2)
    assert lse.shape == (2, 8, 1, 1)


def test_speculative_rows_take_the_guard(shim):
    """4 query rows a head (causal: rows keep different columns of a tile): the V scan, the
    decode kernels and the portable kernel behind them share one guard id."""
    q, k, v = _qkv(np.float16, sq=4, skv=512)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.088,
              sparse_mode=3, atten_mask=FakeCuda((2048, 2048), np.bool_))
    fia(q, k, v, **kw)
    shim.reset()
    fia(q, k, v, **kw)
    assert _kernel_names(shim) == ["nonfinite", "decode_split", "decode_finish", "attention",
                                   "fill_kernel"]
    scan, split, finish, portable = (args for _, _, _, args in shim.launches[:4])
    # (the decode kernels' guard and id come before the int8 cache's five planes)
    assert scan[2] == split[-6] == finish[-6] == portable[17] != 0
    assert scan[1] is split[-7] is finish[-7] is portable[16]


def test_splits_follow_the_multiprocessors_and_the_cache(monkeypatch):
    """split_plan: enough (batch, kv head, split) blocks for CUDA_DECODE_BLOCKS_PER_SM a
    multiprocessor, no split shorter than CUDA_DECODE_MIN_TILES tiles, whole tiles covered."""
    from pfa_numba.gpu import decode_kernel as DK
    monkeypatch.setattr(config, "CUDA_DECODE_MIN_TILES", 4)
    monkeypatch.setattr(config, "CUDA_DECODE_BLOCKS_PER_SM", 4)

    class P:
        B, Nkv = 2, 8
    far = 1 << 31                                 # lens rows: qL, kL, preE, nextE, rows
    lens = np.array([[1, 1], [32768, 4096], [far, far], [far, far], [1, 1]], np.int64)
    splits, per = DK.split_plan(P, lens, 132)
    assert (splits - 1) * per < 512 <= splits * per          # 512 tiles of 64 keys
    # 33 splits wanted (4 x 132 blocks over 16), 16 tiles each: 32 splits hold them all
    assert (splits, per) == (32, 16)
    short = np.array([[1, 1], [300, 64], [far, far], [far, far], [1, 1]], np.int64)
    assert DK.split_plan(P, short, 132) == (1, 5)             # 5 tiles: one split
    assert DK.split_plan(P, lens, 1) == (1, 512)              # 16 blocks fill one SM


def test_numpy_inputs_on_cuda_return_finished_arrays(shim):
    """NumPy inputs with device='cuda': copied in, one synchronisation, results copied out."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8, 64)).astype(np.float16)
    pfa(q, q, q, num_heads=2, input_layout="BNSD", device="cuda")
    shim.reset()
    out = pfa(q, q, q, num_heads=2, input_layout="BNSD", device="cuda",
              return_softmax_lse=True)[0]
    assert isinstance(out, np.ndarray)
    assert shim.counts["syncs"] == 1 and shim.counts["d2h"] == 2
    assert shim.counts["h2d"] == 1             # everything small enough travels packed


def test_the_log_says_which_kernel_and_why(shim, caplog):
    q, k, v = _qkv(np.float16)
    with caplog.at_level(logging.DEBUG):
        pfa(q, k, v, **KW)
        pfa(*_qkv(np.float16, d=96), **KW)
        odd = FakeCuda(q.shape, np.float16, offset=8)
        pfa(odd, k, v, **KW)
    ran = [r.getMessage() for r in caplog.records if r.name == "pfa_numba.cuda"]
    assert ran == ["cuda tensor-core queued: guard scan of v (inf, NaN); tensor-core; portable, "
                   "should the guard find what it cannot compute", "cuda portable queued: portable",
                   "cuda portable queued: portable"]
    lines = [r.getMessage().splitlines() for r in caplog.records if r.name == "pfa_numba.dispatch"]
    assert lines[0][0].startswith("the cuda tensor-core kernel runs this call: mma.sync")
    assert lines[0][1].startswith("  and: the guard scans for inf or NaN in v first")
    assert lines[0][2].startswith("  not decode: 4 query heads a kv head x 256 query rows > 16")
    assert lines[0][3] == "  not portable: it could; tensor-core comes first"
    assert lines[1][0].startswith("the cuda portable kernel runs this call")
    assert lines[1][1:3] == ["  not decode: head dim 96 (it takes 64, 128)",
                             "  not tensor-core: head dim 96 (it takes 64, 128)"]
    assert lines[2][1:3] == ["  not decode: 4 query heads a kv head x 256 query rows > 16: the "
                             "decode kernel holds one kv head's rows in one mma tile; a query, "
                             "key or value device pointer is not 16-byte aligned",
                             "  not tensor-core: a query, key or value device pointer is not "
                             "16-byte aligned"]
    # the log is the text explain gives (but for the plan's line, said of calls' text only)
    assert lines[0] == [line for line in explain(q, k, v, **KW).splitlines()
                        if "a plan (PfaPlan" not in line]


def test_a_plan_given_misaligned_arrays_runs_whole_calls(shim):
    q, k, v = _qkv(np.float16)
    plan = PfaPlan(q, k, v, **KW)
    odd = FakeCuda(q.shape, np.float16, offset=8)
    pfa(q, k, v, **KW)                  # the stream's buffers made
    shim.reset()
    plan(odd, k, v)
    assert shim.counts["h2d"] == 1 and _kernel_names(shim) == ["attention"]


def test_a_staged_cuda_array_lives_as_long_as_its_staging():
    """Metadata and a pointer are all a launch reads of a CUDA array: the array itself must
    live until the kernels reading it are queued (the SDPA drop-in's converted masks exist
    only in its staging)."""
    import gc
    import weakref
    from pfa_numba.interop.cuda_arrays import Meta
    meta, x = Meta(), FakeCuda((2, 3, 4), np.float16)
    alive = weakref.ref(x)
    view = meta.make("attn_mask", x)
    del x
    gc.collect()
    assert alive() is not None and meta.locate(view) == ("attn_mask", 0)
    del meta
    gc.collect()
    assert alive() is None
