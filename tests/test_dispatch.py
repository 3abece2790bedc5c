"""Kernel choice: every kernel is declared once, one rule takes the first a call's device allows,
``explain`` says which and why not each other, and the CPU runs the kernel it names."""
import logging

import ml_dtypes
import numba
import numpy as np
import pytest

from pfa_numba import config, dispatch, explain, explain_fia, prompt_flash_attention
from pfa_numba.cpu import driver

DEQ = dict(deq_scale1=np.ones(1, np.float32), quant_scale1=np.ones(1, np.float32),
           deq_scale2=np.ones(1, np.float32))


def _arrays(dtype, b, n, nkv, sq, skv, d, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.int8:
        make = lambda shape: rng.integers(-8, 8, shape).astype(np.int8)  # noqa: E731
    else:
        make = lambda shape: rng.standard_normal(shape).astype(dtype)    # noqa: E731
    return make((b, n, sq, d)), make((b, nkv, skv, d)), make((b, nkv, skv, d))


def _call(kernel):
    """(arguments, keywords) of a call that the CPU kernel ``kernel`` takes on this host."""
    bnsd = dict(input_layout="BNSD")
    if kernel == "int8":
        return _arrays(np.int8, 1, 2, 2, 40, 40, 32), dict(num_heads=2, **bnsd, **DEQ)
    if kernel == "split-kv":             # one decode row, a long kv range, few runs a thread
        skv = 4 * config.CPU_SPLIT_KV_MIN_COLS
        return _arrays(np.float32, 1, 1, 1, 1, skv, 16), dict(num_heads=1, **bnsd)
    if kernel == "streaming":
        return _arrays(np.float32, 2, 8, 2, 1, 300, 64), dict(num_heads=8,
                                                               num_key_value_heads=2, **bnsd)
    dtype = ml_dtypes.bfloat16 if kernel == "amx" else np.float32
    return _arrays(dtype, 1, 4, 2, 96, 80, 64), dict(num_heads=4, num_key_value_heads=2,
                                                     **bnsd)


def _host_tiles():
    """The float32 tiles this host runs: register blocks where it has AVX-512, else BLAS."""
    return "avx512-tiles" if driver.use_register_blocks() else "blas-tiles"


#: the CPU kernels a call chosen for each kernel runs ("tiles": _host_tiles())
KERNEL_STEPS = {"int8": ["int8"], "split-kv": ["streaming", "merge"],
                "streaming": ["streaming"], "amx": ["amx"], "avx512-tiles": ["avx512-tiles"],
                "blas-tiles": ["blas-tiles"]}


def _ran(caplog):
    """(kernel, [steps]) of each CPU launch the ``pfa_numba.cpu`` log recorded."""
    runs = []
    for record in caplog.records:
        if record.name == "pfa_numba.cpu" and record.getMessage().startswith("cpu "):
            head, steps = record.getMessage().split(": ", 1)
            runs.append((head.split()[1], [s.split(" (")[0] for s in steps.split("; ")]))
    return runs


@pytest.mark.parametrize("kernel", list(KERNEL_STEPS))
def test_the_cpu_runs_the_kernel_explain_names(monkeypatch, caplog, kernel):
    """Each CPU kernel, on a call it takes: explain names it first, the kernels before it
    with their reasons and those after it as able but later; the call runs that kernel's
    steps, and the log says so."""
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 4 if kernel == "split-kv" else 1)
    if kernel == "blas-tiles":
        monkeypatch.setattr(config, "CPU_AVX512_GEMM", False)
    args, kw = _call(kernel)
    names = [k.name for k in dispatch.TARGETS["cpu"].kernels()]
    lacks = {"amx": "AMX", "avx512-tiles": "AVX-512"}.get(kernel)
    if lacks and lacks not in dispatch.TARGETS["cpu"].features():
        assert f"not {kernel}: needs {lacks}, which this machine lacks" in explain(*args, **kw)
        return
    text = [line for line in explain(*args, **kw).splitlines() if not line.startswith("  and")]
    assert text[0].startswith(f"the cpu {kernel} kernel runs this call: ")
    others = [n for n in names if n != kernel]
    assert [line.split(":")[0] for line in text[1:]] == [f"  not {n}" for n in others]
    for n, line in zip(others, text[1:]):
        after = names.index(n) > names.index(kernel)
        able = line.endswith(f"it could; {kernel} comes first")
        assert after or not able, line          # every kernel before it has reasons
    caplog.set_level(logging.INFO, logger="pfa_numba.cpu")
    prompt_flash_attention(*args, **kw)
    assert _ran(caplog) == [(kernel, KERNEL_STEPS[kernel])]


