"""int8 quantization (contract 'Quantization'): the three pipelines against pfa_numba.reference.

int8 outputs may differ from the reference (an exact model) by 1 LSB where an intermediate
float32 rounding lands on a tie; at most ``MAX_LSB_FRACTION`` of the elements may do so.
float16 outputs of the int8 pipeline may differ by one fp16 ulp plus the effect of two P8
steps of one unit (a P8 rounding that differs changes the row by deq2 * |V| / l).
"""
import itertools

import ml_dtypes
import numpy as np
import pytest

from pfa_numba import config, prompt_flash_attention, reference, trans_quant_param

MAX_LSB_FRACTION = 0.01
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(config, "CPU_Q_ROWS", 10)
    monkeypatch.setattr(config, "CPU_KV_COLS", 7)


def _int8_inputs(rng, b, n, nkv, sq, skv, d):
    q = rng.integers(-128, 128, (b, n, sq, d), dtype=np.int8)
    k = rng.integers(-128, 128, (b, nkv, skv, d), dtype=np.int8)
    v = rng.integers(-128, 128, (b, nkv, skv, d), dtype=np.int8)
    deq1 = np.array([3.0 / (np.sqrt(d) * 5000)], np.float32)
    return q, k, v, dict(deq_scale1=deq1, quant_scale1=np.array([127.0], np.float32),
                         deq_scale2=np.array([1 / 127.0], np.float32))


def _mode_args(mode, rng, b, sq, skv):
    if mode in ("0m", "1"):
        mask = rng.random((b, 1, sq, skv)) < 0.3
        mask[0, 0, 1] = True                     # a fully masked row
        return mask, dict(sparse_mode=0 if mode == "0m" else 1, pre_tokens=6, next_tokens=2)
    if mode in ("2", "3", "4"):
        return (np.triu(np.ones((2048, 2048), bool), 1),
                dict(sparse_mode=int(mode), pre_tokens=5, next_tokens=3))
    return None, {}


def assert_int8_close(got, want):
    assert got.dtype == np.int8
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1, f"int8 output differs by {diff.max()} LSB"
    frac = (diff == 1).mean()
    assert frac <= MAX_LSB_FRACTION, f"{frac:.2%} of int8 outputs differ by 1 LSB"


def assert_fp16_close(got, want, deq2, v):
    assert got.dtype == np.float16
    g = got.astype(np.float64)
    assert np.array_equal(np.isnan(g), np.isnan(want))
    ok = ~np.isnan(want)
    ulp = np.spacing(np.abs(want[ok]).astype(np.float16)).astype(np.float64)
    bound = ulp + 2 * float(deq2) * float(np.abs(v.astype(np.float64)).max())
    err = np.abs(g[ok] - want[ok])
    assert (err <= bound).all(), f"max err {err.max():.3e}"
    assert (err > ulp).mean() <= MAX_LSB_FRACTION


MODES = ("0", "0m", "1", "2", "3", "4")
HEADS = ((2, 2), (4, 2), (4, 1))


@pytest.mark.parametrize("mode,heads,lens", [
    pytest.param(m, h, ln, id=f"sm{m}-N{h[0]}Nkv{h[1]}-len{ln}")
    for i, (m, h) in enumerate(itertools.product(MODES, HEADS)) for ln in (i % 2,)])
@pytest.mark.parametrize("out", ["fp16", "int8"])
def test_int8_inputs(out, mode, heads, lens):
    rng = np.random.default_rng(hash((out, mode, heads)) % 2 ** 32)
    b, (n, nkv), sq, skv, d = 2, heads, 13, 17, 32
    q, k, v, qkw = _int8_inputs(rng, b, n, nkv, sq, skv, d)
    mask, mkw = _mode_args(mode, rng, b, sq, skv)
    kw = dict(qkw, **mkw, num_heads=n, num_key_value_heads=nkv if nkv != n else 0,
              input_layout="BNSD", scale_value=1.0)
    if out == "int8":
        kw["quant_scale2"] = np.array([0.8], np.float32)
        kw["quant_offset2"] = np.array([-3.0], np.float32)
    lengths = ([10, 0], [17, 9]) if lens else (None, None)
    got = prompt_flash_attention(q, k, v, mask, *lengths, **kw)
    want = reference.prompt_flash_attention(q, k, v, mask, *lengths, **kw)
    if out == "int8":
        assert_int8_close(got, want)
    else:
        assert_fp16_close(got, want, kw["deq_scale2"][0], v)
    if lens:
        assert np.all(got[1] == 0)               # qL = 0: zeros, also for int8 with offset


@pytest.mark.parametrize("dtype", [F16, BF16, np.dtype(np.float32)], ids=lambda d: d.name)
@pytest.mark.parametrize("mode", MODES)
def test_float_inputs_int8_output(dtype, mode):
    rng = np.random.default_rng(3)
    b, n, nkv, sq, skv, d = 2, 4, 2, 11, 15, 32
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in
               ((b, n, sq, d), (b, nkv, skv, d), (b, nkv, skv, d)))
    mask, mkw = _mode_args(mode, rng, b, sq, skv)
    s2 = np.array([40.0], np.float32)
    kw = dict(mkw, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale_value=0.2,
              quant_scale2=s2.astype(BF16) if dtype == BF16 else s2,
              quant_offset2=np.array([2.0], np.float32).astype(BF16 if dtype == BF16 else np.float32))
    lengths = ([9, 0], [15, 4])
    got = prompt_flash_attention(q, k, v, mask, *lengths, **kw)
    want = reference.prompt_flash_attention(q, k, v, mask, *lengths, **kw)
    assert_int8_close(got, want)
    assert np.all(got[1] == 0) and np.all(got[0, :, 9:] == 0)   # not round(offset)


