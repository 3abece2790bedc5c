"""The records the CPU kernels pass along, by name: Numba types a namedtuple's fields as it
types a tuple's, so a field read costs what an index did.

Numba's on-disk cache pickles these classes by name in the index of every kernel that takes
one, and reading an index fails where a name it holds is gone: a record renamed or removed
keeps its old name here as an alias, so that caches written before still load."""
from collections import namedtuple

#: where elements lie and the problem's sizes (numerics.kernel_args' strides, base offsets,
#: lengths and params)
Geometry = namedtuple("Geometry", ["strides", "boff", "lens", "params"])

#: how the CPU cuts and computes the work (the driver's choice, not the problem's): threads,
#: rows per segment of a tile the band cuts (sub) and of one inside it (seg), register-block
#: products (gemm, else BLAS), the BLAS sgemm address, the most rows of an item that streams
#: its K / V rows, and whether streaming items prefetch the K rows they read next
Tuning = namedtuple("Tuning", ["threads", "sub", "seg", "gemm", "blas", "stream", "next_keys"])

#: what a work item reads: query, key, value (flat storage) and fused_infer_attention_score's
#: kv cache arguments (see .kv): the shared prefix's key and value, the block table, the
#: channel planes and the token planes of an int8 cache. (One level: a parallel kernel's
#: records hold arrays, not records.)
Inputs = namedtuple("Inputs", ["q", "k", "v", "kp", "vp", "table", "channel", "key_scales",
                               "key_offsets", "value_scales", "value_offsets"])

#: what finished rows write: the output, softmax_lse, and the rows-computed flags
Outputs = namedtuple("Outputs", ["out", "lse", "flags"])

#: the score terms a user gives: a bool/int8 mask, a float16 mask, pse_shift, the softcap of
#: the scores (one float32; 0: none) and the sink logit of each query head (float32; empty:
#: none), these two read from the kernel arguments' fparams (numerics.kernel_args)
Extras = namedtuple("Extras", ["mask8", "mask16", "pse", "softcap", "sinks"])

#: the online softmax's state of an item's rows: running max, running sum, acc rescale factor
RowState = namedtuple("RowState", ["m", "l", "alpha"])

#: a thread's float32 tile buffers: query rows, scores, scratch rows, sums, the K and V tiles,
#: the row maxima's order keys, kv row offsets and an int8 tile's token scales
F32Buffers = namedtuple("F32Buffers", ["qb", "sb", "tb", "acc", "kb", "vb", "kx", "ro", "rs"])

#: a thread's AMX tile buffers: the tile configuration, packed query, K^T and V tiles, the
#: packing scratch, scores, weights as bf16 parts, sums, kv row offsets and token scales
AmxBuffers = namedtuple("AmxBuffers", ["cfg", "qh", "kt", "vv", "tmp", "sb", "pp", "acc", "ro",
                                       "rs"])

#: a thread's buffers for the streaming items of a run, each head's part in turn: query rows,
#: sums, the row state's (m, l, alpha) and an int8 cache's folded sums
RunBuffers = namedtuple("RunBuffers", ["q", "acc", "m", "l", "alpha", "fold"])

#: what the float32 kernel's products read (see .tile): the thread's F32Buffers, BLAS's scratch,
#: whether the register blocks run (else BLAS), whether a user mask or pse applies, the empty
#: bf16 parts of an in-place softmax, the head dim, the acc / V row length, the kv storage code
#: and whether int8 rows are dequantized
F32Products = namedtuple("F32Products", ["bufs", "blas", "own", "any_user", "no_p3", "D", "ld",
                                         "code", "dequant"])

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
