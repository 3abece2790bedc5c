"""The records the CPU kernels pass along, by name: Numba types a namedtuple's fields as it
types a tuple's, so a field read costs what an index did. A kernel's worker takes eight of them
(:mod:`.launch`), each holding arrays and numbers only (the parallel region passes records of
one level).

Numba's on-disk cache pickles these classes by name in the index of every kernel that takes
one, and reading an index fails where a name it holds is gone: a record renamed or removed
keeps its old name here as an alias, so that caches written before still load."""
from collections import namedtuple

#: where elements lie and the problem's sizes (numerics.kernel_args' strides, base offsets,
#: lengths and params), and its float32 parameters (the fparams: scale factors, int8 scales,
#: softcap, sink logits)
Geometry = namedtuple("Geometry", ["strides", "boff", "lens", "params", "fparams"])

#: how the CPU cuts and computes the work (the driver's choice, not the problem's): rows per
#: segment of a tile the band cuts (sub) and of one inside it (seg), the row length of the
#: sums and of a V tile (ld), the rows and kv columns a thread's tile buffers hold, the BLAS
#: sgemm address (0: no BLAS), the most rows of an item that streams its K / V rows, and
#: whether streaming items prefetch the K rows they read next
Tuning = namedtuple("Tuning", ["sub", "seg", "ld", "rows", "cols", "blas", "stream",
                               "next_keys"])

#: what a work item reads: query, key, value (flat storage) and fused_infer_attention_score's
#: kv cache arguments (see .kv): the shared prefix's key and value, the block table, the
#: channel planes and the token planes of an int8 cache
Inputs = namedtuple("Inputs", ["q", "k", "v", "kp", "vp", "table", "channel", "key_scales",
                               "key_offsets", "value_scales", "value_offsets"])

#: what finished rows write: the output, softmax_lse, and the rows-computed flags
Outputs = namedtuple("Outputs", ["out", "lse", "flags"])

#: the score terms a user gives: a bool/int8 mask, a float16 mask, pse_shift, the softcap of
#: the scores (one float32; 0: none) and the sink logit of each query head (float32; empty:
#: none), these two views of the geometry's fparams (numerics.kernel_args)
Extras = namedtuple("Extras", ["mask8", "mask16", "pse", "softcap", "sinks"])

#: the work a kernel takes: the work array (rows of .items' W_* columns; split_kv's groups for
#: the merge), the runs of it taken together ((n, 2) int64 [start, end) rows, most expensive
#: first), the counter the threads take runs by, and one flag an item a kernel may set (the
#: AMX kernel's items it leaves to the float32 tiles)
Items = namedtuple("Items", ["work", "runs", "taken", "flags"])

#: split-kv's pieces: per slot, their rows' sums and (m, l) (see .split_kv)
Parts = namedtuple("Parts", ["acc", "ml"])

#: the online softmax's state of an item's rows: running max, running sum, acc rescale factor
RowState = namedtuple("RowState", ["m", "l", "alpha"])

#: the float32 tiles' buffers, one row a thread (.launch.rows): query rows, scores, scratch
#: rows, sums, the K and V tiles, the row maxima's order keys, kv row offsets, an int8 tile's
#: token scales, the row state, BLAS's integer, float and character arguments, and the empty
#: bf16 parts of an in-place softmax
F32Scratch = namedtuple("F32Scratch", ["qb", "sb", "tb", "acc", "kb", "vb", "kx", "ro", "rs",
                                       "m", "l", "alpha", "bi", "bf", "bc", "p3"])

#: a thread's float32 tile buffers (its rows of F32Scratch)
F32Buffers = namedtuple("F32Buffers", ["qb", "sb", "tb", "acc", "kb", "vb", "kx", "ro", "rs"])

#: the streaming runs' buffers, one row a thread: each head's query rows, sums, row state
#: (m, l, alpha) and an int8 cache's folded sums, then a thread's StreamBuffers and the empty
#: bf16 parts of an in-place softmax
StreamScratch = namedtuple("StreamScratch", ["q", "acc", "m", "l", "alpha", "fold", "sb", "tb",
                                             "kg", "vg", "kx", "ro", "rs", "p3"])

#: a thread's streaming tile buffers: scores, scratch rows, a strided tile's K and V rows
#: gathered (in the cache's own storage), the order keys, kv row offsets, token scales
StreamBuffers = namedtuple("StreamBuffers", ["sb", "tb", "kg", "vg", "kx", "ro", "rs"])

