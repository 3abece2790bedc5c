"""Running a planned problem on CUDA: the kernel it gets, its arguments on the device, its
launches on the caller's stream, and results of the query's kind.

Arrays. CUDA arrays (Numba device arrays, CuPy, PyTorch; anything with
``__cuda_array_interface__``) are read in place, and the results are made by the query's
library on the call's stream. NumPy inputs with ``device='cuda'`` are copied in (only the memory
their views span) and the results copied out.

Streams. A call runs on its caller's stream (:func:`.device.caller_stream`: the current stream
of torch or CuPy, a Numba device array's own, else Numba's default) and, for CUDA inputs,
returns without synchronising: its results are ready in that stream's order, and a fault in a
kernel surfaces at the caller's next synchronisation. NumPy inputs get finished NumPy results.

Small arguments (geometry, lengths, parameters, scales, the block table, the placeholders of
absent tensors) travel as one packed buffer (:class:`Packed`): a call copies it into its
stream's buffer (one host-to-device copy; an allocation only when the buffer is first made or
grows), a :class:`Launch` kept by a plan holds its own, copied once when the plan is made.

The tensor-core kernel (:mod:`.tc_kernel`) takes the float16 / bfloat16 problems it supports
except where V holds inf or NaN (or, for an int8 cache, a token plane holds a value that could
take a dequantized one beyond the query's type), and that is decided on the device: a scan
(``variants``' guard_scans) writes the call's guard id into its stream's guard word where it finds
one, the tensor-core kernel then returns at once and the portable kernel launched behind it
computes the call (otherwise its blocks have no rows and no tiles). No host read decides. The
decode kernel takes the guard where its rows may drop different columns of a tile, or for such
token planes.
"""
import dataclasses
import logging
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..numerics.kernel_args import L_ROWS, kernel_args
from . import device
from . import guard as guard_kernels
from ..interop.cuda_arrays import array_kind

#: the kernel a call gets and why, and what it queued (INFO)
log = logging.getLogger("pfa_numba.cuda")

#: host arrays up to this many bytes travel in the packed buffer, larger ones on their own
SMALL_BYTES = 1 << 20
#: the packed buffer's alignment of each array (the tensor-core kernel's 16-byte rows)
ALIGN = 16
#: multiprocessors assumed where the device does not say (the CUDA simulator)
DEFAULT_SMS = 4
#: streams whose buffers are kept (the least recently used beyond are let go)
KEPT_STREAMS = 64


