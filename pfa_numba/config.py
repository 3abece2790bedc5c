"""Tunables of pfa_numba: data, not literals.

Kernels receive tile sizes as runtime arguments, so patching these values (as the tests do, with
small odd tiles) takes effect immediately, even for kernels loaded from Numba's on-disk cache.
Compiler flags are read once, when the kernels are compiled.
"""

# The measurements behind these values, with dates, shapes and threads: docs/tuning.md.

#: Query rows per CPU work item: a long GEMM N, and each K / V tile packed once for many rows.
#: Summed over the G query heads of one kv head: ``max(1, CPU_Q_ROWS // G)`` rows of each.
CPU_Q_ROWS = 1024
#: Key/value columns per CPU tile: narrower tiles ran slower, wider ones no faster (docs/tuning.md).
CPU_KV_COLS = 512

#: Rows per segment of a tile the band cuts (causal diagonal, band edge): short for narrow bands.
#: Each spans just the columns its rows keep (the rest is skipped); rounded up to a multiple of 32.
CPU_SUB_ROWS = 64
#: Rows per segment of a tile inside the band, float32 path: no shorter one won on every shape.
CPU_SEG_ROWS = 512
#: Rows per segment of a tile inside the band on AMX: short segments keep scores and P in L2.
CPU_AMX_SEG_ROWS = 64

#: Fewest kv columns of a finite band's tile: narrower tiles cost more than they save.
#: A band of width W = preE + nextE + 1 gets max(CPU_BAND_TILE_MIN, W // CPU_BAND_TILE_DIV).
CPU_BAND_TILE_MIN = 128
#: Band tile = band width / this: a tile as wide as the band computes scores outside it.
CPU_BAND_TILE_DIV = 2
#: Query rows of a band work item, in band tiles (at most CPU_Q_ROWS): fewer K / V packings.
CPU_BAND_Q_TILES = 2

#: LLVM fast-math flags of the CPU kernels: only those keeping inf/NaN, which masks and lse need.
#: Never 'nnan' / 'ninf' (nor the all-flags form); 'reassoc' vectorises row sums, 'contract' FMA.
CPU_FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})

#: bf16 and float16 tile products on Intel AMX where CPU and OS offer it: faster than float32 path.
#: float16 as exact bf16 hi + lo parts (pfa_numba.cpu._amx); False: float32 path for every dtype.
CPU_AMX = True

#: float32 tile products on the AVX-512 register blocks of pfa_numba.cpu._gemm: faster than sgemm.
#: fp32 / fp16 storage and bf16 without AMX; False, or a host without AVX-512: SciPy's BLAS sgemm.
CPU_AVX512_GEMM = True

#: Split-kv: a call with fewer work items than this many per thread (decode at a small batch)
#: cuts each item's kv range into pieces computed in parallel, then merged exactly. More than 1
#: merges work that equal items already balance (docs/tuning.md). Streaming items run their kv
#: heads together in as many runs as this asks for (0: every kv head of a block in one run).
CPU_SPLIT_KV_ITEMS = 1
#: Fewest kv columns of a split-kv piece: a shorter one costs more in merging than it saves.
CPU_SPLIT_KV_MIN_COLS = 256

#: Work items of at most this many rows (decode: the G query heads of one position) stream each
#: K and V row once from the cache instead of packing tiles, several kv heads a tile at once
#: (cpu/stream.py, cpu/items.kv_head_runs; docs/tuning.md).
CPU_STREAM_ROWS = 16
#: K + V bytes of a streaming tile whose cache rows hold every kv head (BSH, BSND, TND, their
#: paged pools): wider tiles, which BNSD caches want (CPU_KV_COLS), ran slower there.
CPU_STREAM_TILE_BYTES = 1 << 18

#: Decode items prefetch into L2, during P V, the K rows they read next (another kv head's tile,
#: or the next tile) where those rows jump (paged, BSH). None: on AMD Zen hosts only, where it
#: ran faster; on an Intel Xeon it ran slower (docs/tuning.md).
CPU_PREFETCH_NEXT_KEYS = None

#: Numba threads used by one call (None: numba.get_num_threads() at call time).
CPU_THREADS = None
#: Threads a call's work is divided for (split-kv pieces, runs of kv heads), whatever number it
#: runs on (CPU_THREADS, numba.set_num_threads): a call's bits do not depend on that number.
#: None: the process's thread pool, numba.config.NUMBA_NUM_THREADS (the cores, by default).
CPU_WORK_THREADS = None

#: Say on stderr, once per kernel and process, when a call compiles a kernel (a new machine's
#: first call of each kind: tens of seconds, then Numba's cache serves it; pfa_numba.cache).
COMPILE_NOTICES = True

#: CUDA query rows (= threads) per block.
CUDA_Q_ROWS = 64
#: CUDA kv columns per shared-memory tile; fewer for large head dims (see CUDA_TILE_ELEMS).
CUDA_KV_COLS = 64
#: float32 values per K and per V tile at most (2 x 16 KiB here): within static shared memory.
CUDA_TILE_ELEMS = 4096

#: fp16/bf16 on the tensor-core kernels (gpu.tc_kernel, and gpu.decode_kernel for calls of at
#: most 16 query rows a kv head) where they take the problem; False: the portable kernel runs
#: every CUDA call.
CUDA_TENSOR_CORES = True

#: The decode kernel's split of the kv range: enough (batch, kv head, split) blocks for this many
#: a multiprocessor, each split at least CUDA_DECODE_MIN_TILES tiles of 64 keys.
CUDA_DECODE_BLOCKS_PER_SM = 4
CUDA_DECODE_MIN_TILES = 4

#: No CUDA fast-math: numba-cuda's flushes subnormals, breaking numerics.core's exact float16 conversions.
CUDA_FASTMATH = frozenset()

#: The tensor-core kernel's softmax weights exp2(t - m) by ``ex2.approx.ftz`` (one instruction,
#: where keeping subnormals costs four): a weight or rescale factor below 2^-126 becomes 0. Both
#: are relative to the row's largest weight (1) and its sum (>= 1), so no result moves by more
#: than 2^-126 of itself; inf and NaN are kept. False: ``ex2.approx`` with subnormals.
CUDA_EXP2_FTZ = True
