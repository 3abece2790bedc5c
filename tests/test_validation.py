"""Validation tests for ``pfa_numba.prompt_flash_attention`` (the contract, docs/contract.md: every
section but 'The computation', 'Empty rows' and 'softmax_lse and merging').

One test function (usually parametrized) per validation rule of the contract.  Error tests check
the exception type (TypeError / ValueError / RuntimeError as the contract says) and that the message
names the argument and contains the value received (contract 'Errors': "Every message names the
argument and the value received").  Positive tests check the accepted side of each boundary.

The quantization rules (§8 and the quant parts of §10) are at the end, marked ``quant``.

Only the public API is used.  Shapes are tiny so the file runs quickly once compiled.
"""

import functools
import math
import re

import ml_dtypes
import numpy as np
import pytest

from pfa_numba import prompt_flash_attention as pfa
from pfa_numba.frontend import checks


FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP32 = np.dtype(np.float32)
I8 = np.dtype(np.int8)
FLOAT_DTYPES = [FP16, BF16, FP32]
LAYOUTS = ["BSH", "BNSD", "BSND", "BNSD_BSND", "TND"]
INF_TOKENS = 2147483647

# default tiny problem
B_, N_, SQ, SKV, D_ = 2, 2, 4, 6, 16

_EXC_KINDS = (TypeError, ValueError, RuntimeError)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
class AnyOf:
    """At least one of these items must be in the message."""

    def __init__(self, *items):
        self.items = items

    def __repr__(self):
        return "AnyOf(%s)" % ", ".join(repr(_text(i)) for i in self.items)


def _text(item):
    if isinstance(item, str):
        return item
    if isinstance(item, (np.dtype, type)):
        return np.dtype(item).name
    if isinstance(item, tuple):
        return str(tuple(item))
    return str(item)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?\Z")


def _found(text, msg):
    """`text` occurs in `msg`; identifiers and numbers must stand alone (so that 'key' is not
    found inside 'num_key_value_heads', 'float16' not inside 'bfloat16', '3' not inside '300',
    'actual_seq_lengths' not inside 'actual_seq_lengths_kv')."""
    if _IDENT.match(text):
        pat = r"(?<![A-Za-z0-9_])" + re.escape(text) + r"(?![A-Za-z0-9_])"
    elif _NUMBER.match(text):
        pat = r"(?<![0-9.])" + re.escape(text) + r"(?![0-9]|\.[0-9])"
    else:
        return text in msg
    return re.search(pat, msg) is not None


def assert_raises(exc_type, fn, *names_and_values):
    """fn() must raise exc_type (and not another of TypeError/ValueError/RuntimeError; a
    tuple of types where the contract lets the input break two rules at once); its
    message must contain every item (str as is, dtype -> dtype name, tuple -> str(tuple),
    other -> str(x)); an AnyOf(...) item needs one of its members."""
    with pytest.raises(Exception) as info:
        fn()
    err = info.value
    wanted = exc_type if isinstance(exc_type, tuple) else (exc_type,)
    others = tuple(t for t in _EXC_KINDS if t not in wanted)
    assert isinstance(err, wanted) and not isinstance(err, others), (
        "expected %s, got %s: %s" % ("/".join(t.__name__ for t in wanted),
                                     type(err).__name__, err))
    msg = str(err)
    for item in names_and_values:
        options = item.items if isinstance(item, AnyOf) else (item,)
        texts = [_text(o) for o in options]
        assert any(_found(t, msg) for t in texts), (
            "%s message %r does not contain %s" % (type(err).__name__, msg,
                                                   " or ".join(repr(t) for t in texts)))
    return err


def shp(a):
    return str(tuple(np.shape(a)))


def val(x):
    """The value as str() or repr() writes it (NumPy scalars: '1.0' or 'np.float64(1.0)')."""
    return AnyOf(str(x), repr(x))


def make(layout="BNSD", dtype=FP16, B=B_, N=N_, Nkv=None, Sq=SQ, Skv=SKV, D=D_, seed=0):
    """q, k, v (seeded) in `layout`, plus the keyword arguments that describe them."""
    Nkv = N if Nkv is None else Nkv
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)

    def arr(shape):
        if dtype == I8:
            return rng.integers(-8, 8, size=shape, dtype=np.int8)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype)

    if layout == "BSH":
        qs, ks = (B, Sq, N * D), (B, Skv, Nkv * D)
    elif layout in ("BNSD", "BNSD_BSND"):
        qs, ks = (B, N, Sq, D), (B, Nkv, Skv, D)
    elif layout == "BSND":
        qs, ks = (B, Sq, N, D), (B, Skv, Nkv, D)
    elif layout == "TND":
        qs, ks = (B * Sq, N, D), (B * Skv, Nkv, D)
    else:
        raise AssertionError(layout)
    q, k, v = arr(qs), arr(ks), arr(ks)
    kw = dict(num_heads=N, num_key_value_heads=Nkv, input_layout=layout)
    if layout == "TND":
        kw["actual_seq_lengths"] = [Sq * (b + 1) for b in range(B)]
        kw["actual_seq_lengths_kv"] = [Skv * (b + 1) for b in range(B)]
    return q, k, v, kw


def out_shape(layout, B=B_, N=N_, Sq=SQ, D=D_):
    return {
        "BSH": (B, Sq, N * D),
        "BNSD": (B, N, Sq, D),
        "BSND": (B, Sq, N, D),
        "BNSD_BSND": (B, Sq, N, D),
        "TND": (B * Sq, N, D),
    }[layout]


def run(q, k, v, kw, **extra):
    args = dict(kw)
    args.update(extra)
    return pfa(q, k, v, **args)


def user_mask(shape, dtype=np.bool_, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.random(shape) < 0.3).astype(dtype)


@functools.lru_cache(maxsize=None)
def _triu2048():
    m = np.triu(np.ones((2048, 2048), dtype=np.bool_), 1)
    m.setflags(write=False)
    return m


def causal_mask(shape=(2048, 2048), dtype=np.bool_):
    base = _triu2048()
    if shape[-2:] == (2048, 2048):
        return np.ascontiguousarray(np.broadcast_to(base, shape)).astype(dtype)
    return np.triu(np.ones(shape, dtype=np.bool_), 1).astype(dtype)


def pse(shape, dtype=FP16, seed=2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype)


def assert_same(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


def ctx_kwargs(ctx):
    """Contexts in which pre_tokens / next_tokens are used (§4.1)."""
    if ctx == "mode0_mask":
        return dict(sparse_mode=0, attn_mask=user_mask((SQ, SKV)))
    if ctx == "mode4":
        return dict(sparse_mode=4, attn_mask=causal_mask())
    raise AssertionError(ctx)


USED_CTX = ["mode0_mask", "mode4"]


# ============================================================================================
# §1 signature, device, return_softmax_lse
# ============================================================================================
def test_s1_mindspore_positional_call():
    q, k, v, _ = make("BNSD")
    out = pfa(q, k, v, None, None, None, None, None, None, None, None, None, N_,
              input_layout="BNSD")
    assert isinstance(out, np.ndarray)
    assert out.shape == out_shape("BNSD") and out.dtype == FP16
    full = pfa(q, k, v, None, None, None, None, None, None, None, None, None, N_, 1.0,
               2147483647, 0, "BNSD", 0, 0, 1)
    assert_same(out, full)


@pytest.mark.parametrize("device", [None, "cpu"], ids=["None", "cpu"])
def test_s1_device_accepted(device):
    q, k, v, kw = make("BNSD")
    assert_same(run(q, k, v, kw, device=device), run(q, k, v, kw))


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda0", "", 1],
                         ids=["tpu", "gpu", "cuda0", "empty", "int1"])
def test_s1_device_invalid_value(device):
    q, k, v, kw = make("BNSD")
    assert_raises(ValueError, lambda: run(q, k, v, kw, device=device), "device", str(device))


def test_s1_device_cuda_without_backend():
    try:
        from numba import cuda
        available = cuda.is_available()
    except Exception:  # noqa: BLE001 - no CUDA support at all
        available = False
    if available:
        pytest.skip("a CUDA device is usable here")
    q, k, v, kw = make("BNSD")
    err = assert_raises(RuntimeError, lambda: run(q, k, v, kw, device="cuda"))
    assert "cuda" in str(err).lower()


