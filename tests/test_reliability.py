"""Reliability: extreme scores, scale (contract 'The computation' and 'Errors'; memory bounds),
work items taken by any thread (concurrent calls: test_concurrency.py)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit, prange

from pfa_numba import config, prompt_flash_attention
from pfa_numba.cpu._vector import take_next
from _cases import DTYPES, assert_matches_reference, qkv


@pytest.mark.parametrize("dt", list(DTYPES))
def test_extreme_but_finite_scores_give_a_finite_correct_softmax(dt):
    rng = np.random.default_rng(0)
    dtype = DTYPES[dt]
    q, k, v = qkv(rng, "BNSD", dtype, 1, 2, 2, 9, 33, 16)
    kw = dict(num_heads=2, input_layout="BNSD", scale_value=1e4)
    out = prompt_flash_attention(q, k, v, **kw)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_matches_reference(out, (q, k, v), kw, dtype)
    big = np.finfo(np.float16).max if dtype == np.float16 else 60000.0
    qb = np.full((1, 1, 3, 16), big, np.float32).astype(dtype)
    kb = qb.copy()
    kb[0, 0, 1] = -kb[0, 0, 1]
    vb = rng.standard_normal((1, 1, 3, 16)).astype(dtype)
    out = prompt_flash_attention(qb, kb, vb, num_heads=1, input_layout="BNSD", scale_value=3.0)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_matches_reference(out, (qb, kb, vb), dict(num_heads=1, input_layout="BNSD",
                                                     scale_value=3.0), dtype)


SCALE = textwrap.dedent("""
    import resource, sys, numpy as np
    from pfa_numba import prompt_flash_attention
    case = sys.argv[1]
    small = np.ones((1, 1, 64, 64), np.float16)
    prompt_flash_attention(small, small, small, num_heads=1, input_layout='BNSD')
    rng = np.random.default_rng(0)
    if case == 'band65536':
        S, kw = 65536, dict(sparse_mode=4, pre_tokens=512, next_tokens=512)
        m = np.triu(np.ones((2048, 2048), bool), 1)
    else:
        S, kw, m = 16384, {}, None
    q, k, v = (rng.standard_normal((1, 1, S, 64)).astype(np.float16) for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = prompt_flash_attention(q, k, v, m, num_heads=1, input_layout='BNSD',
                                 scale_value=0.125, **kw)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert np.isfinite(out.astype(np.float32)).all()
    print((after - before) / 1024, out.nbytes / 2**20)
""")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["band65536", "dense16384"])
def test_scale_long_sequences_within_output_plus_64_mib(case):
    res = subprocess.run([sys.executable, "-c", SCALE, case], capture_output=True, text=True,
                         timeout=900, env={**os.environ})
    assert res.returncode == 0, res.stderr
    growth, out_mib = map(float, res.stdout.split())
    assert growth <= out_mib + 64, f"peak RSS grew {growth:.0f} MiB (output {out_mib:.0f} MiB)"


def test_many_tiny_batches():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((65536, 1, 3, 16)).astype(np.float16)
    out = prompt_flash_attention(q, q, q, num_heads=1, input_layout="BNSD")
    assert out.shape == q.shape and np.isfinite(out.astype(np.float32)).all()
    sub = slice(65530, 65536)
    assert_matches_reference(out[sub], (q[sub], q[sub], q[sub]),
                             dict(num_heads=1, input_layout="BNSD"), np.float16)


@njit(parallel=True)
def _take_all(n, nthr):
    taken = np.zeros(1, np.int64)
    seen = np.zeros(n, np.int64)
    for t in prange(nthr):
        w = take_next(taken)
        while w < n:
            seen[w] += 1
            w = take_next(taken)
    return seen


def test_each_work_item_is_taken_once_whatever_the_threads():
    seen = _take_all(200_000, 8)
    assert (seen == 1).all()


@pytest.mark.parametrize("dt", list(DTYPES))
def test_results_do_not_depend_on_which_thread_takes_an_item(dt, monkeypatch):
    # threads take items as they free up, so the thread (and its buffers' previous item)
    # that computes an item changes from call to call
    rng = np.random.default_rng(5)
    dtype = DTYPES[dt]
    q, k, v = qkv(rng, "BNSD", dtype, 2, 4, 2, 77, 90, 32)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale_value=0.2,
              sparse_mode=3)
    monkeypatch.setattr(config, "CPU_Q_ROWS", 16)       # 20 work items of unequal cost
    monkeypatch.setattr(config, "CPU_KV_COLS", 32)
    outs = []
    for threads in (1, 2, 3, 2, 3):
        monkeypatch.setattr(config, "CPU_THREADS", threads)
        outs.append(prompt_flash_attention(q, k, v, m, **kw))
    assert_matches_reference(outs[0], (q, k, v, m), kw, dtype)
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint8), outs[0].view(np.uint8))


CACHES = textwrap.dedent("""
    import resource, sys, numpy as np
    from pfa_numba import FiaPlan, fused_infer_attention_score as fia
    B, N, NKV, D = 2, 32, 8, 128

    def case(size):
        # the caches' pages are never written: only what a call reads (or copies) is resident
        q = np.ones((B, N, 1, D), np.float16)
        kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
                  actual_seq_lengths_kv=[300, 200])
        if sys.argv[1] == "paged int8":
            pool = np.zeros((size, NKV, 128, D), np.int8)
            planes = {name: np.full((size, NKV, 128), 0.01, np.float32) for name in (
                "key_antiquant_scale", "value_antiquant_scale", "key_antiquant_offset",
                "value_antiquant_offset")}
            kw.update(block_table=np.arange(4 * B, dtype=np.int32).reshape(B, 4),
                      block_size=128, key_antiquant_mode=5, value_antiquant_mode=5, **planes)
            return (q, pool, pool), kw
        k = np.zeros((B, NKV, size * 64, D), np.float16)
        if sys.argv[1] == "left padded":
            kw.update(kv_padding_size=np.array([7]))
        else:                                            # a shared prefix
            kw.update(key_shared_prefix=k[:1], value_shared_prefix=k[:1])
            k = k[:, :, :400]
        return (q, k, k), kw

    args, kw = case(16)                                  # compiled and warm
    fia(*args, **kw)
    FiaPlan(*args, **kw)(*args)
    args, kw = case(4096)                # 512 MiB int8 pools, 64 MiB of scales; 256 MiB caches
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r0 = rss()
    fia(*args, **kw)
    r1 = rss()
    FiaPlan(*args, **kw)(*args)
    print(r1 - r0, rss() - r1)
