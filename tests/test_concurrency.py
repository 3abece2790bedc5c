"""Concurrent calls from Python threads (docs/guarantees.md, 'Determinism'): every parallel
kernel runs inside the process's one parallel region, and calls made from several threads give
the bits serial calls give, under each Numba threading layer this machine can load.

Numba fixes its threading layer once a process, so each layer runs in a subprocess of its own
(NUMBA_THREADING_LAYER), which reports the layer it ran on. The workqueue layer, which Numba
falls back to where neither TBB nor OpenMP loads, aborts the process on a concurrent launch.
"""
import importlib
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

import pfa_numba
from pfa_numba.cpu.driver import parallel_region

#: the module that loads each threading layer's library (an ImportError where it is missing)
LAYER_MODULES = {"tbb": "numba.np.ufunc.tbbpool", "omp": "numba.np.ufunc.omppool",
                 "workqueue": "numba.np.ufunc.workqueue"}

#: prompt_flash_attention, fused_infer_attention_score and FiaPlan calls of every CPU kernel
#: (float32 tiles, streaming decode, split-kv, int8 query, int8 output, int8 kv caches), made
#: serially and then from four Python threads at once, three rounds; prints the layer
CALLS = textwrap.dedent("""
    import concurrent.futures, numba, numpy as np, ml_dtypes
    from pfa_numba import FiaPlan, config, fused_infer_attention_score as fia
    from pfa_numba import prompt_flash_attention as pfa, trans_quant_param

    config.CPU_SPLIT_KV_MIN_COLS = 64          # the decode calls below split their kv range
    config.CPU_SPLIT_KV_ITEMS = 4
    rng = np.random.default_rng(0)
    x = lambda dt, *s: rng.standard_normal(s).astype(np.float32).astype(dt)
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)
    causal = np.triu(np.ones((2048, 2048), bool), 1)
    jobs = []
    for i, dt in enumerate([np.float16, ml_dtypes.bfloat16, np.float32] * 2):
        q, k, v = x(dt, 1, 4, 40 + i, 32), x(dt, 1, 2, 70, 32), x(dt, 1, 2, 70, 32)
        kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", sparse_mode=3 * (i % 2))
        jobs.append(lambda q=q, k=k, v=v, kw=kw: pfa(q, k, v, causal, **kw))
        jobs.append(lambda q=q, k=k, v=v, kw=kw: pfa(
            q, k, v, None, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
            quant_scale2=np.array([0.7], np.float32)))
    q8, k8, v8 = i8(1, 4, 33, 32), i8(1, 4, 50, 32), i8(1, 4, 50, 32)
    deq = trans_quant_param(np.array([0.01], np.float32))
    jobs.append(lambda: pfa(q8, k8, v8, None, deq_scale1=deq, deq_scale2=deq,
                            quant_scale1=np.array([50.0], np.float32),
                            quant_scale2=np.array([2.0], np.float32), num_heads=4,
                            input_layout="BNSD"))
    qd, kd, vd = (x(np.float16, 1, n, s, 64) for n, s in ((8, 1), (1, 600), (1, 600)))
    dkw = dict(num_heads=8, num_key_value_heads=1, input_layout="BNSD", softmax_lse_flag=True)
    jobs.append(lambda: fia(qd, kd, vd, **dkw))
    plan = FiaPlan(qd, kd, vd, **dkw)
    jobs.append(lambda: plan(qd, kd, vd))
    nb, bs = 12, 16
    pool_k, pool_v = i8(nb, 2, bs, 64), i8(nb, 2, bs, 64)
    table = rng.permutation(nb)[:10].reshape(2, 5).astype(np.int32)
    scales = {n: (rng.random((nb, 2, bs)) * 0.02 + 0.005).astype(np.float32)
              for n in ("key_antiquant_scale", "value_antiquant_scale")}
    pkw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", block_table=table,
               block_size=bs, actual_seq_lengths_kv=[70, 33], key_antiquant_mode=5,
               value_antiquant_mode=5, quant_scale2=np.array([3.0], np.float32), **scales)
    qp = x(np.float16, 2, 8, 1, 64)
    jobs.append(lambda: fia(qp, pool_k, pool_v, **pkw))
    paged_plan = FiaPlan(qp, pool_k, pool_v, **pkw)
    jobs.append(lambda: paged_plan(qp, pool_k, pool_v))
    qs, ks, vs = (x(np.float32, 2, n, s, 32) for n, s in ((8, 5), (2, 30), (2, 30)))
    pre = dict(key_shared_prefix=x(np.float32, 1, 2, 9, 32),
               value_shared_prefix=x(np.float32, 1, 2, 9, 32))
    jobs.append(lambda: fia(qs, ks, vs, num_heads=8, num_key_value_heads=2, input_layout="BNSD",
                            **pre))

    def bits(result):
        parts = result if isinstance(result, tuple) else (result,)
        return [np.ascontiguousarray(p).view(np.uint8).tobytes() for p in parts]

    serial = [bits(job()) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda job: bits(job()), jobs))
            bad = [i for i, (g, s) in enumerate(zip(got, serial)) if g != s]
            assert not bad, f"calls {bad} differ from their serial results"
    print(numba.threading_layer())
""")


