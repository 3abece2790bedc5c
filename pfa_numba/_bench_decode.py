"""Decode (query length 1 against a kv cache) with fused_infer_attention_score, side by side
with torch SDPA on the same contiguous cache and with the time to read the cache's bytes once.

    python -m pfa_numba bench-decode [--quick] [--repeats 5] [--out FILE.md]
    (or python benchmarks/decode.py)

Cases: B in {1, 8}, N = 32, Nkv = 8, D = 128, float16 and bfloat16 caches of 1k to 32k tokens,
contiguous and paged (block_size 128, a shuffled block table), and the same cache in int8 (keys
per channel, values per token, dequantized as they load). Repeats alternate between the
implementations; the table gives medians. "stream" is the time to read the same K and V bytes
once (a sum over them as uint64 on the kernels' threads), measured in the same repeats: the
memory-bound floor.
"""
import statistics
import time

import ml_dtypes
import numpy as np
from numba import njit, prange

from . import config, fused_infer_attention_score
from ._bench import environment

N, NKV, D, BLOCK = 32, 8, 128, 128


@njit(parallel=True, cache=True)
def _read_once(words):
    """The sum of a 1-D uint64 array, on every thread: the time to read its bytes once."""
    total = np.uint64(0)
    for i in prange(words.size):
        total += words[i]
    return total


def _case(B, S, dtype, rng):
    q = rng.standard_normal((B, N, 1, D)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((B, NKV, S, D)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((B, NKV, S, D)).astype(np.float32).astype(dtype)
    blocks = B * (S // BLOCK)
    ids = rng.permutation(blocks).reshape(B, S // BLOCK).astype(np.int32)
    pools = [np.empty((blocks, NKV, BLOCK, D), dtype) for _ in range(2)]
    for b in range(B):
        for i, blk in enumerate(ids[b]):
            for pool, x in zip(pools, (k, v)):
                pool[blk] = x[b, :, i * BLOCK:(i + 1) * BLOCK]
    return q, k, v, pools, ids


def run(batches, lengths, dtypes, repeats):
    import torch
    rows = []
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for B in batches:
            for S in lengths:
                q, k, v, (kp, vp), table = _case(B, S, dtype, rng)
                kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
                          scale=D ** -0.5)
                tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                              if x.dtype == ml_dtypes.bfloat16 else torch.from_numpy(x)
                              for x in (q, k, v))
                raw = [x.reshape(-1).view(np.uint64) for x in (k, v)]
                k8, v8 = (np.clip(np.round(x.astype(np.float32) * 40), -127, 127)
                          .astype(np.int8) for x in (k, v))
                aq = dict(key_antiquant_scale=np.full((NKV, D), 1 / 40, q.dtype),
                          value_antiquant_scale=np.full((B, S), 1 / 40, np.float32),
                          key_antiquant_mode=0, value_antiquant_mode=1)
                calls = {
                    "contiguous": lambda: fused_infer_attention_score(q, k, v, **kw),
                    "paged": lambda: fused_infer_attention_score(
                        q, kp, vp, block_table=table, block_size=BLOCK,
                        actual_seq_lengths_kv=[S] * B, **kw),
                    "int8": lambda: fused_infer_attention_score(q, k8, v8, **kw, **aq),
                    "torch": lambda: torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, enable_gqa=True),
                    "stream": lambda: [_read_once(x) for x in raw],
                }
                times = {name: [] for name in calls}
                for r in range(repeats + 1):
                    for name, call in calls.items():
                        t0 = time.perf_counter()
                        call()
                        if r:
                            times[name].append(time.perf_counter() - t0)
                med = {name: statistics.median(t) for name, t in times.items()}
                rows.append((np.dtype(dtype).name, B, S, 2 * k.nbytes, med))
    return rows


def markdown(rows, repeats):
    lines = [f"Decode, N = {N}, Nkv = {NKV}, D = {D}, paged block_size {BLOCK}; medians of "
             f"{repeats} alternating repeats, ms. {environment()}.", "",
             "| cache | B | kv tokens | K+V MiB | contiguous | paged | int8 cache | torch SDPA | "
             "stream | torch / contiguous | paged / contiguous | contiguous / stream | "
             "contiguous / int8 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dt, B, S, nbytes, t in rows:
        c = t["contiguous"]
        lines.append(f"| {dt} | {B} | {S} | {nbytes / 2**20:.0f} | {c * 1e3:.2f} | "
                     f"{t['paged'] * 1e3:.2f} | {t['int8'] * 1e3:.2f} | {t['torch'] * 1e3:.2f} | "
                     f"{t['stream'] * 1e3:.2f} | {t['torch'] / c:.2f} | {t['paged'] / c:.2f} | "
                     f"{c / t['stream']:.2f} | {c / t['int8']:.2f} |")
    return "\n".join(lines)


def main(args):
    """The decode benchmark for parsed ``args`` (quick, repeats, out)."""
    import numba
    import torch
    torch.set_num_threads(int(config.CPU_THREADS or numba.get_num_threads()))
    if args.quick:
        rows = run((1,), (1024,), (np.float16,), args.repeats)
    else:
        rows = run((1, 8), (1024, 4096, 16384, 32768), (np.float16, ml_dtypes.bfloat16),
                   args.repeats)
    text = markdown(rows, args.repeats)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="one small case (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the table to this markdown file")
