"""On a machine with an NVIDIA GPU: set up, check the CUDA kernels at realistic sizes, time them
against torch's flash attention, all in one run of a few minutes.

    python scripts/gpu_check.py [--wheels DIR] [--quick] [--portable] [--profile] [--tiles]
    python scripts/gpu_check.py --decode [--wheels DIR] [--quick]
    python -m pytest tests/cudasim tests/ptx     # the kernel tests, on the device
    python -m pytest tests/test_transformers.py -k cuda    # models on CUDA tensors vs "sdpa"

Set-up. numba-cuda 0.30 needs NumPy < 2.5. Where numba-cuda is missing or NumPy is too new
(an H200 machine with NumPy 2.5 and no package index, say), ``--wheels DIR`` installs the
wheels of DIR (NumPy < 2.5 and numba-cuda, for this Python: ``pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 "numpy<2.5"
numba-cuda==0.30.4``) into a private folder with ``pip --no-index --no-deps --target`` and
runs the script again with that folder first on PYTHONPATH and the project second.

1. Correctness: pfa_numba on CUDA (Numba device arrays, and torch tensors when torch has CUDA)
   against pfa_numba.reference (the first kv group's heads) and the CPU path (every head), for
   fp16, bf16 and fp32, dense / causal / band / user mask / pse / GQA / varlen, and a V holding
   inf (the tensor-core route's guard); the SDPA drop-in's softcap and sinks on the
   tensor-core and decode kernels; every case is reported, then the script fails if any did.
2. Speed: for fp16 and bf16 at the shapes of SHAPES, on torch tensors: 50 back-to-back calls
   between two synchronisations, median of 5 such runs, for a whole call, a planned call
   (PfaPlan) and torch SDPA's FLASH backend, alternating; beside them the device time of one
   call (CUDA events around it while the stream is held, so no host time shows) and the host
   time of a whole and of a planned call (the calls' own time, the stream not waited for).
3. ``--decode`` instead: fused_infer_attention_score decode steps (N 32, Nkv 8, D 128; B 1, 8,
   32; kv lengths 1k-32k and 128k at B 1; fp16 and bf16; contiguous and paged caches, block
   sizes 16 and 128 in a shuffled table, int8 caches contiguous and paged by 16 with a
   per-channel scale) through a planned call, against torch SDPA with
   enable_gqa on the contiguous cache: ms, the cache's bytes a second and their share of a
   device copy's bandwidth, and each output's error against torch's.
4. ``--profile``: an ncu summary (launch, speed of light, occupancy) of one tensor-core launch.

``--portable`` turns config.CUDA_TENSOR_CORES off (every call on the portable kernel).
Exits non-zero if a check fails.
"""
import argparse
import glob
import logging
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join("/tmp", "pfa_numba_gpu_site")

#: (B, N, Nkv, S, D, causal) of the speed table
SHAPES = [(1, 16, 16, 4096, 128, False), (1, 16, 16, 4096, 128, True),
          (4, 32, 32, 1024, 128, False), (2, 32, 8, 2048, 128, True),
          (1, 32, 32, 4096, 64, False), (8, 16, 16, 512, 128, False)]
#: calls between two synchronisations, and such runs a median is taken of
CALLS, RUNS = 50, 5


# ---------------------------------------------------------------------------------------------
# set-up
# ---------------------------------------------------------------------------------------------

def _environment_problem():
    """Why numba-cuda cannot run here, or None."""
    try:
        import numpy
        if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 5):
            return f"NumPy {numpy.__version__} (numba-cuda 0.30 needs < 2.5)"
        import numba_cuda  # noqa: F401
    except ImportError as exc:
        return f"numba-cuda is not installed ({exc})"
    return None


