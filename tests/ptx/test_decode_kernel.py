"""The split-kv decode kernel (pfa_numba.gpu.decode_kernel) compiles for every sm_90
specialisation (float16 / bfloat16 x D 64 / 128 x contiguous rows / rows through the kv
sequence / an int8 cache) and the contiguous D 64 sm_80 ones, without a GPU: tensor-core
instructions, cp.async, no fp64, no local memory, ptxas with 0 spill bytes (one int8
variant's figure aside) inside 48 KiB of shared memory, and the SASS
of each kv loop held to its figures as they stand (docs/cuda.md, 'The decode kernel'), so a
change that adds instructions fails here. decode_reason picks the problems it runs."""
import re

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is in the test extra")

from pfa_numba.frontend import problem  # noqa: E402
from pfa_numba.frontend import pfa as PV  # noqa: E402
from pfa_numba.frontend import fia as FV  # noqa: E402
from pfa_numba.fia import planned  # noqa: E402
from pfa_numba import dispatch  # noqa: E402
from pfa_numba.gpu import decode_kernel as DK  # noqa: E402
from pfa_numba.gpu import launch as L  # noqa: E402
from test_tensor_core_ptx import assemble  # noqa: E402

F64 = re.compile(r"\.f64\b")
#: every float16 sm_90 specialisation, the plain bfloat16 ones and the plain D 64 sm_80 ones
#: (one source and one Numba IR serve both capabilities, and the lane's time goes to Numba's
#: front end: D 64 holds each dtype's instructions on sm_80)
SPECS = [pytest.param(*spec, id=name[:-4]) for name, spec in DK.ptx_names().items()
         if (spec[0] == "f16" and spec[2] == (9, 0))
         or (not (spec[3] or spec[4] or spec[6]) and (spec[2] == (9, 0) or spec[1] == 64))]
#: the int8 variants dequantize each warp's rows into a 16-bit tile (a token pair a row,
#: two channel values and a conversion a value): their figures by (head dim, masked), and
#: the spill bytes of the one that spills (masked at D 128: 255 registers)
INT8_CEILINGS = {(64, False): 2060, (128, False): 2310, (64, True): 2270, (128, True): 2520}
INT8_SPILLS = {(128, True): 20}
#: static instructions of one tile's step in a warp, as they stand, by (head dim, walk,
#: masked): the loop over the tiles inside the band (the masked variant's loop over every
#: tile); a 64-key tile of K and V is 16 KiB (D 64) or 32 KiB
#: (D 128) read by 4 warps, so D 128's 649 are ~1.3 warp instructions a 16-byte chunk
#: (contiguous), ~5 through the block table (a division a row, shared by K and V)
TILE_CEILINGS = {(64, False, False): 430, (128, False, False): 670, (64, True, False): 1270,
                 (128, True, False): 2380, (64, False, True): 650, (128, False, True): 880,
                 (64, True, True): 1470, (128, True, True): 2600}
#: the capped variants (masked, contiguous; an ex2, a reciprocal and an fma an accumulator
#: for the softcap): that loop's figures by head dim
CAPPED_CEILINGS = {64: 680, 128: 900}


