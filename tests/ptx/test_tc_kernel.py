"""The tensor-core kernel (pfa_numba.gpu.tc_kernel) compiles for its specialisations (float16 /
bfloat16 x D 64 / 128 x sm_80 / sm_90 x plain / masked x contiguous / walking the kv
sequence / an int8 cache: those of SPECS), without a GPU, with the float kernel's signature
(the cache's arrays too); its PTX has the tensor-core instructions and no fp64, and ptxas (the nvidia-cuda-nvcc-cu12 wheel's,
see test_tensor_core_ptx.wheel_ptxas) assembles it. tc_conditions.tensor_core_reason picks the
problems it runs; config.CUDA_TENSOR_CORES (on by default) lets it run them.

Registers and spill bytes are printed (pytest -s); 0 spill bytes and a 0-byte stack frame are
asserted for every specialisation (D = 128 sits at 244-255 registers: a change that adds live
values there shows up here first), and the SASS of every kv loop is held to the targets of a
lean kernel or, where it does not meet them, to its figures as they stand.
"""
import re

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is in the test extra")

from pfa_numba.frontend import problem  # noqa: E402
from pfa_numba.frontend import pfa as PV  # noqa: E402
from pfa_numba import config  # noqa: E402
from pfa_numba.gpu import guard as G  # noqa: E402
from pfa_numba.gpu import tc_kernel as T  # noqa: E402
from pfa_numba import dispatch  # noqa: E402
from pfa_numba.gpu import launch as L  # noqa: E402
from test_tensor_core_ptx import assemble  # noqa: E402

F64 = re.compile(r"\.f64\b")
#: every plain sm_90 specialisation and the plain D 64 sm_80 ones, the masked ones for sm_90,
#: and the float16 sm_90 ones that walk the kv sequence (int8 caches too) or cap the scores.
#: One source and one Numba IR serve both capabilities (the lane's time goes to Numba's front
#: end); the D 64 sm_80 ones hold the arch difference: each dtype's instructions on sm_80
SPECS = [pytest.param(*spec, id=name[:-4]) for name, spec in T.ptx_names().items()
         if (not spec[4] and not spec[6] and
             (spec[2] == (9, 0) if spec[3] or spec[1] == 128 else True))
         or ((spec[4] or spec[6]) and spec[0] == "f16" and spec[2] == (9, 0))]
_PTX = {}
_COMPILE = T.tc_ptx


def tc_ptx(*spec):
    """T.tc_ptx, each specialisation compiled once in this process."""
    if spec not in _PTX:
        _PTX[spec] = _COMPILE(*spec)
    return _PTX[spec]