def test_s1_device_cuda_when_numba_cuda_cannot_compile(monkeypatch, tmp_path):
    """numba-cuda 0.30 with NumPy 2.5 fails inside its first kernel compile: device='cuda'
    refuses with a RuntimeError naming NumPy's version, before any kernel is launched."""
    from pfa_numba import dispatch
    if not dispatch._numba_cuda_installed():
        pytest.skip("numba-cuda is not installed here")
    (tmp_path / "pfa_test_broken_compiler.py").write_text(
        "raise AttributeError(\"module 'numpy' has no attribute 'row_stack'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch, "CUDA_COMPILER_MODULE", "pfa_test_broken_compiler")
    q, k, v, kw = make("BNSD")
    err = assert_raises(RuntimeError, lambda: run(q, k, v, kw, device="cuda"))
    assert "row_stack" in str(err) and f"NumPy {np.__version__}" in str(err)
    assert run(q, k, v, kw, device="cpu").shape == q.shape       # the CPU is unaffected


@pytest.mark.parametrize("flag", [1, 0, "True", None], ids=["int1", "int0", "strTrue", "None"])
def test_s1_return_softmax_lse_not_bool(flag):
    q, k, v, kw = make("BNSD")
    assert_raises(TypeError, lambda: run(q, k, v, kw, return_softmax_lse=flag),
                  "return_softmax_lse", str(flag))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_s1_return_softmax_lse_bool(layout):
    q, k, v, kw = make(layout)
    out = run(q, k, v, kw, return_softmax_lse=False)
    assert isinstance(out, np.ndarray) and out.shape == out_shape(layout)
    res = run(q, k, v, kw, return_softmax_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    o, lse = res
    assert_same(o, out)
    assert lse.dtype == FP32
    assert lse.shape == ((B_ * SQ, N_, 1) if layout == "TND" else (B_, N_, SQ, 1))


# ============================================================================================
# §2 dtypes, bf16 head dim, inner_precise
# ============================================================================================
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_s2_float_dtypes_accepted(layout, dtype):
    q, k, v, kw = make(layout, dtype)
    out = run(q, k, v, kw)
    assert isinstance(out, np.ndarray)
    assert out.dtype == dtype and out.shape == out_shape(layout)
    assert np.all(np.isfinite(out.astype(np.float32)))


@pytest.mark.parametrize("dtype", ["float64", "int32", "int16", "uint8", "bool", "complex64",
                                   "int64"])
def test_s2_query_dtype_unsupported(dtype):
    q, k, v, kw = make("BNSD", FP32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    assert_raises(TypeError, lambda: run(q, k, v, kw), "query", np.dtype(dtype))


_MISMATCH = [(FP16, FP32), (FP16, BF16), (BF16, FP16), (FP32, FP16), (FP16, np.dtype("float64")),
             (FP32, BF16)]


@pytest.mark.parametrize("qdt,odt", _MISMATCH, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("which", ["key", "value"])
def test_s2_kv_dtype_differs_from_query(which, qdt, odt):
    q, k, v, kw = make("BNSD", qdt)
    if which == "key":
        k = k.astype(odt)
    else:
        v = v.astype(odt)
    assert_raises(TypeError, lambda: run(q, k, v, kw), which, np.dtype(odt))


@pytest.mark.parametrize("D", [8, 24, 40])
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "TND"])
def test_s2_bf16_head_dim_not_multiple_of_16(layout, D):
    q, k, v, kw = make(layout, BF16, D=D)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("query", "key", "value", "num_heads"), str(D))


@pytest.mark.parametrize("D", [16, 32, 48])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s2_bf16_head_dim_multiple_of_16_ok(layout, D):
    q, k, v, kw = make(layout, BF16, D=D)
    out = run(q, k, v, kw)
    assert out.dtype == BF16 and out.shape == out_shape(layout, D=D)


@pytest.mark.parametrize("D", [8, 24])
@pytest.mark.parametrize("dtype", [FP16, FP32], ids=lambda d: d.name)
def test_s2_fp16_fp32_any_head_dim_ok(dtype, D):
    q, k, v, kw = make("BNSD", dtype, D=D)
    assert run(q, k, v, kw).shape == out_shape("BNSD", D=D)


@pytest.mark.parametrize("ip", [-1, 4, 5, 100])
def test_s2_inner_precise_out_of_range(ip):
    q, k, v, kw = make("BNSD")
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, inner_precise=ip),
                  "inner_precise", str(ip))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s2_inner_precise_0_to_3_accepted(dtype):
    q, k, v, kw = make("BNSD", dtype)
    m = user_mask((SQ, SKV))
    outs = [run(q, k, v, kw, attn_mask=m, inner_precise=ip) for ip in range(4)]
    for o in outs:
        assert o.shape == out_shape("BNSD") and o.dtype == dtype
    assert_same(outs[0], outs[1])
    assert_same(outs[2], outs[3])


# ============================================================================================
# §3 layouts, shapes, heads
# ============================================================================================
@pytest.mark.parametrize("layout", [None, 0, b"BSH", ["BSH"]],
                         ids=["None", "int0", "bytes", "list"])
def test_s3_input_layout_not_str(layout):
    q, k, v, kw = make("BSH")
    kw["input_layout"] = layout
    assert_raises(TypeError, lambda: run(q, k, v, kw), "input_layout", str(layout))


@pytest.mark.parametrize("layout", ["XYZ", "SBH", "bnsd", "BNSD_BNSD", "NSD", ""])
def test_s3_input_layout_unknown(layout):
    q, k, v, kw = make("BNSD")
    kw["input_layout"] = layout
    assert_raises(ValueError, lambda: run(q, k, v, kw), "input_layout", layout)


def _bad_rank(x, layout):
    # one axis too many for 3-D layouts, one too few for 4-D layouts
    return x[..., None] if layout in ("BSH", "TND") else x[0]


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_s3_wrong_rank_for_layout(layout, which):
    q, k, v, kw = make(layout)
    arrs = dict(query=q, key=k, value=v)
    arrs[which] = _bad_rank(arrs[which], layout)
    bad = arrs[which]
    assert_raises(ValueError, lambda: run(arrs["query"], arrs["key"], arrs["value"], kw),
                  which, shp(bad))


@pytest.mark.parametrize("n", [0, -1, -8])
def test_s3_num_heads_not_positive(n):
    q, k, v, kw = make("BSH", N=1)
    kw["num_heads"] = n
    kw["num_key_value_heads"] = 0
    assert_raises(RuntimeError, lambda: run(q, k, v, kw), "num_heads", str(n))


@pytest.mark.parametrize("nkv", [-1, -2])
def test_s3_num_key_value_heads_negative(nkv):
    q, k, v, kw = make("BNSD")
    kw["num_key_value_heads"] = nkv
    assert_raises(RuntimeError, lambda: run(q, k, v, kw), "num_key_value_heads", str(nkv))


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "TND"])
def test_s3_num_heads_not_multiple_of_kv_heads(layout):
    q, k, v, kw = make(layout, N=4, Nkv=3)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("num_heads", "num_key_value_heads"), AnyOf("4", "3"))


@pytest.mark.parametrize("N,Nkv", [(64, 1), (128, 2), (256, 4)], ids=["64/1", "128/2", "256/4"])
def test_s3_group_size_64_ok(N, Nkv):
    q, k, v, kw = make("BNSD", B=1, N=N, Nkv=Nkv, Sq=1, Skv=2)
    assert run(q, k, v, kw).shape == (1, N, 1, D_)


@pytest.mark.parametrize("N,Nkv", [(65, 1), (130, 2)], ids=["65/1", "130/2"])
def test_s3_group_size_over_64(N, Nkv):
    q, k, v, kw = make("BNSD", B=1, N=N, Nkv=Nkv, Sq=1, Skv=2)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("num_heads", "num_key_value_heads"), AnyOf(str(N), str(N // Nkv)))


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s3_num_heads_256_ok(layout):
    q, k, v, kw = make(layout, B=1, N=256, Nkv=256, Sq=1, Skv=2)
    assert run(q, k, v, kw).shape == out_shape(layout, B=1, N=256, Sq=1)


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s3_num_heads_over_256(layout):
    q, k, v, kw = make(layout, B=1, N=257, Nkv=257, Sq=1, Skv=2)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw), "num_heads", "257")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s3_head_dim_512_ok(dtype):
    q, k, v, kw = make("BNSD", dtype, B=1, N=1, Sq=2, Skv=2, D=512)
    out = run(q, k, v, kw)
    assert out.shape == (1, 1, 2, 512) and out.dtype == dtype