def set_up(wheels):
    """None when the environment is ready; else run this script again with the wheels of
    ``wheels`` installed into SITE first on the path, returning its exit code."""
    problem = _environment_problem()
    if problem is None or os.environ.get("PFA_GPU_CHECK_SITE"):
        return None
    if not wheels:
        print(f"set-up: {problem}; pass --wheels DIR with NumPy < 2.5 and numba-cuda wheels")
        return 2
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    print(f"set-up: {problem}; installing {len(found)} wheels from {wheels} into {SITE}")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                           "--no-deps", "--upgrade", "--target", SITE, *found])
    env = dict(os.environ, PFA_GPU_CHECK_SITE="1",
               PYTHONPATH=os.pathsep.join([SITE, ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.call([sys.executable, *sys.argv], env=env)


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------

def _cases(quick):
    import ml_dtypes
    import numpy as np
    s = 256 if quick else 1024
    return [
        ("fp16 dense GQA", np.float16, dict(B=1, N=8, Nkv=2, S=s, D=128, mode=0)),
        ("bf16 causal", ml_dtypes.bfloat16, dict(B=1, N=4, Nkv=4, S=s, D=64, mode=3)),
        ("fp32 band", np.float32, dict(B=2, N=4, Nkv=4, S=s, D=80, mode=4)),
        ("fp16 mask+pse varlen", np.float16, dict(B=2, N=4, Nkv=4, S=s // 2, D=128, mode=1)),
        ("fp16 causal, V with inf", np.float16, dict(B=1, N=4, Nkv=2, S=s, D=128, mode=3,
                                                     inf=True)),
    ]


def check(quick):
    ok = True
    for name, dt, c in _cases(quick):
        try:
            ok &= _check_case(name, dt, c)
        except Exception:                   # report every case, then fail
            traceback.print_exc()
            print(f"  {name:26s} FAIL (exception above)", flush=True)
            ok = False
    return ok


def _check_case(name, dt, c):
    import numpy as np
    from numba import cuda

    from pfa_numba import prompt_flash_attention, reference
    from pfa_numba.interop.cuda_arrays import numba_device_array
    rng = np.random.default_rng(0)
    b, n, nkv, s, d = c["B"], c["N"], c["Nkv"], c["S"], c["D"]
    q = rng.standard_normal((b, n, s, d)).astype(dt)
    k = rng.standard_normal((b, nkv, s, d)).astype(dt)
    v = rng.standard_normal((b, nkv, s, d)).astype(dt)
    if c.get("inf"):
        v[:, :, s - 1] = np.inf                  # causal: only the last rows keep it
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD",
              scale_value=d ** -0.5, sparse_mode=c["mode"], pre_tokens=100, next_tokens=20)
    mask = pse = lens = None
    if c["mode"] in (2, 3, 4):
        mask = np.triu(np.ones((2048, 2048), bool), 1)
    elif c["mode"] == 1:
        mask = rng.random((b, 1, s, s)) < 0.2
        pse = rng.standard_normal((1, n, s, s)).astype(dt)
        lens = [s, s // 3][:b]
    t0 = time.perf_counter()
    dev = [None if x is None else numba_device_array(x) for x in (q, k, v, mask)]
    dpse = None if pse is None else numba_device_array(pse)
    out_dev = prompt_flash_attention(*dev, lens, None, dpse, **kw).copy_to_host()
    cuda.synchronize()
    t_gpu = time.perf_counter() - t0
    out_cpu = prompt_flash_attention(q, k, v, mask, lens, None, pse, **kw)
    g = n // nkv
    sub = (q[:, :g], k[:, :1], v[:, :1], mask, lens, None, None if pse is None else pse[:, :g])
    ref = reference.prompt_flash_attention(*sub, **dict(kw, num_heads=g, num_key_value_heads=0))

    err_gpu, err_cpu = _max_err(out_dev[:, :g], ref), _max_err(out_cpu[:, :g], ref)
    err_all = _max_err(out_dev, out_cpu)         # every head: cuda against the cpu path
    good = err_gpu <= 2 * err_cpu + 1e-3 and err_all <= 2 * err_cpu + 2e-3
    print(f"  {name:26s} max err vs reference: cuda {err_gpu:.2e}, cpu {err_cpu:.2e}; "
          f"all heads |cuda - cpu| {err_all:.2e} ({t_gpu:.2f} s incl. JIT)  "
          f"{'OK' if good else 'FAIL'}", flush=True)
    torch = _torch_cuda()
    if torch is None:
        return bool(good)
    to = prompt_flash_attention(*(None if x is None else _to_torch(torch, x)
                                  for x in (q, k, v, mask)), lens, None,
                                None if pse is None else _to_torch(torch, pse), **kw)
    torch.cuda.synchronize()
    same = np.array_equal(_from_torch(torch, to).view(np.uint8), out_dev.view(np.uint8))
    print(f"  {'':26s} torch tensors in/out: {'identical' if same else 'DIFFER'}")
    return bool(good) and same


def _max_err(a, b):
    """max |a - b| over the finite values of b; inf where a and b are not finite alike."""
    import numpy as np
    a, b = np.asarray(a).astype(np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return np.inf
    fin = np.isfinite(b)
    return np.abs(a[fin] - b[fin]).max(initial=0.0)


class _Said(logging.Handler):
    """The messages of the log records it is given."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check_extensions(quick):
    """The SDPA drop-in's softcap and sinks (NumPy arrays, device="cuda") on the tensor-core
    kernel (a causal prefill) and the decode kernel (one query row a head; the portable
    kernel for both with --portable), against the reference (the first kv group's heads) and
    the CPU path (every head); a case fails where another kernel ran it. Where torch has
    CUDA, the same call on torch CUDA tensors must give the same bits."""
    import ml_dtypes
    import numpy as np

    from pfa_numba import config, reference, scaled_dot_product_attention
    said = _Said()
    log = logging.getLogger("pfa_numba.cuda")
    log.addHandler(said)
    log.setLevel(logging.INFO)
    s = 256 if quick else 1024
    ok = True
    for name, dt, (b, n, nkv, sq, skv, d), causal, kernel in (
            ("fp16 softcap+sinks causal", np.float16, (1, 8, 2, s, s, 128), True,
             "tensor-core"),
            ("bf16 softcap+sinks decode", ml_dtypes.bfloat16, (4, 32, 8, 1, 4 * s, 128), False,
             "decode")):
        kernel = kernel if config.CUDA_TENSOR_CORES else "portable"
        rng = np.random.default_rng(1)
        q, k, v = (rng.standard_normal(shape).astype(np.float32).astype(dt) for shape in
                   ((b, n, sq, d), (b, nkv, skv, d), (b, nkv, skv, d)))
        q = (q.astype(np.float32) * 3).astype(dt)          # scores past the cap
        sinks = rng.standard_normal(n).astype(np.float32) * 2
        kw = dict(is_causal=causal, enable_gqa=True, softcap=5.0, sinks=sinks)
        said.lines.clear()
        out_dev = scaled_dot_product_attention(q, k, v, **kw, device="cuda")
        ran = any(line.startswith(f"cuda {kernel} queued") for line in said.lines)
        out_cpu = scaled_dot_product_attention(q, k, v, **kw)
        g = n // nkv
        ref = reference.prompt_flash_attention(
            q[:, :g], k[:, :1], v[:, :1], np.triu(np.ones((2048, 2048), bool), 1) if causal
            else None, num_heads=g, input_layout="BNSD", scale_value=d ** -0.5,
            sparse_mode=2 if causal else 0, next_tokens=0 if causal else 2147483647,
            inner_precise=2, softcap=5.0, sinks=sinks[:g])
        err_gpu, err_cpu = _max_err(out_dev[:, :g], ref), _max_err(out_cpu[:, :g], ref)
        err_all = _max_err(out_dev, out_cpu)
        tensors = _sdpa_on_torch_cuda(q, k, v, kw, out_dev)
        good = ran and err_gpu <= 2 * err_cpu + 1e-3 and err_all <= 2 * err_cpu + 2e-3 and \
            tensors != "differ"
        print(f"  {name:26s} max err vs reference: cuda {err_gpu:.2e}, cpu {err_cpu:.2e}; "
              f"all heads |cuda - cpu| {err_all:.2e}; the {kernel} kernel "
              f"{'ran' if ran else 'did NOT run'}; torch CUDA tensors: {tensors}  "
              f"{'OK' if good else 'FAIL'}", flush=True)
        ok &= bool(good)
    log.removeHandler(said)
    return ok


def _sdpa_on_torch_cuda(q, k, v, kw, want):
    """'same bits' or 'differ': the SDPA call of NumPy ``q, k, v`` and ``kw`` on torch CUDA
    tensors against ``want`` (its result with device="cuda"); 'no torch CUDA' without them."""
    import numpy as np

    from pfa_numba import scaled_dot_product_attention
    from pfa_numba.interop.cuda_arrays import to_host
    torch = _torch_cuda()
    if torch is None:
        return "no torch CUDA"
    tq, tk, tv = (_to_torch(torch, x) for x in (q, k, v))
    got = scaled_dot_product_attention(tq, tk, tv, **dict(kw, sinks=_to_torch(torch, kw["sinks"])))
    same = got.is_cuda and np.array_equal(to_host(got).view(np.uint16), want.view(np.uint16))
    return "same bits" if same else "differ"


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _to_torch(torch, x):
    import numpy as np
    if x.dtype.itemsize == 2 and x.dtype != np.float16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(x).cuda()


def _from_torch(torch, t):
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).cpu().numpy()


# ---------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------

def _back_to_back(torch, fn):
    """(seconds a call over CALLS calls between two synchronisations, the host's seconds a
    call: the calls' own time, the stream not waited for)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / CALLS, (t1 - t0) / CALLS


def _device_time(torch, fn):
    """The device time of one call: CUDA events around it, queued while the stream is held by
    a sleeping kernel, so that the host's time does not show between them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def bench(quick):
    import numpy as np

    from pfa_numba import PfaPlan, prompt_flash_attention
    torch = _torch_cuda()
    if torch is None:
        print("\nspeed: torch with CUDA is not installed, no table")
        return
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    shapes = SHAPES[:2] if quick else SHAPES
    print(f"\nspeed: {CALLS} calls between two synchronisations, median of {RUNS} runs "
          "(ms a call); device: one call's device time; host: a call's own time")
    print(f"  {'case':38s} {'pfa':>7s} {'plan':>7s} {'torch':>7s} {'x torch':>7s} "
          f"{'device':>7s} {'TF/s':>6s} {'host':>7s} {'plan host':>9s}")
    for dt_name, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for b, n, nkv, s, d, causal in shapes:
            q = torch.randn(b, n, s, d, device="cuda", dtype=tdt)
            k, v = (torch.randn(b, nkv, s, d, device="cuda", dtype=tdt) for _ in range(2))
            mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="cuda"), 1) \
                if causal else None
            kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD",
                      scale_value=d ** -0.5, sparse_mode=3 if causal else 0)
            plan = PfaPlan(q, k, v, mask, **kw)
            fns = {"pfa": lambda: prompt_flash_attention(q, k, v, mask, **kw),
                   "plan": lambda: plan(q, k, v)}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fns["torch"] = lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=nkv != n)
                for fn in fns.values():               # compiles, caches, allocator
                    fn()
                times = {name: [] for name in fns}
                for _ in range(RUNS):                 # alternating
                    for name, fn in fns.items():
                        times[name].append(_back_to_back(torch, fn))
            wall = {name: float(np.median([t[0] for t in ts])) for name, ts in times.items()}
            host = {name: float(np.median([t[1] for t in ts])) for name, ts in times.items()}
            device = _device_time(torch, fns["plan"])
            flop = 4.0 * b * n * s * s * d * (0.5 if causal else 1.0)
            case = f"{dt_name} {'causal' if causal else 'dense'} {(b, n, nkv, s, d)}"
            print(f"  {case:38s} {wall['pfa'] * 1e3:7.3f} {wall['plan'] * 1e3:7.3f} "
                  f"{wall['torch'] * 1e3:7.3f} {wall['torch'] / wall['pfa']:7.3f} "
                  f"{device * 1e3:7.3f} {flop / device / 1e12:6.1f} "
                  f"{host['pfa'] * 1e6:5.0f}us {host['plan'] * 1e6:7.0f}us", flush=True)


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------

#: (B, kv lengths) of the decode table (N 32, Nkv 8, D 128); forms of the cache
DECODE_SHAPES = [(1, (1024, 4096, 32768, 131072)), (8, (1024, 4096, 32768)),
                 (32, (1024, 4096, 32768))]
DECODE_FORMS = ("contiguous", "paged 16", "paged 128", "int8", "int8 paged 16")
#: the int8 caches' per-channel scale: values of about N(0, 1) quantized to steps of 1/16
INT8_STEP = 1.0 / 16


def _copy_bandwidth(torch):
    """Bytes a second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    wall, _ = _back_to_back(torch, lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / wall


def _decode_cache(torch, form, k, v):
    """(key, value, extra FIA arguments) of cache ``k``, ``v`` (B, Nkv, L, D) in ``form``:
    contiguous BNSD, or paged pools (blocks, Nkv, block_size, D) in a shuffled table; "int8"
    forms quantize it (steps of INT8_STEP, a per-channel antiquant scale)."""
    if form.startswith("int8"):
        k, v = ((x / INT8_STEP).round().clamp(-128, 127).to(torch.int8) for x in (k, v))
        scale = torch.full((2, k.shape[1] * k.shape[3]), INT8_STEP, dtype=torch.float16,
                           device="cuda")
        kc, vc, extra = _decode_cache(torch, form[5:] or "contiguous", k, v)
        return kc, vc, dict(extra, antiquant_scale=scale)
    if form == "contiguous":
        return k, v, {}
    bs = int(form.split()[1])
    b, nkv, length, d = k.shape
    per = length // bs
    order = torch.randperm(b * per, device="cuda")
    table = order.reshape(b, per).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.empty(b * per, nkv, bs, d, dtype=x.dtype, device="cuda")
        pool[order] = x.reshape(b, nkv, per, bs, d).permute(0, 2, 1, 3, 4).reshape(
            b * per, nkv, bs, d)
        pools.append(pool)
    return pools[0], pools[1], dict(block_table=table, block_size=bs)


def decode(quick):
    """Decode steps (N 32, Nkv 8, D 128) through a planned FiaPlan call against torch SDPA with
    enable_gqa (its fastest backend) on the same contiguous cache: ms a call, the cache's bytes
    a second and their share of the copy bandwidth; each case's output against torch's."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pfa_numba import FiaPlan
    torch = _torch_cuda()
    if torch is None:
        print("\ndecode: torch with CUDA is not installed, no table")
        return True
    copy = _copy_bandwidth(torch)
    print(f"\ndecode (N 32, Nkv 8, D 128; planned calls; {CALLS} calls between two "
          f"synchronisations, median of {RUNS}); copy bandwidth {copy / 1e12:.2f} TB/s")
    print(f"  {'case':34s} {'ms':>8s} {'TB/s':>6s} {'copy':>6s} {'torch ms':>9s} "
          f"{'x torch':>7s} {'max err':>8s}")
    ok = True
    shapes = DECODE_SHAPES[:1] if quick else DECODE_SHAPES
    backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    for dt_name, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for b, lengths in shapes:
            for length in lengths[:2] if quick else lengths:
                q = torch.randn(b, 32, 1, 128, device="cuda", dtype=tdt)
                k, v = (torch.randn(b, 8, length, 128, device="cuda", dtype=tdt)
                        for _ in range(2))
                ref, t_torch = None, None
                for backend in backends:
                    with sdpa_kernel(backend):
                        fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                            q, k, v, scale=128 ** -0.5, enable_gqa=True)
                        try:
                            ref = fn()
                        except RuntimeError:
                            continue
                        t = float(np.median([_back_to_back(torch, fn)[0] for _ in range(RUNS)]))
                        t_torch = t if t_torch is None else min(t_torch, t)
                for form in DECODE_FORMS:
                    kc, vc, extra = _decode_cache(torch, form, k, v)
                    if "antiquant_scale" in extra:          # extra: query's dtype scales
                        extra["antiquant_scale"] = extra["antiquant_scale"].to(tdt)
                    nbytes = 2 * k.numel() * kc.element_size()
                    plan = FiaPlan(q, kc, vc, num_heads=32, num_key_value_heads=8,
                                   input_layout="BNSD", scale=128 ** -0.5, **extra)
                    out, _ = plan(q, kc, vc)
                    err = float((out.float() - ref.float()).abs().max()) if ref is not None \
                        else float("nan")
                    # (an int8 cache against torch on the unquantized one: steps of 1/16)
                    ok &= err <= (6e-2 if form.startswith("int8") else 2e-2)
                    t = float(np.median([_back_to_back(torch, lambda: plan(q, kc, vc))[0]
                                         for _ in range(RUNS)]))
                    ratio = f"{t_torch / t:7.2f}" if t_torch else "      -"
                    case = f"{dt_name} B {b} L {length} {form}"
                    print(f"  {case:34s} {t * 1e3:8.3f} {nbytes / t / 1e12:6.2f} "
                          f"{nbytes / t / copy:6.2f} "
                          f"{(t_torch or float('nan')) * 1e3:9.3f} {ratio} {err:8.1e}",
                          flush=True)
                torch.cuda.empty_cache()
    return ok


def profile():
    """An ncu summary of one tensor-core launch (fp16 dense (1, 16, 4096, 128))."""
    cmd = ["ncu", "--clock-control", "none", "--section", "LaunchStats", "--section",
           "SpeedOfLight", "--section", "Occupancy", "-k", "regex:attention_tc", "-c", "1",
           sys.executable, os.path.abspath(__file__), "--one-launch"]
    print("\nprofile: " + " ".join(cmd[:-3]), flush=True)
    try:
        subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [SITE if os.environ.get("PFA_GPU_CHECK_SITE") else "", ROOT,
             os.environ.get("PYTHONPATH", "")])))
    except FileNotFoundError:
        print("  ncu is not on PATH")


def one_launch():
    """What --profile runs under ncu."""
    import numpy as np
    from numba import cuda

    from pfa_numba import prompt_flash_attention
    from pfa_numba.interop.cuda_arrays import numba_device_array
    x = numba_device_array(np.random.default_rng(0).standard_normal((1, 16, 4096, 128))
                           .astype(np.float16))
    prompt_flash_attention(x, x, x, num_heads=16, input_layout="BNSD", scale_value=128 ** -0.5)
    cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# tile sizes of the portable kernel
# ---------------------------------------------------------------------------------------------

#: (CUDA_Q_ROWS, CUDA_KV_COLS, CUDA_TILE_ELEMS) to time against the defaults: threads per
#: block, kv columns per shared-memory tile, and the cap on a tile's float32 values (a tile's
#: columns are at most CUDA_TILE_ELEMS // the padded head dim; K and V tiles together must
#: stay within 48 KiB of static shared memory)
TILE_VARIANTS = [(64, 64, 4096), (32, 64, 4096), (128, 64, 4096), (256, 64, 4096),
                 (128, 16, 2048), (64, 48, 6144), (128, 48, 6144)]


def tiles(quick, shape=None):
    """Time the portable kernel's tile sizes on one problem (float32, dense; ``shape`` (B, N,
    S, D) or the default); each variant's output is compared with the first's."""
    import numpy as np
    from numba import cuda

    from pfa_numba import config, prompt_flash_attention
    from pfa_numba.interop.cuda_arrays import numba_device_array
    b, n, s, d = shape or ((1, 8, 1024, 128) if quick else (1, 16, 2048, 128))
    rng = np.random.default_rng(2)
    dev = [numba_device_array(rng.standard_normal((b, n, s, d)).astype(np.float32))
           for _ in range(3)]
    kw = dict(num_heads=n, input_layout="BNSD", scale_value=d ** -0.5)
    saved = (config.CUDA_Q_ROWS, config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS)
    first = None
    print(f"\n  portable kernel tile sizes, fp32 dense {(b, n, s, d)}: (rows per block, kv "
          "columns, tile cap)")
    try:
        for rows, cols, elems in TILE_VARIANTS:
            config.CUDA_Q_ROWS, config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS = rows, cols, elems
            out = prompt_flash_attention(*dev, **kw).copy_to_host()
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
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", help="a folder of NumPy < 2.5 and numba-cuda wheels to set up "
                                     "from when they are missing")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, two table rows")
    ap.add_argument("--portable", action="store_true",
                    help="every call on the portable kernel (config.CUDA_TENSOR_CORES off)")
    ap.add_argument("--profile", action="store_true", help="an ncu summary of one launch")
    ap.add_argument("--decode", action="store_true",
                    help="the decode table (fused_infer_attention_score steps) only")
    ap.add_argument("--tiles", action="store_true",
                    help="also time the portable kernel's tile sizes (TILE_VARIANTS)")
    ap.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rc = set_up(args.wheels)
    if rc is not None:
        return rc
    if args.one_launch:
        return one_launch()
    from numba import cuda

    import numba
    import numpy

    from pfa_numba import config
    config.CUDA_TENSOR_CORES = not args.portable
    if not cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 1
    torch = _torch_cuda()
    print(f"device: {cuda.get_current_device().name}; numba {numba.__version__}, NumPy "
          f"{numpy.__version__}, torch {getattr(torch, '__version__', 'absent')}; "
          f"tensor cores {'on' if config.CUDA_TENSOR_CORES else 'off'}")
    t0 = time.perf_counter()
    if args.decode:
        ok = decode(args.quick)
        print(f"\n{time.perf_counter() - t0:.0f} s in all")
        return 0 if ok else 1
    print("correctness at realistic sizes:")
    ok = check(args.quick)
    try:
        ok &= check_extensions(args.quick)
    except Exception:                       # report it, go on to the speed table, then fail
        traceback.print_exc()
        ok = False
    bench(args.quick)
    if args.tiles:
        tiles(args.quick)
    if args.profile:
        profile()
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