def _loads(layer):
    """Whether this machine loads Numba's ``layer`` (asked in a subprocess: loading one can
    decide the layer of the process that loads it)."""
    probe = f"import {LAYER_MODULES[layer]}"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@pytest.mark.parametrize("layer", ["default", "workqueue", "omp", "tbb"])
def test_concurrent_calls_under_each_threading_layer(layer):
    env = dict(os.environ)
    env.pop("NUMBA_THREADING_LAYER", None)
    if layer != "default":
        if not _loads(layer):
            assert layer not in ("workqueue",), "Numba's workqueue layer always loads"
            pytest.skip(f"this machine cannot load Numba's {layer} threading layer")
        env["NUMBA_THREADING_LAYER"] = layer
    res = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True,
                         timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    ran_on = res.stdout.split()[-1]
    assert ran_on == layer if layer != "default" else ran_on in LAYER_MODULES


def _parallel_kernels():
    """(module, name) of every ``parallel=True`` dispatcher a pfa_numba module holds."""
    found = []
    for name in sorted(sys.modules):
        if name == "pfa_numba" or name.startswith("pfa_numba."):
            module = sys.modules[name]
            for attr, value in list(vars(module).items()):
                if isinstance(value, CPUDispatcher) and value.targetoptions.get("parallel"):
                    found.append((module, attr))
    return found