@pytest.mark.parametrize("dtype", [FP16, FP32], ids=lambda d: d.name)
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "TND"])
def test_s3_head_dim_over_512(layout, dtype):
    q, k, v, kw = make(layout, dtype, B=1, N=1, Sq=2, Skv=2, D=513)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("query", "key", "value"), "513")


def test_s3_batch_65536_ok():
    q, k, v, kw = make("BNSD", B=65536, N=1, Sq=1, Skv=1)
    out = run(q, k, v, kw)
    assert out.shape == (65536, 1, 1, D_)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND"])
def test_s3_batch_over_65536(layout):
    q, k, v, kw = make(layout, B=65537, N=1, Sq=1, Skv=1)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("query", "key", "value"), "65537")


_HEAD_AXIS = {"BNSD": 1, "BNSD_BSND": 1, "BSND": 2, "TND": 1}


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BNSD_BSND", "TND"])
def test_s3_query_heads_differ_from_num_heads(layout):
    q, k, v, kw = make(layout, N=2)
    kw["num_heads"] = 4
    kw["num_key_value_heads"] = 2
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("num_heads", "query"), AnyOf("4", shp(q)))


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BNSD_BSND", "TND"])
def test_s3_kv_heads_differ_from_num_key_value_heads(layout):
    q, k, v, kw = make(layout, N=4, Nkv=2)
    kw["num_key_value_heads"] = 1
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("num_key_value_heads", "key", "value"), AnyOf("1", shp(k)))


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "TND"])
def test_s3_kv_heads_default_zero_means_N(layout):
    # num_key_value_heads = 0 with kv heads == N: fine
    q, k, v, kw = make(layout, N=4, Nkv=4)
    kw["num_key_value_heads"] = 0
    assert run(q, k, v, kw).shape == out_shape(layout, N=4)
    # num_key_value_heads = 0 with kv heads != N (BSH: Hkv != H): RuntimeError, saying what
    # 0 means and what to pass instead
    q, k, v, kw = make(layout, N=4, Nkv=2)
    kw["num_key_value_heads"] = 0
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  "num_key_value_heads = 0 means as many kv heads as num_heads (4)",
                  "for grouped-query attention pass num_key_value_heads",
                  AnyOf(shp(k), "32" if layout == "BSH" else shp(k)))
    if layout != "BSH":
        assert_raises(RuntimeError, lambda: run(q, k, v, kw), "num_key_value_heads=2")


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "TND"])
def test_s3_gqa_ok(layout):
    q, k, v, kw = make(layout, N=4, Nkv=2)
    assert run(q, k, v, kw).shape == out_shape(layout, N=4)


def test_s3_bsh_hidden_not_divisible_by_num_heads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 30)).astype(np.float16)
    k = rng.standard_normal((2, 5, 30)).astype(np.float16)
    v = k.copy()
    assert_raises(RuntimeError, lambda: pfa(q, k, v, num_heads=4, input_layout="BSH"),
                  AnyOf("num_heads", "query"), AnyOf("30", shp(q)))


def test_s3_bsh_kv_hidden_not_divisible_by_kv_heads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 64)).astype(np.float16)     # N = 4, D = 16
    k = rng.standard_normal((2, 5, 18)).astype(np.float16)     # Hkv = 18, Nkv = 4
    v = k.copy()
    assert_raises(RuntimeError,
                  lambda: pfa(q, k, v, num_heads=4, num_key_value_heads=4, input_layout="BSH"),
                  AnyOf("num_key_value_heads", "key", "value"), AnyOf("18", shp(k)))


def _resize_last(x, D):
    shape = x.shape[:-1] + (D,)
    return np.zeros(shape, x.dtype)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND", "TND"])
def test_s3_head_dim_differs(layout):
    """Key's head dim must be the query's (value may have its own: contract 'Layouts',
    tests/test_value_head_dim.py)."""
    q, k, v, kw = make(layout, N=2, D=16)
    if layout == "BSH":
        new = _resize_last(k, 48)     # Hkv = 48 with Nkv = 2 -> D = 24
    else:
        new = _resize_last(k, 32)
    assert_raises(RuntimeError, lambda: run(q, new, v, kw),
                  AnyOf("key", "query"), AnyOf(shp(new), "48" if layout == "BSH" else "32"))


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND"])
def test_s3_batch_differs(layout, which):
    q, k, v, kw = make(layout, B=2)
    _, k3, v3, _ = make(layout, B=3)
    arrs = dict(key=k, value=v)
    arrs[which] = dict(key=k3, value=v3)[which]
    assert_raises(RuntimeError, lambda: run(q, arrs["key"], arrs["value"], kw),
                  AnyOf(which, "query"), AnyOf("3", shp(arrs[which])))


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND"])
def test_s3_kv_length_differs_between_key_and_value(layout):
    q, k, v, kw = make(layout, Skv=6)
    _, _, v7, _ = make(layout, Skv=7)
    assert_raises(RuntimeError, lambda: run(q, k, v7, kw),
                  AnyOf("key", "value"), AnyOf("7", shp(v7)))


@pytest.mark.parametrize("missing", ["actual_seq_lengths", "actual_seq_lengths_kv"])
def test_s3_tnd_lengths_missing(missing):
    q, k, v, kw = make("TND")
    kw[missing] = None
    assert_raises(ValueError, lambda: run(q, k, v, kw), missing, AnyOf("None", "TND"))


def test_s3_tnd_lengths_both_missing():
    q, k, v, kw = make("TND")
    del kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"]
    assert_raises(ValueError, lambda: run(q, k, v, kw),
                  AnyOf("actual_seq_lengths", "actual_seq_lengths_kv"))


@pytest.mark.parametrize("which,ends", [
    ("actual_seq_lengths", [5, 3, 12]),
    ("actual_seq_lengths_kv", [10, 6, 18]),
], ids=["q", "kv"])
def test_s3_tnd_lengths_decreasing(which, ends):
    q, k, v, kw = make("TND", B=3)        # T = 12, Tkv = 18
    kw[which] = ends
    assert_raises(ValueError, lambda: run(q, k, v, kw), which, AnyOf(str(ends[0]), str(ends[1])))


@pytest.mark.parametrize("q_ends,kv_ends", [
    ([4, 8], [12]),
    ([8], [6, 12]),
    ([2, 4, 8], [6, 12]),
], ids=["kv_len1", "q_len1", "3_vs_2"])
def test_s3_tnd_lengths_unequal_count(q_ends, kv_ends):
    q, k, v, kw = make("TND")             # T = 8, Tkv = 12
    kw["actual_seq_lengths"] = q_ends
    kw["actual_seq_lengths_kv"] = kv_ends
    assert_raises(ValueError, lambda: run(q, k, v, kw),
                  AnyOf("actual_seq_lengths", "actual_seq_lengths_kv"), str(q_ends), str(kv_ends))


@pytest.mark.parametrize("which,ends,total", [
    ("actual_seq_lengths", [4, 7], 8),
    ("actual_seq_lengths", [4, 9], 8),
    ("actual_seq_lengths_kv", [6, 11], 12),
    ("actual_seq_lengths_kv", [6, 13], 12),
], ids=["q_short", "q_long", "kv_short", "kv_long"])
def test_s3_tnd_lengths_not_ending_at_total(which, ends, total):
    q, k, v, kw = make("TND")
    kw[which] = ends
    assert_raises(ValueError, lambda: run(q, k, v, kw), which, AnyOf(str(ends[-1]), str(total)))


@pytest.mark.parametrize("which,ends", [
    ("actual_seq_lengths", [-1, 8]),
    ("actual_seq_lengths_kv", [-2, 12]),
], ids=["q", "kv"])
def test_s3_tnd_lengths_negative(which, ends):
    q, k, v, kw = make("TND")
    kw[which] = ends
    assert_raises(ValueError, lambda: run(q, k, v, kw), which, str(ends[0]))


@pytest.mark.parametrize("which", ["actual_seq_lengths", "actual_seq_lengths_kv"])
def test_s3_tnd_lengths_non_integer(which):
    q, k, v, kw = make("TND")
    kw[which] = [float(x) + 0.5 for x in kw[which][:-1]] + [kw[which][-1]]
    assert_raises(TypeError, lambda: run(q, k, v, kw), which, str(kw[which][0]))


