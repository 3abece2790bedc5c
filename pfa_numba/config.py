"""Tunables of pfa_numba: data, not literals.

Kernels receive tile sizes as runtime arguments, so patching these values (as the tests do, with
small odd tiles) takes effect immediately, even for kernels loaded from Numba's on-disk cache.
Compiler flags are read once, when the kernels are compiled.
"""

#: Query rows per CPU work item, summed over the G query heads that share one kv head
#: (a work item holds ``max(1, CPU_Q_ROWS // G)`` rows of each of those heads).
#: Key/value columns per CPU tile.
#: Measured 2026-11-29, fp32 (1, 4, 2048, 128), 1 thread, BLAS products: 512 x 512 tiles 74
#: GFLOP/s, 256 x 512 65, 128 x 512 61, 512 x 256 64, 1024 x 512 70 (the GEMM N = query rows
#: wants to be large). With the AVX-512 register blocks, 2 threads, time relative to 512 x 512:
#: (1, 16, 2048, 128) 256 x 512 1.06, 512 x 256 1.03, 1024 x 512 0.98, 512 x 1024 0.98, 384 x 384
#: 1.02; (1, 16, 1024, 64) 1.09 / 1.12 / 1.00 / 0.98 / 1.10. Once the per-row helpers ran
#: without reference counting, 1024 x 512 against 512 x 512 (2 threads, interleaved medians):
#: fp32 (1, 16, 2048, 128) dense 0.97, causal 0.94; (1, 16, 1024, 64) 0.97; (1, 8, 8192, 64)
#: 0.96; bf16 (1, 16, 2048, 128) 0.95 (each K / V tile is packed once per 1024 rows). With
#: threads taking work items as they free up, 512 against 1024 rows (2 threads, interleaved
#: medians): fp32 (1, 16, 1024, 64) 1.02, (1, 16, 2048, 128) 1.07; bf16 1.04 / 1.06: more
#: items balance the threads better, but cost more K / V packing.
CPU_Q_ROWS = 1024
CPU_KV_COLS = 512

#: A tile the band cuts (a causal diagonal, a band edge) is computed CPU_SUB_ROWS rows at a
#: time (rounded up to a multiple of 32), each over just the columns those rows can keep; a
#: tile inside the band CPU_SEG_ROWS rows at a time. Measured 2026-11-29, 2 threads, medians:
#: causal (4, 32, 512, 128) fp32 137 ms without row segments, 101 ms with 128-row ones (torch
#: 110 ms); sub rows 32 / 64 / 128 / 256 within noise of each other for causal and band 256,
#: 64 kept for narrow bands. Inside tiles, fp32 (1, 16, 2048, 128): 64 / 128 / 256 / 512 rows
#: 329 / 293 / 273 / 260 ms, so 512 = whole tiles. bf16 on AMX keeps its scores and bf16 P
#: in L2 with short segments: (1, 16, 2048, 128), 2 threads, 64 / 128 / 256 / 512 rows ran
#: 104 / 113 / 118 / 119 ms (1 thread: within noise). With the AVX-512 register blocks (2
#: threads), inside segments of 256 / 128 / 64 rows ran 1.05 / 1.05 / 1.05x the time of 512 at
#: (1, 16, 2048, 128) and 0.97 / 0.96 / 1.01x at (1, 16, 1024, 64): 512 kept. AMX segments, with
#: float16 on AMX too (2 threads, interleaved medians, time relative to 64 rows): 32 / 128 rows
#: fp16 (1, 16, 1024, 64) 1.03 / 1.01, bf16 (1, 16, 2048, 128) 1.01 / 0.98: 64 kept.
CPU_SUB_ROWS = 64
CPU_SEG_ROWS = 512
CPU_AMX_SEG_ROWS = 64

#: A band narrower than the tiles wastes the scores outside it: for a finite band of width W
#: (= preE + nextE + 1) the kv tile becomes max(CPU_BAND_TILE_MIN, W // CPU_BAND_TILE_DIV)
#: columns, and a work item CPU_BAND_Q_TILES times that many query rows (at most CPU_Q_ROWS).
#: Measured 2026-11-29 (fp32 (1, 16, 2048, 128), pre = next = 256, before row segments):
#: tiles 64 / 128 / 256 / 513 ran 90 / 81 / 74 / 90 ms; with row segments cutting the band's
#: edge triangles, 256-wide tiles (W // 2) keep most of that gain for wide and narrow bands.
#: Rows per item (2 threads, time relative to 1 tile of rows): pre = next = 256, fp32 2 / 4
#: tiles 0.96 / 0.95, W // 4 columns with 2 tiles 1.05; bf16 0.94 / 0.94; pre = next = 64, fp32
#: 0.96 / 0.95 (fewer packings of each K / V row).
CPU_BAND_TILE_MIN = 128
CPU_BAND_TILE_DIV = 2
CPU_BAND_Q_TILES = 2

#: LLVM fast-math flags for the CPU kernels. Only flags that keep inf/NaN semantics: masking,
#: the -inf softmax_lse of empty rows and NaN propagation rely on them, so never 'nnan' or
#: 'ninf' (and so never the all-flags boolean form). 'reassoc' lets the row sums vectorise;
#: 'contract' allows FMA; 'arcp', 'nsz' and 'afn' cost no inf/NaN behaviour.
CPU_FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

#: bf16 and float16 tile products on Intel AMX where the CPU and OS offer it (pfa_numba.cpu._amx;
#: float16 as exact bf16 hi + lo parts). False: the float32 path for every dtype. Measured
#: 2026-11-29, fp16 (1, 16, 2048, 128), 2 threads: 142 ms on AMX, 199 ms on the float32 path.
CPU_AMX = True

#: float32 tile products (fp32 / fp16 storage, and bf16 without AMX) on the register-blocked
#: AVX-512 kernels of pfa_numba.cpu._gemm where the host has AVX-512; False, or a host without it:
#: SciPy's BLAS sgemm. Measured 2026-11-29, 1 thread, 512 x 512 tiles, D = 128 / 64:
#: Q K^T 151 / 148 GFLOP/s vs sgemm 126 / 116; P V 148 / 138 vs 130 / 121.
CPU_AVX512_GEMM = True

#: Numba threads used by one call (None: numba.get_num_threads() at call time).
CPU_THREADS = None

#: CUDA: query rows (= threads) per block, and kv columns per shared-memory tile; a tile holds
#: at most CUDA_TILE_ELEMS float32 values per K and per V (2 x 16 KiB at the default), so its
#: column count shrinks for large head dims.
CUDA_Q_ROWS = 64
CUDA_KV_COLS = 64
CUDA_TILE_ELEMS = 4096

#: fast-math flags for the CUDA kernel: none. numba-cuda's fastmath flushes subnormals to
#: zero, which would break the exact float16 subnormal conversions of _core.
CUDA_FASTMATH = frozenset()