def test_explain_names_what_runs_beside_the_kernel(monkeypatch, caplog):
    """A call whose last block of rows is few enough to stream: the float32 tiles run it, the
    streaming kernel its short rows, and explain says both."""
    caplog.set_level(logging.INFO, logger="pfa_numba.cpu")
    monkeypatch.setattr(config, "CPU_Q_ROWS", 64)
    args, kw = _arrays(np.float32, 1, 4, 2, 65, 80, 32), dict(num_heads=4,
                                                              num_key_value_heads=2,
                                                              input_layout="BNSD")
    text = explain(*args, **kw)
    assert text.startswith(f"the cpu {_host_tiles()} kernel")
    assert "runs of work items have at most config.CPU_STREAM_ROWS = 16 rows: the streaming " \
        "kernel runs them" in text
    prompt_flash_attention(*args, **kw)
    assert _ran(caplog) == [(_host_tiles(), [_host_tiles(), "streaming"])]


def test_switches_and_features_rule_kernels_out(monkeypatch):
    args, kw = _call("amx")
    monkeypatch.setattr(config, "CPU_AMX", False)
    text = explain(*args, **kw)
    assert text.startswith(f"the cpu {_host_tiles()} kernel") and \
        "config.CPU_AMX is False" in text
    monkeypatch.setattr(config, "CPU_AMX", True)
    monkeypatch.setattr(dispatch.CpuTarget, "features", lambda self, situation=None: set())
    assert "not amx: needs AMX, which this machine lacks" in explain(*args, **kw)


def test_a_declaration_rules_out_what_it_does_not_take():
    kernel = dispatch.Kernel("narrow", "a test kernel", dtypes=("float16",), head_dims=(64,),
                             layouts=("BNSD",), caches=("paged",), features=("AMX",),
                             switch="CPU_AMX", extensions=("sinks",))

    class P:                       # what a declaration reads of a planned problem
        dtype, D, Dv, layout = np.dtype(np.float32), 96, 80, "TND"
        cache = type("C", (), dict(block_table=None, P=3, antiquant=(1, 1)))()
        softcap, sinks = 30.0, np.zeros(2, np.float32)
    reasons = kernel.not_supported_reasons(P, None, features=set())
    assert reasons == ["needs AMX, which this machine lacks", "float32 inputs (it takes float16)",
                       "head dim 96 (it takes 64)",
                       "value head dim Dv = 80 with head dim D = 96 (it takes Dv = D)",
                       "layout TND (it takes BNSD)",
                       "a shared prefix (it reads contiguous key / value)",
                       "an int8 kv cache (it reads contiguous key / value)",
                       "softcapped scores (it does not compute them)"]


def _as_if_the_machine_had_amx(monkeypatch):
    """The reasons a test is about, on any machine (no call runs here: none is chosen)."""
    from pfa_numba.cpu import _amx
    monkeypatch.setattr(_amx, "available", lambda: True)


