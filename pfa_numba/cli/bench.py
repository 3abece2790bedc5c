"""Side-by-side CPU benchmark: pfa_numba vs torch SDPA (when installed) vs NumPy naive attention.

One input generator, one validator (pfa_numba.reference on a head subset), repeats interleaved
across implementations, medians, effective TFLOP/s (useful work only: masked-out pairs are not
counted), peak extra memory (RSS sampled during the call). Results go to a markdown table and a
PNG plot. ``python -m pfa_numba bench`` runs it; ``benchmarks/run.py`` is the same entry point.
"""
import dataclasses
import functools
import importlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from .. import prompt_flash_attention, reference

INF = 2147483647
#: Before each timed call: a pause, then one untimed call of the same implementation. BLAS and
#: OpenMP worker threads spin for a while after a call, taking a core from whichever
#: implementation runs next; the pause outlasts that spinning. And this virtual machine wakes
#: slowly from a pause; the untimed call takes that. Measurements: docs/tuning.md.
QUIET_S = 0.25


@dataclasses.dataclass
class Case:
    name: str
    B: int
    N: int
    S: int
    D: int
    dtype: str = "fp32"          # fp32, fp16, bf16
    mode: str = "dense"          # dense, causal, band
    nkv: int = 0                 # 0: = N
    layout: str = "BNSD"
    band: int = 256              # pre = next tokens for mode 'band'
    varlen: bool = False         # actual_seq_lengths = S // 2 (torch runs the padded shape)

    @property
    def kv_heads(self):
        return self.nkv or self.N

    def useful_flops(self):
        """4 * B * N * D * (kept (i, j) pairs)."""
        s = self.S // 2 if self.varlen else self.S
        if self.mode == "dense":
            pairs = s * s
        elif self.mode == "causal":
            pairs = s * (s + 1) // 2
        else:
            i = np.arange(s)
            pairs = int((np.minimum(i + self.band, s - 1) - np.maximum(i - self.band, 0) + 1).sum())
        return 4.0 * self.B * self.N * self.D * pairs

    def baseline(self):
        """The BNSD MHA case with the same work that a GQA, BSH or varlen case is compared with
        per useful FLOP (None for a case that is one already): the same shape and dtype, and
        for varlen the actual lengths as the whole shape (padding should cost nothing)."""
        s = self.S // 2 if self.varlen else self.S
        base = dataclasses.replace(self, name=f"{self.dtype} {self.mode} MHA BNSD", nkv=0,
                                   layout="BNSD", varlen=False, S=s)
        return None if (base.nkv, base.layout, base.varlen) == (self.nkv, self.layout,
                                                                 self.varlen) else base


def default_cases(quick=False):
    shapes = [(1, 16, 1024, 64), (1, 16, 2048, 128), (4, 32, 512, 128), (1, 8, 8192, 64)]
    if quick:
        shapes = shapes[:1]
    cases = []
    for dt in ("fp32", "fp16", "bf16"):
        for (b, n, s, d) in shapes:
            for mode in ("dense", "causal"):
                cases.append(Case(f"{dt} {mode} {(b, n, s, d)}", b, n, s, d, dt, mode))
    b, n, s, d = (1, 16, 2048, 128) if not quick else (1, 16, 1024, 64)
    cases += [
        Case(f"fp32 band 256 {(b, n, s, d)}", b, n, s, d, "fp32", "band"),
        Case(f"fp32 GQA 16q/4kv {(b, n, s, d)}", b, n, s, d, "fp32", "dense", nkv=4),
        Case(f"fp32 BSH {(b, n, s, d)}", b, n, s, d, "fp32", "dense", layout="BSH"),
        Case(f"fp32 varlen S/2 {(b, n, s, d)}", b, n, s, d, "fp32", "dense", varlen=True),
    ]
    return cases


