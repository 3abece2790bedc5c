"""The AMX path of the CPU kernel (bf16 tile products, pfa_numba._amx).

On a CPU with AMX every bf16 and float16 test of the suite runs on it; these tests add what is
particular to it: the tile product itself, the exact split of float16 values into bf16 parts,
agreement with the float32 path, the subnormal fallback (AMX reads bf16 subnormals as zero) and
non-finite values. Without AMX they are skipped, and say so.
"""
import ml_dtypes
import numpy as np
import pytest
from numba import njit

from pfa_numba import config, prompt_flash_attention, reference
from pfa_numba.cpu import _amx, _vector
from _cases import BF16, assert_matches_reference, qkv

pytestmark = pytest.mark.skipif(not _amx.available(),
                                reason="this CPU or OS offers no AMX-BF16 (tested where it does)")


@njit
def _gemm_bf16(*args):
    """_amx.gemm_bf16 (a kernel function: callable from compiled code only)."""
    _amx.gemm_bf16(*args)


def _bf16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


@pytest.mark.parametrize("accumulate,a2,b2", [(False, False, False), (True, False, False),
                                               (True, True, False), (False, True, True)])
def test_gemm_bf16_against_numpy(accumulate, a2, b2):
    rng = np.random.default_rng(0)
    m, n, k = 64, 96, 160
    a, a_2, b, b_2 = _bf16(rng, m, k), _bf16(rng, m, k), _bf16(rng, k, n), _bf16(rng, k, n)
    flat_a = np.concatenate([a.view(np.uint16).ravel(), a_2.view(np.uint16).ravel()])
    ldb = 2 * n + 32                                      # a pair-row longer than the data
    vnni = np.zeros((2, k // 2, ldb), np.uint16)
    for part, x in enumerate((b, b_2)):
        vnni[part, :, :2 * n] = (x.view(np.uint16).reshape(k // 2, 2, n).transpose(0, 2, 1)
                                 .reshape(k // 2, -1))
    ldc = n + 16
    c = np.full((m, ldc), 0.5, np.float32)
    _gemm_bf16(_amx.tile_config(), flat_a, m * k if a2 else -1, k, vnni.ravel(),
               vnni[0].size if b2 else -1, ldb, c.ravel(), ldc, m, n, k, accumulate)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    terms = [(a64, b64)]
    if a2:
        terms.append((a_2.astype(np.float64), b64))
    if b2:
        terms.append((a64, b_2.astype(np.float64)))
    want = sum(x @ y for x, y in terms) + (0.5 if accumulate else 0.0)
    # float32 accumulation of exact products
    bound = 4 * k * np.finfo(np.float32).eps * (sum(np.abs(x) @ np.abs(y) for x, y in terms)
                                                + 0.5)
    assert (np.abs(c[:, :n] - want) <= bound).all()
    assert (c[:, n:] == 0.5).all()                        # columns past n untouched


def test_float16_split_is_exact():
    """Every finite float16 is the sum of its two bf16 parts, neither a bf16 subnormal (AMX
    would read it as zero)."""
    from numba import njit
    from pfa_numba.cpu.amx_pack import _split_f16

    @njit
    def split_all(u, hi, lo):
        for i in range(u.size):
            hi[i], lo[i] = _split_f16(u[i])

    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    u = u[np.isfinite(u.view(np.float16))]
    hi, lo = np.empty_like(u), np.empty_like(u)
    split_all(u, hi, lo)
    as_f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(as_f32(hi) + as_f32(lo), u.view(np.float16).astype(np.float32))
    for part in (hi, lo):
        assert not ((part & 0x7F80) == 0)[(part & 0x7FFF) != 0].any()


@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("mode", [0, 3, 4])
@pytest.mark.parametrize("sq,skv,d,n,nkv", [(37, 70, 16, 4, 2), (130, 530, 48, 3, 1),
                                            (600, 700, 128, 2, 2)])
def test_agrees_with_the_float32_path(monkeypatch, dtype, mode, sq, skv, d, n, nkv):
    rng = np.random.default_rng(sq + skv + d)
    q, k, v = qkv(rng, "BNSD", dtype, 2, n, nkv, sq, skv, d)
    mask = np.triu(np.ones((2048, 2048), bool), 1) if mode else None
    kw = dict(num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", sparse_mode=mode,
              scale_value=d ** -0.5, pre_tokens=40, next_tokens=9)
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert_matches_reference(out, (q, k, v, mask), kw, BF16, lse=lse)
    monkeypatch.setattr(config, "CPU_AMX", False)
    out32, lse32 = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    _assert_within_an_ulp((out, lse), (out32, lse32), dtype)


def _assert_within_an_ulp(amx, f32, dtype):
    """AMX's (out, lse) against the float32 path's: both round a float32 result to bf16 /
    float16, so one ulp apart at most, plus float32 rounding differences near zero (relative to
    the size of the terms summed, here about max |out|)."""
    a, b = amx[0].astype(np.float64), f32[0].astype(np.float64)
    big = np.maximum(np.abs(a), np.abs(b))
    info = ml_dtypes.finfo(dtype)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(big, float(info.tiny)))) - info.nmant)
    assert (np.abs(a - b) <= ulp + 1e-5 * big.max()).all()
    np.testing.assert_allclose(amx[1], f32[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["q", "k", "v", "v tiny", "scale"])
def test_tiny_values_are_not_flushed(where):
    """AMX reads bf16 subnormals as 0 and flushes subnormal products: work items where that
    could matter take the float32 path."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, "BNSD", BF16, 1, 2, 2, 40, 50, 32)
    tiny = np.array(1e-39, np.float32).astype(BF16)        # a bf16 subnormal
    assert 0 < float(tiny) < np.finfo(np.float32).tiny
    big = np.array(3e37, np.float32).astype(BF16)
    scale = 1.0
    if where == "q":       # q subnormal, k large: scores of order one
        q[0, 1] = (q[0, 1].astype(np.float32) * float(tiny)).astype(BF16)
        k[0, 1] = (k[0, 1].astype(np.float32) * float(big)).astype(BF16)
    elif where == "k":
        k[0, 0] = (k[0, 0].astype(np.float32) * float(tiny)).astype(BF16)
        q[0, 0] = (q[0, 0].astype(np.float32) * float(big)).astype(BF16)
    elif where == "v":     # v subnormal in one head: the output is of subnormal size there
        v[0, 1] = (v[0, 1].astype(np.float32) * 3e-39).astype(BF16)
    elif where == "v tiny":  # v normal but p * v subnormal for the smaller p
        v[0, 1] = (v[0, 1].astype(np.float32) * 1e-37).astype(BF16)
    else:                  # q . k products below float32's range, made order one by the scale
        q = (q.astype(np.float32) * 1e-20).astype(BF16)
        k = (k.astype(np.float32) * 1e-20).astype(BF16)
        scale = 1e38
    kw = dict(num_heads=2, input_layout="BNSD", scale_value=scale)
    out = prompt_flash_attention(q, k, v, **kw)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_matches_reference(out, (q, k, v), kw, BF16)
    if where.startswith("v"):      # the tolerance floor above is absolute: check head 1 at its scale
        ref = reference.prompt_flash_attention(q, k, v, **kw)[0, 1]
        assert (np.abs(out[0, 1].astype(np.float64) - ref) <= 0.01 * np.abs(ref).max()).all()


@pytest.mark.parametrize("where", ["q inf", "k inf", "v inf", "v nan", "subnormal", "large"])
def test_float16_edge_values(where):
    """float16 work items holding inf or NaN take the float32 path (a bf16 split would turn
    inf into NaN); subnormal and large float16 values split exactly."""
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, "BNSD", np.float16, 1, 2, 2, 70, 90, 48)
    if where == "q inf":      # every score of that row -inf: a row with nothing kept
        q[0, 0, 5, 7] = np.inf
        k[0, 0, :, 7] = -np.abs(k[0, 0, :, 7]) - 1
    elif where == "k inf":    # score -inf in every row: column 60 as if masked
        k[0, 1, 60, 0] = np.inf
        q[0, 1, :, 0] = -np.abs(q[0, 1, :, 0]) - 1
    elif where == "v inf":
        v[0, 0, 30, 2] = -np.inf
    elif where == "v nan":
        v[0, 1, 80, :] = np.nan
    elif where == "subnormal":
        q[0, 0] = (q[0, 0].astype(np.float32) * 2.0 ** -14).astype(np.float16)
        v[0, 1] = (v[0, 1].astype(np.float32) * 2.0 ** -16).astype(np.float16)
    else:
        q[0, 1] = (q[0, 1].astype(np.float32) * 2.0 ** 13).astype(np.float16)
        k[0, 1] = (k[0, 1].astype(np.float32) * 2.0 ** 13).astype(np.float16)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    scale = 48 ** -0.5 * (2.0 ** -26 if where == "large" else 1.0)
    for mask, kw in ((None, dict()), (m, dict(sparse_mode=3))):
        kw.update(num_heads=2, input_layout="BNSD", scale_value=scale)
        out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
        ref = assert_matches_reference(out, (q, k, v, mask), kw, np.float16, lse=lse)
        if where == "subnormal":   # head 1 at its own scale: within two float16 subnormal steps
            assert (np.abs(out[0, 1].astype(np.float64) - ref[0, 1]) <= 2.0 ** -23).all()


def _rising_scores(dtype, ramp, skv, v_size=None):
    """q, k, v (1, 2 heads) whose scores rise by ``ramp`` per kv column (plus noise)."""
    rng = np.random.default_rng(10)
    d = 32
    q, k, v = (x.astype(np.float32) for x in qkv(rng, "BNSD", dtype, 1, 2, 2, 50, skv, d))
    q[..., 0] = 1.0
    k[..., 0] = ramp * np.arange(skv) * d ** 0.5
    if v_size is not None:
        v = v_size * (1.0 + 0.01 * np.abs(v))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("ramp", [0.0, 0.02, 0.1, 0.5])
def test_softmax_against_the_old_running_max(monkeypatch, dtype, ramp):
    """On AMX a row's softmax step first takes p against its old running max, kept when no
    score exceeds it by more than LAZY_MARGIN (8): scores rising by 0, 1.3, 6.4 and 32 per
    64-column tile exercise the kept pass, the retaken one, and both within one row."""
    from pfa_numba.cpu import rows as cpu
    assert cpu.LAZY_MARGIN == 8.0
    monkeypatch.setattr(config, "CPU_KV_COLS", 64)
    q, k, v = _rising_scores(dtype, ramp, 400)
    for mask, kw in ((None, dict()), (np.triu(np.ones((2048, 2048), bool), 1),
                                      dict(sparse_mode=4, pre_tokens=300, next_tokens=200))):
        kw.update(num_heads=2, input_layout="BNSD", scale_value=32 ** -0.5)
        out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
        assert_matches_reference(out, (q, k, v, mask), kw, dtype, lse=lse)


def test_large_values_with_a_rising_max(monkeypatch):
    """V near bf16's largest values (2^118): p up to e^8 against an old max would overflow
    acc, so such tiles take the two-pass step."""
    monkeypatch.setattr(config, "CPU_KV_COLS", 64)
    q, k, v = _rising_scores(BF16, 0.05, 400, v_size=2.0 ** 118)
    kw = dict(num_heads=2, input_layout="BNSD", scale_value=32 ** -0.5)
    out = prompt_flash_attention(q, k, v, **kw)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_matches_reference(out, (q, k, v), kw, BF16)


def test_non_finite_values_stay_in_their_rows():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, "BNSD", BF16, 1, 2, 2, 100, 100, 64)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    v[0, 0, 70, 3] = np.inf            # read from row 70 on (causal)
    v[0, 1, 40, :] = np.nan            # read from row 40 on
    kw = dict(num_heads=2, input_layout="BNSD", sparse_mode=2)
    out = prompt_flash_attention(q, k, v, m, **kw)
    assert_matches_reference(out, (q, k, v, m), kw, BF16)
    o = out.astype(np.float32)
    assert np.isfinite(o[0, 0, :70]).all() and np.isfinite(o[0, 1, :40]).all()
    assert np.isnan(o[0, 1, 40:]).all()


@pytest.mark.parametrize("scale", [0.0, 1.0, -0.3, 0.0883883, -2.5])
def test_scale_values(scale):
    """Rows without a mask are scaled inside the max and exp passes (the max from the smallest
    raw score when the scale is negative); masked rows are scaled first. Both, against the
    reference, with one NaN row."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, "BNSD", BF16, 1, 2, 2, 90, 150, 32)
    q[0, 0] *= 16                         # raw scores in the hundreds: a max taken before
    q[0, 1, 9, 0] = np.nan                # scaling would underflow exp; row 9 of head 1: NaN
    band = np.triu(np.ones((2048, 2048), bool), 1)
    for mask, kw in ((None, dict()), (band, dict(sparse_mode=4, pre_tokens=30, next_tokens=20))):
        kw.update(num_heads=2, input_layout="BNSD", scale_value=scale)
        out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
        assert_matches_reference(out, (q, k, v, mask), kw, BF16, lse=lse)


@pytest.mark.skipif(not _vector.host_has("avx512bf16"), reason="this CPU has no AVX512-BF16")
def test_hardware_bf16_rounding():
    """bf16_bits_hw (VCVTNEPS2BF16) rounds as f32_to_bf16 for the values the softmax splits."""
    from numba import njit
    from pfa_numba.numerics.core import f32_to_bf16

    @njit
    def both(x, hw, sw):
        for i in range(x.size):
            hw[i] = _vector.bf16_bits_hw(x[i])
            sw[i] = f32_to_bf16(x[i])

    rng = np.random.default_rng(8)
    bits = rng.integers(0, 1 << 16, 200_000, dtype=np.uint32)
    x = ((np.uint32(127 - 60) << 23) + (bits << 7)).view(np.float32)   # [2^-60, 2^-52): ties too
    x = np.concatenate([x, rng.random(100_000, dtype=np.float32), [0.0, 1.0, 2.0 ** -126]])
    x = x.astype(np.float32)
    hw, sw = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    both(x, hw, sw)
    assert np.array_equal(hw, sw)


def _paged_pool(rng, x, lens, bs, nb, layout):
    """x (B, Nkv, S, D) in a pool of nb blocks of bs under a shuffled table, NaN in every slot
    no used entry names, a partial last block: (pool, table)."""
    B, nkv, _, d = x.shape
    per = -(-x.shape[2] // bs)
    table = rng.permutation(nb)[:B * per].reshape(B, per).astype(np.int32)
    pool = np.full((nb, nkv, bs, d), np.nan, np.float32).astype(x.dtype)
    for b, n in enumerate(lens):
        for t in range(n):
            pool[table[b, t // bs], :, t % bs] = x[b, :, t]
    if layout == "BSH":
        pool = np.ascontiguousarray(pool.transpose(0, 2, 1, 3)).reshape(nb, bs, nkv * d)
    return pool, table


@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("kind", ["paged BNSD", "paged BSH", "shared prefix"])
@pytest.mark.parametrize("tiles", ["default tiles", "small tiles"])
def test_paged_and_prefixed_prefill_run_on_amx(monkeypatch, dtype, kind, tiles):
    """Prefill over a paged cache (shuffled blocks, partial last blocks, NaN where no used
    entry points) or after a shared prefix runs on AMX, its tiles read through the kv
    sequence (small tiles: tiles that straddle blocks of 5 rows and end at the prefix's end):
    the reference's result, and within an ulp of the float32 path's."""
    from pfa_numba import fused_infer_attention_score as fia
    from pfa_numba.cpu import driver
    rng = np.random.default_rng(9)
    B, n, nkv, sq, skv, d, bs = 2, 4, 2, 40, 70, 64, 16
    if tiles == "small tiles":              # items of 24 rows: more than stream
        monkeypatch.setattr(config, "CPU_Q_ROWS", 24)
        monkeypatch.setattr(config, "CPU_KV_COLS", 24)
        bs = 5
    lens = [70, 53]
    q, k, v = (rng.standard_normal(s).astype(np.float32).astype(dtype)
               for s in ((B, n, sq, d), (B, nkv, skv, d), (B, nkv, skv, d)))
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale=d ** -0.5, softmax_lse_flag=True,
              actual_seq_lengths=[sq, 31], actual_seq_lengths_kv=lens, sparse_mode=3,
              atten_mask=np.triu(np.ones((2048, 2048), bool), 1))
    if kind == "shared prefix":
        pk, pv = (rng.standard_normal((1, nkv, 24, d)).astype(np.float32).astype(dtype)
                  for _ in range(2))
        args = (q, k, v)
        kw.update(input_layout="BNSD", key_shared_prefix=pk, value_shared_prefix=pv,
                  actual_shared_prefix_len=19)
    else:
        layout = kind.split()[1]
        (kp, table), (vp, _) = (_paged_pool(np.random.default_rng(3), x, lens, bs,
                                            -(-skv // bs) * B + 4, layout) for x in (k, v))
        if layout == "BSH":
            q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).reshape(B, sq, n * d)
        args = (q, kp, vp)
        kw.update(input_layout=layout, block_table=table, block_size=bs)
    ran = []
    launch_run = driver.Launch.run
    monkeypatch.setattr(driver.Launch, "run", lambda self, *a: (
        launch_run(self, *a), ran.extend(name for name, _ in self.ran))[0])
    out, lse = fia(*args, **kw)
    assert "amx" in ran, "the AMX kernel did not run"
    ref, ref_lse = reference.fused_infer_attention_score(*args, **kw)
    low, _ = reference.fused_infer_attention_score(*args, **kw, compute_dtype=dtype)
    got = out.astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(ref).all()
    floor = (float(ml_dtypes.finfo(dtype).eps) + 16 * 2.0 ** -23) * max(1.0, np.abs(ref).max())
    assert np.abs(got - ref).max() <= 2 * np.abs(low - ref).max() + floor
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(config, "CPU_AMX", False)
    _assert_within_an_ulp((out, lse), fia(*args, **kw), dtype)