def test_cuda_ptx_command_writes_one_file_a_specialisation(tmp_path, monkeypatch):
    from pfa_numba.cli.main import main
    from pfa_numba.gpu import sass
    monkeypatch.setattr(T, "tc_ptx", tc_ptx)       # compiled once for this and the SPECS test
    assert len(T.ptx_names()) == 56 and "tc_bf16_d128_masked_walk_sm90.ptx" in T.ptx_names()
    assert T.ptx_names()["tc_f16_d64_int8_sm80.ptx"] == ("f16", 64, (8, 0), False, True, True,
                                                         False)
    assert T.ptx_names()["tc_f16_d64_masked_capped_sm80.ptx"][3:] == (True, False, False, True)
    assert main(["cuda-ptx", "--out", str(tmp_path), "--filter", "tc_f16_d64_sm80"]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    with_sass = ["tc_f16_d64_sm80.sass.txt"] if not sass.missing_tools() else []
    assert written == ["tc_f16_d64_sm80.ptx"] + with_sass
    if with_sass:
        text = (tmp_path / with_sass[0]).read_text()
        assert "tiles inside the band" in text and "spill bytes            0" in text
    ptx = (tmp_path / written[0]).read_text()
    assert ".target sm_80" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert not F64.search(ptx)


@pytest.mark.parametrize("kind, d, cc, masked, walk, int8, capped", SPECS)
def test_tc_kernel_compiles_with_the_tensor_core_instructions(kind, d, cc, masked, walk, int8,
                                                               capped, tmp_path):
    ptx = tc_ptx(kind, d, cc, masked, walk, int8, capped)
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    # per tile: S = Q K^T is 8 n-tiles x d/16 k-steps, O += P V is d/8 n-tiles x 4 k-steps,
    # once per kv loop (the plain variant has two: tiles inside the band, tiles crossing it)
    loops = len(T.loop_names(masked))
    assert ptx.count(mma) == loops * 2 * 8 * d // 16, ptx.count(mma)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == d // 16 + loops * 4 * d // 16
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == loops * 4 * d // 16
    for needle in ("cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0;",
                   "ex2.approx.ftz.f32", "max.NaN.f32", "fma.rn.f32", "shfl.sync.bfly",
                   f"cvt.rn.{kind}x2.f32", "bar.sync", "st.global.v4.b32"):
        assert needle in ptx, needle
    assert ("ld.global.nc.u8" in ptx) == masked       # the mask read per element: masked only
    assert ("rcp.approx.ftz.f32" in ptx) == capped    # the softcap's reciprocal: capped only
    bad = [line.strip() for line in ptx.splitlines() if F64.search(line)]
    assert not bad, "fp64 instructions in the tensor-core kernel's PTX:\n" + "\n".join(bad[:20])
    assert "ld.local" not in ptx and "st.local" not in ptx   # fragments stayed in registers

    log, _ = assemble(ptx, cc, tmp_path, f"tc {kind} D={d}")
    smem = re.search(r"(\d+) bytes smem", log)
    # one K and one V tile (and, for an int8 cache, the int8 rows staged past each)
    assert smem and int(smem.group(1)) == 2 * 64 * d * 2 + (2 * 64 * d if int8 else 0)
    _holds_the_sass_targets(kind, d, cc, (masked, capped), walk, int8,
                            tmp_path / f"tc {kind} D={d}.cubin", log)


#: the issue's targets for the kv loop of the plain variant (the one dense, causal and banded
#: calls take): instructions per HMMA, and no 64-bit integer multiply-add in any kv loop
PER_HMMA_TARGET = 8.0
#: instructions per HMMA of the loops the targets do not bound, as they stand: the plain
#: variant's tiles crossing the band (a band test per accumulator; few tiles a row block) and
#: the masked variant's loop (band, pse and mask per accumulator, a predicated load each); a
#: change that adds to them fails here (docs/cuda.md, 'The instruction mix')
PER_HMMA_CEILINGS = {(64, False): 9.9, (128, False): 6.75, (64, True): 19.5, (128, True): 11.4}
#: the capped variants (masked, and an ex2, a reciprocal and an fma an accumulator for the
#: softcap), by head dim: instructions per HMMA of their loop
CAPPED_CEILINGS = {64: 22.6, 128: 12.7}
#: the variants that walk the kv sequence (a block-table lookup a K row, reused by its V row;
#: 64-bit row offsets), by (head dim, masked): instructions per HMMA of the last loop
WALK_CEILINGS = {(64, False): 25.5, (128, False): 21.6, (64, True): 34.9, (128, True): 26.4}
#: the int8 variants (each thread dequantizes the chunks it copied: a token pair a row, two
#: channel values and a conversion a value), the same way
INT8_CEILINGS = {(64, False): 33.2, (128, False): 22.1, (64, True): 43.5, (128, True): 26.6}


def _holds_the_sass_targets(kind, d, cc, variant, walk, int8, cubin, log):
    from pfa_numba.gpu import sass
    masked, capped = variant
    missing = sass.missing_tools()
    if missing:
        pytest.skip(f"the wheels of {missing} (test extra) are not installed: no SASS")
    s = sass.summary(sass.disassemble(str(cubin)), log)
    print(sass.format_summary(f"tc_{kind}_d{d}_sm{cc[0]}{cc[1]}", s, T.loop_names(masked)))
    assert s["registers"] <= 255, s
    assert s["spill_bytes"] == 0, s
    loops = s["loops"]
    assert len(loops) == len(T.loop_names(masked)), s
    assert all(loop["hmma"] == 2 * 8 * d // 16 for loop in loops), s   # each loop: a whole tile
    if walk:
        ceilings = INT8_CEILINGS if int8 else WALK_CEILINGS
        assert loops[-1]["per_hmma"] <= ceilings[d, masked], s
    else:
        assert all(loop["imad_wide"] == 0 for loop in loops), s
        if not masked:
            assert loops[0]["per_hmma"] <= PER_HMMA_TARGET, s
        ceiling = CAPPED_CEILINGS[d] if capped else PER_HMMA_CEILINGS[d, masked]
        assert loops[-1]["per_hmma"] <= ceiling, s
    assert set(s["store_bits"]) == {32, 128}, s     # 16-byte output stores, float32 lse


# ---------------------------------------------------------------------------------------------
# which problems the kernel takes
# ---------------------------------------------------------------------------------------------

def _problem(dtype=np.float16, d=64, layout="BNSD", scale=0.125, **kw):
    rng = np.random.default_rng(0)
    shape = {"BNSD": (1, 2, 8, d), "BSH": (1, 8, 2 * d)}[layout]
    q = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    return problem.plan(PV.validate(PV.Call(q, q, q, num_heads=2, input_layout=layout,
                                        scale_value=scale, **kw)))


def _why(p, cc=(9, 0)):
    """Why the tensor-core kernel cannot run planned problem ``p`` on a device of capability
    cc."""
    return "; ".join(dispatch.reasons_against(dispatch.kernel("cuda", "tensor-core"), p,
                                              L.Situation.of(p, cc=cc, sms=132)))


def test_the_tensor_core_kernel_takes_plain_fp16_and_bf16_problems():
    import ml_dtypes
    assert _why(_problem()) == ""
    assert _why(_problem(ml_dtypes.bfloat16, 128, "BSH")) == ""
    assert _why(_problem(), (9, 0)) == ""
    causal = np.triu(np.ones((2048, 2048), bool), 1)
    assert _why(_problem(sparse_mode=2, attn_mask=causal), (8, 0)) == ""


def test_the_tensor_core_kernel_refuses_what_the_kernel_does_not_run():
    assert "float32" in _why(_problem(np.float32))
    assert "head dim 32" in _why(_problem(d=32))
    assert "compute capability 8.0" in _why(_problem(), (7, 5))
    assert "scale_value" in _why(_problem(scale=2.0 ** -120))
    assert "scale_value" in _why(_problem(scale=2.0 ** 120))
    p = _problem()
    p.k = p.k[..., ::2, :]                       # a row stride of 2 x 128 bytes: still aligned
    assert _why(p) == ""
    p = _problem()
    base = np.zeros(2 * 8 * 64 + 4, np.float16)[4:].reshape(1, 2, 8, 64)   # rows 8-byte aligned
    p.v = np.lib.stride_tricks.as_strided(base, base.shape, (0, 8 * 66 * 2, 66 * 2, 2))
    assert "value rows" in _why(p)


def test_paged_prefixed_and_int8_caches_are_taken_unless_dequantized_values_overflow():
    """fused_infer_attention_score's contiguous, paged, prefixed and int8 caches are taken;
    an int8 cache whose channel planes may take its values beyond float16 is refused with
    the reason (the launch logs it and runs the portable kernel); token planes are left to
    the guard's scan, with limits that keep the values finite."""
    from pfa_numba.frontend import fia as FV
    from pfa_numba.fia import planned
    q = np.zeros((1, 4, 1, 64), np.float16)
    pool = np.zeros((3, 2, 16, 64), np.float16)
    i8 = pool[:1].astype(np.int8)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    calls = {"paged": FV.FiaCall(q, pool, pool, block_table=np.array([[2, 0]], np.int32),
                                 block_size=16, actual_seq_lengths_kv=[20], **kw),
             "prefix": FV.FiaCall(q, pool[:1], pool[:1], key_shared_prefix=pool[:1],
                                  value_shared_prefix=pool[:1], **kw),
             "int8": FV.FiaCall(q, i8, i8, antiquant_scale=np.ones(2, np.float16), **kw),
             "contiguous": FV.FiaCall(q, pool[:1], pool[:1], **kw)}
    for name, call in calls.items():
        assert _why(planned(FV.validate(call)), (9, 0)) == "", name
    big = planned(FV.validate(FV.FiaCall(q, i8, i8, antiquant_scale=np.array([1, 600],
                                                                              np.float16),
                                         **kw)))
    assert "int8 cache" in _why(big) and G.antiquant_limits(big) is None
    tokens = planned(FV.validate(FV.FiaCall(
        q, i8, i8, key_antiquant_scale=np.ones((1, 16), np.float32),
        value_antiquant_scale=np.ones((1, 16), np.float32),
        value_antiquant_offset=np.zeros((1, 16), np.float32),
        key_antiquant_offset=np.zeros((1, 16), np.float32),
        key_antiquant_mode=1, value_antiquant_mode=1, **kw)))
    limits = dict(G.antiquant_limits(tokens))
    assert set(limits) == {"kts", "kto", "vts", "vto"} and limits["kto"] == 256.0
    assert 3 * 128 * limits["kts"] < 65504 < 3 * 128 * limits["kts"] * 1.01


def test_the_tensor_core_kernels_are_on_by_default_and_their_switch_turns_them_off(monkeypatch):
    assert config.CUDA_TENSOR_CORES is True
    p = _problem()
    assert _why(p) == "" and "compute capability 8.0" in _why(p, (7, 5))
    monkeypatch.setattr(config, "CUDA_TENSOR_CORES", False)
    assert "config.CUDA_TENSOR_CORES is False" in _why(p)


# on a GPU only: the kernel against the reference (CUDA_TENSOR_CORES switched on for the test)
# ---------------------------------------------------------------------------------------------

def _on_gpu(monkeypatch, args, kw, dtype, tc_expected=True):
    """Run on the device with the tensor-core kernel enabled; check it ran (or did not) and
    that the result and lse match the reference within the documented tolerance."""
    if not cuda.is_available():
        pytest.skip("no CUDA GPU here: the tensor-core kernel only compiles (see the tests above)")
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _cases import assert_matches_reference

    from pfa_numba import prompt_flash_attention
    used = []
    real = T.tc_kernel_for
    monkeypatch.setattr(config, "CUDA_TENSOR_CORES", True)
    monkeypatch.setattr(T, "tc_kernel_for", lambda *a: used.append(a) or real(*a))
    out, lse = prompt_flash_attention(*args, **kw, device="cuda", return_softmax_lse=True)
    assert bool(used) == tc_expected, used
    assert_matches_reference(out, args, kw, dtype, lse=lse)
    return out


def _qkv(dtype, layout, B, N, Nkv, Sq, Skv, D, seed=0):
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _cases import qkv
    return qkv(np.random.default_rng(seed), layout, dtype, B, N, Nkv, Sq, Skv, D)


def _dtype(kind):
    import ml_dtypes
    return np.dtype(np.float16) if kind == "f16" else np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_gpu_dense_gqa_ragged_tiles(kind, d, monkeypatch):
    dt = _dtype(kind)
    q, k, v = _qkv(dt, "BNSD", 2, 4, 2, 130, 200, d)
    _on_gpu(monkeypatch, (q, k, v), dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                         scale_value=d ** -0.5), dt)


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_gpu_sparse_modes_lengths_and_layouts(mode, monkeypatch):
    dt = np.dtype(np.float16)
    q, k, v = _qkv(dt, "BSH", 2, 2, 2, 150, 170, 64, seed=mode)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    _on_gpu(monkeypatch, (q, k, v, m, [150, 77], [170, 0]),
            dict(num_heads=2, input_layout="BSH", sparse_mode=mode, pre_tokens=40,
                 next_tokens=9), dt)


@pytest.mark.parametrize("ip", [1, 2])
def test_gpu_user_mask_fully_masked_rows_and_pse(ip, monkeypatch):
    dt = np.dtype(np.float16)
    rng = np.random.default_rng(3)
    q, k, v = _qkv(dt, "BNSD", 1, 2, 2, 96, 140, 128, seed=3)
    mask = rng.random((96, 140)) < 0.3
    mask[5] = True
    pse = rng.standard_normal((1, 2, 96, 140)).astype(np.float16)
    pse[0, 0, 70, :] = -np.inf
    _on_gpu(monkeypatch, (q, k, v, mask, None, None, pse),
            dict(num_heads=2, input_layout="BNSD", sparse_mode=0, pre_tokens=60, next_tokens=20,
                 inner_precise=ip), dt)


def test_gpu_float16_additive_mask_and_tnd(monkeypatch):
    dt = np.dtype(np.float16)
    rng = np.random.default_rng(4)
    q, k, v = _qkv(dt, "BNSD", 1, 1, 1, 80, 90, 64, seed=4)
    mask = (rng.random((80, 90)) < 0.5).astype(np.float16)
    with pytest.warns(DeprecationWarning):
        _on_gpu(monkeypatch, (q, k, v, mask), dict(num_heads=1, input_layout="BNSD",
                                                   sparse_mode=1), dt)
    qt = rng.standard_normal((150, 2, 64)).astype(np.float16)
    kt = rng.standard_normal((200, 1, 64)).astype(np.float16)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    _on_gpu(monkeypatch, (qt, kt, kt.copy(), m, [70, 150], [90, 200]),
            dict(num_heads=2, num_key_value_heads=1, input_layout="TND", sparse_mode=3), dt)


def test_gpu_nonfinite_v_goes_to_the_portable_kernel_on_the_device(monkeypatch):
    """V holding inf: the tensor-core kernel is launched but the scan's guard word sends the
    call to the portable kernel launched behind it (the guard holds the call's id); the result
    is the reference's. A finite V leaves the guard alone."""
    from pfa_numba.gpu import device, launch as L
    dt = np.dtype(np.float16)
    q, k, v = _qkv(dt, "BNSD", 1, 1, 1, 70, 70, 64, seed=5)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=1, input_layout="BNSD", sparse_mode=2)
    _on_gpu(monkeypatch, (q, k, v, m), kw, dt)
    state = L._STREAMS[device.stream_key(device.caller_stream(None))]
    assert state.guard.copy_to_host()[0] != state.last_id
    v[0, 0, 69] = np.inf          # causal: only the last row keeps it
    _on_gpu(monkeypatch, (q, k, v, m), kw, dt)
    assert state.guard.copy_to_host()[0] == state.last_id
