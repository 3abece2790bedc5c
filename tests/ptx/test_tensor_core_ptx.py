"""The tensor-core intrinsics (pfa_numba.gpu.ptx) and the fragment maps compile into a kernel,
for sm_80 and sm_90, without a GPU; ptxas (the nvidia-cuda-nvcc-cu12 wheel's, from the test
extra, not whatever is on PATH) accepts the PTX with no spills.

The probe is one warp doing one FA2 step on a 16-row Q tile and a 16-key K/V tile, with every
intrinsic: cp.async (plain and zero-fill) into XOR-swizzled shared memory, ldmatrix (plain for
Q and K, .trans for V), mma m16n8k16 for S and for O, exp2 with the scale folded in, the quad
shuffles, P packed from the S accumulators, the C-fragment store; one probe per 16-bit type.
On a machine with a GPU the probe also runs, against the NumPy warp model: the fragment maps
checked on the hardware itself.
"""
import os
import re
import subprocess
from importlib import metadata

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is in the test extra")
from numba import float32, types, uint16, uint32  # noqa: E402

from pfa_numba.gpu import fragments as F  # noqa: E402
from pfa_numba.gpu import ptx as P  # noqa: E402

FULL = 0xFFFFFFFF
F64 = re.compile(r"\.f64\b")


def wheel_ptxas():
    """The ptxas binary of the installed nvidia-cuda-nvcc-cu12 wheel, or None."""
    try:
        dist = metadata.distribution("nvidia-cuda-nvcc-cu12")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith("bin/ptxas"):
            path = str(dist.locate_file(f))
            return path if os.access(path, os.X_OK) else None
    return None


def assemble(ptx, cc, tmp_path, name, spills=0):
    """ptxas -v of ``ptx`` for compute capability ``cc`` (skips without the wheel's ptxas):
    asserts it assembles with at most ``spills`` spill bytes (0 unless a test names a
    specialisation's figure), that stack frame, and <= 255 registers, and returns (its log,
    the register line)."""
    ptxas = wheel_ptxas()
    if ptxas is None:
        pytest.skip("the nvidia-cuda-nvcc-cu12 wheel (test extra) with its ptxas is not installed")
    src = tmp_path / f"{name}.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", "-o",
                          str(tmp_path / f"{name}.cubin"), str(src)], capture_output=True,
                         text=True, timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and all(int(st) + int(ld) <= spills for st, ld in found), log
    frame = re.search(r"\b(\d+) bytes stack frame", log)
    assert frame and int(frame.group(1)) <= spills, log
    regs = re.search(r"Used (\d+) registers", log)
    assert regs and int(regs.group(1)) <= 255, log
    print(f"\nsm_{cc[0]}{cc[1]} {name}: {regs.group(0)}, {found}")
    return log, regs.group(0)


