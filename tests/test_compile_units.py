"""A call compiles only what it runs: each CPU kernel is its own compiled unit (pfa_numba.cpu.launch),
so a prefill compiles the float32 tiles and not the streaming kernel, a decode step the
streaming kernel and not the tiles, and neither compiles the merge, AMX or int8 kernels. Counted
with Numba's compile-event recorder, in a process of its own with an empty cache."""
import json
import os
import subprocess
import sys

import pytest

RECORD = """
import json, numpy as np
from numba.core import event
import pfa_numba
rng = np.random.default_rng(0)
if {decode}:
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float16)
    k = rng.standard_normal((1, 2, 700, 64)).astype(np.float16)
    call = lambda: pfa_numba.fused_infer_attention_score(q, k, k, num_heads=8,
                                                          num_key_value_heads=2,
                                                          input_layout="BNSD")
else:
    q = rng.standard_normal((1, 4, 96, 32)).astype(np.float16)
    call = lambda: pfa_numba.prompt_flash_attention(q, q, q, num_heads=4, input_layout="BNSD")
with event.install_recorder("numba:compile") as rec:
    call()
names = [e.data["dispatcher"].py_func.__module__ + "." + e.data["dispatcher"].py_func.__qualname__
         for _, e in rec.buffer if e.is_start]
print(json.dumps(names))
"""

#: the CPU kernels' workers, by module and function
WORKERS = {"pfa_numba.cpu.float_tiles.avx512_tiles", "pfa_numba.cpu.float_tiles.blas_tiles",
           "pfa_numba.cpu.streaming.streaming", "pfa_numba.cpu.tile.merge",
           "pfa_numba.cpu.block_amx.amx", "pfa_numba.cpu.block_int8.int8",
           "pfa_numba.cpu.quantize.quantize", "pfa_numba.cpu.backward.kv_pass",
           "pfa_numba.cpu.backward.query_pass"}


def _compiled(tmp_path, decode):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", RECORD.format(decode=decode)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def _tiles():
    from pfa_numba.cpu import driver
    return "pfa_numba.cpu.float_tiles." + ("avx512_tiles" if driver.use_register_blocks()
                                            else "blas_tiles")


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_a_first_call_compiles_only_the_kernel_it_runs(tmp_path, decode):
    names = _compiled(tmp_path, decode)
    ran = "pfa_numba.cpu.streaming.streaming" if decode else _tiles()
    assert set(names) & WORKERS == {ran}, sorted(set(names) & WORKERS)
    assert names.count(ran) == 1
    # each helper is compiled once: no second specialisation for a read-only or writable
    # array, a literal argument, or rows gathered from a strided cache
    helpers = [n for n in names if n.startswith("pfa_numba.") and n not in WORKERS]
    twice = {n for n in helpers if helpers.count(n) > 1}
    assert not twice, sorted(twice)
    # the streaming products are the decode step's, the tile products the prefill's
    streamed = {"pfa_numba.cpu.stream.stream_pv", "pfa_numba.cpu.stream.stream_scores"}
    assert (set(names) & streamed == streamed) if decode else not set(names) & streamed