class Packed:
    """Host arrays packed into one byte buffer, each at a multiple of ALIGN bytes, and where
    each lies (``layout``: (name, byte offset, dtype, shape) per array)."""

    def __init__(self, arrays):
        arrays = {name: np.ascontiguousarray(x) for name, x in arrays.items()}
        layout, size = [], 0
        for name, x in arrays.items():
            layout.append((name, size, x.dtype.str, x.shape))
            size += -(-max(x.nbytes, 1) // ALIGN) * ALIGN
        self.bytes = np.zeros(max(size, ALIGN), np.uint8)
        for (_, offset, _, _), x in zip(layout, arrays.values()):
            self.bytes[offset:offset + x.nbytes] = x.reshape(-1).view(np.uint8)
        self.layout = tuple(layout)

    def views(self, buffer):
        """{name: device array} over the device byte array ``buffer`` holding these bytes."""
        return {name: buffer[offset:offset + np.dtype(dtype).itemsize * math.prod(shape)]
                .view(dtype).reshape(shape)
                for name, offset, dtype, shape in self.layout}


class _Stream:
    """What the calls on one stream reuse: the buffer their packed arguments are copied into
    (and its views per layout), the guard word of the tensor-core route and its last id, and
    per-call device buffers held until the kernels that read them have run. Its lock keeps one
    call's copy and launches together (another's copy into the buffer would come between)."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()
        self.buffer, self.views = None, {}
        self.guard, self.last_id = device.upload(np.zeros(1, np.int64), stream), 0
        self.held = []
        self.work = None

    def workspace(self, floats):
        """A float32 device buffer of at least ``floats`` values, this stream's (its calls run
        in stream order, so one after another may reuse it); made again only to grow."""
        if self.work is None or self.work.size < floats:
            self.hold(self.work)             # read by kernels still queued
            self.work = device.empty(max(floats, 1 << 16), np.float32, self.stream)
        return self.work

    def small_args(self, packed):
        """Device views of ``packed``'s arrays, copied into this stream's buffer."""
        if self.buffer is None or self.buffer.size < packed.bytes.size:
            self.hold(self.buffer)           # read by kernels still queued
            self.buffer = device.empty(max(packed.bytes.size, 4096), np.uint8, self.stream)
            self.views = {}
        device.copy_in(self.buffer, packed.bytes, self.stream)
        views = self.views.get(packed.layout)
        if views is None:
            if len(self.views) >= 8:
                self.views.clear()
            views = self.views[packed.layout] = packed.views(self.buffer)
        return views

    def next_guard_id(self):
        """A guard id no earlier call on this stream had."""
        self.last_id += 1
        return self.last_id

    def hold(self, buffers):
        """Keep ``buffers`` until the work queued so far on the stream has run; let go of
        those held before whose work has."""
        self.held = [(event, kept) for event, kept in self.held if not device.done(event)]
        if buffers is not None and (not isinstance(buffers, list) or buffers):
            self.held.append((device.mark(self.stream), buffers))


_STREAMS = OrderedDict()
_STREAMS_LOCK = threading.Lock()


def _stream_state(stream):
    key = device.stream_key(stream)
    with _STREAMS_LOCK:
        state = _STREAMS.get(key)
        if state is None:
            state = _STREAMS[key] = _Stream(stream)
            while len(_STREAMS) > KEPT_STREAMS:
                _STREAMS.popitem(last=False)
        else:
            _STREAMS.move_to_end(key)
    return state


# ---------------------------------------------------------------------------------------------
# which kernel
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Situation:
    """What the CUDA kernels' conditions read of a planned problem beyond the problem: its
    kernel arguments, the device's compute capability and multiprocessors, and whether the
    device pointers the tensor-core and decode kernels read in 16-byte rows are aligned."""
    args: Any                        # KernelArgs over metadata outputs; None: nothing to compute
    cc: tuple
    sms: int
    located: tuple                   # ((argument name, byte offset)) of those rows' CUDA arrays
    aligned: bool

    @classmethod
    def of(cls, p, meta=None, cc=None, sms=None):
        """The situation of planned problem ``p`` over the CUDA arrays ``meta`` made metadata
        of (None: NumPy inputs) on the current device (or one of compute capability ``cc``
        with ``sms`` multiprocessors)."""
        cc = tuple(cc or device.compute_capability())
        sms = sms or device.multiprocessor_count()
        if p.B == 0 or math.prod(p.out_shape) == 0:
            return cls(None, cc, sms or DEFAULT_SMS, (), True)
        a = kernel_args(p, _metadata_array(p.out_shape, p.out_dtype),
                        _metadata_array(p.lse_shape, np.float32))
        located = tuple(meta.locate(x) for x in (a.q, a.k, a.v, a.kp, a.vp)
                        if meta is not None and meta.holds(x))
        return cls(a, cc, sms or DEFAULT_SMS, located,
                   aligned(located, meta.pointers if meta is not None else {}))


def aligned(located, pointers):
    """Whether the arrays at ``located`` ((argument name, byte offset)) start 16-byte aligned
    given the arguments' device ``pointers``."""
    return all(pointers[name] + offset & 15 == 0 for name, offset in located)


def decode_reasons(p, situation):
    """Why the decode kernel cannot take planned problem ``p`` beyond what dispatch declares."""
    from .decode_kernel import decode_reason
    return _with_alignment(decode_reason(p), situation)


def tensor_core_reasons(p, situation):
    """Why the tensor-core kernel cannot take planned problem ``p`` beyond what dispatch
    declares."""
    from .tc_conditions import tensor_core_reason
    return _with_alignment(tensor_core_reason(p), situation)


def _with_alignment(why, situation):
    reasons = [why] if why else []
    if not situation.aligned:
        reasons.append("a query, key or value device pointer is not 16-byte aligned")
    return reasons