@pytest.mark.parametrize("mode", [0, 1])
def test_s3_tnd_user_mask_rejected(mode):
    q, k, v, kw = make("TND")
    m = user_mask((SQ, SKV))
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, attn_mask=m, sparse_mode=mode),
                  "attn_mask", AnyOf("TND", shp(m)))


def test_s3_tnd_pse_rejected():
    q, k, v, kw = make("TND")
    p = pse((B_, N_, SQ, SKV))
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, pse_shift=p),
                  "pse_shift", AnyOf("TND", shp(p)))


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s3_tnd_supported_modes(dtype, mode):
    q, k, v, kw = make("TND", dtype)
    extra = {} if mode == 0 else dict(attn_mask=causal_mask())
    out = run(q, k, v, kw, sparse_mode=mode, **extra)
    assert out.shape == out_shape("TND") and out.dtype == dtype


@pytest.mark.parametrize("ends", [[], ()], ids=["list", "tuple"])
def test_s3_tnd_empty(ends):
    q, k, v, kw = make("TND", B=0)
    assert q.shape == (0, N_, D_)
    kw["actual_seq_lengths"] = ends
    kw["actual_seq_lengths_kv"] = ends
    out = run(q, k, v, kw)
    assert out.shape == (0, N_, D_) and out.dtype == FP16


def test_s3_strided_views_accepted():
    q, k, v, kw = make("BNSD")
    # BSND views of BNSD data: non-contiguous
    qv, kv_, vv = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    assert not qv.flags.c_contiguous
    kw2 = dict(kw, input_layout="BSND")
    out_view = run(qv, kv_, vv, kw2)
    out_copy = run(*(np.ascontiguousarray(x) for x in (qv, kv_, vv)), kw2)
    assert_same(out_view, out_copy)


# ============================================================================================
# §4.1 sparse modes, the 2048 mask, pre/next tokens
# ============================================================================================
@pytest.mark.parametrize("mode", [5, -1, 10])
def test_s41_sparse_mode_out_of_range(mode):
    q, k, v, kw = make("BNSD")
    assert_raises(RuntimeError,
                  lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=user_mask((SQ, SKV))),
                  "sparse_mode", str(mode))


@pytest.mark.parametrize("mode", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s41_modes_1_to_4_require_mask(layout, mode):
    q, k, v, kw = make(layout)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, sparse_mode=mode),
                  "attn_mask", AnyOf("None", str(mode)))


@pytest.mark.parametrize("shape", [(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048),
                                   (B_, 1, 2048, 2048)], ids=str)
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_s41_causal_mask_shape_accepted(mode, shape):
    q, k, v, kw = make("BNSD")
    out = run(q, k, v, kw, sparse_mode=mode, attn_mask=causal_mask(shape))
    assert out.shape == out_shape("BNSD")
    ref = run(q, k, v, kw, sparse_mode=mode, attn_mask=causal_mask())
    assert_same(out, ref)


@pytest.mark.parametrize("mdt", ["bool", "int8", "uint8"])
@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s41_causal_mask_dtype_accepted(dtype, mode, mdt):
    q, k, v, kw = make("BSH", dtype)
    out = run(q, k, v, kw, sparse_mode=mode, attn_mask=causal_mask(dtype=mdt))
    assert out.shape == out_shape("BSH") and out.dtype == dtype


@pytest.mark.parametrize("shape", [(B_, 2048, 2048), (SQ, SKV), (2048, 2047), (2048, 2049),
                                   (1, 2, 2048, 2048), (3, 1, 2048, 2048), (2048,),
                                   (1, 1, 1, 2048, 2048)], ids=str)
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_s41_causal_mask_bad_shape(mode, shape):
    q, k, v, kw = make("BNSD", B=2)
    m = np.zeros(shape, np.bool_)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=m),
                  "attn_mask", str(tuple(shape)))


@pytest.mark.parametrize("mdt", [FP16, FP32, np.dtype("int32"), BF16, np.dtype("float64")],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("mode", [2, 3, 4])
def test_s41_causal_mask_bad_dtype(mode, mdt):
    q, k, v, kw = make("BNSD", FP16)
    m = causal_mask(dtype=mdt)
    assert_raises(TypeError, lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=m),
                  "attn_mask", mdt)


_SIGN_BAD = [(-1, -1), (-5, 2), (1, -3), (0, -1), (-2147483647, -1)]


@pytest.mark.parametrize("pre,nxt", _SIGN_BAD, ids=lambda x: str(x))
@pytest.mark.parametrize("ctx", USED_CTX)
def test_s41_sign_rules_violated_where_used(ctx, pre, nxt):
    q, k, v, kw = make("BNSD")
    assert_raises(RuntimeError,
                  lambda: run(q, k, v, kw, pre_tokens=pre, next_tokens=nxt, **ctx_kwargs(ctx)),
                  AnyOf("pre_tokens", "next_tokens"), AnyOf(str(pre), str(nxt)))


