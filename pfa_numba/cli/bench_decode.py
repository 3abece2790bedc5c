"""Decode (query length 1 against a kv cache) with fused_infer_attention_score, side by side
with torch SDPA on the same contiguous cache and with the time to read the cache's bytes once.

    python -m pfa_numba bench-decode [--quick] [--repeats 5] [--out FILE.md]
    (or python benchmarks/decode.py)

Cases: B in {1, 8}, N = 32, Nkv = 8, D = 128, float16 and bfloat16 caches of 1k to 32k tokens,
contiguous and paged (block_size 128, a shuffled block table) in two layouts: BNSD (a head's
rows together, torch's layout) and BSH (a row's heads together: FIA's default, and the paged
pools of serving stacks), and the BNSD cache in int8 (keys per channel, values per token,
dequantized as they load), and the BNSD calls, contiguous and paged, through a
:class:`.FiaPlan` made before the repeats (a model's layers share one plan a decode step).
Repeats alternate between the implementations; the table gives medians. "stream" is the time
to read the same K and V bytes once (a sum over them as uint64 on the kernels' threads),
measured in the same repeats: the memory-bound floor.

Every timed call finds the caches as a decode step of a model does: this layer's kv cache
cold (the other layers' caches and weights ran since), the code and the small arrays warm (the
other layers ran the same code). Before each call a buffer of twice the last-level cache is
read, then the same implementation runs once on a one-block cache of another "layer". Without
the read each call would find whatever bytes the previous calls left (the call after "stream"
would find the contiguous cache in a large L3); without the small call, the interpreter's and
the libraries' own state would be cold too, which no model's decode step sees.

A second table times the prefill branch over the same kinds of cache, contiguous and paged:
a chunk of a prompt against the tokens cached before it, and a whole prompt (causal), warm
calls alternating (prefill is bound by its products, not by the cache's reads).
"""
import functools
import glob
import statistics
import time

import ml_dtypes
import numpy as np
from numba import njit, prange

from .. import FiaPlan, config, fused_infer_attention_score
from ..cache import CACHE
from ..cpu.driver import parallel_region
from ..cpu.threads import pool_size
from .bench import environment, interleaved_times, torch_note

N, NKV, D, BLOCK = 32, 8, 128, 128
#: the eviction buffer's size where the last-level cache's is unknown
_LLC_FALLBACK = 256 << 20


@njit(parallel=True, cache=CACHE)
def _read_once(words):
    """The sum of a 1-D uint64 array, on every thread: the time to read its bytes once."""
    total = np.uint64(0)
    for i in prange(words.size):
        total += words[i]
    return total


def _read_each(arrays):
    """:func:`_read_once` of each array, in the process's one parallel region."""
    with parallel_region():
        return [_read_once(x) for x in arrays]


