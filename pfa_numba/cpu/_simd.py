"""The decode products in explicit vector code (LLVM IR through Numba intrinsics).

A decode item has few query rows (the G heads of one kv head), so its products are short: a
K row against four query rows, four weights against a V row. Written as Python loops, LLVM
vectorises each D loop on its own: per block of four K rows it pays sixteen horizontal sums,
the loop set-up and its remainder, and per four V rows a load and a store of every accumulator.
Here the vectors are explicit:

- ``scores_*``: each block of four K rows against four query rows keeps sixteen vector
  accumulators and reduces them in one transposing tree (fifteen folds of two shuffles and an
  add give the sixteen dot products in one vector) instead of sixteen horizontal sums. It also
  prefetches the tile's V rows into L2 as it goes, so that the weighted sum, which follows,
  does not wait on memory row after row.
- ``weighted_sum_*``: the accumulator rows stay in registers over every V row of the tile (up
  to four rows, a slice of four vectors of each at a time): each V vector is loaded and
  converted once and meets the rows' broadcast weights. Every weight must be nonzero (the
  caller takes a column with a zero elsewhere: a zero weight never meets V). It also
  prefetches into L2 the K rows the caller reads next (another head's tile, or the next
  tile), so that memory keeps working while the sums are computed.

Rows are read straight from the cache (element offsets ``offs``, contiguous elements) and
converted as they load: IEEE half (VCVTPH2PS), bfloat16 (a shift), int8 (as integer values:
the callers fold dequantization, see :mod:`.stream`) or float32. A D that is not a multiple of
the vector width takes masked loads for its last vectors. The rows PF_ROWS ahead are
prefetched into L1: paged rows and the rows of one head in BSH / BSND caches jump, where the
hardware prefetcher starts over.

Vectors are 16 float32 lanes on AVX-512 hosts, 8 elsewhere (sixteen accumulators fill an
AVX2 register file).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._vector import PREFETCH_L1 as _L1
from ._vector import PREFETCH_L2 as _L2
from ._vector import add_products, counted_loop, emit_prefetch, host_has, llvm_function, splat

LANES = 16 if host_has("avx512f") else 8
#: K / V rows are prefetched this many rows ahead of their use
PF_ROWS = 8
_BLOCK = 4                            # K rows of a scores block, query rows of a block / slice
_SLICE = 4                            # vectors of an accumulator row held in registers

_I1, _I32, _I64 = (ir.IntType(n) for n in (1, 32, 64))
_F32 = ir.FloatType()
_VF = ir.VectorType(_F32, LANES)
_VMASK = ir.VectorType(_I1, LANES)


def _i64(context, builder, value, ty):
    return context.cast(builder, value, ty, types.int64)


def _c64(n):
    return ir.Constant(_I64, n)


def _splat(builder, scalar, lanes=LANES):
    return splat(builder, scalar, lanes)


def _lane_mask(builder, n_left):
    """Lanes i < n_left (an i64 count, possibly >= LANES)."""
    iota = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
    return builder.icmp_signed("<", iota, _splat(builder, n_left))


class _Rows:
    """Loads of LANES elements of a 1-d array (its data pointer, LLVM element type) as float32
    vectors, converted by ``kind``: "f16" (uint16 IEEE half bits), "bf16" (uint16 bfloat16
    bits) or "native" (float32 as is, int8 as integer values)."""

    def __init__(self, builder, data, elem, kind):
        self.builder, self.data, self.elem, self.kind = builder, data, elem, kind
        self.vec = ir.VectorType(elem, LANES)
        self.size = elem.width // 8 if isinstance(elem, ir.IntType) else 4

    @classmethod
    def of(cls, context, builder, ty, value, kind):
        """The rows of array argument ``value`` of Numba type ``ty``."""
        return cls(builder, _array(context, builder, ty, value).data,
                   context.get_value_type(ty.dtype), kind)

    def load(self, offset, mask=None):
        b = self.builder
        ptr = b.bitcast(b.gep(self.data, [offset]), self.vec.as_pointer())
        if mask is None:
            raw = b.load(ptr, align=self.size)
        else:
            name = f"llvm.masked.load.v{LANES}{_suffix(self.elem)}.p0"
            fn = llvm_function(b, name, self.vec, [self.vec.as_pointer(), _I32, _VMASK, self.vec])
            raw = b.call(fn, [ptr, ir.Constant(_I32, self.size), mask,
                              ir.Constant(self.vec, None)])
        return self._widen(raw)

    def _widen(self, raw):
        b = self.builder
        if self.kind == "f16":
            return b.fpext(b.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VF)
        if self.kind == "bf16":
            wide = b.zext(raw, ir.VectorType(_I32, LANES))
            return b.bitcast(b.shl(wide, _splat(b, ir.Constant(_I32, 16))), _VF)
        if isinstance(self.elem, ir.IntType):
            return b.sitofp(raw, _VF)
        return raw

    def prefetch(self, offset, nlines, level):
        """Prefetch the nlines cache lines from element ``offset`` (level: _L1 or _L2)."""
        b = self.builder
        per_line = _c64(64 // self.size)
        with counted_loop(b, nlines) as index:
            emit_prefetch(b, b.gep(self.data, [b.add(offset, b.mul(index, per_line))]),
                          level)


def _suffix(elem):
    return f"i{elem.width}" if isinstance(elem, ir.IntType) else "f32"


def _fma(builder, a, b, c):
    fn = llvm_function(builder, f"llvm.fmuladd.v{LANES}f32", _VF, [_VF, _VF, _VF])
    return builder.call(fn, [a, b, c])


def _store_f32(builder, data, offset, vec, mask=None):
    ptr = builder.bitcast(builder.gep(data, [offset]), vec.type.as_pointer())
    if mask is None:
        builder.store(vec, ptr, align=4)
        return
    name = f"llvm.masked.store.v{vec.type.count}f32.p0"
    fn = llvm_function(builder, name, ir.VoidType(), [vec.type, vec.type.as_pointer(), _I32,
                                                       ir.VectorType(_I1, vec.type.count)])
    builder.call(fn, [vec, ptr, ir.Constant(_I32, 4), mask])


def _reduce_lanes(builder, vectors):
    """The lane sums of ``vectors`` (at least LANES of them, a power of two): a list of
    vectors whose lanes, in order, are the sums of the inputs in order. Pairs are folded level
    by level; each fold, two shuffles and an add, halves the width of every group of partial
    sums in a vector and doubles their number."""
    assert len(vectors) >= LANES and len(vectors) & (len(vectors) - 1) == 0
    width = LANES                          # lanes of partial sums per input in each vector
    while width > 1:
        half, groups = width // 2, LANES // width
        lo = [g * width + i for g in range(groups) for i in range(half)]
        lo = lo + [LANES + x for x in lo]
        lo, hi = (ir.Constant(ir.VectorType(_I32, LANES), [x + h for x in lo]) for h in (0, half))
        vectors = [builder.fadd(builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi))
                   for a, b in zip(vectors[0::2], vectors[1::2])]
        width = half
    return vectors


def _lanes_of(builder, vectors, i):
    """Element i of the concatenation of ``vectors`` (each of the same length)."""
    n = vectors[0].type.count
    return builder.extract_element(vectors[i // n], ir.Constant(_I32, i % n))


def _array(context, builder, ty, value):
    return context.make_array(ty)(context, builder, value)


def _line_count(builder, D, size):
    """Cache lines of a row of D elements of ``size`` bytes (rows start anywhere: one more)."""
    return builder.add(builder.udiv(builder.mul(D, _c64(size)), _c64(64)), _c64(1))


# ---------------------------------------------------------------------------------------------
# scores: s[r * lds + c] = q[r0 + r] . K[c0 + c], r < nr (<= 4), c < nc; V rows
# voffs[c0 + c], c < nv, are prefetched into L2 along the way (the weighted sum takes them next)
# ---------------------------------------------------------------------------------------------

def _scores_codegen(kind):
    def codegen(context, builder, sig, args):
        s_ty, _, q_ty, _, _, src_ty, offs_ty, _, _, vsrc_ty, voffs_ty, _ = sig.args
        if not _runs(kind, src_ty):
            return context.get_dummy_value()
        s, lds, q, r0, nr, src, offs, c0, nc, vsrc, voffs, nv = args
        nv = _i64(context, builder, nv, sig.args[11])
        vrows = _Rows.of(context, builder, vsrc_ty, vsrc, kind)
        vodata = _array(context, builder, voffs_ty, voffs).data
        lds, r0, nr, c0, nc = (_i64(context, builder, v, sig.args[i])
                               for i, v in ((1, lds), (3, r0), (4, nr), (7, c0), (8, nc)))
        qa = _array(context, builder, q_ty, q)
        D = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
        qstride = builder.sdiv(cgutils.unpack_tuple(builder, qa.strides, 2)[0], _c64(4))
        sdata = _array(context, builder, s_ty, s).data
        odata = _array(context, builder, offs_ty, offs).data
        rows = _Rows.of(context, builder, src_ty, src, kind)
        qrows = _Rows(builder, qa.data, _F32, "native")
        last_r = builder.sub(nr, _c64(1))
        qoff = [builder.mul(builder.add(r0, _min(builder, _c64(r), last_r)), qstride)
                for r in range(_BLOCK)]
        nlines = _line_count(builder, D, rows.size)
        d_main = builder.sub(D, builder.srem(D, _c64(LANES)))
        nblocks = builder.sdiv(builder.add(nc, _c64(_BLOCK - 1)), _c64(_BLOCK))
        last_c = builder.sub(nc, _c64(1))
        with counted_loop(builder, nblocks) as blk:
            c = builder.mul(blk, _c64(_BLOCK))
            koff = [_load_i64(builder, odata, builder.add(c0, _min(builder, builder.add(
                c, _c64(t)), last_c))) for t in range(_BLOCK)]
            for t in range(_BLOCK):
                ct = builder.add(c, _c64(t))
                _prefetch(builder, (rows, odata, c0, nc), builder.add(ct, _c64(PF_ROWS)), nlines)
                _prefetch(builder, (vrows, vodata, c0, nv), ct, nlines, _L2)
            acc = _accumulators(builder, _BLOCK * _BLOCK)

            def step(d, mask):
                ks = [rows.load(builder.add(o, d), mask) for o in koff]
                for r in range(_BLOCK):
                    x = qrows.load(builder.add(qoff[r], d), mask)
                    for t in range(_BLOCK):
                        a = acc[r * _BLOCK + t]
                        builder.store(_fma(builder, x, ks[t], builder.load(a)), a)

            _row_loop(builder, D, d_main, step)
            sums = _reduce_lanes(builder, [builder.load(a) for a in acc])
            _store_block(builder, sdata, lds, c, nc, nr, sums)
        return context.get_dummy_value()
    return codegen


def _min(builder, a, b):
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _load_i64(builder, data, index):
    return builder.load(builder.gep(data, [index]))


def _accumulators(builder, n):
    """n zeroed vector variables (allocas in the entry block, promoted to registers)."""
    out = []
    for _ in range(n):
        a = cgutils.alloca_once(builder, _VF)
        builder.store(ir.Constant(_VF, None), a)
        out.append(a)
    return out


def _row_loop(builder, D, d_main, step):
    """step(d, mask) for d = 0, LANES, .. < d_main unmasked, then once masked for the rest."""
    nvec = builder.sdiv(d_main, _c64(LANES))
    with counted_loop(builder, nvec) as index:
        step(builder.mul(index, _c64(LANES)), None)
    with builder.if_then(builder.icmp_signed("<", d_main, D), likely=False):
        step(d_main, _lane_mask(builder, builder.sub(D, d_main)))


def _prefetch(builder, kv, c, nlines, level=_L1):
    """Prefetch row c of kv = (rows, offsets, c0, nc) where it exists (c < nc)."""
    rows, odata, c0, nc = kv
    with builder.if_then(builder.icmp_signed("<", c, nc)):
        rows.prefetch(_load_i64(builder, odata, builder.add(c0, c)), nlines, level)


def _store_block(builder, sdata, lds, c, nc, nr, sums):
    """s[r * lds + c + t] = sums[r * 4 + t] for r < nr and c + t < nc."""
    full = builder.icmp_signed("<=", builder.add(c, _c64(_BLOCK)), nc)
    for r in range(_BLOCK):
        with builder.if_then(builder.icmp_signed("<", _c64(r), nr)):
            at = builder.add(builder.mul(_c64(r), lds), c)
            with builder.if_else(full, likely=True) as (whole, part):
                with whole:
                    vec = ir.Constant(ir.VectorType(_F32, _BLOCK), None)
                    for t in range(_BLOCK):
                        vec = builder.insert_element(vec, _lanes_of(builder, sums, r * _BLOCK + t),
                                                     ir.Constant(_I32, t))
                    _store_f32(builder, sdata, at, vec)
                with part:
                    for t in range(_BLOCK):
                        with builder.if_then(builder.icmp_signed(
                                "<", builder.add(c, _c64(t)), nc)):
                            builder.store(_lanes_of(builder, sums, r * _BLOCK + t),
                                          builder.gep(sdata, [builder.add(at, _c64(t))]))


def _scores_typer(kind):
    def typer(typingctx, s, lds, q, r0, nr, src, offs, c0, nc, vsrc, voffs, nv):
        if not all(isinstance(a, types.Array) for a in (s, q, src, offs, vsrc, voffs)) \
                or q.ndim != 2:
            return None
        return (types.none(s, lds, q, r0, nr, src, offs, c0, nc, vsrc, voffs, nv),
                _scores_codegen(kind))
    return typer


# ---------------------------------------------------------------------------------------------
# weighted sum: acc[r * ld + d] += sum over c < nc of p[r * lds + c] * V[c0 + c, d], r < nr
# (<= 4), d < D, every weight nonzero (the caller takes columns with a zero weight elsewhere:
# a zero weight never meets V); the K rows koffs[c0 + c], c < nk, are prefetched into L2 on
# the way (those the caller reads next)
# ---------------------------------------------------------------------------------------------

def _weighted_sum_codegen(kind):
    def codegen(context, builder, sig, args):
        acc_ty, _, _, _, p_ty, _, src_ty, offs_ty, _, _, ksrc_ty, koffs_ty, _ = sig.args
        if not _runs(kind, src_ty):
            return context.get_dummy_value()
        acc, ld, nr, D, p, lds, src, offs, c0, nc, ksrc, koffs, nk = args
        ld, nr, D, lds, c0, nc, nk = (_i64(context, builder, v, sig.args[i]) for i, v in
                                      ((1, ld), (2, nr), (3, D), (5, lds), (8, c0), (9, nc),
                                       (12, nk)))
        adata = _array(context, builder, acc_ty, acc).data
        pdata = _array(context, builder, p_ty, p).data
        odata = _array(context, builder, offs_ty, offs).data
        rows = _Rows.of(context, builder, src_ty, src, kind)
        krows = _Rows.of(context, builder, ksrc_ty, ksrc, kind)
        next_keys = (krows, _array(context, builder, koffs_ty, koffs).data, c0, nk)
        nlines = _line_count(builder, D, rows.size)
        span = _c64(_SLICE * LANES)
        nslices = builder.sdiv(builder.add(D, _c64(_SLICE * LANES - 1)), span)
        sw = builder.switch(nr, builder.function.append_basic_block("nr_other"))
        done = builder.function.append_basic_block("weighted_sum_done")
        for n in range(1, _BLOCK + 1):
            blk = builder.function.append_basic_block(f"nr_{n}")
            sw.add_case(ir.Constant(_I64, n), blk)
            builder.position_at_end(blk)
            with counted_loop(builder, nslices) as sl:
                d0 = builder.mul(sl, span)
                prefetch = builder.icmp_signed("==", sl, _c64(0))
                _slice(builder, (adata, ld, n, d0, D), (pdata, lds), (rows, odata, c0, nc),
                       (prefetch, nlines, next_keys))
            builder.branch(done)
        builder.position_at_end(sw.default)
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return codegen


def _slice(builder, out, weights, kv, prefetch):
    """Elements [d0, d0 + SLICE * LANES) of the n accumulator rows (out = (acc data, ld, n, d0,
    D)) over every V row of the tile; the rows PF_ROWS ahead prefetched in the first slice."""
    adata, ld, n, d0, D = out
    masks = [_lane_mask(builder, builder.sub(D, builder.add(d0, _c64(v * LANES))))
             for v in range(_SLICE)]
    whole = builder.icmp_signed("<=", builder.add(d0, _c64(_SLICE * LANES)), D)
    with builder.if_else(whole, likely=True) as (full, part):
        with full:
            _slice_rows(builder, out, weights, kv, prefetch, [None] * _SLICE)
        with part:
            _slice_rows(builder, out, weights, kv, prefetch, masks)


def _slice_rows(builder, out, weights, kv, prefetch, masks):
    """:func:`_slice` with the lane masks of its vectors (None: all lanes)."""
    adata, ld, n, d0, D = out
    pdata, lds = weights
    rows, odata, c0, nc = kv
    do_prefetch, nlines, next_keys = prefetch
    acc = [[cgutils.alloca_once(builder, _VF) for _ in range(_SLICE)] for _ in range(n)]
    at = [[builder.add(builder.mul(_c64(r), ld), builder.add(d0, _c64(v * LANES)))
           for v in range(_SLICE)] for r in range(n)]
    arows = _Rows(builder, adata, _F32, "native")
    for r in range(n):
        for v in range(_SLICE):
            builder.store(arows.load(at[r][v], masks[v]), acc[r][v])
    # columns PF_ROWS at a time, each group's prefetches ahead of it first: no branch between
    # the accumulator updates of a group
    ngroups = builder.sdiv(builder.add(nc, _c64(PF_ROWS - 1)), _c64(PF_ROWS))
    with counted_loop(builder, ngroups) as grp:
        cg = builder.mul(grp, _c64(PF_ROWS))
        with builder.if_then(do_prefetch):
            with counted_loop(builder, _c64(PF_ROWS)) as t:
                ct = builder.add(cg, t)
                _prefetch(builder, kv, builder.add(ct, _c64(PF_ROWS)), nlines)
                _prefetch(builder, next_keys, ct, nlines, _L2)
        with counted_loop(builder, _min(builder, _c64(PF_ROWS), builder.sub(nc, cg))) as col:
            c = builder.add(cg, col)
            w = [builder.load(builder.gep(pdata, [builder.add(builder.mul(_c64(r), lds), c)]))
                 for r in range(n)]
            vo = builder.add(_load_i64(builder, odata, builder.add(c0, c)), d0)
            vs = [rows.load(builder.add(vo, _c64(v * LANES)), masks[v]) for v in range(_SLICE)]
            add_products(builder, _fma, w, vs, acc)
    for r in range(n):
        for v in range(_SLICE):
            _store_f32(builder, adata, at[r][v], builder.load(acc[r][v]), masks[v])


def _weighted_sum_typer(kind):
    def typer(typingctx, acc, ld, nr, D, p, lds, src, offs, c0, nc, ksrc, koffs, nk):
        if not all(isinstance(a, types.Array) for a in (acc, p, src, offs, ksrc, koffs)):
            return None
        return (types.none(acc, ld, nr, D, p, lds, src, offs, c0, nc, ksrc, koffs, nk),
                _weighted_sum_codegen(kind))
    return typer


def _runs(kind, src_ty):
    """Whether a product of ``kind`` can run on rows of array type src_ty: the 16-bit kinds on
    uint16 bits, "native" on the others. The kernels type the products of every storage in
    branches on its code, and the branch that cannot run for an array emits no code."""
    return (src_ty.dtype == types.uint16) == (kind != "native")


def _intrinsics(kind):
    return intrinsic(_scores_typer(kind)), intrinsic(_weighted_sum_typer(kind))


#: scores(s, lds, q, r0, nr, src, offs, c0, nc, vsrc, voffs, nv) and weighted_sum(acc, ld, nr, D, p, lds, src,
#: offs, c0, nc, ksrc, koffs, nk) by the rows' storage: IEEE half bits, bfloat16 bits, float32 or int8 values
(scores_f16, weighted_sum_f16), (scores_bf16, weighted_sum_bf16), \
    (scores_native, weighted_sum_native) = (_intrinsics(k) for k in ("f16", "bf16", "native"))