@pytest.mark.parametrize("pre,nxt", [(-1, 3), (3, -1), (0, 0), (-2, 2), (2, -2), (5, 7)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("ctx", USED_CTX)
def test_s41_sign_rules_satisfied_where_used(ctx, pre, nxt):
    q, k, v, kw = make("BNSD")
    out = run(q, k, v, kw, pre_tokens=pre, next_tokens=nxt, **ctx_kwargs(ctx))
    assert out.shape == out_shape("BNSD")


@pytest.mark.parametrize("pre,nxt", [(-1, -1), (-5, 2), (1, -3), (-2147483648, -2147483648)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("ctx", ["mode0_nomask", "mode1", "mode2", "mode3"])
def test_s41_pre_next_ignored_where_unused(ctx, pre, nxt):
    q, k, v, kw = make("BNSD")
    extra = {
        "mode0_nomask": dict(sparse_mode=0),
        "mode1": dict(sparse_mode=1, attn_mask=user_mask((SQ, SKV))),
        "mode2": dict(sparse_mode=2, attn_mask=causal_mask()),
        "mode3": dict(sparse_mode=3, attn_mask=causal_mask()),
    }[ctx]
    out = run(q, k, v, kw, pre_tokens=pre, next_tokens=nxt, **extra)
    assert_same(out, run(q, k, v, kw, **extra))


_BIG = [2147483647, 2147483648, 2 ** 40, 2 ** 63 - 1, np.int64(2 ** 62)]


@pytest.mark.parametrize("big", _BIG, ids=lambda x: str(int(x)))
@pytest.mark.parametrize("arg", ["pre_tokens", "next_tokens"])
@pytest.mark.parametrize("ctx", USED_CTX)
def test_s41_large_pre_next_mean_infinity(ctx, arg, big):
    q, k, v, kw = make("BNSD")
    base = dict(pre_tokens=INF_TOKENS, next_tokens=INF_TOKENS)
    ref = run(q, k, v, kw, **base, **ctx_kwargs(ctx))
    base[arg] = big
    out = run(q, k, v, kw, **base, **ctx_kwargs(ctx))
    assert_same(out, ref)


@pytest.mark.parametrize("arg", ["pre_tokens", "next_tokens"])
@pytest.mark.parametrize("ctx", USED_CTX)
def test_s41_sign_rules_apply_after_infinity(ctx, arg):
    # +inf on one side, a huge negative on the other: raw sum < 0, but +inf + x >= 0 -> OK
    q, k, v, kw = make("BNSD")
    other = "next_tokens" if arg == "pre_tokens" else "pre_tokens"
    out = run(q, k, v, kw, **{arg: 2 ** 40, other: -(2 ** 41)}, **ctx_kwargs(ctx))
    assert out.shape == out_shape("BNSD")
    out = run(q, k, v, kw, **{arg: INF_TOKENS, other: -INF_TOKENS - 5}, **ctx_kwargs(ctx))
    assert out.shape == out_shape("BNSD")


@pytest.mark.parametrize("val", [2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30], ids=str)
@pytest.mark.parametrize("arg", ["pre_tokens", "next_tokens"])
@pytest.mark.parametrize("ctx", USED_CTX)
def test_s41_pre_next_outside_int64(ctx, arg, val):
    q, k, v, kw = make("BNSD")
    assert_raises(ValueError, lambda: run(q, k, v, kw, **{arg: val}, **ctx_kwargs(ctx)),
                  arg, str(val))


# ============================================================================================
# §4.2 the user mask (modes 0 and 1)
# ============================================================================================
@pytest.mark.parametrize("mdt", ["bool", "int8", "uint8"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s42_user_mask_dtype_accepted(dtype, mode, mdt):
    q, k, v, kw = make("BNSD", dtype)
    m = user_mask((SQ, SKV), mdt)
    out = run(q, k, v, kw, sparse_mode=mode, attn_mask=m)
    assert out.shape == out_shape("BNSD") and out.dtype == dtype
    # nonzero = discard: an int8/uint8 mask equals the bool mask with the same nonzeros
    assert_same(out, run(q, k, v, kw, sparse_mode=mode, attn_mask=m.astype(bool)))


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s42_float16_mask_fp16_query_deprecated(layout, mode):
    q, k, v, kw = make(layout, FP16)
    m = user_mask((SQ, SKV), np.float16)
    with pytest.warns(DeprecationWarning):
        out = run(q, k, v, kw, sparse_mode=mode, attn_mask=m)
    assert out.shape == out_shape(layout) and out.dtype == FP16


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=lambda d: d.name)
def test_s42_float16_mask_non_fp16_query(dtype, mode):
    q, k, v, kw = make("BNSD", dtype)
    m = user_mask((SQ, SKV), np.float16)
    assert_raises(TypeError, lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=m),
                  "attn_mask", "float16")


_BAD_MASK_DT = [FP32, np.dtype("float64"), np.dtype("int16"), np.dtype("int32"),
                np.dtype("int64"), np.dtype("uint16"), BF16]


@pytest.mark.parametrize("mdt", _BAD_MASK_DT, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", [FP16, FP32], ids=lambda d: d.name)
def test_s42_user_mask_dtype_rejected(dtype, mode, mdt):
    q, k, v, kw = make("BNSD", dtype)
    m = user_mask((SQ, SKV), mdt)
    assert_raises(TypeError, lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=m),
                  "attn_mask", mdt)


_GOOD_MASK_SHAPES = [(SQ, SKV), (B_, SQ, SKV), (1, SQ, SKV), (B_, 1, SQ, SKV), (1, 1, SQ, SKV),
                     (SQ + 2, SKV + 3), (B_, 1, SQ + 1, SKV + 5), (1, SQ + 3, SKV),
                     (1, 1, SQ, SKV + 1)]


@pytest.mark.parametrize("shape", _GOOD_MASK_SHAPES, ids=str)
@pytest.mark.parametrize("mode", [0, 1])
def test_s42_user_mask_shape_accepted(mode, shape):
    q, k, v, kw = make("BNSD", B=B_, Sq=SQ, Skv=SKV)
    m = user_mask(shape)
    out = run(q, k, v, kw, sparse_mode=mode, attn_mask=m)
    assert out.shape == out_shape("BNSD")
    window = np.ascontiguousarray(m[..., :SQ, :SKV])
    assert_same(out, run(q, k, v, kw, sparse_mode=mode, attn_mask=window))


_BAD_MASK_SHAPES = [(B_, N_, SQ, SKV), (1, 2, SQ, SKV), (SKV,), (1, 1, 1, SQ, SKV),
                    (3, SQ, SKV), (3, 1, SQ, SKV), (SQ - 1, SKV), (SQ, SKV - 1),
                    (B_, 1, SQ, SKV - 1), ()]


@pytest.mark.parametrize("shape", _BAD_MASK_SHAPES, ids=str)
@pytest.mark.parametrize("mode", [0, 1])
def test_s42_user_mask_shape_rejected(mode, shape):
    q, k, v, kw = make("BNSD", B=B_, N=N_)
    m = np.zeros(shape, np.bool_)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, sparse_mode=mode, attn_mask=m),
                  "attn_mask", str(tuple(shape)))


# ============================================================================================
# §6 actual_seq_lengths, actual_seq_lengths_kv
# ============================================================================================
LEN_ARGS = ["actual_seq_lengths", "actual_seq_lengths_kv"]


@pytest.mark.parametrize("B,lens,shown", [
    (2, [1, 2, 3], AnyOf("3", "[1, 2, 3]")),
    (2, [], AnyOf("0", "[]")),
    (3, [1, 2], AnyOf("2", "[1, 2]")),
], ids=["3_for_B2", "empty_for_B2", "2_for_B3"])
@pytest.mark.parametrize("arg", LEN_ARGS)
def test_s6_lengths_count_not_1_or_B(arg, B, lens, shown):
    q, k, v, kw = make("BNSD", B=B)
    assert_raises(ValueError, lambda: run(q, k, v, kw, **{arg: lens}), arg, shown)


@pytest.mark.parametrize("lens,bad", [([5], 5), ([2, 5], 5), ([100], 100)], ids=str)
def test_s6_q_lengths_above_Sq(lens, bad):
    q, k, v, kw = make("BNSD", Sq=SQ)
    assert_raises(ValueError, lambda: run(q, k, v, kw, actual_seq_lengths=lens),
                  "actual_seq_lengths", str(bad))


@pytest.mark.parametrize("lens,bad", [([7], 7), ([3, 7], 7), ([100], 100)], ids=str)
def test_s6_kv_lengths_above_Skv(lens, bad):
    q, k, v, kw = make("BNSD", Skv=SKV)
    assert_raises(ValueError, lambda: run(q, k, v, kw, actual_seq_lengths_kv=lens),
                  "actual_seq_lengths_kv", str(bad))


@pytest.mark.parametrize("lens,bad", [([-1], -1), ([2, -1], -1), (np.array([-3, 1]), -3)],
                         ids=["list1", "list2", "array"])
@pytest.mark.parametrize("arg", LEN_ARGS)
def test_s6_lengths_negative(arg, lens, bad):
    q, k, v, kw = make("BNSD")
    assert_raises(ValueError, lambda: run(q, k, v, kw, **{arg: lens}), arg, str(bad))


@pytest.mark.parametrize("lens,shown", [
    ([1.5], "1.5"),
    ([2.0, 3.0], "2.0"),
    (np.array([2.0, 3.0]), AnyOf("float64", "2.")),
    (["2"], "2"),
    ([None], "None"),
    ([True], AnyOf("True", "bool")),
    (np.array([True, False]), AnyOf("bool", "True")),
    ("ab", "ab"),
], ids=["float", "float_whole", "float_array", "str_item", "None_item", "bool_item",
        "bool_array", "str"])
@pytest.mark.parametrize("arg", LEN_ARGS)
def test_s6_lengths_non_integer(arg, lens, shown):
    q, k, v, kw = make("BNSD", B=2)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **{arg: lens}), arg, shown)


@pytest.mark.parametrize("lens", [np.array([[2, 3]]), [[2], [3]], np.array(3),
                                  np.array([[3]])],
                         ids=["array2d", "nested_list", "array0d", "array1x1"])
@pytest.mark.parametrize("arg", LEN_ARGS)
def test_s6_lengths_not_1d(arg, lens):
    q, k, v, kw = make("BNSD", B=2)
    a = np.asarray(lens)
    # a nested list is also a list of non-integers (TypeError): §10 lets either be raised
    exc = (ValueError, TypeError) if isinstance(lens, list) else ValueError
    shown = AnyOf(shp(a), str(lens), "%d-D" % a.ndim, "ndim",
                  *([str(lens[0])] if isinstance(lens, list) else []))
    assert_raises(exc, lambda: run(q, k, v, kw, **{arg: lens}), arg, shown)


_LEN_FORMS = [
    ("list", lambda xs: list(xs)),
    ("tuple", lambda xs: tuple(xs)),
    ("int32", lambda xs: np.array(xs, np.int32)),
    ("int64", lambda xs: np.array(xs, np.int64)),
    ("uint8", lambda xs: np.array(xs, np.uint8)),
    ("np_scalars", lambda xs: [np.int64(x) for x in xs]),
]


@pytest.mark.parametrize("form", _LEN_FORMS, ids=lambda f: f[0])
@pytest.mark.parametrize("arg", LEN_ARGS)
def test_s6_lengths_container_types_accepted(arg, form):
    q, k, v, kw = make("BNSD", B=2)
    vals = [3, 2] if arg == "actual_seq_lengths" else [5, 1]
    ref = run(q, k, v, kw, **{arg: vals})
    assert_same(run(q, k, v, kw, **{arg: form[1](vals)}), ref)
    # length 1 broadcasts to every batch
    ref1 = run(q, k, v, kw, **{arg: [vals[0], vals[0]]})
    assert_same(run(q, k, v, kw, **{arg: form[1](vals[:1])}), ref1)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "TND"])