#: a thread's buffers for the streaming items of a run, each head's part in turn: query rows,
#: sums, the row state's (m, l, alpha) and an int8 cache's folded sums
RunBuffers = namedtuple("RunBuffers", ["q", "acc", "m", "l", "alpha", "fold"])

#: the AMX kernel's buffers, one row a thread: the tile configuration, packed query, K^T and V
#: tiles, the packing scratch, scores, weights as bf16 parts, sums, kv row offsets, token
#: scales, finish's scratch row, the row state and an (unused) order-keys row
AmxScratch = namedtuple("AmxScratch", ["cfg", "qh", "kt", "vv", "tmp", "sb", "pp", "acc", "ro",
                                       "rs", "tb", "m", "l", "alpha", "kx"])

#: a thread's AMX tile buffers (its rows of AmxScratch, to the row state)
AmxBuffers = namedtuple("AmxBuffers", ["cfg", "qh", "kt", "vv", "tmp", "sb", "pp", "acc", "ro",
                                       "rs"])

#: the int8 kernel's buffers, one row a thread: query rows, scores, P8 . V, the exact sums
#: (float64), the K and V tiles, the row max and sum, BLAS's arguments
Int8Scratch = namedtuple("Int8Scratch", ["qb", "sb", "tb", "acc", "kb", "vb", "m", "l", "bi",
                                         "bf", "bc"])

#: the merge's buffers, one row a thread: an item's sums, its row state, finish's scratch row
MergeScratch = namedtuple("MergeScratch", ["acc", "m", "l", "alpha", "tb"])

#: what the float32 tiles' products read (see .tile): the thread's F32Buffers, the BLAS
#: arguments (products on BLAS), whether a user mask or pse applies (the register blocks take
#: the row maxima only without), the empty bf16 parts of an in-place softmax, the head dims
#: of query and key (D) and of value (Dv), the acc / V row length, the kv storage code and
#: whether int8 rows are dequantized
RegisterProducts = namedtuple("RegisterProducts", ["bufs", "any_user", "no_p3", "D", "Dv", "ld",
                                                   "code", "dequant"])
BlasProducts = namedtuple("BlasProducts", ["bufs", "blas", "no_p3", "D", "Dv", "ld", "code",
                                           "dequant"])

#: what the AMX kernel's products read: the thread's AmxBuffers, the head dim, its padded
#: width, the storage code, the score scale and the offsets of the float16 lo parts of the
#: packed query, K^T and V tiles (-1: bf16, no lo parts); no order keys (the softmax pass
#: takes the row maxima)
AmxProducts = namedtuple("AmxProducts", ["bufs", "D", "Dp", "code", "scale", "q_lo", "k_lo",
                                         "v_lo", "no_keys"])

#: what the streaming products read for one head's tile: its query rows, the tile's K and V
#: rows as (array, element offsets, storage code), the K rows to prefetch next, the scores,
#: token scales and int8 folded sums, a V row's buffer, whether int8 rows are folded, and the
#: empty bf16 parts and order keys of the in-place softmax
StreamProducts = namedtuple("StreamProducts", ["q2", "k_rows", "v_rows", "next_keys", "sb",
                                               "rs", "fold", "buf", "dequant", "no_p3",
                                               "no_keys"])

#: the backward's arguments (see .backward): query, key, value and dO (flat float32), the
#: problem's sizes (B, N, Nkv, Sq, Skv, D), the scores' terms (bias, discard mask, lens, scale,
#: softcap), lse and delta, the gradients written (dq, dk, dv, dbias, weights) and the switches
#: (whether dQ is added by the kv pass, whether dbias is wanted)
BackwardInputs = namedtuple("BackwardInputs", ["q", "k", "v", "do"])
BackwardTerms = namedtuple("BackwardTerms", ["bias", "mask", "lens", "scale", "cap"])
BackwardRows = namedtuple("BackwardRows", ["lse", "delta"])
Gradients = namedtuple("Gradients", ["dq", "dk", "dv", "dbias", "weights"])
#: the backward's buffers, one row a thread: four tiles and BLAS's arguments
BackwardScratch = namedtuple("BackwardScratch", ["t0", "t1", "t2", "t3", "bi", "bf", "bc"])

#: old names, for caches written before (see the module docstring)
F32Products = RegisterProducts
