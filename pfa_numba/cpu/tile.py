"""The tile loop every float kernel of the CPU shares, with pluggable products.

The float32 kernel (register blocks or BLAS), the AMX kernel and the streaming decode kernel
differ only in their products: how a kv tile is loaded, how S = Q K^T is formed and how
acc += P V is added. The rest is one rule, here: the row segments of a tile (a band cuts
them, :func:`.items.segment`), the masked online-softmax step (:func:`.rows.softmax_rows`) and
the rescale of the running sums; the finish is :func:`.block_f32.finish` for all of them.

A kernel declares its products with :func:`products`, under the record class of what they
read (``kernel``, a namedtuple of :mod:`.records`); the loop calls them through
:func:`load_tile`, :func:`scores` and :func:`weighted_sum`, which Numba resolves by that
record's type when it compiles the loop, once per kernel (a function passed as an argument
instead would be a run-time value, which Numba's cache cannot store). What they take and give:

* ``load_tile(kernel, ins, item, cols, prefix, sdk, sdv)`` -> (ok, tile): the K and V rows of
  the tile of cols = (j0, nc) columns (their places in ``kernel``'s buffers, from
  :func:`.kv.next_tile`); ``tile``: what the products need to know of it; ok False: this
  kernel cannot take the tile exactly (the caller falls back to another, nothing written);
* ``scores(kernel, tile, seg)`` -> (s2, p3, keys, split, lazy, scale): the segment's scores
  and the other arguments of :func:`.rows.softmax_rows`;
* ``weighted_sum(kernel, tile, seg, s2, acc, ld, state)``: acc (the segment's first row) +=
  P V.

seg = (r0, r1, c0, ns, inside): rows [r0, r1) of the item over the ns columns from tile
column c0, ``inside`` the band.
"""
from numba import njit
from numba.extending import overload

from ..numerics.kernel_args import P_COLS, P_D
from ._jit import LEAF
from .items import segment
from .kv import next_tile
from .rows import rescale_rows, softmax_rows

#: {record class: (load_tile, scores, weighted_sum)} of every kernel
_PRODUCTS = {}


def products(record, load_tile, scores, weighted_sum):
    """Declare the products of the kernel whose products read a ``record`` (load_tile: None
    for a kernel that loads no tiles)."""
    _PRODUCTS[record] = (load_tile, scores, weighted_sum)


def load_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    """The declared load_tile of ``kernel``'s products."""


def scores(kernel, tile, seg):
    """The declared scores of ``kernel``'s products."""


def weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    """The declared weighted_sum of ``kernel``'s products."""


# Each overload's implementation is a call of the product declared for the record type of
# ``kernel``, inlined where the loop calls it.

@overload(load_tile, inline="always")
def _load_tile(kernel, ins, item, cols, prefix, sdk, sdv):
    impl = _PRODUCTS[kernel.instance_class][0]
    return lambda kernel, ins, item, cols, prefix, sdk, sdv: impl(kernel, ins, item, cols,
                                                                   prefix, sdk, sdv)


@overload(scores, inline="always")
def _scores(kernel, tile, seg):
    impl = _PRODUCTS[kernel.instance_class][1]
    return lambda kernel, tile, seg: impl(kernel, tile, seg)


@overload(weighted_sum, inline="always")
def _weighted_sum(kernel, tile, seg, s2, acc, ld, state):
    impl = _PRODUCTS[kernel.instance_class][2]
    return lambda kernel, tile, seg, s2, acc, ld, state: impl(kernel, tile, seg, s2, acc, ld,
                                                               state)


@njit(**LEAF)
def tile_step(kernel, tile, item, rows, align, extras, geo, tuning, state, acc, ld):
    """One kv tile [j0, j1) of an item (rows = (i1, R, j0, j1), see :func:`.items.item_rows`;
    ``tile``: what load_tile gave), segment by segment (``align``: the products' column
    granularity): S by the scores product, the masked online-softmax step, acc *= alpha,
    acc += P V by the weighted_sum product (acc: rows of ld values)."""
    b, _, i0 = item
    i1, R, j0, j1 = rows
    params = geo.params
    r0 = 0
    while r0 < R:
        r1, cl, ch, inside = segment(params, tuning, geo.lens, b, i0, i1, j0, j1, r0, R, align)
        if ch > cl:
            seg = (r0, r1, cl - j0, ch - cl, inside)
            s2, p3, keys, split, lazy, scale = scores(kernel, tile, seg)
            softmax_rows(s2, p3, keys, (r0, r1, ch - cl, cl, inside, split, lazy), item, extras,
                         geo, state, scale)
            rescale_rows(acc[r0 * ld:], ld, r1 - r0, params[P_D], state.alpha[r0:])
            weighted_sum(kernel, tile, seg, s2, acc[r0 * ld:], ld, state)
        r0 = r1


@njit(**LEAF)
def walk_tiles(kernel, ins, item, rows, align, extras, geo, tuning, state, acc, ld, places):
    """Every kv tile of an item's rows = (i1, R, jstart, jend) in the kv sequence of :mod:`.kv`
    (places = (ro, rs): next_tile's row buffers), loaded by the load_tile product and taken by
    :func:`tile_step`. Returns False as soon as a load refuses its tile."""
    b, g, _ = item
    i1, R, jstart, jend = rows
    ro, rs = places
    j0 = jstart
    while j0 < jend:
        j1, nc, prefix, sdk, sdv = next_tile(ins, geo, b, g, j0, geo.params[P_COLS], jend, ro,
                                             rs)
        ok, tile = load_tile(kernel, ins, item, (j0, nc), prefix, sdk, sdv)
        if not ok:
            return False
        tile_step(kernel, tile, item, (i1, R, j0, j1), align, extras, geo, tuning, state, acc,
                  ld)
        j0 = j1
    return True
