"""On a machine with an NVIDIA GPU: check the CUDA kernel at realistic sizes and time it.

    python scripts/gpu_check.py [--quick] [--tiles] [--tensor-cores]
    python -m pytest tests/cudasim     # the kernel tests, run on the GPU (no simulator)
    python -m pytest tests/ptx         # with a GPU: the tensor-core kernel's device tests too

``--tensor-cores`` turns config.CUDA_TENSOR_CORES on, so fp16 / bf16 run on the tensor-core
kernel (gpu.tc_kernel) wherever it applies; the first GPU run should check it this way before
it becomes the default.

1. Correctness: pfa_numba on CUDA (Numba device arrays, and torch tensors when torch has CUDA)
   against pfa_numba.reference (the first kv group's heads) and the CPU path (every head), for
   fp16, bf16 and fp32, dense / causal / band / user mask / pse / GQA / varlen; every case is
   reported, then the script fails if any did.
2. Speed: a side-by-side table of pfa_numba CUDA vs torch SDPA (flash backend, when torch with
   CUDA is installed) for fp16 and bf16 at (1,16,4096,128) dense and causal and (4,32,1024,128).
Exits non-zero if a check fails. numba-cuda 0.30 needs NumPy < 2.5 (its first kernel compile
fails otherwise).
"""
import argparse
import sys
import time
import traceback

import ml_dtypes
import numpy as np


def _cases(quick):
    s = 256 if quick else 1024
    return [
        ("fp16 dense GQA", np.float16, dict(B=1, N=8, Nkv=2, S=s, D=128, mode=0)),
        ("bf16 causal", ml_dtypes.bfloat16, dict(B=1, N=4, Nkv=4, S=s, D=64, mode=3)),
        ("fp32 band", np.float32, dict(B=2, N=4, Nkv=4, S=s, D=80, mode=4)),
        ("fp16 mask+pse varlen", np.float16, dict(B=2, N=4, Nkv=4, S=s // 2, D=128, mode=1)),
    ]


def check(quick):
    ok = True
    for name, dt, c in _cases(quick):
        try:
            ok &= _check_case(name, dt, c)
        except Exception:                   # report every case, then fail
            traceback.print_exc()
            print(f"  {name:24s} FAIL (exception above)", flush=True)
            ok = False
    return ok


def _check_case(name, dt, c):
    from pfa_numba import prompt_flash_attention, reference
    from pfa_numba.gpu.arrays import numba_device_array
    rng = np.random.default_rng(0)
    ok = True
    b, n, nkv, s, d = c["B"], c["N"], c["Nkv"], c["S"], c["D"]
    q = rng.standard_normal((b, n, s, d)).astype(dt)
    k = rng.standard_normal((b, nkv, s, d)).astype(dt)
    v = rng.standard_normal((b, nkv, s, d)).astype(dt)
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD",
              scale_value=d ** -0.5, sparse_mode=c["mode"], pre_tokens=100, next_tokens=20)
    mask = pse = lens = None
    if c["mode"] in (2, 3, 4):
        mask = np.triu(np.ones((2048, 2048), bool), 1)
    elif c["mode"] == 1:
        mask = rng.random((b, 1, s, s)) < 0.2
        pse = rng.standard_normal((1, n, s, s)).astype(dt)
        lens = [s, s // 3][:b]
    args = (q, k, v, mask, lens, None, pse)
    t0 = time.perf_counter()
    dev = [None if x is None else numba_device_array(x) for x in (q, k, v, mask)]
    dpse = None if pse is None else numba_device_array(pse)
    out_dev = prompt_flash_attention(*dev, lens, None, dpse, **kw).copy_to_host()
    t_gpu = time.perf_counter() - t0
    out_cpu = prompt_flash_attention(*args, **kw)
    g = n // nkv
    sub = (q[:, :g], k[:, :1], v[:, :1], mask, lens, None,
           None if pse is None else pse[:, :g])
    ref = reference.prompt_flash_attention(*sub, **dict(kw, num_heads=g,
                                                        num_key_value_heads=0))
    err_gpu = np.abs(out_dev[:, :g].astype(np.float64) - ref).max()
    err_cpu = np.abs(out_cpu[:, :g].astype(np.float64) - ref).max()
    # every head (the reference covers the first kv group): cuda against the cpu path
    diff = np.abs(out_dev.astype(np.float64) - out_cpu.astype(np.float64))
    err_all = diff.max() if np.isfinite(diff).all() else np.inf
    good = err_gpu <= 2 * err_cpu + 1e-3 and err_all <= 2 * err_cpu + 2e-3
    ok &= bool(good)
    print(f"  {name:24s} max err vs reference: cuda {err_gpu:.2e}, cpu {err_cpu:.2e}; "
          f"all heads |cuda - cpu| {err_all:.2e} ({t_gpu:.2f} s incl. JIT)  "
          f"{'OK' if good else 'FAIL'}", flush=True)
    try:
        import torch
    except ImportError:
        return ok
    if torch.cuda.is_available():
        tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
                      if dt == ml_dtypes.bfloat16 else torch.from_numpy(x).cuda()
                      for x in (q, k, v))
        tm = None if mask is None else torch.from_numpy(mask).cuda()
        tp = None if pse is None else (torch.from_numpy(pse.view(np.int16)).view(
            torch.bfloat16).cuda() if dt == ml_dtypes.bfloat16 else torch.from_numpy(pse).cuda())
        to = prompt_flash_attention(tq, tk, tv, tm, lens, None, tp, **kw)
        assert isinstance(to, torch.Tensor) and to.is_cuda
        same = np.array_equal(
            (to.view(torch.int16) if to.dtype == torch.bfloat16 else to).cpu().numpy().view(
                np.uint8), out_dev.view(np.uint8))
        ok &= same
        print(f"  {'':24s} torch tensors in/out: {'identical' if same else 'DIFFER'}")
    return ok


def bench(quick):
    from numba import cuda

    from pfa_numba import prompt_flash_attention
    from pfa_numba.gpu.arrays import numba_device_array
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    shapes = [(1, 16, 4096, 128, "dense"), (1, 16, 4096, 128, "causal"),
              (4, 32, 1024, 128, "dense")]
    if quick:
        shapes = [(1, 8, 1024, 128, "dense")]
    print(f"\n  {'case':34s} {'pfa_numba cuda':>15s} {'TFLOP/s':>8s} {'torch flash':>12s} "
          f"{'TFLOP/s':>8s} {'torch/pfa':>9s}")
    for dt_name, dt in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        for b, n, s, d, mode in shapes:
            rng = np.random.default_rng(1)
            host = [rng.standard_normal((b, n, s, d)).astype(dt) for _ in range(3)]
            dev = [numba_device_array(x) for x in host]
            mask = cuda.to_device(np.triu(np.ones((2048, 2048), bool), 1)) if mode == "causal" \
                else None
            kw = dict(num_heads=n, input_layout="BNSD", scale_value=d ** -0.5,
                      sparse_mode=3 if mode == "causal" else 0)
            run = lambda: prompt_flash_attention(*dev, mask, **kw)  # noqa: E731
            run()
            cuda.synchronize()
            t = []
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                cuda.synchronize()
                t.append(time.perf_counter() - t0)
            t_pfa = float(np.median(t))
            t_torch = float("nan")
            if torch is not None and torch.cuda.is_available():
                tdt = torch.float16 if dt == np.float16 else torch.bfloat16
                tq, tk, tv = (torch.randn(b, n, s, d, device="cuda", dtype=tdt) for _ in range(3))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    f = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        tq, tk, tv, is_causal=mode == "causal")
                    f()
                    torch.cuda.synchronize()
                    t = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        f()
                        torch.cuda.synchronize()
                        t.append(time.perf_counter() - t0)
                t_torch = float(np.median(t))
            flop = 4.0 * b * n * s * s * d * (0.5 if mode == "causal" else 1.0)
            print(f"  {dt_name + ' ' + mode + ' ' + str((b, n, s, d)):34s} {t_pfa * 1e3:12.2f} ms "
                  f"{flop / t_pfa / 1e12:8.2f} {t_torch * 1e3:9.2f} ms "
                  f"{flop / t_torch / 1e12:8.2f} {t_torch / t_pfa:9.3f}", flush=True)


