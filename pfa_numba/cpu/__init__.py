"""The CPU backend: tiled online-softmax kernels in Numba, each kernel its own compiled unit.

Work items are (batch, kv head, query-row block). A work item holds the rows ``[i0, i0 + r)``
of all G query heads that read one kv head, stacked into one ``(G*r, D)`` float32 block, so one
loaded K/V tile serves the whole GQA group and the tile products are large GEMMs:

    S = Q_block @ K_tile^T          (into a per-thread buffer)
    per row: pse, fp16 mask, band / user mask (-inf), running max m, p = exp(s - m), sum l
    acc = acc * exp(m_old - m_new);  acc += P @ V_tile   (accumulating in place)

and the division by l happens once, at the end (deferred normalisation). Q/K/V are read in
place through strided views of their memory (a flat read-only array plus element offsets),
fp16/bf16 as uint16 bits widened per tile, so a layout change never copies. Per-thread
buffers are O(rows x kv tile); no Sq x Skv matrix exists. Threads take runs of work items as
they free up; each item is computed by one thread, the same way whichever thread takes it, so
results do not depend on the thread count or on which thread takes which item.

Each kernel variant (``variants``: int8, split-kv, streaming, amx, avx512-tiles, blas-tiles)
runs steps, each one kernel's worker (``launch``) over some runs of items, compiled when a call
first runs it: the float32 tiles on AVX-512 register blocks or BLAS (``float_tiles``), the
streaming kernel for items of few rows (``streaming`` over ``stream``), split-kv's merge
(``tile.merge``), AMX (``block_amx`` with ``amx_pack``), int8 (``block_int8``), the int8
output's quantization (``quantize``) and the SDPA drop-in's backward (``backward``). Beside
them: ``driver`` (a problem's division of work and its launch: steps, buffers, tile sizes,
the log of what ran), ``items`` (work items and row segments), ``rows`` (per-row steps),
``tile`` (the tile loop the float kernels share, their start and finish), ``kv`` (the kv
sequence: prefix, own rows, paged blocks, int8 dequantization), ``split_kv``, ``records``, and
the tile products ``_gemm`` (AVX-512 register blocks), ``_blas`` (SciPy's sgemm), ``_amx``
(AMX tiles) and ``_simd`` (the streaming products), over ``_vector`` (CPU intrinsics).
"""
