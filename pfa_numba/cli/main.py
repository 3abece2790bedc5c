"""``python -m pfa_numba demo | bench | bench-decode | warmup | info | cuda-ptx`` (or
``pfa-numba ...``): the main job, the benchmarks, cache warm-up for deployment images, a look
at this installation, and the tensor-core kernel's PTX."""
import argparse
import os
import platform
import sys
import time

import numpy as np


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def demo(args):
    from pfa_numba import prompt_flash_attention, reference
    from .bench import naive_attention

    print("pfa_numba demo: Ascend prompt_flash_attention on the CPU\n")
    print("1. The MindSpore call, unchanged, on NumPy arrays:")
    q = k = v = np.ones((1, 16, 256, 16), dtype=np.float16)
    t0 = time.perf_counter()
    out = prompt_flash_attention(q, k, v, None, None, None, None, None, None, None, None, None,
                                 16, input_layout='BNSD')
    print(f"   out.shape = {out.shape}, dtype {out.dtype}, all ones: {bool(np.all(out == 1))} "
          f"(first call {time.perf_counter() - t0:.2f} s, JIT or cache load included)\n")

    b, n, nkv, s, d = 1, 16, 4, args.seq, 128
    print(f"2. A prefill: B={b}, N={n} query heads over Nkv={nkv} kv heads (GQA), Sq=Skv={s}, "
          f"D={d}, float16, causal (sparse_mode 3), scale 1/sqrt(D), layout BSH")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, s, n * d)).astype(np.float16)
    k = rng.standard_normal((b, s, nkv * d)).astype(np.float16)
    v = rng.standard_normal((b, s, nkv * d)).astype(np.float16)
    mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=1 / np.sqrt(d),
              input_layout="BSH", sparse_mode=3)
    out = prompt_flash_attention(q, k, v, mask, **kw)
    ref = reference.prompt_flash_attention(q, k, v, mask, **kw)
    err = float(np.abs(out.astype(np.float64) - ref).max())
    low = reference.prompt_flash_attention(q, k, v, mask, **kw, compute_dtype=np.float16)
    err_low = float(np.abs(low - ref).max())
    ok = err <= 2 * err_low + 1e-3
    print(f"   max |pfa_numba - reference (float64)| = {err:.2e}  (the reference itself run in "
          f"float16: {err_low:.2e})  -> {'OK' if ok else 'MISMATCH'}")

    flops = 4 * b * n * s * s * d / 2  # causal: half of the dense work
    t_pfa = _median_time(lambda: prompt_flash_attention(q, k, v, mask, **kw), args.repeats)
    q4 = q.reshape(b, s, n, d).transpose(0, 2, 1, 3)
    k4 = k.reshape(b, s, nkv, d).transpose(0, 2, 1, 3)
    v4 = v.reshape(b, s, nkv, d).transpose(0, 2, 1, 3)
    keep = np.tril(np.ones((s, s), dtype=bool))
    t_np = _median_time(lambda: naive_attention(q4, k4, v4, 1 / np.sqrt(d), keep), args.repeats)
    rows = [("pfa_numba (CPU)", t_pfa), ("NumPy naive (float32)", t_np)]
    try:
        import torch
        import torch.nn.functional as F
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q4, k4, v4))
        sdpa = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,  # noqa: E731
                                                      scale=1 / np.sqrt(d), enable_gqa=True)
        sdpa()
        rows.append((f"torch {torch.__version__} SDPA (float16)",
                     _median_time(sdpa, args.repeats)))
    except ImportError:
        pass
    print(f"\n   {'implementation':34s} {'median time':>12s} {'TFLOP/s':>8s} {'vs pfa_numba':>13s}")
    for name, t in rows:
        print(f"   {name:34s} {t * 1e3:9.1f} ms {flops / t / 1e12:8.3f} {t / t_pfa:12.2f}x")
    import numba
    print(f"\n   ({numba.get_num_threads()} threads, median of {args.repeats}; "
          f"'vs pfa_numba' > 1 means pfa_numba is faster)")
    return 0 if ok else 1


def warmup(args):
    """Compile every CPU kernel specialisation into Numba's cache (a deployment image runs this
    once at build time; later processes load the kernels in well under a second)."""
    from pfa_numba import config
    from pfa_numba.cache import cache_folder
    from .warmup import warm
    print(f"compiling the CPU kernels into Numba's cache ({cache_folder()}):", flush=True)
    notices, config.COMPILE_NOTICES = config.COMPILE_NOTICES, False
    try:
        seconds = warm(lambda line: print(line, flush=True))
    finally:
        config.COMPILE_NOTICES = notices
    print(f"done in {seconds:.0f} s. CUDA kernels are compiled by numba-cuda at their first "
          "launch in each process.")
    return 0