def test_s6_lengths_boundaries_accepted(layout):
    q, k, v, kw = make(layout, B=2)
    if layout == "TND":
        out = run(q, k, v, kw, actual_seq_lengths=[0, 8], actual_seq_lengths_kv=[0, 12])
        assert out.shape == out_shape("TND")
        return
    out = run(q, k, v, kw, actual_seq_lengths=[0, SQ], actual_seq_lengths_kv=[SKV, 0])
    assert out.shape == out_shape(layout)
    assert np.all(out.astype(np.float32) == 0)   # batch 0: qL = 0, batch 1: kL = 0
    out = run(q, k, v, kw, actual_seq_lengths=[SQ], actual_seq_lengths_kv=[SKV])
    assert_same(out, run(q, k, v, kw))
    out = run(q, k, v, kw, actual_seq_lengths=None, actual_seq_lengths_kv=None)
    assert_same(out, run(q, k, v, kw))


@pytest.mark.parametrize("which", LEN_ARGS)
def test_s6_tnd_lengths_array_forms_accepted(which):
    q, k, v, kw = make("TND")
    ref = run(q, k, v, kw)
    for form in (tuple, lambda x: np.array(x, np.int64), lambda x: np.array(x, np.int32)):
        assert_same(run(q, k, v, kw, **{which: form(kw[which])}), ref)


# ============================================================================================
# §7 pse_shift
# ============================================================================================
_GOOD_PSE = [(B_, N_, SQ, SKV), (1, N_, SQ, SKV), (B_, N_, SQ + 2, SKV + 3), (1, N_, SQ + 1, SKV)]


@pytest.mark.parametrize("shape", _GOOD_PSE, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s7_pse_shape_accepted(dtype, shape):
    q, k, v, kw = make("BNSD", dtype)
    p = pse(shape, dtype)
    out = run(q, k, v, kw, pse_shift=p)
    assert out.shape == out_shape("BNSD") and out.dtype == dtype
    window = np.ascontiguousarray(p[:, :, :SQ, :SKV])
    assert_same(out, run(q, k, v, kw, pse_shift=window))


_BAD_PSE = [(B_, N_, SQ - 1, SKV), (B_, N_, SQ, SKV - 1), (B_, 1, SQ, SKV), (3, N_, SQ, SKV),
            (N_, SQ, SKV), (1, 1, N_, SQ, SKV), (B_, N_ + 1, SQ, SKV), (SQ, SKV)]


@pytest.mark.parametrize("shape", _BAD_PSE, ids=str)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s7_pse_shape_rejected(layout, shape):
    q, k, v, kw = make(layout, B=B_, N=N_)
    p = pse(shape)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, pse_shift=p), "pse_shift", shp(p))


_BAD_PSE_DT = [(FP16, FP32), (FP16, BF16), (FP16, np.dtype("float64")), (BF16, FP16),
               (BF16, FP32), (FP32, FP16), (FP32, BF16), (FP32, np.dtype("float64")),
               (FP16, np.dtype("int8"))]


@pytest.mark.parametrize("qdt,pdt", _BAD_PSE_DT, ids=lambda d: d.name)
def test_s7_pse_dtype_rejected(qdt, pdt):
    q, k, v, kw = make("BNSD", qdt)
    p = pse((B_, N_, SQ, SKV), pdt)
    assert_raises(TypeError, lambda: run(q, k, v, kw, pse_shift=p), "pse_shift", pdt)


# ============================================================================================
# §10 scale_value, integer arguments, edge sizes, no side effects
# ============================================================================================
@pytest.mark.parametrize("scale", [True, False, np.True_, 1j, np.complex64(1), None, "0.5",
                                   [0.5]],
                         ids=["True", "False", "np_True", "complex", "np_complex", "None",
                              "str", "list"])
def test_s10_scale_value_not_real(scale):
    q, k, v, kw = make("BNSD")
    assert_raises(TypeError, lambda: run(q, k, v, kw, scale_value=scale),
                  "scale_value", val(scale))


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, np.float32("nan"),
                                   np.float16("inf"), np.float64("-inf")],
                         ids=["nan", "inf", "-inf", "np32_nan", "np16_inf", "np64_-inf"])
def test_s10_scale_value_not_finite(scale):
    q, k, v, kw = make("BNSD")
    assert_raises(ValueError, lambda: run(q, k, v, kw, scale_value=scale),
                  "scale_value", val(scale))


@pytest.mark.parametrize("scale,equiv", [
    (0.5, 0.5), (1, 1.0), (2, 2.0), (np.float16(0.5), 0.5), (np.float32(0.25), 0.25),
    (np.float64(0.125), 0.125), (np.int32(1), 1.0), (np.int64(2), 2.0), (np.uint8(1), 1.0),
    (-0.25, -0.25), (0.0, 0.0), (0, 0.0),
], ids=["float", "int1", "int2", "np_f16", "np_f32", "np_f64", "np_i32", "np_i64", "np_u8",
        "negative", "zero_float", "zero_int"])
def test_s10_scale_value_real_types_accepted(scale, equiv):
    q, k, v, kw = make("BNSD")
    assert_same(run(q, k, v, kw, scale_value=scale), run(q, k, v, kw, scale_value=equiv))


INT_ARGS = ["num_heads", "num_key_value_heads", "pre_tokens", "next_tokens", "sparse_mode",
            "inner_precise"]


def _int_ctx():
    q, k, v, kw = make("BNSD")
    return q, k, v, kw, dict(sparse_mode=0, attn_mask=user_mask((SQ, SKV)))


@pytest.mark.parametrize("value", [True, False, np.True_], ids=["True", "False", "np_True"])
@pytest.mark.parametrize("arg", INT_ARGS)
def test_s10_int_args_reject_bool(arg, value):
    q, k, v, kw, extra = _int_ctx()
    args = dict(kw, **extra)
    args[arg] = value
    assert_raises(TypeError, lambda: pfa(q, k, v, **args), arg, val(value))


@pytest.mark.parametrize("value", [2.0, "2", None, np.float64(2.0), [2]],
                         ids=["float", "str", "None", "np_float", "list"])
@pytest.mark.parametrize("arg", INT_ARGS)
def test_s10_int_args_reject_non_int(arg, value):
    q, k, v, kw, extra = _int_ctx()
    args = dict(kw, **extra)
    args[arg] = value
    assert_raises(TypeError, lambda: pfa(q, k, v, **args), arg, val(value))


_NP_INTS = [
    ("num_heads", np.int64(N_)), ("num_heads", np.int32(N_)), ("num_heads", np.uint8(N_)),
    ("num_key_value_heads", np.int16(N_)), ("num_key_value_heads", np.int64(0)),
    ("pre_tokens", np.int64(3)), ("pre_tokens", np.int32(2147483647)),
    ("next_tokens", np.int16(1)), ("next_tokens", np.int64(-1)),
    ("sparse_mode", np.int64(1)), ("sparse_mode", np.uint8(0)),
    ("inner_precise", np.int8(0)), ("inner_precise", np.uint16(2)),
]


@pytest.mark.parametrize("arg,val", _NP_INTS, ids=lambda x: str(x) if isinstance(x, str)
                         else type(x).__name__ + "_" + str(x))
def test_s10_int_args_accept_numpy_integers(arg, val):
    q, k, v, kw, extra = _int_ctx()
    args = dict(kw, **extra, pre_tokens=2, next_tokens=1)
    args[arg] = val
    out = pfa(q, k, v, **args)
    args[arg] = int(val)
    assert_same(out, pfa(q, k, v, **args))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_s10_edge_batch_zero(layout, dtype):
    q, k, v, kw = make(layout, dtype, B=0)
    out = run(q, k, v, kw)
    assert isinstance(out, np.ndarray)
    assert out.shape == out_shape(layout, B=0) and out.dtype == dtype
    o, lse = run(q, k, v, kw, return_softmax_lse=True)
    assert o.shape == out_shape(layout, B=0)
    assert lse.shape == ((0, N_, 1) if layout == "TND" else (0, N_, SQ, 1))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_s10_edge_query_length_zero(layout, dtype):
    q, k, v, kw = make(layout, dtype, Sq=0)
    out = run(q, k, v, kw)
    assert out.shape == out_shape(layout, Sq=0) and out.dtype == dtype
    assert out.size == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_s10_edge_kv_length_zero(layout, dtype):
    q, k, v, kw = make(layout, dtype, Skv=0)
    out = run(q, k, v, kw)
    assert out.shape == out_shape(layout) and out.dtype == dtype
    assert np.all(out.astype(np.float32) == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_s10_edge_head_dim_zero(layout):
    q, k, v, kw = make(layout, FP16, D=0)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("query", "key", "value", "num_heads"), AnyOf("0", shp(q)))