PER_CHANNEL = [(64,), (1, 1, 64), (1, 2, 1, 32), (2, 32), (1, 1, 2, 32)]


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND"])
@pytest.mark.parametrize("shape", PER_CHANNEL, ids=str)
def test_per_channel_output_scales(layout, shape):
    rng = np.random.default_rng(4)
    b, n, sq, skv, d = 1, 2, 6, 9, 32
    q4, k4, v4, qkw = _int8_inputs(rng, b, n, n, sq, skv, d)
    tr = {"BSH": lambda x: x.transpose(0, 2, 1, 3).reshape(b, x.shape[2], -1),
          "BSND": lambda x: x.transpose(0, 2, 1, 3)}.get(layout, lambda x: x)
    q, k, v = (np.ascontiguousarray(tr(x)) for x in (q4, k4, v4))
    s2 = rng.uniform(0.2, 2.0, n * d).astype(np.float32).reshape(shape)
    o2 = rng.uniform(-5, 5, n * d).astype(np.float32).reshape(shape)
    kw = dict(qkw, quant_scale2=s2, quant_offset2=o2, num_heads=n, input_layout=layout)
    got = prompt_flash_attention(q, k, v, **kw)
    want = reference.prompt_flash_attention(q, k, v, **kw)
    assert_int8_close(got, want)
    # the same scales per tensor element: channel c of head n is flat[n*D + d]
    ref_bnsd = reference.prompt_flash_attention(q4, k4, v4, **dict(kw, input_layout="BNSD"))
    got_bnsd = prompt_flash_attention(q4, k4, v4, **dict(kw, input_layout="BNSD"))
    assert_int8_close(got_bnsd, ref_bnsd)


def test_packed_uint64_deq_scales_equal_their_float32_decoding():
    rng = np.random.default_rng(5)
    q, k, v, qkw = _int8_inputs(rng, 1, 2, 2, 8, 8, 32)
    packed = dict(qkw, deq_scale1=trans_quant_param(qkw["deq_scale1"]),
                  deq_scale2=trans_quant_param(qkw["deq_scale2"]))
    decoded = {k_: (x & np.uint64(0xFFFFE000)).astype(np.uint32).view(np.float32)
               for k_, x in packed.items() if x.dtype == np.uint64}
    a = prompt_flash_attention(q, k, v, **packed, num_heads=2, input_layout="BNSD")
    b = prompt_flash_attention(q, k, v, **dict(qkw, **decoded), num_heads=2, input_layout="BNSD")
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    want = reference.prompt_flash_attention(q, k, v, **packed, num_heads=2, input_layout="BNSD")
    assert_fp16_close(a, want, decoded["deq_scale2"][0], v)


@pytest.mark.parametrize("ip", [0, 1, 2, 3])
def test_int8_fully_masked_rows_and_pse(ip):
    rng = np.random.default_rng(6)
    q, k, v, qkw = _int8_inputs(rng, 2, 2, 2, 9, 12, 32)
    mask = rng.random((2, 9, 12)) < 0.25
    mask[0, 3] = True
    pse = (rng.standard_normal((1, 2, 9, 12)) * 2).astype(np.float16)
    kw = dict(qkw, num_heads=2, input_layout="BNSD", sparse_mode=1, inner_precise=ip)
    got = prompt_flash_attention(q, k, v, mask, None, None, pse, **kw)
    want = reference.prompt_flash_attention(q, k, v, mask, None, None, pse, **kw)
    assert_fp16_close(got, want, qkw["deq_scale2"][0], v)
    row = got[0, :, 3].astype(np.float64)
    assert np.all(row == 0) if ip >= 2 else np.any(row != 0)
    kw["quant_scale2"], kw["quant_offset2"] = (np.array([0.5], np.float32),
                                               np.array([7.0], np.float32))
    got8 = prompt_flash_attention(q, k, v, mask, None, None, pse, **kw)
    assert_int8_close(got8, reference.prompt_flash_attention(q, k, v, mask, None, None, pse, **kw))
    assert np.all(got8[0, :, 3] == 0) if ip >= 2 else True


def test_long_rows_accumulate_exactly(monkeypatch):
    """kv longer than one int8 tile: P8 . V sums across tiles stay exact."""
    monkeypatch.setattr(config, "CPU_KV_COLS", 4096)
    rng = np.random.default_rng(7)
    q, k, v, qkw = _int8_inputs(rng, 1, 1, 1, 4, 3000, 32)
    qkw["deq_scale1"] = np.array([1e-6], np.float32)     # nearly uniform weights
    kw = dict(qkw, num_heads=1, input_layout="BNSD")
    got = prompt_flash_attention(q, k, v, **kw)
    assert_fp16_close(got, reference.prompt_flash_attention(q, k, v, **kw),
                      qkw["deq_scale2"][0], v)