@pytest.mark.parametrize("kind, d, cc, walk, masked, int8, capped", SPECS)
def test_decode_kernel_compiles_lean(kind, d, cc, walk, masked, int8, capped, tmp_path):
    ptx = DK.decode_ptx(kind, d, cc, walk, masked, int8, capped)
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    # per tile and warp: S is 2 n-tiles x d/16 k-steps, O += P V d/8 n-tiles; three kv loops
    # (tiles before the band's interior, inside it, after it), two in the masked variant
    loops = len(DK.loop_names(walk, masked))
    assert ptx.count(mma) == loops * (2 * d // 16 + d // 8), ptx.count(mma)
    for needle in ("cp.async.cg.shared.global", "cp.async.commit_group",
                   f"cp.async.wait_group {DK.ring_buffers(d, int8) - 2};", "ldmatrix.sync.aligned",
                   "ex2.approx.ftz.f32", "max.NaN.f32", "shfl.sync.bfly", "bar.sync"):
        assert needle in ptx, needle
    bad = [line.strip() for line in ptx.splitlines() if F64.search(line)]
    assert not bad, "fp64 instructions in the decode kernel's PTX:\n" + "\n".join(bad[:20])
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ("ld.global.nc.u8" in ptx) == masked       # the mask read per element: masked only
    assert ("rcp.approx.ftz.f32" in ptx) == capped    # the softcap's reciprocal: capped only

    log, _ = assemble(ptx, cc, tmp_path, f"decode {kind} D={d}",
                      spills=INT8_SPILLS.get((d, masked), 0) if int8 else 0)
    smem = re.search(r"(\d+) bytes smem", log)
    assert smem and int(smem.group(1)) <= 48 * 1024
    from pfa_numba.gpu import sass
    if sass.missing_tools():
        pytest.skip("the SASS tools' wheels (test extra) are not installed")
    s = sass.summary(sass.disassemble(str(tmp_path / f"decode {kind} D={d}.cubin")), log)
    print(sass.format_summary(f"decode_{kind}_d{d}_sm{cc[0]}{cc[1]}", s,
                              DK.loop_names(walk, masked, int8)))
    assert s["registers"] <= 255, s
    assert s["spill_bytes"] <= (INT8_SPILLS.get((d, masked), 0) if int8 else 0), s
    assert len(s["loops"]) == loops, s
    assert all(loop["hmma"] == 2 * d // 16 + d // 8 for loop in s["loops"]), s
    ceiling = (INT8_CEILINGS[d, masked] if int8 else CAPPED_CEILINGS[d] if capped
               else TILE_CEILINGS[d, walk, masked])
    assert s["loops"][1]["instructions"] <= ceiling, s


def _why(p, cc=(9, 0)):
    """Why the decode kernel cannot run planned problem ``p`` on a device of capability cc."""
    return "; ".join(dispatch.reasons_against(dispatch.kernel("cuda", "decode"), p,
                                              L.Situation.of(p, cc=cc, sms=132)))


def _fia(q, k, v, **kw):
    return planned(FV.validate(FV.FiaCall(q, k, v, **kw)))


def test_the_decode_kernel_takes_decode_steps_and_few_query_rows():
    import ml_dtypes
    q = np.zeros((2, 8, 1, 128), np.float16)
    cache = np.zeros((2, 2, 300, 128), np.float16)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD")
    assert _why(_fia(q, cache, cache, **kw), (9, 0)) == ""
    bf = ml_dtypes.bfloat16
    assert _why(_fia(q.astype(bf), cache.astype(bf), cache.astype(bf), **kw)) == ""
    pool = np.zeros((6, 2, 16, 128), np.float16)
    table = np.array([[5, 0, 3], [1, 2, 4]], np.int32)
    assert _why(_fia(q, pool, pool, block_table=table, block_size=16,
                     actual_seq_lengths_kv=[40, 33], **kw)) == ""
    q4 = np.zeros((2, 8, 4, 128), np.float16)                 # 4 heads a group x 4 rows = 16
    assert _why(_fia(q4, cache, cache, **kw)) == ""


def test_the_decode_kernel_refuses_what_the_kernel_does_not_run():
    q = np.zeros((1, 8, 1, 64), np.float16)
    cache = np.zeros((1, 2, 100, 64), np.float16)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD")
    assert "> 16" in _why(_fia(np.zeros((1, 8, 5, 64), np.float16), cache, cache,
                               **kw))
    assert "float32" in _why(_fia(q.astype(np.float32), cache.astype(np.float32),
                                  cache.astype(np.float32), **kw))
    assert "head dim 96" in _why(_fia(np.zeros((1, 8, 1, 96), np.float16),
                                      *[np.zeros((1, 2, 100, 96), np.float16)] * 2,
                                      **kw))
    assert "compute capability 8.0" in _why(_fia(q, cache, cache, **kw), (7, 5))
    assert _why(_fia(q, cache, cache, atten_mask=np.zeros((1, 100), bool),
                     **kw)) == ""
    assert _why(_fia(q, cache.astype(np.int8), cache.astype(np.int8),
                     antiquant_scale=np.ones(2, np.float16), **kw)) == ""
    assert "int8 cache" in _why(_fia(q, cache.astype(np.int8), cache.astype(np.int8),
                                     antiquant_scale=np.array([1e3, 1], np.float16),
                                     **kw))
    rows = np.zeros((1, 2, 100, 68), np.float16)[..., :64]   # 136-byte rows: not aligned
    assert "key rows" in _why(_fia(q, rows, cache, **kw))
    p = problem.plan(PV.validate(PV.Call(q, cache, cache, num_heads=8, num_key_value_heads=2,
                                     input_layout="BNSD", scale_value=0.0)))
    assert "scale_value 0" in _why(p)