def probe_source(d, kind):
    """The probe kernel for head dim ``d`` and 16-bit type ``kind`` ("f16" or "bf16")
    (compile-time sizes and type, as the real kernel's)."""
    D, TILE, KT = d, 16 * d, d // 16
    mma = P.mma_m16n8k16_f16 if kind == "f16" else P.mma_m16n8k16_bf16
    pack = P.pack_f16x2 if kind == "f16" else P.pack_bf16x2

    def probe(q, k, v, out, nbytes, scale_log2):
        qs = cuda.shared.array(TILE, uint16, alignment=16)
        ks = cuda.shared.array(TILE, uint16, alignment=16)
        vs = cuda.shared.array(TILE, uint16, alignment=16)
        s = cuda.local.array(8, float32)
        pa = cuda.local.array(4, uint32)
        lane = cuda.laneid
        for idx in range(lane, TILE // F.CHUNK, F.WARP):
            r, c = F.tile_chunk(idx, D)
            o = F.swizzle(r, c, D)
            P.cp_async_16(qs, o, q, r * D + c)
            P.cp_async_16_zfill(ks, o, k, r * D + c, nbytes)
            P.cp_async_commit()
            P.cp_async_16(vs, o, v, r * D + c)
        P.cp_async_commit()
        P.cp_async_wait(1)
        P.cp_async_wait(0)
        cuda.syncthreads()
        for i in range(8):
            s[i] = float32(0)
        for kk in range(KT):
            r, c = F.ldsm_a_addr(lane)
            a0, a1, a2, a3 = P.ldmatrix_x4(qs, F.swizzle(r, c + 16 * kk, D))
            r, c = F.ldsm_b_addr(lane)
            b0, b1, b2, b3 = P.ldmatrix_x4(ks, F.swizzle(r, c + 16 * kk, D))
            s[0], s[1], s[2], s[3] = mma(a0, a1, a2, a3, b0, b1, s[0], s[1], s[2], s[3])
            s[4], s[5], s[6], s[7] = mma(a0, a1, a2, a3, b2, b3, s[4], s[5], s[6], s[7])
        m0 = max(max(s[0], s[1]), max(s[4], s[5])) * scale_log2
        m1 = max(max(s[2], s[3]), max(s[6], s[7])) * scale_log2
        for x in (1, 2):
            m0 = max(m0, cuda.shfl_xor_sync(FULL, m0, x))
            m1 = max(m1, cuda.shfl_xor_sync(FULL, m1, x))
        l0 = float32(0)
        l1 = float32(0)
        for i in range(8):
            p = P.exp2_approx(s[i] * scale_log2 - (m0 if (i & 2) == 0 else m1))
            s[i] = p
            if (i & 2) == 0:
                l0 += p
            else:
                l1 += p
        for x in (1, 2):
            l0 += cuda.shfl_xor_sync(FULL, l0, x)
            l1 += cuda.shfl_xor_sync(FULL, l1, x)
        for reg in range(4):
            tile, i = F.p_from_s(reg)
            pa[reg] = pack(s[4 * tile + i], s[4 * tile + i + 1])
        z = float32(0)
        for dp in range(KT):
            r, c = F.ldsm_a_addr(lane)
            v0, v1, v2, v3 = P.ldmatrix_x4_trans(vs, F.swizzle(r, c + 16 * dp, D))
            o0 = mma(pa[0], pa[1], pa[2], pa[3], v0, v1, z, z, z, z)
            o1 = mma(pa[0], pa[1], pa[2], pa[3], v2, v3, z, z, z, z)
            for i in range(4):
                r, c = F.mma_c(lane, i)
                den = l0 if i < 2 else l1
                out[r * D + 16 * dp + c] = o0[i] / den
                out[r * D + 16 * dp + 8 + c] = o1[i] / den

    return probe


SIG = (types.uint16[::1], types.uint16[::1], types.uint16[::1], types.float32[::1], types.int32,
       types.float32)
CCS = [pytest.param((8, 0), id="sm_80"), pytest.param((9, 0), id="sm_90")]
KINDS = ["f16", "bf16"]
_PTX = {}


def probe_ptx(d, cc, kind):
    if (d, cc, kind) not in _PTX:
        _PTX[d, cc, kind], _ = cuda.compile_ptx(probe_source(d, kind), SIG, cc=cc)
    return _PTX[d, cc, kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("d", [64, 128])
def test_probe_has_the_tensor_core_instructions_and_no_fp64(d, cc, kind):
    ptx = probe_ptx(d, cc, kind)
    for needle in (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32",
                   f"cvt.rn.{kind}x2.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                   "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                   "cp.async.cg.shared.global", "cp.async.commit_group",
                   "cp.async.wait_group 1;", "cp.async.wait_group 0;", "cvta.to.shared.u64",
                   "ex2.approx.f32", "shfl.sync.bfly"):
        assert needle in ptx, needle
    assert "ex2.approx.ftz" not in ptx                       # subnormals are kept
    # shared operands are 32-bit shared-window addresses (the base converted once)
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[ga\], 16, %r\d+;", ptx)
    assert re.search(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16 \{[^}]*\}, \[%r\d+\];", ptx)
    assert ptx.count("mma.sync.aligned") >= 4                # S pair and O pair at least
    bad = [line.strip() for line in ptx.splitlines() if F64.search(line)]
    assert not bad, "fp64 instructions in the probe's PTX:\n" + "\n".join(bad[:20])
    assert "ld.local" not in ptx and "st.local" not in ptx   # fragments stayed in registers


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("d", [64, 128])
def test_ptxas_accepts_the_probe_without_spills(d, cc, kind, tmp_path):
    assemble(probe_ptx(d, cc, kind), cc, tmp_path, f"probe {kind} D={d}")


@pytest.mark.parametrize("kind", KINDS)
def test_probe_on_the_gpu_matches_the_warp_model(kind):
    """On hardware: the probe's 16 x 16 FA2 step equals the NumPy warp model's (a wrong map
    would be off by O(1)); with src-size 0 the zero-filled K gives uniform weights, the
    mean of V."""
    if not cuda.is_available():
        pytest.skip("no CUDA GPU here: the probe only compiles (the warp model runs on the CPU)")
    from pfa_numba.gpu import warp_model as W
    dtype = W.DTYPES[KINDS.index(kind)]
    d, rng = 64, np.random.default_rng(11)
    q, k, v = (rng.standard_normal((16, d)).astype(np.float32).astype(dtype) for _ in range(3))
    scale = 1.0 / np.sqrt(d)
    kern = cuda.jit(SIG)(probe_source(d, kind))
    for nbytes, want in ((16, W.attention(q, k, v, scale, bkv=16)[0]), (0, None)):
        out = cuda.device_array(16 * d, np.float32)
        kern[1, 32](*(cuda.to_device(x.view(np.uint16).ravel()) for x in (q, k, v)), out,
                    np.int32(nbytes), np.float32(scale * np.log2(np.e)))
        got = out.copy_to_host().reshape(16, d)
        if want is None:               # K zero-filled: every score 0, P = 1, O = mean of V
            want = np.broadcast_to(v.astype(np.float32).mean(axis=0), (16, d))
        tol = 4 * float(np.finfo(np.float16).eps if kind == "f16" else 2.0 ** -8)
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_intrinsics_refuse_wrong_operand_types():
    """An ldmatrix on a float32 array is a typing error, not silent garbage."""
    def bad(out):
        sm = cuda.shared.array(64, float32)
        out[0] = P.ldmatrix_x4(sm, 0)[0]
    with pytest.raises(Exception, match="(?i)ldmatrix|typing|invalid"):
        cuda.compile_ptx(bad, (types.uint32[::1],), cc=(8, 0))


def test_fragment_maps_are_the_same_functions_on_both_sides():
    """The kernel's maps are the model's: the warp model's default maps are the very
    njit functions the probe inlines."""
    from pfa_numba.gpu import warp_model as W
    assert W.MAPS.mma_c is F.mma_c and W.MAPS.swizzle is F.swizzle
    assert F.swizzle(np.int64(9), np.int64(17), np.int64(64)) == 9 * 64 + ((2 ^ 1) << 3 | 1)
