"""The CPU backend: ``@njit(parallel=True)`` tiled online-softmax kernels.

Work items are (batch, kv head, query-row block). A work item holds the rows ``[i0, i0 + r)``
of all G query heads that read one kv head, stacked into one ``(G*r, D)`` float32 block, so one
loaded K/V tile serves the whole GQA group and the tile products are large GEMMs:

    S = Q_block @ K_tile^T          (into a per-thread buffer)
    per row: pse, fp16 mask, band / user mask (-inf), running max m, p = exp(s - m), sum l
    acc = acc * exp(m_old - m_new);  acc += P @ V_tile   (accumulating in place)

and the division by l happens once, at the end (deferred normalisation). The products run on
the register-blocked AVX-512 kernels of ``_gemm`` (K packed into K^T panels as it is loaded)
or, on hosts without AVX-512, on SciPy's BLAS sgemm; bf16 and float16 storage run them on AMX
where the host has it (``_amx``; float16 as exact hi + lo bf16 parts). Per-thread tile buffers
start a cache line. Tiles that lie wholly outside the band or past kL are never visited; tiles
wholly inside the band (with no user mask or pse) touch no per-element mask. Q/K/V are read in
place through strided views of their memory (a flat read-only array plus element offsets),
fp16/bf16 as uint16 bits widened per tile, so a layout change never copies and only two
kernels are compiled (uint16 and float32 storage). Per-thread buffers are O(rows x kv tile);
no Sq x Skv matrix exists. Threads take work items as they free up; each item is computed by
one thread, the same way whichever thread takes it, so results do not depend on the thread
count or on which thread takes which item.

Modules: ``driver`` (a planned problem's division of work, which ``dispatch`` chooses a kernel
by, and its launch: buffers, tile sizes), ``items`` (work
items and row segments), ``rows`` (per-row steps), ``block_f32``, ``block_amx`` with
``amx_pack``, ``block_int8`` (one work item each), and the tile products ``_gemm`` (AVX-512
register blocks), ``_blas`` (SciPy's sgemm), ``_amx`` (AMX tiles) over ``_vector`` (CPU
intrinsics).
"""