def _metadata_array(shape, dtype):
    """A C-contiguous array of ``shape`` over one element: its strides are all kernel_args
    reads of an output made elsewhere."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape,
                                           strides=_c_strides(shape, np.dtype(dtype).itemsize))


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


# the tensor arguments of the kernels, in order, by their KernelArgs field; the float kernel's
# kv cache ones after the common arguments
_COMMON_TENSORS = ("q", "k", "v")
_MASKS = ("mask8", "mask16", "pse")
_SMALL = ("strides", "boff", "lens", "params")
_CACHE = ("kp", "vp", "table", "channel", "kts", "kto", "vts", "vto")


class Launch:
    """A planned problem ready to launch on CUDA: its kernels and grids, its small arguments
    packed, and where each tensor argument comes from: the memory of a CUDA array argument
    (``("device", argument name, byte offset, values, dtype)``: a view of it, read in place),
    or a host array (packed when small, copied in by each call otherwise). Made per call, or
    once by a plan; :meth:`run` computes it."""

    def __init__(self, p, meta, kernel, situation):
        self.p, self.on_device = p, meta is not None
        self.kernel = kernel
        self.empty = situation.args is None
        if self.empty:
            return
        a = situation.args
        self.out_storage = a.out.dtype
        self.left_padded = p.q_off is not None and bool(p.q_off.any())
        self.pointers = meta.pointers if meta is not None else {}
        self.located = situation.located
        host = dict(zip(_SMALL, (a.strides, a.boff, a.lens, a.params)))
        host.update(fparams=a.fparams, scale2=a.scale2, offset2=a.offset2,
                    no_lse=np.zeros(1, np.float32), table=a.table, channel=a.channel)
        self.sources = {}
        tensors = dict(q=a.q, k=a.k, v=a.v, mask8=a.mask8, mask16=a.mask16, pse=a.pse, kp=a.kp,
                       vp=a.vp, kts=a.tokens[0], kto=a.tokens[1], vts=a.tokens[2],
                       vto=a.tokens[3])
        for field, x in tensors.items():
            if meta is not None and meta.holds(x):
                name, offset = meta.locate(x)
                self.sources[field] = ("device", name, offset, x.size, x.dtype)
            elif x.nbytes <= SMALL_BYTES:
                host[field] = x
            else:
                self.sources[field] = ("host", x)
        self.packed = Packed(host)
        self.rows = int(a.lens[L_ROWS].max())
        self.kernel.plan(self, a, situation)
        self.own_views = None
        self.scans = self.kernel.guard_scans(p)

    def keep_arguments(self, stream):
        """Copy the packed arguments to a buffer of this launch's own, once (a plan's): its
        runs then copy nothing. Waits for the copy (runs on other streams read it)."""
        buffer = device.upload(self.packed.bytes, stream)
        device.synchronize(stream)
        self.own_buffer, self.own_views = buffer, self.packed.views(buffer)

    def aligned(self, pointers):
        """Whether this launch's kernel may read its query, key and value (and a shared
        prefix's) at these argument pointers ({argument name: device pointer}): 16-byte-aligned
        rows for the tensor-core and decode kernels, any for the portable kernel."""
        return not self.kernel.reads_rows or aligned(self.located, pointers)

    def run(self, query=None, pointers=None):
        """(out, lse or None): NumPy arrays for NumPy inputs; for CUDA inputs arrays of
        ``query``'s kind, made on the call's stream, before the kernels have run (the stream
        orders them). ``pointers``: {argument name: device pointer} of the CUDA array
        arguments (those the plan was made with where None)."""
        p = self.p
        if self.empty:
            return _empty_results(p, query if self.on_device else None)
        like = query if self.on_device else None
        device.select(device.library_device(like))
        stream = device.caller_stream(like)
        state = _stream_state(stream)
        with state.lock:
            views = self.own_views if self.own_views is not None else \
                state.small_args(self.packed)
            tensors, uploads = self._tensors(views, pointers, stream)
            out, lse, d_out, d_lse = self._outputs(query, views, stream)
            guard_id = state.next_guard_id() if self.scans else 0
            launches = self._launches(tensors, views, d_out, d_lse, state, guard_id)
            for _, kernel, grid, block, args in launches:
                device.launch(kernel, grid, block, stream, args)
            if self.on_device:
                state.hold(uploads)
        log.info("cuda %s queued: %s", self.kernel.name, "; ".join(role for role, *_ in launches))
        if self.on_device:
            return out, lse
        device.download(d_out, out.reshape(-1).view(self.out_storage), stream)
        if lse is not None:
            device.download(d_lse, lse.reshape(-1), stream)
        device.synchronize(stream)
        return out, lse

    def _tensors(self, views, pointers, stream):
        """{KernelArgs field: device array} of the tensor arguments, and the per-call copies
        made (host arrays too large to pack)."""
        tensors, uploads = {}, []
        for field, src in self.sources.items():
            if src[0] == "device":
                _, name, offset, n, dtype = src
                tensors[field] = device.span((pointers or self.pointers)[name] + offset, n,
                                             dtype)
            else:
                tensors[field] = device.upload(src[1], stream)
                uploads.append(tensors[field])
        for field in _COMMON_TENSORS + _MASKS + _CACHE:
            tensors.setdefault(field, views.get(field))
        return tensors, uploads

    def _outputs(self, query, views, stream):
        """(out, lse or None) as returned, and the flat device arrays the kernels write."""
        p, padded = self.p, self.left_padded
        if self.on_device:
            out = library_array(query, p.out_shape, p.out_dtype, 0 if padded else None, stream)
            lse = library_array(query, p.lse_shape, np.float32, -np.inf if padded else None,
                                stream) if p.want_lse else None
            d_out = _flat_device(out, self.out_storage)
            d_lse = _flat_device(lse, np.float32) if lse is not None else views["no_lse"]
            return out, lse, d_out, d_lse
        out = np.empty(p.out_shape, p.out_dtype)
        lse = np.empty(p.lse_shape, np.float32) if p.want_lse else None
        d_out = _numba_array(out.size, self.out_storage, 0 if padded else None, stream)
        d_lse = _numba_array(lse.size, np.float32, -np.inf if padded else None, stream) \
            if lse is not None else views["no_lse"]
        return out, lse, d_out, d_lse

    def _launches(self, t, views, d_out, d_lse, state, guard_id):
        """(what, kernel, grid, block, arguments) of each launch, in order: the guard's scans,
        then the kernel's own (:meth:`.variants.CudaKernel.launches`)."""
        p, guard = self.p, state.guard
        from .tc_conditions import kind_of
        launches = []
        for field, limit in self.scans:
            if limit is None:
                launches.append((f"guard scan of {field} (inf, NaN)",
                                 guard_kernels.nonfinite_scan(kind_of(p.dtype)),
                                 *guard_kernels.SCAN_GRID, [t[field], guard, guard_id]))
            else:
                launches.append((f"guard scan of {field} (limit {limit})",
                                 guard_kernels.limit_scan(), *guard_kernels.SCAN_GRID,
                                 [t[field], np.float32(limit), guard, guard_id]))
        return launches + self.kernel.launches(self, t, views, (d_out, d_lse), state, guard_id)

    def _head_and_tail(self, t, views, outs, guard, guard_id):
        """The arguments every forward kernel begins and ends with."""
        head = [t["q"], t["k"], t["v"], *outs, t["mask8"], t["mask16"], t["pse"]]
        tail = [views["fparams"], views["scale2"], views["offset2"], guard, guard_id]
        return head, [views[name] for name in _SMALL], tail

    def portable_launch(self, t, views, outs, state, guard_id):
        """The portable kernel's launch (:mod:`.kernels`)."""
        from .kernels import kernel_for, launch_config
        p = self.p
        head, small, tail = self._head_and_tail(t, views, outs, state.guard, guard_id)
        dpad, bq, bkv = launch_config(p)
        qtiles = max(1, -(-self.rows // bq))
        args = head + small + [qtiles] + tail
        if p.dtype != np.int8:
            args += [t[field] for field in _CACHE]
        return ("portable", kernel_for(dpad, bq, bkv, int8=p.dtype == np.int8),
                (p.B * qtiles, p.N), bq, args)

    def tensor_core_launch(self, t, views, outs, state, guard_id):
        """The tensor-core kernel's launch (:mod:`.tc_kernel`): the specialisation of the
        call's dtype, head dim, mask, kv walk, int8 cache, softcap and sinks."""
        from . import tc_conditions
        from . import tc_kernel as tc
        p = self.p
        head, small, tail = self._head_and_tail(t, views, outs, state.guard, guard_id)
        tc_tiles = max(1, -(-self.rows // tc.ROWS))
        kernel = tc.tc_kernel_for(tc_conditions.kind_of(p.dtype), p.D,
                                  tc_conditions.masked_variant(p), tc_conditions.walks(p),
                                  guard_kernels.dequantizes(p), p.softcap != 0,
                                  p.sinks is not None)
        return ("tensor-core", kernel, (p.B * tc_tiles, p.N), tc.THREADS,
                head + small + [tc_tiles] + tail + [t[field] for field in _CACHE])

    def decode_launches(self, t, views, outs, state, guard_id):
        """The decode kernel's launches: its split kernel's and its finish kernel's."""
        from . import decode_kernel as dk
        from .tc_conditions import kind_of, masked_variant, walks
        p, splits = self.p, self.splits
        kind = kind_of(p.dtype)
        d_out, d_lse = outs
        split, finish = dk.decode_kernels_for(kind, p.D, walks(p), masked_variant(p),
                                              guard_kernels.dequantizes(p), p.softcap != 0)
        ws = state.workspace(dk.workspace_floats(p, splits))
        geo = [t["table"], views["strides"], views["boff"], views["lens"], views["params"]]
        planes = [t[field] for field in ("channel", "kts", "kto", "vts", "vto")]
        (sgrid, sblock), (fgrid, fblock) = dk.grids(p, splits)
        split_args = [t["q"], t["k"], t["v"], t["kp"], t["vp"], t["mask8"], t["mask16"], t["pse"],
                      *geo, views["fparams"], ws, p.Sq, self.per_split, splits, state.guard,
                      guard_id, *planes]
        finish_args = [ws, d_out, d_lse, t["v"], t["vp"], *geo, views["fparams"], p.Sq, splits,
                       state.guard, guard_id, *planes]
        return [("decode split", split, sgrid, sblock, split_args),
                ("decode finish", finish, fgrid, fblock, finish_args)]


def _empty_results(p, query):
    """The results of a problem with nothing to compute: zeros, and -inf lse."""
    out = np.zeros(p.out_shape, p.out_dtype)
    lse = np.full(p.lse_shape, -np.inf, np.float32) if p.want_lse else None
    if query is None:
        return out, lse
    from ..interop.cuda_arrays import to_kind
    return to_kind(out, query), (to_kind(lse, query) if lse is not None else None)


def prepare(p, meta, kernel, situation):
    """The :class:`Launch` of planned problem ``p`` on ``kernel`` (a CUDA kernel of
    ``dispatch.KERNELS``) in its :class:`Situation`, over the CUDA arrays ``meta`` made
    metadata of (:class:`..interop.cuda_arrays.Meta`; None for NumPy inputs)."""
    return Launch(p, meta, kernel, situation)


# ---------------------------------------------------------------------------------------------
# results of the caller's library
# ---------------------------------------------------------------------------------------------

_TORCH_DTYPES = {"float16": "float16", "float32": "float32", "int8": "int8",
                 "bfloat16": "bfloat16"}


def library_array(like, shape, dtype, fill, stream):
    """A new CUDA array of ``like``'s library (torch, CuPy; Numba otherwise) on its device, made
    on the call's stream: uninitialised (``fill`` None) or filled with ``fill``."""
    kind = array_kind(like)
    if kind == "torch":
        import torch
        tdt = getattr(torch, _TORCH_DTYPES[np.dtype(dtype).name])
        if fill is None:
            return torch.empty(shape, dtype=tdt, device=like.device)
        return torch.full(shape, fill, dtype=tdt, device=like.device)
    if kind == "cupy":
        import cupy
        if fill is None:
            return cupy.empty(shape, dtype=dtype)
        return cupy.full(shape, fill, dtype=dtype)
    return _numba_array(math.prod(shape), dtype, fill, stream).reshape(shape)


def _numba_array(n, dtype, fill, stream):
    """A new flat Numba device array, filled on ``stream`` unless ``fill`` is None."""
    from .kernels import fill_grid, fill_kernel
    arr = device.empty(n, dtype, stream)
    if fill is not None:
        storage = arr.view(np.uint16) if np.dtype(dtype).itemsize == 2 else arr
        device.launch(fill_kernel, *fill_grid(n), stream, (storage, storage.dtype.type(fill)))
    return arr


def placeholder_lse(like):
    """fused_infer_attention_score's softmax_lse without softmax_lse_flag: one float32 zero,
    made by the query's library on its stream."""
    device.select(device.library_device(like))
    return library_array(like, (1,), np.float32, 0, device.caller_stream(like))


def _flat_device(arr, storage_dtype):
    """A contiguous CUDA array of ours as a flat Numba device array of its storage type."""
    if array_kind(arr) == "torch":
        import torch
        if arr.dtype == torch.bfloat16:
            arr = arr.view(torch.int16)
    d = device.as_device(arr) if array_kind(arr) != "numba" else arr
    return d.reshape(d.size).view(storage_dtype)