def last_level_cache_bytes():
    """The size of this machine's largest cache (Linux sysfs), or _LLC_FALLBACK."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=_LLC_FALLBACK)


def _cold_cache(call, evict, other_layer):
    """``call`` preceded (untimed, see the module's doc) by a read of ``evict`` and a call of
    the same implementation on another layer's small cache."""
    def cold():
        with parallel_region():
            _read_once(evict)
        other_layer()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0
    return cold


def _case(B, S, dtype, rng, sq=1):
    """(q, k, v) in BNSD (sq query rows), the same in BSH, and the shuffled block table."""
    q = rng.standard_normal((B, N, sq, D)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((B, NKV, S, D)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((B, NKV, S, D)).astype(np.float32).astype(dtype)
    bsh = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B, x.shape[2], -1)
           for x in (q, k, v)]
    table = rng.permutation(B * (S // BLOCK)).reshape(B, S // BLOCK).astype(np.int32)
    return (q, k, v), bsh, table


def _pool(x, table, layout):
    """The block pool of cache ``x`` (B, Nkv, S, D) in BNSD or (B, S, H) in BSH under the
    block table: (blocks, Nkv, block_size, D) or (blocks, block_size, H)."""
    B = x.shape[0]
    blocks = table.size
    pool = np.empty((blocks,) + ((NKV, BLOCK, D) if layout == "BNSD" else (BLOCK, NKV * D)),
                    x.dtype)
    for b in range(B):
        for i, blk in enumerate(table[b]):
            pool[blk] = (x[b, :, i * BLOCK:(i + 1) * BLOCK] if layout == "BNSD"
                         else x[b, i * BLOCK:(i + 1) * BLOCK])
    return pool


def _layouts(bnsd, bsh, table, **kw):
    """fused_infer_attention_score's arguments on the case's cache, contiguous and paged, BNSD
    and BSH: {column: ((query, key, value), keyword arguments)}."""
    (q, k, v), (qh, kh, vh) = bnsd, bsh
    B, S = k.shape[0], k.shape[2]
    kw = dict(kw, num_heads=N, num_key_value_heads=NKV, scale=D ** -0.5)
    paged = dict(kw, block_table=table, block_size=BLOCK, actual_seq_lengths_kv=[S] * B)
    kp, vp, khp, vhp = (_pool(x, table, lay) for x, lay in
                        ((k, "BNSD"), (v, "BNSD"), (kh, "BSH"), (vh, "BSH")))
    return {"BNSD": ((q, k, v), dict(kw, input_layout="BNSD")),
            "BNSD paged": ((q, kp, vp), dict(paged, input_layout="BNSD")),
            "BSH": ((qh, kh, vh), dict(kw, input_layout="BSH")),
            "BSH paged": ((qh, khp, vhp), dict(paged, input_layout="BSH"))}


def _called(layouts):
    """{column: the call} of :func:`_layouts`' arguments."""
    return {name: functools.partial(fused_infer_attention_score, *arrays, **kw)
            for name, (arrays, kw) in layouts.items()}


def _calls(bnsd, bsh, table):
    """The timed calls of one decode case, by column (torch's where torch is installed)."""
    q, k, v = bnsd
    B, S = k.shape[0], k.shape[2]
    kw = dict(num_heads=N, num_key_value_heads=NKV, scale=D ** -0.5)
    raw = [x.reshape(-1).view(np.uint64) for x in (k, v)]
    k8, v8 = (np.clip(np.round(x.astype(np.float32) * 40), -127, 127).astype(np.int8)
              for x in (k, v))
    aq = dict(key_antiquant_scale=np.full((NKV, D), 1 / 40, q.dtype),
              value_antiquant_scale=np.full((B, S), 1 / 40, np.float32),
              key_antiquant_mode=0, value_antiquant_mode=1)
    layouts = _layouts(bnsd, bsh, table)
    planned = {f"{name} planned": functools.partial(FiaPlan(*arrays, **kw), *arrays)
               for name, (arrays, kw) in layouts.items() if name.startswith("BNSD")}
    calls = {
        **_called(layouts),
        **planned,
        "int8": lambda: fused_infer_attention_score(q, k8, v8, input_layout="BNSD", **kw, **aq),
        "stream": lambda: _read_each(raw),
    }
    if not torch_note():
        calls["torch"] = _torch_sdpa(q, k, v)
    return calls


def _torch_sdpa(q, k, v):
    """torch's SDPA of BNSD arrays ``q``, ``k``, ``v`` (GQA)."""
    import torch
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                  if x.dtype == ml_dtypes.bfloat16 else torch.from_numpy(x) for x in (q, k, v))
    return lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)


def run(batches, lengths, dtypes, repeats, progress=print):
    """Rows (dtype, B, S, K+V bytes, medians by column) of the decode table, each case
    reported to ``progress`` as it ends."""
    rows = []
    rng = np.random.default_rng(0)
    evict = np.ones(2 * last_level_cache_bytes() // 8, np.uint64)
    for dtype in dtypes:
        for B in batches:
            for S in lengths:
                bnsd, bsh, table = _case(B, S, dtype, rng)
                small = _calls(*_case(B, BLOCK, dtype, rng))
                calls = {name: _cold_cache(call, evict, small[name])
                         for name, call in _calls(bnsd, bsh, table).items()}
                times = {name: [] for name in calls}
                for r in range(repeats + 1):
                    for name, call in calls.items():
                        elapsed = call()
                        if r:
                            times[name].append(elapsed)
                med = {name: statistics.median(t) for name, t in times.items()}
                rows.append((np.dtype(dtype).name, B, S, 2 * bnsd[1].nbytes, med))
                progress(f"  decode {np.dtype(dtype).name} B={B} kv {S}: "
                         f"{med['BNSD'] * 1e3:.2f} ms")
                del calls
    return rows


def run_prefill(cases, dtypes, repeats, progress=print):
    """Rows (dtype, Sq, Skv, medians by column) of the prefill table: B = 1, query row i at
    kv position Skv - Sq + i (causal at the cache's end), warm calls alternating; each case
    reported to ``progress`` as it ends."""
    rows = []
    rng = np.random.default_rng(1)
    for dtype in dtypes:
        for sq, S in cases:
            bnsd, bsh, table = _case(1, S, dtype, rng, sq)
            calls = _called(_layouts(bnsd, bsh, table, actual_seq_lengths=[sq],
                                     next_tokens=S - sq))
            times = interleaved_times(calls, repeats)
            rows.append((np.dtype(dtype).name, sq, S,
                         {name: statistics.median(t) for name, t in times.items()}))
            progress(f"  prefill {np.dtype(dtype).name} {sq} rows, kv {S}: "
                     f"{rows[-1][3]['BNSD'] * 1e3:.2f} ms")
    return rows


def markdown_prefill(rows, repeats):
    names = ("BNSD", "BNSD paged", "BSH", "BSH paged")
    lines = [f"Prefill, B = 1, N = {N}, Nkv = {NKV}, D = {D}, causal at the cache's end, paged "
             f"block_size {BLOCK}; medians of {repeats} alternating repeats, warm calls, ms. "
             f"{environment()}.", "",
             "| cache | query rows | kv tokens | " + " | ".join(names)
             + " | BNSD paged / BNSD | BSH paged / BSH |", "|---" * 9 + "|"]
    for dt, sq, S, t in rows:
        cells = [f"{t[c] * 1e3:.2f}" for c in names] + [
            f"{t['BNSD paged'] / t['BNSD']:.2f}", f"{t['BSH paged'] / t['BSH']:.2f}"]
        lines.append(f"| {dt} | {sq} | {S} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: the table's time columns (call, heading) and ratio columns (numerator, denominator)
_TIMES = (("BNSD", "BNSD"), ("BNSD paged", "BNSD paged"), ("BSH", "BSH"),
          ("BSH paged", "BSH paged"), ("BNSD planned", "BNSD planned"),
          ("BNSD paged planned", "BNSD paged planned"), ("int8", "int8 cache (BNSD)"),
          ("torch", "torch SDPA (BNSD)"), ("stream", "stream"))
_RATIOS = (("torch", "BNSD"), ("torch", "BNSD planned"), ("BNSD paged", "BNSD"),
           ("BSH paged", "BSH"), ("BNSD paged planned", "BNSD planned"), ("BNSD", "stream"),
           ("BSH", "stream"), ("BNSD", "int8"))


def markdown(rows, repeats):
    head = [h for _, h in _TIMES] + [f"{a} / {b}" for a, b in _RATIOS]
    lines = [f"Decode, N = {N}, Nkv = {NKV}, D = {D}, paged block_size {BLOCK}; medians of "
             f"{repeats} alternating repeats, each call with its kv cache cold, ms (last-level "
             f"cache {last_level_cache_bytes() >> 20} MiB). {environment()}.", "",
             "| cache | B | kv tokens | K+V MiB | " + " | ".join(head) + " |",
             "|---" * (4 + len(head)) + "|"]
    for dt, B, S, nbytes, t in rows:
        cells = ([f"{t[c] * 1e3:.2f}" if c in t else "-" for c, _ in _TIMES]
                 + [f"{t[a] / t[b]:.2f}" if a in t and b in t else "-" for a, b in _RATIOS])
        lines.append(f"| {dt} | {B} | {S} | {nbytes / 2**20:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args):
    """The decode benchmark for parsed ``args`` (quick, repeats, out)."""
    if torch_note():
        print(torch_note(), flush=True)
    else:
        import torch
        torch.set_num_threads(int(config.CPU_THREADS or pool_size()))
    progress = functools.partial(print, flush=True)
    dtypes = (np.float16,) if args.quick else (np.float16, ml_dtypes.bfloat16)
    if args.quick:
        rows = run((1,), (1024,), dtypes, args.repeats, progress)
        prefill = run_prefill(((64, 512),), dtypes, args.repeats, progress)
    else:
        rows = run((1, 8), (1024, 4096, 16384, 32768), dtypes, args.repeats, progress)
        prefill = run_prefill(((256, 4096), (1024, 1024)), dtypes, args.repeats, progress)
    text = markdown(rows, args.repeats) + "\n\n" + markdown_prefill(prefill, args.repeats)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="one small case (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the table to this markdown file")
