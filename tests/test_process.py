"""Whole-process properties: thread-count determinism and bounded memory."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

DETERMINISM = textwrap.dedent("""
    import hashlib, json
    import numpy as np, ml_dtypes
    from pfa_numba import prompt_flash_attention, config
    config.CPU_Q_ROWS, config.CPU_KV_COLS = 24, 40
    rng = np.random.default_rng(0)
    digests = []
    m = np.triu(np.ones((2048, 2048), bool), 1)
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32):
        q = rng.standard_normal((2, 8, 150, 64)).astype(dt)
        k = rng.standard_normal((2, 2, 170, 64)).astype(dt)
        v = rng.standard_normal((2, 2, 170, 64)).astype(dt)
        for mode in (0, 3, 4):
            kw = dict(num_heads=8, num_key_value_heads=2, input_layout='BNSD', sparse_mode=mode,
                      pre_tokens=40, next_tokens=3, scale_value=0.125)
            for _ in range(2):
                o, lse = prompt_flash_attention(q, k, v, None if mode == 0 else m, [150, 77],
                                                **kw, return_softmax_lse=True)
                digests.append(hashlib.sha256(o.tobytes() + lse.tobytes()).hexdigest())
    print(json.dumps(digests))
""")


def _run(code, threads):
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def test_bit_identical_for_1_and_2_threads_and_repeated_calls():
    one = json.loads(_run(DETERMINISM, 1))
    two = json.loads(_run(DETERMINISM, 2))
    assert one == two
    assert one[0::2] == one[1::2]   # each call repeated: identical


MEMORY = textwrap.dedent("""
    import resource, numpy as np
    from pfa_numba import prompt_flash_attention
    small = np.ones((1, 2, 64, 64), np.float16)
    prompt_flash_attention(small, small, small, num_heads=2, input_layout='BNSD')  # JIT / cache
    S = 16384
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, S, 64)).astype(np.float16) for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = prompt_flash_attention(q, k, v, num_heads=2, input_layout='BNSD', scale_value=0.125)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert np.isfinite(out.astype(np.float32)).all()
    print((after - before) / 1024)
""")


@pytest.mark.slow
def test_memory_stays_far_below_s_squared():
    """Sq = Skv = 16384: an S^2 float32 score matrix per head would be 1 GiB."""
    growth_mib = float(_run(MEMORY, 2))
    assert growth_mib < 128, f"peak RSS grew by {growth_mib:.0f} MiB"


def test_float32_call_leaves_ml_dtypes_unimported():
    """ml_dtypes (about 25 ms of a fresh process's first call) is imported only when a
    bfloat16 array arrives, and then recognised."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from pfa_numba import prompt_flash_attention
        q = np.ones((1, 2, 16, 16), np.float32)
        prompt_flash_attention(q, q, q, num_heads=2, input_layout='BNSD')
        before = 'ml_dtypes' in sys.modules
        import ml_dtypes
        b = q.astype(ml_dtypes.bfloat16)
        out = prompt_flash_attention(b, b, b, num_heads=2, input_layout='BNSD')
        print(before, out.dtype == ml_dtypes.bfloat16)
    """)
    assert _run(code, 1) == "False True"