#: (CUDA_Q_ROWS, CUDA_KV_COLS, CUDA_TILE_ELEMS) to time against the defaults: threads per
#: block, kv columns per shared-memory tile, and the cap on a tile's float32 values (a tile's
#: columns are at most CUDA_TILE_ELEMS // the padded head dim; K and V tiles together must
#: stay within 48 KiB of static shared memory)
TILE_VARIANTS = [(64, 64, 4096), (32, 64, 4096), (128, 64, 4096), (256, 64, 4096),
                 (128, 16, 2048), (64, 48, 6144), (128, 48, 6144)]


def tiles(quick, shape=None):
    """Time the kernel's tile sizes on one problem (fp16, dense; ``shape`` (B, N, S, D) or the
    default); each variant's output is compared with the first's (tile sizes must not change
    the result beyond rounding)."""
    from pfa_numba import config, prompt_flash_attention
    from pfa_numba.gpu.arrays import numba_device_array
    from numba import cuda
    b, n, s, d = shape or ((1, 8, 1024, 128) if quick else (1, 16, 2048, 128))
    rng = np.random.default_rng(2)
    dev = [numba_device_array(rng.standard_normal((b, n, s, d)).astype(np.float16))
           for _ in range(3)]
    kw = dict(num_heads=n, input_layout="BNSD", scale_value=d ** -0.5)
    saved = (config.CUDA_Q_ROWS, config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS)
    first = None
    print(f"\n  tile sizes, fp16 dense {(b, n, s, d)}: (rows per block, kv columns, tile cap)")
    try:
        for rows, cols, elems in TILE_VARIANTS:
            config.CUDA_Q_ROWS, config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS = rows, cols, elems
            out = prompt_flash_attention(*dev, **kw).copy_to_host().astype(np.float32)
            first = out if first is None else first
            t = []
            for _ in range(5):
                t0 = time.perf_counter()
                prompt_flash_attention(*dev, **kw)
                cuda.synchronize()
                t.append(time.perf_counter() - t0)
            med = float(np.median(t))
            print(f"  {str((rows, cols, elems)):20s} {med * 1e3:9.2f} ms "
                  f"{4.0 * b * n * s * s * d / med / 1e12:6.2f} TFLOP/s   max |out - first| "
                  f"{np.abs(out - first).max():.1e}", flush=True)
    finally:
        config.CUDA_Q_ROWS, config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiles", action="store_true",
                    help="also time the kernel's tile sizes (TILE_VARIANTS)")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="fp16 / bf16 on the tensor-core kernel (config.CUDA_TENSOR_CORES)")
    args = ap.parse_args()
    from pfa_numba import config
    config.CUDA_TENSOR_CORES = args.tensor_cores
    from numba import cuda
    if not cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    print(f"device: {cuda.get_current_device().name}")
    print("correctness at realistic sizes:")
    ok = check(args.quick)
    bench(args.quick)
    if args.tiles:
        tiles(args.quick)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