""")


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["paged int8", "left padded", "prefix"])
def test_kv_caches_are_read_where_they_lie(cache):
    """A paged int8 cache with per-token-and-head scales and offsets (antiquant mode 5), a
    left-padded cache and a shared prefix of hundreds of MiB: neither a whole call nor a plan
    copies them (docs/guarantees.md, 'Memory')."""
    res = subprocess.run([sys.executable, "-c", CACHES, cache], capture_output=True, text=True,
                         timeout=900, env={**os.environ})
    assert res.returncode == 0, res.stderr
    call, plan = map(float, res.stdout.split())
    assert call <= 4 and plan <= 4, f"peak RSS grew {call:.0f} MiB (call), {plan:.0f} MiB (plan)"


def test_a_misaligned_token_scale_plane_is_copied_once_not_once_a_head():
    """Per-token paged scales (mode 4, one value for every kv head) at an odd address: the one
    copy a misaligned array takes holds the plane once, not once for each of the 8 kv heads."""
    import tracemalloc
    from pfa_numba import fused_infer_attention_score

    rng = np.random.default_rng(3)
    nb, nkv, bs, d = 512, 8, 128, 32

    def misaligned(x):
        y = np.zeros(x.nbytes + 1, np.uint8)[1:].view(x.dtype).reshape(x.shape)
        y[...] = x
        return y
    scales = [misaligned((rng.random((nb, bs)) * 0.02).astype(np.float32)) for _ in range(2)]
    pool = rng.integers(-100, 100, (nb, nkv, bs, d)).astype(np.int8)
    q = rng.standard_normal((2, 32, 1, d)).astype(np.float16)
    kw = dict(num_heads=32, num_key_value_heads=nkv, input_layout="BNSD", block_size=bs,
              block_table=rng.permutation(nb)[:8].reshape(2, 4).astype(np.int32),
              actual_seq_lengths_kv=[500, 300], key_antiquant_scale=scales[0],
              value_antiquant_scale=scales[1], key_antiquant_mode=4, value_antiquant_mode=4)
    fused_infer_attention_score(q, pool, pool, **kw)
    tracemalloc.start()
    try:
        fused_infer_attention_score(q, pool, pool, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    planes = sum(x.nbytes for x in scales)
    assert peak <= planes + (1 << 20), f"{peak / 2**20:.1f} MiB traced for {planes / 2**20} MiB"