def _dtype(name):
    import ml_dtypes
    return {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[name]


def make_inputs(case, seed=0):
    rng = np.random.default_rng(seed)
    dt = _dtype(case.dtype)
    q = rng.standard_normal((case.B, case.N, case.S, case.D), dtype=np.float32).astype(dt)
    k = rng.standard_normal((case.B, case.kv_heads, case.S, case.D), dtype=np.float32).astype(dt)
    v = rng.standard_normal((case.B, case.kv_heads, case.S, case.D), dtype=np.float32).astype(dt)
    return q, k, v


def pfa_call(case, q, k, v):
    """The pfa_numba call for ``case`` on BNSD inputs (BSH inputs are made up front)."""
    kw = dict(num_heads=case.N, num_key_value_heads=case.nkv, scale_value=case.D ** -0.5,
              input_layout=case.layout)
    if case.layout == "BSH":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(x.shape[0], x.shape[2], -1)
                   for x in (q, k, v))
    mask = None
    if case.mode == "causal":
        mask, kw["sparse_mode"] = np.triu(np.ones((2048, 2048), bool), 1), 3
    elif case.mode == "band":
        mask, kw["sparse_mode"] = np.triu(np.ones((2048, 2048), bool), 1), 4
        kw["pre_tokens"] = kw["next_tokens"] = case.band
    lens = [case.S // 2] if case.varlen else None
    args = (q, k, v, mask, lens, lens)
    return (lambda: prompt_flash_attention(*args, **kw)), args, kw


def torch_call(case, q, k, v):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]

    def conv(x):
        if case.dtype == "bf16":
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x)).to(tdt)

    tq, tk, tv = conv(q), conv(k), conv(v)
    kw = dict(scale=case.D ** -0.5)
    if case.nkv:
        kw["enable_gqa"] = True
    if case.mode == "causal":
        kw["is_causal"] = True
    elif case.mode == "band":
        i = torch.arange(case.S)
        kw["attn_mask"] = (i[None, :] - i[:, None]).abs() <= case.band
    return lambda: F.scaled_dot_product_attention(tq, tk, tv, **kw)


def naive_attention(q, k, v, scale, keep):
    """Plain NumPy attention in float32 on (B, N, S, D) arrays, materialising the scores."""
    g = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float32), g, axis=1)
    v = np.repeat(v.astype(np.float32), g, axis=1)
    s = np.matmul(q.astype(np.float32), k.swapaxes(-1, -2)) * np.float32(scale)
    s = np.where(keep, s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p, v)


def numpy_call(case, q, k, v):
    if case.dtype != "fp32" or case.B * case.N * case.S * case.S * 4 > (2 << 30):
        return None
    s = case.S
    i = np.arange(s)
    keep = np.ones((s, s), bool)
    if case.mode == "causal":
        keep = i[None, :] <= i[:, None]
    elif case.mode == "band":
        keep = np.abs(i[None, :] - i[:, None]) <= case.band
    return lambda: naive_attention(q, k, v, case.D ** -0.5, keep)


def validate(case, out, args, kw):
    """Max error of pfa_numba's output against the float64 reference on the first kv group."""
    g = case.N // case.kv_heads
    q, k, v = args[:3]
    if case.layout == "BSH":
        d = case.D
        sub = (q[:, :, :g * d], k[:, :, :d], v[:, :, :d])
        o = out[:, :, :g * d]
    else:
        sub = (q[:, :g], k[:, :1], v[:, :1])
        o = out[:, :g]
    kw = dict(kw, num_heads=g, num_key_value_heads=0)
    ref = reference.prompt_flash_attention(*sub, *args[3:], **kw)
    return float(np.abs(o.astype(np.float64) - ref).max())


