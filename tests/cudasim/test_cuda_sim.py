"""The CUDA kernel on tiny problems with patched small tiles, so that every case crosses several
query blocks and kv tiles, against pfa_numba.reference: under the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, set by the test runner before Numba is imported), or on a real GPU when
the process has one (``python -m pytest tests/cudasim`` on a GPU machine)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from pfa_numba import config, prompt_flash_attention  # noqa: E402
from _cases import DTYPES, assert_matches_reference, qkv  # noqa: E402

SIMULATED = bool(numba.config.ENABLE_CUDASIM)
if not SIMULATED and not cuda.is_available():
    pytest.skip("no GPU here: run with NUMBA_ENABLE_CUDASIM=1 (scripts/run_tests.py does)",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(config, "CUDA_Q_ROWS", 4)
    monkeypatch.setattr(config, "CUDA_KV_COLS", 3)


def _run(args, kw, dtype, lse=True):
    out = prompt_flash_attention(*args, **kw, device="cuda", return_softmax_lse=lse)
    out, l = out if lse else (out, None)
    assert isinstance(out, np.ndarray) and out.dtype == dtype
    assert_matches_reference(out, args, kw, dtype, lse=l)
    return out


@pytest.mark.parametrize("dt", list(DTYPES))
def test_dtypes_gqa(dt):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, "BNSD", DTYPES[dt], 1, 2, 1, 5, 7, 16)
    _run((q, k, v), dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD",
                         scale_value=0.25), DTYPES[dt])


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD_BSND"])
def test_layouts(layout):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, layout, np.float16, 1, 2, 2, 6, 5, 16)
    _run((q, k, v), dict(num_heads=2, input_layout=layout), np.float16)


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_sparse_modes_and_lengths(mode):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, "BNSD", np.float32, 2, 1, 1, 7, 9, 16)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    _run((q, k, v, m, [7, 3], [9, 0]), dict(num_heads=1, input_layout="BNSD", sparse_mode=mode,
                                            pre_tokens=2, next_tokens=1), np.float32)


@pytest.mark.parametrize("ip", [1, 2])
def test_user_mask_fully_masked_rows_and_pse(ip):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 2, 2, 6, 7, 16)
    mask = rng.random((6, 7)) < 0.3
    mask[2] = True
    pse = rng.standard_normal((1, 2, 6, 7)).astype(np.float16)
    pse[0, 0, 4, :] = -np.inf
    _run((q, k, v, mask, None, None, pse), dict(num_heads=2, input_layout="BNSD", sparse_mode=0,
                                                 pre_tokens=3, next_tokens=2, inner_precise=ip),
         np.float16)


def test_float16_additive_mask():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 1, 1, 5, 6, 16)
    mask = (rng.random((5, 6)) < 0.5).astype(np.float16)
    with pytest.warns(DeprecationWarning):
        _run((q, k, v, mask), dict(num_heads=1, input_layout="BNSD", sparse_mode=1),
             np.float16, lse=False)


def test_nan_in_masked_v_and_tnd():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((5, 2, 16)).astype(np.float32)
    k = rng.standard_normal((8, 1, 16)).astype(np.float32)
    v = rng.standard_normal((8, 1, 16)).astype(np.float32)
    v[7] = np.nan          # sequence 2 (2 rows, causal): its rows keep kv rows 4 and 5 only
    m = np.triu(np.ones((2048, 2048), bool), 1)
    out = _run((q, k, v, m, [3, 5], [4, 8]),
               dict(num_heads=2, num_key_value_heads=1, input_layout="TND", sparse_mode=2),
               np.float32)
    assert np.isfinite(out).all()


def test_device_arrays_in_device_arrays_out():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 2, 2, 5, 6, 16)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out = prompt_flash_attention(dq, dk, dv, num_heads=2, input_layout="BNSD")
    assert hasattr(out, "copy_to_host")
    host = prompt_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", device="cuda")
    assert np.array_equal(out.copy_to_host(), host)
    with pytest.raises(RuntimeError, match="key"):
        prompt_flash_attention(dq, k, dv, num_heads=2, input_layout="BNSD")
    cpu = prompt_flash_attention(dq, dk, dv, num_heads=2, input_layout="BNSD", device="cpu")
    assert hasattr(cpu, "copy_to_host")
    assert_matches_reference(cpu.copy_to_host(), (q, k, v),
                             dict(num_heads=2, input_layout="BNSD"), np.float32)


def test_bf16_numba_device_arrays():
    """bf16 Numba device arrays are made from uint16 bits (numba-cuda cannot copy ml_dtypes'
    bfloat16 to a GPU directly); results come back as bf16 device arrays, on either device."""
    from pfa_numba.interop.cuda_arrays import numba_device_array
    rng = np.random.default_rng(9)
    bf16 = DTYPES["bf16"]
    q, k, v = qkv(rng, "BNSD", bf16, 1, 2, 1, 5, 6, 16)
    dq, dk, dv = (numba_device_array(x) for x in (q, k, v))
    assert dq.dtype == bf16 and np.array_equal(dq.copy_to_host().view(np.uint16),
                                               q.view(np.uint16))
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", scale_value=0.25)
    for device in (None, "cpu"):
        out = prompt_flash_attention(dq, dk, dv, **kw, device=device)
        assert hasattr(out, "copy_to_host") and out.dtype == bf16
        assert_matches_reference(out.copy_to_host(), (q, k, v), kw, bf16)


def _int8_problem(rng, n=2, sq=5, skv=7, d=32):
    q = rng.integers(-128, 128, (1, n, sq, d), dtype=np.int8)
    k = rng.integers(-128, 128, (1, n, skv, d), dtype=np.int8)
    v = rng.integers(-128, 128, (1, n, skv, d), dtype=np.int8)
    return q, k, v, dict(deq_scale1=np.array([3.0 / (np.sqrt(d) * 5000)], np.float32),
                         quant_scale1=np.array([127.0], np.float32),
                         deq_scale2=np.array([1 / 127.0], np.float32))


@pytest.mark.parametrize("out", ["fp16", "int8-per-channel"])
def test_int8_pipeline(out):
    from pfa_numba import reference
    rng = np.random.default_rng(7)
    q, k, v, qkw = _int8_problem(rng)
    mask = rng.random((5, 7)) < 0.3
    mask[1] = True
    kw = dict(qkw, num_heads=2, input_layout="BNSD", sparse_mode=1, inner_precise=0)
    if out != "fp16":
        kw["quant_scale2"] = rng.uniform(0.5, 2, (2, 32)).astype(np.float32)
        kw["quant_offset2"] = rng.uniform(-3, 3, (2, 32)).astype(np.float32)
    got = prompt_flash_attention(q, k, v, mask, **kw, device="cuda")
    want = reference.prompt_flash_attention(q, k, v, mask, **kw)
    if out == "fp16":
        assert got.dtype == np.float16
        g = got.astype(np.float64)
        ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
        assert (np.abs(g - want) <= ulp + 2 * kw["deq_scale2"][0] * 128).all()
    else:
        assert got.dtype == np.int8
        assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


@pytest.mark.parametrize("dt", ["fp16", "bf16", "fp32"])
def test_float_inputs_int8_output(dt):
    from pfa_numba import reference
    rng = np.random.default_rng(8)
    dtype = DTYPES[dt]
    q, k, v = qkv(rng, "BNSD", dtype, 2, 2, 1, 5, 6, 32)
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD",
              quant_scale2=np.array([30.0], np.float32), quant_offset2=np.array([1.5], np.float32))
    got = prompt_flash_attention(q, k, v, None, [5, 2], None, **kw, device="cuda")
    want = reference.prompt_flash_attention(q, k, v, None, [5, 2], None, **kw)
    assert got.dtype == np.int8
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1
    assert np.all(got[1, :, 2:] == 0)            # rows >= qL stay 0, not round(offset)


INT8_CASES = {
    # name: (B, N, Nkv, Sq, Skv, D, sparse_mode, inner_precise, lengths, NaN in pse)
    "mask-mean-rows-ip0": (1, 2, 2, 5, 7, 32, 1, 0, None, False),
    "gqa-lengths-ip1": (2, 4, 2, 6, 9, 32, 0, 1, ([6, 3], [9, 4]), False),
    "d64-causal-ip0": (1, 2, 1, 7, 8, 64, 2, 0, None, False),
    "nan-row-ip2": (1, 2, 2, 5, 6, 32, 1, 2, None, True),
}


@pytest.mark.parametrize("out", ["fp16", "int8"])
@pytest.mark.parametrize("case", list(INT8_CASES))
def test_int8_pipeline_cpu_and_cuda_bit_identical(case, out):
    """Both backends turn deq2 * (P8 . V) / l into float16 with numerics.core.int8_out_f16, one exact
    rounding, so their float16 (and int8) outputs agree bit for bit, fully masked rows
    (contract 'Empty rows' means) and NaN rows included."""
    from pfa_numba import reference
    from test_quant import assert_fp16_close, assert_int8_close
    b, n, nkv, sq, skv, d, mode, ip, lengths, nan = INT8_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case + out)))
    q = rng.integers(-128, 128, (b, n, sq, d), dtype=np.int8)
    k = rng.integers(-128, 128, (b, nkv, skv, d), dtype=np.int8)
    v = rng.integers(-128, 128, (b, nkv, skv, d), dtype=np.int8)
    mask = rng.random((b, 1, sq, skv)) < 0.3
    mask[0, 0, 1] = True                                  # a fully masked row
    if mode == 2:
        mask = np.triu(np.ones((2048, 2048), bool), 1)
    pse = (rng.standard_normal((1, n, sq, skv)) * 2).astype(np.float16)
    if nan:
        pse[0, 1, 3, 2] = np.nan                          # row 3 of head 1 is NaN
    kw = dict(deq_scale1=np.array([3.0 / (np.sqrt(d) * 5000)], np.float32),
              quant_scale1=np.array([127.0], np.float32),
              deq_scale2=np.array([rng.uniform(0.002, 0.02)], np.float32),
              num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", sparse_mode=mode,
              inner_precise=ip)
    if out == "int8":
        kw["quant_scale2"] = rng.uniform(0.5, 2, (n, d)).astype(np.float32)
        kw["quant_offset2"] = rng.uniform(-3, 3, (n, d)).astype(np.float32)
    args = (q, k, v, mask) + (lengths or (None, None)) + (pse,)
    cpu = prompt_flash_attention(*args, **kw, device="cpu")
    gpu = prompt_flash_attention(*args, **kw, device="cuda")
    want = reference.prompt_flash_attention(*args, **kw)
    if out == "fp16":
        assert cpu.dtype == gpu.dtype == np.float16
        assert np.array_equal(cpu.view(np.uint16), gpu.view(np.uint16))
        assert_fp16_close(gpu, want, kw["deq_scale2"][0], v)
        if ip < 2:
            assert np.any(gpu[0, :, 1] != 0)              # the contract 'Empty rows' mean row
        if nan:
            assert np.isnan(gpu[0, 1, 3]).all() and not np.isnan(gpu[0, 0]).any()
    else:
        assert cpu.dtype == gpu.dtype == np.int8
        assert np.array_equal(cpu, gpu)
        assert_int8_close(gpu, want)
        if nan:
            assert np.all(gpu[0, 1, 3] == 0)              # NaN quantizes to 0


def test_int8_mean_row_near_float16_midpoints(monkeypatch):
    """A contract 'Empty rows' mean row whose exact values lie 1/cnt away from float16 midpoints,
    where a float32 evaluation of deq2 * A / cnt (float32(A) alone rounds A > 2^24) lands on the
    midpoint and ties the wrong way: both backends give the exact rounding."""
    from fractions import Fraction
    monkeypatch.setattr(config, "CUDA_KV_COLS", 256)
    cnt, d = 3000, 32
    rng = np.random.default_rng(12)
    v = rng.integers(-128, 128, (1, 1, cnt, d), dtype=np.int8)
    mids = []
    for ch in range(8):                       # A = P8 * S = M * cnt +- 1, M a float16 midpoint
        pm = 1 if ch % 2 else -1
        for j in range(ch * 50, 1000):
            mid = 8196 + 8 * j                    # odd multiples of 4 in [8192, 16384)
            if (mid * cnt + pm) % 127 == 0:
                break
        s = (mid * cnt + pm) // 127
        col = np.full(cnt, s // cnt, np.int64)
        col[:s - col.sum()] += 1
        v[0, 0, :, ch] = col
        mids.append(s * 127)
    q = rng.integers(-128, 128, (1, 1, 2, d), dtype=np.int8)
    k = rng.integers(-128, 128, (1, 1, cnt, d), dtype=np.int8)
    mask = np.zeros((2, cnt), bool)
    mask[0] = True                            # row 0: the mean over all cnt columns
    kw = dict(deq_scale1=np.array([1e-6], np.float32), quant_scale1=np.array([127.0], np.float32),
              deq_scale2=np.array([2.0 ** -10], np.float32), num_heads=1, input_layout="BNSD",
              sparse_mode=0, pre_tokens=cnt, next_tokens=cnt, inner_precise=0)
    cpu = prompt_flash_attention(q, k, v, mask, **kw, device="cpu")
    gpu = prompt_flash_attention(q, k, v, mask, **kw, device="cuda")
    assert np.array_equal(cpu.view(np.uint16), gpu.view(np.uint16))
    exact = [np.float16(0)] * 8
    for ch, a in enumerate(mids):
        x = Fraction(a, cnt) / 1024
        lo = Fraction(float(np.float16(float(x))))    # within an ulp; pick the nearest exactly
        cands = [np.float16(float(lo)), np.nextafter(np.float16(float(lo)), np.float16(np.inf)),
                 np.nextafter(np.float16(float(lo)), np.float16(-np.inf))]
        exact[ch] = min(cands, key=lambda h: abs(Fraction(float(h)) - x))
    assert np.array_equal(gpu[0, 0, 0, :8], np.array(exact, np.float16))