def _failing_cases():
    """(name, arrays that must stay untouched, call that must raise, exception type)."""
    cases = []

    q, k, v, kw = make("BNSD")
    m = user_mask((SQ, SKV))
    cases.append(("num_heads", [q, k, v, m],
                  lambda q=q, k=k, v=v, kw=kw, m=m: run(q, k, v, kw, attn_mask=m, num_heads=3),
                  RuntimeError))

    q, k, v, kw = make("BSH")
    m = user_mask((3, SQ, SKV))
    cases.append(("mask_shape", [q, k, v, m],
                  lambda q=q, k=k, v=v, kw=kw, m=m: run(q, k, v, kw, attn_mask=m),
                  RuntimeError))

    q, k, v, kw = make("BNSD")
    lens = np.array([2, 9], np.int64)
    m = user_mask((SQ, SKV))
    cases.append(("lengths", [q, k, v, m, lens],
                  lambda q=q, k=k, v=v, kw=kw, m=m, lens=lens:
                  run(q, k, v, kw, attn_mask=m, actual_seq_lengths=lens),
                  ValueError))

    q, k, v, kw = make("BNSD", FP16)
    p = pse((B_, N_, SQ, SKV), FP32)
    cases.append(("pse_dtype", [q, k, v, p],
                  lambda q=q, k=k, v=v, kw=kw, p=p: run(q, k, v, kw, pse_shift=p), TypeError))

    q, k, v, kw = make("BNSD", BF16)
    p = pse((B_, N_, SQ - 1, SKV), BF16)
    cases.append(("pse_shape", [q, k, v, p],
                  lambda q=q, k=k, v=v, kw=kw, p=p: run(q, k, v, kw, pse_shift=p), RuntimeError))

    q, k, v, kw = make("BSND", FP32)
    cases.append(("scale_nan", [q, k, v],
                  lambda q=q, k=k, v=v, kw=kw: run(q, k, v, kw, scale_value=math.nan),
                  ValueError))

    q, k, v, kw = make("BNSD")
    m = causal_mask((B_, 2048, 2048))
    cases.append(("causal_mask_shape", [q, k, v, m],
                  lambda q=q, k=k, v=v, kw=kw, m=m: run(q, k, v, kw, sparse_mode=3, attn_mask=m),
                  RuntimeError))

    q, k, v, kw = make("BNSD")
    m = user_mask((SQ, SKV))
    cases.append(("sign_rule", [q, k, v, m],
                  lambda q=q, k=k, v=v, kw=kw, m=m:
                  run(q, k, v, kw, attn_mask=m, pre_tokens=-1, next_tokens=-1), RuntimeError))

    q, k, v, kw = make("TND")
    kw = dict(kw, actual_seq_lengths=[4, 7])
    cases.append(("tnd_ends", [q, k, v],
                  lambda q=q, k=k, v=v, kw=kw: run(q, k, v, kw), ValueError))

    q, k, v, kw = make("BNSD", FP16)
    v = v.astype(np.float32)
    cases.append(("value_dtype", [q, k, v],
                  lambda q=q, k=k, v=v, kw=kw: run(q, k, v, kw), TypeError))

    q, k, v, kw = make("BNSD", FP16)
    m = user_mask((SQ, SKV))
    cases.append(("sparse_mode", [q, k, v, m],
                  lambda q=q, k=k, v=v, kw=kw, m=m: run(q, k, v, kw, attn_mask=m, sparse_mode=9),
                  RuntimeError))
    return cases


@pytest.mark.parametrize("case", range(len(_failing_cases())),
                         ids=[c[0] for c in _failing_cases()])
def test_s10_failed_call_leaves_inputs_untouched(case):
    name, arrays, call, exc = _failing_cases()[case]
    before = [(a.shape, a.dtype, a.strides, a.tobytes()) for a in arrays]
    assert_raises(exc, call)
    after = [(a.shape, a.dtype, a.strides, a.tobytes()) for a in arrays]
    assert before == after, name


# ============================================================================================
# §8 / §10 quantization arguments (int8)
# ============================================================================================
DEQ1 = np.array([0.05], np.float32)
QS1 = np.array([100.0], np.float32)
DEQ2 = np.array([0.001], np.float32)
QS2 = np.array([10.0], np.float32)
QO2 = np.array([1.0], np.float32)


def _u64(x):
    bits = np.array(x, np.float32).view(np.uint32).astype(np.uint64)
    return (bits & np.uint64(0xFFFFE000)) | np.uint64(1 << 46)


def int8_fp16_out():
    return dict(deq_scale1=DEQ1, quant_scale1=QS1, deq_scale2=DEQ2)


def int8_int8_out():
    return dict(deq_scale1=DEQ1, quant_scale1=QS1, deq_scale2=DEQ2, quant_scale2=QS2)


@pytest.mark.quant
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_s8_int8_valid_combinations(layout):
    q, k, v, kw = make(layout, I8)
    out = run(q, k, v, kw, **int8_fp16_out())
    assert out.dtype == FP16 and out.shape == out_shape(layout)
    out = run(q, k, v, kw, **int8_int8_out())
    assert out.dtype == I8 and out.shape == out_shape(layout)
    out = run(q, k, v, kw, **int8_int8_out(), quant_offset2=QO2)
    assert out.dtype == I8
    u = dict(int8_fp16_out(), deq_scale1=_u64(DEQ1), deq_scale2=_u64(DEQ2))
    assert run(q, k, v, kw, **u).dtype == FP16


@pytest.mark.quant
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s8_float_query_int8_output(dtype):
    q, k, v, kw = make("BNSD", dtype)
    out = run(q, k, v, kw, quant_scale2=QS2)
    assert out.dtype == I8 and out.shape == out_shape("BNSD")
    out = run(q, k, v, kw, quant_scale2=QS2, quant_offset2=QO2)
    assert out.dtype == I8


@pytest.mark.quant
def test_s8_bf16_query_bf16_quant_scale2():
    q, k, v, kw = make("BNSD", BF16)
    out = run(q, k, v, kw, quant_scale2=QS2.astype(BF16), quant_offset2=QO2.astype(BF16))
    assert out.dtype == I8


@pytest.mark.quant
@pytest.mark.parametrize("missing", ["deq_scale1", "quant_scale1", "deq_scale2"])
@pytest.mark.parametrize("out", ["fp16_out", "int8_out"])
def test_s8_int8_missing_required(out, missing):
    q, k, v, kw = make("BNSD", I8)
    args = int8_fp16_out() if out == "fp16_out" else int8_int8_out()
    del args[missing]
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, **args), missing)


@pytest.mark.quant
def test_s8_int8_without_any_scale():
    q, k, v, kw = make("BNSD", I8)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw),
                  AnyOf("deq_scale1", "quant_scale1", "deq_scale2"))


@pytest.mark.quant
@pytest.mark.parametrize("qdt", [I8, FP16, BF16, FP32], ids=lambda d: d.name)
def test_s8_quant_offset2_without_quant_scale2(qdt):
    q, k, v, kw = make("BNSD", qdt)
    args = int8_fp16_out() if qdt == I8 else {}
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, quant_offset2=QO2, **args),
                  AnyOf("quant_offset2", "quant_scale2"))


@pytest.mark.quant
@pytest.mark.parametrize("with_qs2", [False, True], ids=["no_qs2", "with_qs2"])
@pytest.mark.parametrize("arg", ["deq_scale1", "quant_scale1", "deq_scale2"])
@pytest.mark.parametrize("qdt", FLOAT_DTYPES, ids=lambda d: d.name)
def test_s8_float_query_rejects_int8_input_scales(qdt, arg, with_qs2):
    q, k, v, kw = make("BNSD", qdt)
    args = {arg: int8_fp16_out()[arg]}
    if with_qs2:
        args["quant_scale2"] = QS2
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, **args), arg)


