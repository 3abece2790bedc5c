"""The shared numerics compile for CUDA (no GPU needed) and stay free of fp64.

Runs in its own pytest process: ``cuda.compile_ptx`` needs the real numba.cuda, which the CUDA
simulator (another process) replaces.
"""
import re

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is in the test extra")
from numba import types  # noqa: E402

from pfa_numba.numerics import band as Band  # noqa: E402
from pfa_numba.numerics import core as C  # noqa: E402


def _probe(out_f, out_u, inp_f, inp_u, code):
    """Calls every helper of numerics.core and numerics.band once, so each is compiled into the kernel."""
    i = cuda.grid(1)
    x = inp_f[i]
    h = inp_u[i]
    a = C.f16_to_f32(h) + C.bf16_to_f32(h) + C.widen(h, code)
    C.store(out_u, i, x, code)
    out_u[i] += C.f32_to_f16(x) + C.f32_to_bf16(x)
    big = np.int64(h) * np.int64(i) - np.int64(1 << 40)
    out_u[i] += C.int8_out_f16(big, x, C.f16_to_f32(h))
    e = C.exp_f32(x) + C.exp_nonpos(-x) + C.exp_nonpos5(-x)
    y = C.from_order_key(C.order_key(x))
    m = C.max_nan(x, y)
    lo, hi = Band.row_band(i, np.int64(3), np.int64(5), np.int64(100))
    js, je = Band.block_kv_range(i, i + 4, np.int64(3), np.int64(5), np.int64(100))
    lo = lo + js + je + (1 if Band.tile_inside_band(i, i + 4, js, je, np.int64(3), np.int64(5)) else 0)
    m2, r = C.online_update(x, m, np.int64(i))
    r = r + C.rescale_factor(x, m, np.int64(0)) + C.softmax_weight(x, m2, np.int64(3))
    r = r + C.running_sum(x, r, e) + C.times_pow2(x, np.int64(i))
    r = r + C.int8_score(x, m, e) + C.int8_score_pse(x, h) + C.int8_weight(e, x)
    lse = C.lse_value(m, e + C.F32_ONE, np.int64(i))
    total, lse2 = C.row_total(m, e + C.F32_ONE, C.sink_of(inp_f, i), np.int64(i))
    lse = lse + total + lse2
    flo, fhi = Band.fully_masked_band(np.int64(1), i, np.int64(3), np.int64(5), np.int64(100))
    lo = lo + flo + fhi
    lo2 = Band.band_lo(i, np.int64(2))
    hi2 = Band.band_hi(i, np.int64(2), np.int64(50))
    out_f[i] = a + e + m + r + lse + np.float32(lo + hi + lo2 + hi2)


SIG = (types.float32[::1], types.uint16[::1], types.float32[::1], types.uint16[::1],
       types.int64)
F64 = re.compile(r"\.f64\b")


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
def test_core_helpers_compile_without_fp64(cc):
    ptx, _ = cuda.compile_ptx(_probe, SIG, cc=cc)
    bad = [line.strip() for line in ptx.splitlines() if F64.search(line)]
    assert not bad, "fp64 instructions in PTX:\n" + "\n".join(bad[:20])
    assert "ex2.approx" in ptx or "mul.f32" in ptx


def _kernel_specialisations():
    """Every (kernel, query storage, output storage, key/value storage) the backend launches,
    at every head-dim capacity for the plain float kernels, at the smallest and largest for the
    others, at the smallest for int8 key/value (fused_infer_attention_score's dequantized
    caches), for sm_90; and the smallest of each kernel for sm_80. The portable kernels have
    no architecture-dependent code: one source and one Numba IR for every compute capability
    (Numba's front end, where the lane's time goes, does not see it), so sm_80 checks only
    that NVVM takes each kernel for the oldest architecture it runs on."""
    from pfa_numba import config
    i8 = types.int8
    combos = [(False, types.uint16, types.uint16, None, (32, 64, 128, 256, 512)),
              (False, types.float32, types.float32, None, (32, 64, 128, 256, 512)),
              (False, types.uint16, types.int8, None, (32, 512)),
              (False, types.float32, types.int8, None, (32, 512)),
              (False, types.uint16, types.uint16, i8, (32,)),
              (False, types.float32, types.float32, i8, (32,)),
              (True, types.int8, types.uint16, None, (32, 512)),
              (True, types.int8, types.int8, None, (32, 512))]
    oldest = {False: (types.uint16, types.uint16, 32), True: (types.int8, types.uint16, 32)}
    for int8, storage, out, kv, dpads in combos:
        for dpad in dpads:
            bkv = max(1, min(config.CUDA_KV_COLS, config.CUDA_TILE_ELEMS // dpad))
            ccs = [(9, 0)] + ([(8, 0)] if (storage, out, dpad) == oldest[int8] and not kv else [])
            for cc in ccs:
                yield pytest.param(
                    cc, int8, storage, out, kv, dpad, config.CUDA_Q_ROWS, bkv,
                    id=f"{'int8-kernel' if int8 else 'float-kernel'}-{storage}-to-{out}"
                       f"{'-kv-' + str(kv) if kv else ''}-D{dpad}-BQ{config.CUDA_Q_ROWS}-"
                       f"BKV{bkv}-sm_{cc[0]}{cc[1]}")


@pytest.mark.parametrize("cc,int8,storage,out,kv,dpad,bq,bkv", list(_kernel_specialisations()))
def test_attention_kernel_compiles_without_fp64(cc, int8, storage, out, kv, dpad, bq, bkv):
    from pfa_numba.gpu import kernels as gpu
    src = (gpu.kernel_source_int8 if int8 else gpu.kernel_source)(dpad, bq, bkv)
    ptx, _ = cuda.compile_ptx(src, gpu.kernel_signature(storage, out, int8=int8, kv_storage=kv),
                              cc=cc)
    bad = [line.strip() for line in ptx.splitlines() if F64.search(line)]
    assert not bad, "fp64 instructions in the kernel's PTX:\n" + "\n".join(bad[:20])
    assert "bar.sync" in ptx               # the shared-memory tiles are synchronised
    assert ".shared" in ptx