def test_no_kernel_raises_every_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "KERNELS", tuple(k for k in dispatch.KERNELS
                                                   if not k.name.endswith("-tiles")))
    monkeypatch.setattr(config, "CPU_AMX", False)
    _as_if_the_machine_had_amx(monkeypatch)
    args, kw = _call("blas-tiles")
    with pytest.raises(RuntimeError) as err:
        prompt_flash_attention(*args, **kw)
    for line in ("int8: float32 inputs (it takes int8)", "amx: config.CPU_AMX is False; float32"):
        assert line in str(err.value)


def test_explain_raises_the_calls_errors():
    args, kw = _call("blas-tiles")
    with pytest.raises(RuntimeError, match="num_heads"):
        explain(*args, **{**kw, "num_heads": 3})
    with pytest.raises(TypeError, match="prompt_flash_attention"):
        explain(*args, bogus=1)


def test_explain_fia_over_an_int8_cache(monkeypatch):
    """An int8 cache: AMX (which dequantizes nothing) is ruled out by its declaration."""
    _as_if_the_machine_had_amx(monkeypatch)
    q, k, v = _arrays(np.float16, 1, 4, 2, 40, 64, 64)
    i8 = k.astype(np.int8)
    text = explain_fia(q, i8, i8, antiquant_scale=np.ones(2, np.float16), num_heads=4,
                       num_key_value_heads=2, input_layout="BNSD")
    assert text.startswith(f"the cpu {_host_tiles()} kernel")
    assert "not amx: an int8 kv cache (it reads contiguous key / value)" in text


def test_every_declared_kernel_is_reachable_and_explained(monkeypatch):
    """Each kernel of both devices is the one explain names for some call, on this machine or,
    for what it lacks, on one described (AMX, AVX-512 and the switches; a GPU by its compute
    capability and multiprocessors, none needed here)."""
    from pfa_numba.cpu import _amx, _gemm
    monkeypatch.setattr(_amx, "available", lambda: True)
    monkeypatch.setattr(_gemm, "available", lambda: True)
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 1)
    seen = set()
    for kernel in KERNEL_STEPS:
        monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 4 if kernel == "split-kv" else 1)
        monkeypatch.setattr(config, "CPU_AMX", kernel == "amx")
        monkeypatch.setattr(config, "CPU_AVX512_GEMM", kernel != "blas-tiles")
        args, kw = _call(kernel)
        first = explain(*args, **kw).splitlines()[0]
        assert first.startswith(f"the cpu {kernel} kernel runs this call"), first
        seen.add(("cpu", kernel))
    if dispatch.TARGETS["cuda"].environment_problems(machine={"compute_capability": (9, 0)}):
        pytest.skip("numba-cuda cannot compile here: the CUDA kernels are explained elsewhere")
    gpu = dict(device="cuda", compute_capability=(9, 0), sms=132)
    prefill, decode = _arrays(np.float16, 1, 8, 2, 96, 300, 64), \
        _arrays(np.float16, 1, 8, 2, 1, 300, 64)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD")
    for args, cc, kernel in ((prefill, (9, 0), "tensor-core"), (decode, (9, 0), "decode"),
                             (prefill, (7, 5), "portable")):
        text = explain(*args, **kw, **dict(gpu, compute_capability=cc))
        assert text.startswith(f"the cuda {kernel} kernel runs this call"), text
        seen.add(("cuda", kernel))
    from pfa_numba.sdpa import attention_problem
    for nkv, kernel in ((4, "backward-heads"), (1, "backward-tiles")):
        q, k, v = _arrays(np.float32, 1, 4, nkv, 20, 30, 16)
        p = attention_problem(q, k, v, None, None, dropout_p=0.0, is_causal=False, scale=None,
                              softcap=None, enable_gqa=True)
        monkeypatch.setattr(numba, "get_num_threads", lambda: 2)
        assert dispatch.choose(p, "cpu", operation="backward").kernel.name == kernel
        seen.add(("cpu", kernel))
    assert seen == {(k.device, k.name) for k in dispatch.KERNELS}