@pytest.mark.quant
@pytest.mark.parametrize("bad", [FP16, np.dtype("float64"), np.dtype("int32"), BF16],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("arg", ["deq_scale1", "deq_scale2"])
def test_s8_deq_scale_dtype(arg, bad):
    q, k, v, kw = make("BNSD", I8)
    args = int8_fp16_out()
    args["deq_scale1"] = args["deq_scale1"].astype(bad)
    args["deq_scale2"] = args["deq_scale2"].astype(bad)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args),
                  AnyOf("deq_scale1", "deq_scale2"), bad)
    args = int8_fp16_out()
    args[arg] = args[arg].astype(bad)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args), arg, bad)


@pytest.mark.quant
def test_s8_deq_scales_must_share_dtype():
    q, k, v, kw = make("BNSD", I8)
    args = dict(int8_fp16_out(), deq_scale1=_u64(DEQ1))         # uint64 + float32
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args),
                  AnyOf("deq_scale1", "deq_scale2"), AnyOf("uint64", "float32"))


@pytest.mark.quant
@pytest.mark.parametrize("shape", [(2,), (1, 1), (), (4,)], ids=str)
@pytest.mark.parametrize("arg", ["deq_scale1", "quant_scale1", "deq_scale2"])
def test_s8_scale_shape_not_1(arg, shape):
    q, k, v, kw = make("BNSD", I8)
    args = int8_fp16_out()
    args[arg] = np.full(shape, 0.5, np.float32)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, **args), arg, str(tuple(shape)))


@pytest.mark.quant
@pytest.mark.parametrize("bad", [FP16, np.dtype("float64"), BF16, np.dtype("uint64")],
                         ids=lambda d: d.name)
def test_s8_quant_scale1_dtype(bad):
    q, k, v, kw = make("BNSD", I8)
    args = dict(int8_fp16_out(), quant_scale1=QS1.astype(bad))
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args), "quant_scale1", bad)


@pytest.mark.quant
@pytest.mark.parametrize("qdt,bad", [(FP16, FP16), (FP16, BF16), (FP32, BF16), (I8, BF16),
                                     (BF16, FP16), (FP32, np.dtype("float64"))],
                         ids=lambda d: d.name)
def test_s8_quant_scale2_dtype(qdt, bad):
    q, k, v, kw = make("BNSD", qdt)
    args = int8_fp16_out() if qdt == I8 else {}
    args["quant_scale2"] = QS2.astype(bad)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args), "quant_scale2", bad)


@pytest.mark.quant
@pytest.mark.parametrize("qdt,s2,o2", [(FP16, FP32, FP16), (BF16, BF16, FP32),
                                       (BF16, FP32, BF16), (I8, FP32, FP16)],
                         ids=lambda d: d.name)
def test_s8_quant_offset2_dtype_differs(qdt, s2, o2):
    q, k, v, kw = make("BNSD", qdt)
    args = int8_int8_out() if qdt == I8 else {}
    args["quant_scale2"] = QS2.astype(s2)
    args["quant_offset2"] = QO2.astype(o2)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **args), "quant_offset2", o2)


@pytest.mark.quant
def test_s8_quant_offset2_shape_differs():
    q, k, v, kw = make("BNSD", FP16, N=2, D=32)
    H = 2 * 32
    o2 = np.zeros((H,), np.float32)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, quant_scale2=QS2, quant_offset2=o2),
                  "quant_offset2", shp(o2))


_PER_CHANNEL_OK = [(64,), (1, 1, 64), (1, 2, 1, 32), (2, 32), (1, 1, 2, 32)]


@pytest.mark.quant
@pytest.mark.parametrize("shape", _PER_CHANNEL_OK, ids=str)
@pytest.mark.parametrize("qdt", [FP16, I8], ids=lambda d: d.name)
def test_s8_quant_scale2_per_channel_shapes_accepted(qdt, shape):
    q, k, v, kw = make("BNSD", qdt, N=2, D=32)
    args = int8_int8_out() if qdt == I8 else {}
    args["quant_scale2"] = np.full(shape, 10.0, np.float32)
    args["quant_offset2"] = np.full(shape, 1.0, np.float32)
    out = run(q, k, v, kw, **args)
    assert out.dtype == I8 and out.shape == out_shape("BNSD", N=2, D=32)


@pytest.mark.quant
@pytest.mark.parametrize("shape", [(2,), (65,), (32, 2), (1, 64, 1), (1, 2, 32, 1), (63,)],
                         ids=str)
def test_s8_quant_scale2_bad_shape(shape):
    q, k, v, kw = make("BNSD", FP16, N=2, D=32)
    s2 = np.full(shape, 10.0, np.float32)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, quant_scale2=s2),
                  "quant_scale2", str(tuple(shape)))


@pytest.mark.quant
@pytest.mark.parametrize("qdt", [FP16, I8], ids=lambda d: d.name)
def test_s8_per_channel_needs_D_multiple_of_32(qdt):
    q, k, v, kw = make("BNSD", qdt, N=2, D=16)
    args = int8_int8_out() if qdt == I8 else {}
    args["quant_scale2"] = np.full((32,), 10.0, np.float32)
    assert_raises(RuntimeError, lambda: run(q, k, v, kw, **args),
                  AnyOf("quant_scale2", "query"), AnyOf("16", "(32,)"))


@pytest.mark.quant
@pytest.mark.parametrize("mode", [0, 1])
def test_s8_float16_mask_with_int8_query(mode):
    q, k, v, kw = make("BNSD", I8)
    m = user_mask((SQ, SKV), np.float16)
    assert_raises(TypeError,
                  lambda: run(q, k, v, kw, attn_mask=m, sparse_mode=mode, **int8_fp16_out()),
                  "attn_mask", "float16")


@pytest.mark.quant
def test_s8_pse_dtype_with_int8_query():
    q, k, v, kw = make("BNSD", I8)
    ok = run(q, k, v, kw, pse_shift=pse((B_, N_, SQ, SKV), FP16), **int8_fp16_out())
    assert ok.dtype == FP16
    for bad in (FP32, BF16):
        p = pse((B_, N_, SQ, SKV), bad)
        assert_raises(TypeError, lambda: run(q, k, v, kw, pse_shift=p, **int8_fp16_out()),
                      "pse_shift", bad)


@pytest.mark.quant
@pytest.mark.parametrize("pre,nxt", [(-1, 5), (5, -1)], ids=str)
@pytest.mark.parametrize("qdt", [FP16, I8], ids=lambda d: d.name)
def test_s8_mode4_int8_output_rejects_negative_tokens(qdt, pre, nxt):
    q, k, v, kw = make("BNSD", qdt)
    args = int8_int8_out() if qdt == I8 else dict(quant_scale2=QS2)
    call = lambda: run(q, k, v, kw, sparse_mode=4, attn_mask=causal_mask(), pre_tokens=pre,
                       next_tokens=nxt, **args)
    assert_raises(RuntimeError, call, AnyOf("pre_tokens", "next_tokens"),
                  AnyOf(str(pre), str(nxt)))
    # same tokens with a float output: allowed
    fargs = int8_fp16_out() if qdt == I8 else {}
    out = run(q, k, v, kw, sparse_mode=4, attn_mask=causal_mask(), pre_tokens=pre,
              next_tokens=nxt, **fargs)
    assert out.dtype == FP16
    # int8 output with non-negative tokens: allowed
    out = run(q, k, v, kw, sparse_mode=4, attn_mask=causal_mask(), pre_tokens=5,
              next_tokens=0, **args)
    assert out.dtype == I8


@pytest.mark.quant
@pytest.mark.parametrize("qdt,args", [
    (FP16, dict(quant_scale2=QS2)),
    (I8, int8_fp16_out()),
    (I8, int8_int8_out()),
], ids=["fp16_qs2", "int8_fp16_out", "int8_int8_out"])
def test_s8_tnd_rejects_quantization(qdt, args):
    q, k, v, kw = make("TND", qdt)
    err = assert_raises(RuntimeError, lambda: run(q, k, v, kw, **args), "TND", *args.keys())
    for name, x in args.items():                 # each argument received, with its shape
        assert f"{name} of shape {checks.shape_str(np.shape(x))}" in str(err)


@pytest.mark.quant
@pytest.mark.parametrize("which,other", [("key", FP16), ("value", FP16), ("key", np.uint8)],
                         ids=["key_fp16", "value_fp16", "key_uint8"])
def test_s8_int8_kv_dtype_differs(which, other):
    q, k, v, kw = make("BNSD", I8)
    if which == "key":
        k = k.astype(other)
    else:
        v = v.astype(other)
    assert_raises(TypeError, lambda: run(q, k, v, kw, **int8_fp16_out()), which,
                  np.dtype(other))