def test_every_parallel_kernel_runs_inside_the_parallel_region(monkeypatch):
    """Each parallel dispatcher, wherever a module holds it (the kernels' launcher and the
    decode benchmark's memory read), asserts that its caller holds the region; then calls of
    every CPU kernel and the int8 output quantization."""
    for module in ("pfa_numba.cli.bench_decode",):
        importlib.import_module(module)
    kernels = _parallel_kernels()
    assert {attr for _, attr in kernels} == {"_on_threads", "_read_once"}
    calls = []

    def guarded(kernel, attr):
        def call(*args):
            assert parallel_region.held(), f"{attr} ran outside the parallel region"
            calls.append(attr)
            return kernel(*args)
        return call

    for module, attr in kernels:
        monkeypatch.setattr(module, attr, guarded(getattr(module, attr), attr))
    monkeypatch.setattr(pfa_numba.config, "CPU_SPLIT_KV_MIN_COLS", 64)   # a decode call splits
    monkeypatch.setattr(pfa_numba.config, "CPU_SPLIT_KV_ITEMS", 4)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float16)
    k = rng.standard_normal((1, 2, 700, 32)).astype(np.float16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    pfa_numba.prompt_flash_attention(q, k, k, **kw, quant_scale2=np.array([2.0], np.float32))
    pfa_numba.fused_infer_attention_score(q, k, k, **kw)
    q8 = rng.integers(-128, 128, (1, 2, 9, 32)).astype(np.int8)
    deq = pfa_numba.trans_quant_param(np.array([0.01], np.float32))
    pfa_numba.prompt_flash_attention(q8, q8, q8, None, deq_scale1=deq, deq_scale2=deq,
                                     quant_scale1=np.array([40.0], np.float32), num_heads=2,
                                     input_layout="BNSD")
    from pfa_numba.cli import bench_decode as _bench_decode
    _bench_decode._read_each([np.ones(64, np.uint64)])
    assert {"_on_threads", "_read_once"} <= set(calls)
    assert numba.get_num_threads() >= 1


def test_blas_is_held_to_one_thread_in_a_region_that_calls_it():
    """A kernel that calls BLAS runs with every BLAS library at one thread, SciPy's among them
    (the kernels' sgemm), although a fresh process loads it only when the first such call
    runs: a BLAS with threads of its own inside the parallel region oversubscribes the cores."""
    code = textwrap.dedent("""
        import sys
        from threadpoolctl import threadpool_info
        from pfa_numba.cpu._blas import sgemm_address
        from pfa_numba.cpu.driver import parallel_region
        assert "scipy.linalg.cython_blas" not in sys.modules
        with parallel_region(True):
            sgemm_address()                 # what preparing a BLAS kernel's call does
            held = [(i["filepath"], i["num_threads"]) for i in threadpool_info()
                    if i["user_api"] == "blas"]
        print(held)
        assert any("scipy" in path for path, _ in held), held
        assert all(n == 1 for _, n in held), held
    """)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


#: with torch loaded first (its OpenMP runtime the process's first) and Numba set to a thread
#: count torch does not have: the thread counts of torch and of every BLAS and OpenMP library,
#: before and after calls of a decode step (first: a kernel without BLAS), a BLAS kernel, a
#: half-precision kernel and the SDPA drop-in's forward and backward
HOST_SETTINGS = textwrap.dedent("""
    import os, sys
    import torch
    os.environ["NUMBA_NUM_THREADS"] = str(torch.get_num_threads() + 1)
    import numba, numpy as np
    from threadpoolctl import threadpool_info
    import pfa_numba

    def settings():
        return (torch.get_num_threads(), torch.get_num_interop_threads(),
                sorted((i["filepath"], i["num_threads"]) for i in threadpool_info()))

    before = settings()
    rng = np.random.default_rng(0)
    d, c = (rng.standard_normal(s).astype(np.float16) for s in ((1, 2, 1, 32), (1, 2, 700, 32)))
    split, pfa_numba.config.CPU_SPLIT_KV_ITEMS = pfa_numba.config.CPU_SPLIT_KV_ITEMS, 0
    pfa_numba.fused_infer_attention_score(d, c, c, num_heads=2, input_layout="BNSD")  # no BLAS
    pfa_numba.config.CPU_SPLIT_KV_ITEMS = split
    q = rng.standard_normal((1, 2, 300, 32)).astype(np.float32)
    pfa_numba.prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD")
    h = q.astype(np.float16)
    pfa_numba.prompt_flash_attention(h, h, h, num_heads=2, input_layout="BNSD")
    t = torch.tensor(q, requires_grad=True)
    pfa_numba.scaled_dot_product_attention(t, t, t, is_causal=True).sum().backward()
    after = settings()
    known = {path for path, _ in before[2]}
    after = after[:2] + ([(p, n) for p, n in after[2] if p in known],)
    assert after == before, (before, after)
    print(numba.threading_layer())
""")


@pytest.mark.parametrize("layer", ["workqueue", "omp", "tbb"])
def test_a_call_leaves_the_hosts_thread_settings_as_it_found_them(layer):
    """Numba's OpenMP layer sets OpenMP's thread count when it starts its pool, which lands in
    torch's runtime where torch was loaded first; a pfa_numba call must leave torch's and the
    BLAS libraries' thread counts as they were, under each threading layer this machine loads
    (libraries a call loads itself, SciPy's BLAS and the layer's own runtime, are new)."""
    pytest.importorskip("torch")
    if not _loads(layer):
        assert layer != "workqueue", "Numba's workqueue layer always loads"
        pytest.skip(f"this machine cannot load Numba's {layer} threading layer")
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer}
    res = subprocess.run([sys.executable, "-c", HOST_SETTINGS], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.split()[-1] == layer