def info(args):
    import numba

    import pfa_numba
    from pfa_numba import dispatch
    print(f"pfa_numba {pfa_numba.__version__} on Python {platform.python_version()} "
          f"({platform.machine()})")
    for mod in ("numpy", "numba", "llvmlite", "scipy", "ml_dtypes", "threadpoolctl"):
        try:
            m = __import__(mod)
            print(f"  {mod:14s} {getattr(m, '__version__', '?')}")
        except ImportError:
            print(f"  {mod:14s} not installed")
    print(f"  threads        {numba.get_num_threads()} (NUMBA_NUM_THREADS), threading layer "
          f"{numba.config.THREADING_LAYER}")
    print(f"  cache          {numba.config.CACHE_DIR or os.path.dirname(pfa_numba.__file__)}")
    from pfa_numba.cpu import _gemm
    products = ("AVX-512 register blocks" if _gemm.available() else "BLAS sgemm (no AVX-512)")
    print(f"  float32 tiles  {products}")
    print("kernels (each device's in order of preference; a call gets the first that takes it):")
    for target in dispatch.TARGETS.values():
        broken = target.environment_problems()
        features = set() if broken else target.features()
        for kernel in target.kernels() + target.kernels("backward"):
            why = broken or kernel.not_supported_reasons(None, None, features)
            print(f"  {target.name} {kernel.name:14s} " + ("available" if not why else
                                                        "unavailable: " + "; ".join(why)))
            print(f"      {kernel.does}")
            print(f"      takes {_takes(kernel)}")
    if args.call:
        print("\n" + _explain_call(args))
    else:
        print("\n(pfa_numba.explain(...) says which a call gets and why; here: info --call "
              "B,N,Nkv,Sq,Skv,D)")
    return 0


def _takes(kernel):
    """What ``kernel`` takes, in words."""
    parts = ["/".join(kernel.dtypes),
             "D in " + ", ".join(map(str, kernel.head_dims)) if kernel.head_dims else "any D",
             "any value head dim Dv" if kernel.own_value_head_dim else "Dv = D",
             "layouts " + ", ".join(kernel.layouts) if kernel.layouts else "any layout",
             "caches: contiguous" + "".join(f", {c}" for c in kernel.caches)]
    if kernel.features:
        parts.append("needs " + ", ".join(kernel.features))
    return "; ".join(parts)


def _explain_call(args):
    """pfa_numba.explain of a call of shape ``args.call`` (B,N,Nkv,Sq,Skv,D) on random data."""
    import ml_dtypes

    from pfa_numba import explain
    b, n, nkv, sq, skv, d = (int(x) for x in args.call.split(","))
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, n, sq, d)).astype(dtype)
    k, v = (rng.standard_normal((b, nkv, skv, d)).astype(dtype) for _ in range(2))
    return (f"prompt_flash_attention of {args.dtype} B={b} N={n} Nkv={nkv} Sq={sq} Skv={skv} "
            f"D={d} (BNSD, causal) on {args.device}:\n" +
            explain(q, k, v, np.triu(np.ones((2048, 2048), bool), 1), num_heads=n,
                    num_key_value_heads=nkv, scale_value=d ** -0.5, input_layout="BNSD",
                    sparse_mode=3, device=args.device))


def cuda_ptx(args):
    """Write the tensor-core kernels' PTX files (tc_<dtype>_d<D>_sm<arch>.ptx, decode_...) and
    their SASS summaries (.sass.txt: registers, spills, the kv loops' instruction mix, store
    widths)."""
    from pfa_numba.gpu import sass
    missing = sass.missing_tools()
    if missing:
        print(f"no SASS summaries: the wheels of {', '.join(missing)} are not installed (the "
              "test extra has them)", file=sys.stderr)
    for path in sass.write_ptx(args.out, args.filter):
        print(path)
        if path.endswith(".sass.txt"):
            with open(path) as f:
                print(f.read(), end="")
    return 0


def _bench(args):
    from .bench import main as bench_main
    return bench_main(args)


def _bench_decode_module():
    from . import bench_decode
    return bench_decode


def main(argv=None):
    prog = "pfa-numba" if os.path.basename(sys.argv[0]) == "pfa-numba" else "python -m pfa_numba"
    parser = argparse.ArgumentParser(
        prog=prog, description="pfa_numba's commands: the demo, the benchmarks, compiling the "
        "CPU kernels ahead (images, CI), this installation and its kernels, the CUDA kernels' "
        "PTX. Each takes --help.")
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("demo", help="the seed example and a realistic prefill, checked and timed")
    p.add_argument("--seq", type=int, default=1024, help="sequence length of the prefill")
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(fn=demo)
    p = sub.add_parser("bench", help="side-by-side CPU benchmark vs torch SDPA and NumPy")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="one shape only")
    p.add_argument("--filter", default="", help="only cases whose name contains this")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="also time first calls from an empty cache (minutes: each compiles)")
    p.set_defaults(fn=_bench)
    p = sub.add_parser("bench-decode", help="decode with fused_infer_attention_score vs torch "
                                            "SDPA and the memory-streaming floor")
    _bench_decode_module().add_arguments(p)
    p.set_defaults(fn=lambda a: _bench_decode_module().main(a))
    p = sub.add_parser("warmup", help="compile every CPU kernel into Numba's cache")
    p.set_defaults(fn=warmup)
    p = sub.add_parser("info", help="versions, kernels, threads, cache location; with --call, "
                                    "the kernel a call gets and why")
    p.add_argument("--call", default="", help="B,N,Nkv,Sq,Skv,D of a call to explain")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.set_defaults(fn=info)
    p = sub.add_parser("cuda-ptx", help="write the tensor-core kernels' PTX and SASS summaries, "
                                        "one pair a specialisation (needs numba-cuda, not a GPU)")
    p.add_argument("--out", required=True, help="folder for the .ptx and .sass.txt files")
    p.add_argument("--filter", default="", help="only files whose name contains this")
    p.set_defaults(fn=cuda_ptx)
    args = parser.parse_args(argv)
    if args.cmd is None:                # a bare command: what it can do
        parser.print_help()
        return 0
    try:
        return args.fn(args)
    except BrokenPipeError:
        # the reader went away (``info | head``): stop quietly, and keep Python's exit-time
        # flush of stdout from failing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