class PeakRSS:
    """Samples this process's resident set size every millisecond while active."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, self._rss())
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra_mib(self):
        return (self.peak - self.base) / 2 ** 20


def interleaved_times(calls, repeats, untimed_rounds=1, before=None):
    """{name: [seconds of each timed call]} of the zero-argument ``calls``, {name: call}, run
    in turn: ``untimed_rounds`` rounds first, then ``repeats`` timed ones (interleaved, so that
    a machine whose speed drifts moves them alike); ``before(call)``, where given, runs untimed
    before each call."""
    times = {name: [] for name in calls}
    for r in range(untimed_rounds + repeats):
        for name, call in calls.items():
            if before is not None:
                before(call)
            t0 = time.perf_counter()
            call()
            if r >= untimed_rounds:
                times[name].append(time.perf_counter() - t0)
    return times


def _quiet_then_warm(call):
    time.sleep(QUIET_S)
    call()


def sgemm_peak(repeats=7, n=2048):
    """float32 GEMM throughput of this machine (NumPy's BLAS, all threads), TFLOP/s: the best
    of ``repeats`` (a peak; this machine's speed drifts over minutes, see docs/tuning.md)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        t.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(t) / 1e12


def run(cases, repeats=5, progress=True, gemm_n=2048):
    """Time every case; returns a list of result dicts. Each repeat also times NumPy's sgemm
    on two gemm_n x gemm_n float32 matrices: this machine's speed drifts over minutes (see
    docs/tuning.md), so pfa_numba's share of the GEMM rate is also taken against the sgemm of
    the same repeat."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    results = []
    it = tqdm(cases, desc="bench", unit="case") if (progress and tqdm) else cases
    for case in it:
        q, k, v = make_inputs(case)
        f_pfa, args, kw = pfa_call(case, q, k, v)
        impls = {"pfa_numba": f_pfa, "torch": torch_call(case, q, k, v),
                 "numpy": numpy_call(case, q, k, v)}
        base = case.baseline()
        if base is not None:       # timed in the same repeats: pfa_numba's cost per FLOP
            impls["baseline"] = pfa_call(base, *make_inputs(base))[0]
        impls = {k_: f for k_, f in impls.items() if f is not None}
        a = np.random.default_rng(1).standard_normal((gemm_n, gemm_n), dtype=np.float32)
        impls["sgemm"] = lambda: a @ a
        mem = {}
        for name, f in impls.items():       # warm-up (JIT, caches), check, then memory
            out = f()
            if name == "pfa_numba":
                err = validate(case, out, args, kw)
            del out
            with PeakRSS() as pr:   # a warm call: loading compiled kernels is not counted
                f()
            mem[name] = pr.extra_mib
        times = interleaved_times(impls, repeats, untimed_rounds=0, before=_quiet_then_warm)
        med = {name: float(np.median(t)) for name, t in times.items()}
        # ratio to pfa_numba: median over the repeats of (time / pfa_numba time in the same
        # repeat), so a machine that speeds up or slows down between repeats shifts both
        ratio = {name: float(np.median(np.array(t) / np.array(times["pfa_numba"])))
                 for name, t in times.items()}
        per_flop = None
        if base is not None:
            per_flop = float(np.median(np.array(times["pfa_numba"]) / np.array(times["baseline"]))
                             * base.useful_flops() / case.useful_flops())
        # pfa_numba's TFLOP/s over the sgemm's in the same repeat
        gemm_share = float(np.median(np.array(times["sgemm"]) / np.array(times["pfa_numba"]))
                           * case.useful_flops() / (2.0 * gemm_n ** 3))
        out_mib = case.B * case.N * case.S * case.D * np.dtype(_dtype(case.dtype)).itemsize / 2 ** 20
        results.append(dict(case=case, med=med, times=times, ratio=ratio, mem=mem, err=err,
                            out_mib=out_mib, per_flop=per_flop, gemm_share=gemm_share,
                            tflops={n: case.useful_flops() / t / 1e12 for n, t in med.items()
                                    if n != "sgemm"}))
        if progress and not tqdm:
            print(f"  {case.name}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in med.items()),
                  flush=True)
    return results


#: The first-call programs, each run in a fresh process with a warm cache (``python -c``):
#: pfa_numba's fp32 call, and the floor any Numba program pays, a one-line cached ``@njit``
#: function in a module of its own (the same NumPy and Numba imports, the same typing set-up
#: and cache load).
FIRST_CALL_PFA = """import numpy as np
from pfa_numba import prompt_flash_attention
q = np.ones((1, 8, 256, 64), np.float32)
prompt_flash_attention(q, q, q, num_heads=8, input_layout='BNSD')
"""
FIRST_CALL_NUMBA = """import sys
sys.path.insert(0, {folder!r})
import numpy as np
import one_line
one_line.total(np.ones(4))
"""
ONE_LINE_MODULE = """from numba import njit


@njit(cache=True)
def total(a):
    return a.sum()
"""


def first_call(repeats=5):
    """Wall time of a fresh ``python -c`` process computing a first call with a warm cache:
    pfa_numba against a one-line cached Numba function, interleaved. Returns the two lists of
    seconds (one warm-up run each first, which fills the caches: Numba's, and Python's
    bytecode cache, which the runs may write whatever PYTHONDONTWRITEBYTECODE says here)."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "one_line.py"), "w") as f:
            f.write(ONE_LINE_MODULE)
        programs = {"pfa_numba": FIRST_CALL_PFA,
                    "numba": FIRST_CALL_NUMBA.format(folder=folder)}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        runs = {name: functools.partial(subprocess.run, [sys.executable, "-c", code],
                                        check=True, env=env)
                for name, code in programs.items()}
        times = interleaved_times(runs, repeats)
    return times["pfa_numba"], times["numba"]


def first_call_markdown(pfa, floor):
    return (f"First call in a fresh process with a warm cache (`python -c`, end to end, median "
            f"of {len(pfa)} interleaved runs): pfa_numba {np.median(pfa):.2f} s (fp32 "
            f"(1, 8, 256, 64)); a one-line cached Numba function {np.median(floor):.2f} s, the "
            f"floor of any Numba program here (importing NumPy and Numba, Numba's typing set-up "
            f"and cache load, interpreter exit).")


def environment():
    import numba
    import scipy
    lines = [f"{platform.node() or 'machine'}: {os.cpu_count()} cores, {platform.machine()}, "
             f"numba {numba.__version__} ({numba.get_num_threads()} threads), numpy "
             f"{np.__version__}, scipy {scipy.__version__}"]
    try:
        import torch
        lines.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    except ImportError:
        lines.append("torch not installed")
    return "; ".join(lines)


def markdown(results, peak_tflops):
    rows = [f"sgemm peak (NumPy BLAS, 2048^3 fp32, best of 7 runs before and of 7 after the "
            f"cases): {peak_tflops:.3f} TFLOP/s; \"% sgemm, same repeats\": pfa_numba's TFLOP/s "
            f"over those of the same sgemm timed in each of its repeats (median), which follows "
            f"the machine's drifting speed. "
            f"Ratios are torch (or NumPy) time / pfa_numba time, the median over the repeats of "
            f"the ratio within one repeat: > 1 means pfa_numba is faster. "
            f"TFLOP/s count useful (kept) pairs only. \"per FLOP vs MHA\": pfa_numba's time per "
            f"useful FLOP on a GQA, BSH or varlen case over its time per FLOP on the BNSD MHA "
            f"case of the same shape (varlen: of the actual lengths), timed in the same repeats "
            f"(1.00: the same cost).", "",
            "| case | pfa_numba ms | TFLOP/s | % sgemm peak | % sgemm, same repeats | torch ms | "
            "torch / pfa | NumPy ms | NumPy / pfa | pfa extra MiB (output MiB) | max err vs ref | "
            "per FLOP vs MHA |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m, t = r["med"], r["tflops"]
        p = m["pfa_numba"]

        def cell(name):
            return (f"{m[name] * 1e3:.1f}", f"{r['ratio'][name]:.2f}") if name in m else ("-", "-")

        tm, tr = cell("torch")
        nm, nr = cell("numpy")
        rows.append(f"| {r['case'].name} | {p * 1e3:.1f} | {t['pfa_numba']:.3f} | "
                    f"{100 * t['pfa_numba'] / peak_tflops:.0f}% | {100 * r['gemm_share']:.0f}% | "
                    f"{tm} | {tr} | {nm} | {nr} | "
                    f"{r['mem']['pfa_numba']:.0f} ({r['out_mib']:.0f}) | {r['err']:.1e} | "
                    + ("-" if r["per_flop"] is None else f"{r['per_flop']:.2f}") + " |")
    return "\n".join(rows)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["case"].name for r in results]
    ratio = [r["ratio"].get("torch", np.nan) for r in results]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(names) + 1.5))
    y = np.arange(len(names))
    ax.barh(y, ratio, color=["tab:green" if x >= 1 else "tab:red" for x in ratio])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("torch SDPA time / pfa_numba time (> 1: pfa_numba faster)")
    ax.set_title("pfa_numba vs torch SDPA on the CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: where the optional packages of the benchmarks come from
EXTRA_HINT = 'the bench extra has it: python -m pip install -e ".[bench]"'


def torch_note():
    """A line saying the torch column is left out, or "" where torch is installed."""
    try:
        importlib.import_module("torch")
        return ""
    except ImportError:
        return f"torch is not installed: no torch column ({EXTRA_HINT})"


def main(args):
    if torch_note():
        print(torch_note(), flush=True)
    cases = default_cases(quick=args.quick)
    if args.filter:
        cases = [c for c in cases if args.filter in c.name]
    peak = sgemm_peak()
    results = run(cases, repeats=args.repeats)
    peak = max(peak, sgemm_peak())           # before and after the cases
    table = markdown(results, peak) + "\n\n" + first_call_markdown(*first_call())
    if args.cold:
        from .cold import cold_first_calls, cold_markdown
        print("first calls from an empty cache:", flush=True)
        table += "\n\n" + cold_markdown(cold_first_calls())
    env = environment()
    stamp = time.strftime("%Y-%m-%d")
    text = f"# pfa_numba CPU benchmark ({stamp})\n\n{env}\n\n{table}\n"
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    written = [os.path.join(args.out, "results.md")]
    with open(written[0], "w") as f:
        f.write(text)
    if not any("torch" in r["ratio"] for r in results):
        print("no plot: it draws torch's time over pfa_numba's, and torch is not installed")
    else:
        try:
            plot(results, os.path.join(args.out, "results.png"))
            written.append(os.path.join(args.out, "results.png"))
        except ImportError as e:
            print(f"no plot: {e.name} is not installed ({EXTRA_HINT})")
    print("written: " + ", ".join(written))
    return 0
