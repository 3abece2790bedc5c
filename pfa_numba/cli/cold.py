"""First calls from an empty Numba cache: what a new machine's first call of each kind costs
(its kernels compile), then what a later process's costs (they load), each call in a fresh
process (``python -c``). Part of ``python -m pfa_numba bench`` (``--cold``) and of
docs/performance.md's first-call table."""
import os
import subprocess
import sys
import tempfile
import time

#: what every program starts with: the call's seconds are printed by the program itself
_TIMED = """import time, numpy as np
import pfa_numba
from pfa_numba import prompt_flash_attention as pfa, fused_infer_attention_score as fia
rng = np.random.default_rng(0)
{setup}
t0 = time.perf_counter()
{call}
print("SECONDS", time.perf_counter() - t0)
"""

#: {case: (setup, call)}: the first calls the targets name (issue "The first result in
#: seconds"); the demo's first call is the README's
CASES = {
    "the demo's first call (float16 BNSD (1, 16, 256, 16))": (
        "q = np.ones((1, 16, 256, 16), np.float16)",
        "pfa(q, q, q, None, None, None, None, None, None, None, None, None, 16, "
        "input_layout='BNSD')"),
    "float16 causal BNSD prefill (1, 8, 256, 64)": (
        "q = rng.standard_normal((1, 8, 256, 64)).astype(np.float16)\n"
        "mask = np.triu(np.ones((2048, 2048), bool), 1)",
        "pfa(q, q, q, mask, num_heads=8, input_layout='BNSD', sparse_mode=3)"),
    "float32 BSH prefill (2, 256, 8 x 64)": (
        "q = rng.standard_normal((2, 256, 512)).astype(np.float32)",
        "pfa(q, q, q, num_heads=8, input_layout='BSH')"),
    "bfloat16 GQA prefill (1, 8 / 2 heads, 256, 64)": (
        "import ml_dtypes\n"
        "q = rng.standard_normal((1, 8, 256, 64)).astype(ml_dtypes.bfloat16)\n"
        "k = rng.standard_normal((1, 2, 256, 64)).astype(ml_dtypes.bfloat16)",
        "pfa(q, k, k, num_heads=8, num_key_value_heads=2, input_layout='BNSD')"),
    "fused_infer_attention_score float16 decode step (1, 32 / 8 heads, 1 x 2048, 128)": (
        "q = rng.standard_normal((1, 32, 1, 128)).astype(np.float16)\n"
        "k = rng.standard_normal((1, 8, 2048, 128)).astype(np.float16)",
        "fia(q, k, k, num_heads=32, num_key_value_heads=8, input_layout='BNSD')"),
    "SDPA drop-in, float32 torch tensors, bool mask (1, 8, 128, 64)": (
        "import torch\nfrom pfa_numba.sdpa import scaled_dot_product_attention as sdpa\n"
        "q = torch.randn(1, 8, 128, 64)\n"
        "m = torch.ones(128, 128, dtype=torch.bool).tril()",
        "sdpa(q, q, q, attn_mask=m)"),
}


def _program(case):
    setup, call = CASES[case]
    return _TIMED.format(setup=setup, call=call)


def _run(code, cache):
    """(the call's seconds, the process's seconds) of ``code`` with Numba's cache in
    ``cache``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"the first-call program failed:\n{res.stderr[-2000:]}")
    seconds = float(next(line.split()[1] for line in res.stdout.splitlines()
                         if line.startswith("SECONDS")))
    return seconds, wall


def runnable(case):
    """Whether ``case`` can run here (the SDPA case needs torch)."""
    import importlib.util
    return "torch" not in case or importlib.util.find_spec("torch") is not None


def cold_first_calls(cases=None, progress=print):
    """{case: (cold call s, cold process s, warm call s, warm process s)}: each case in a fresh
    process with an empty Numba cache of its own, then in another over that cache."""
    results = {}
    for case in cases or CASES:
        if not runnable(case):
            progress(f"  {case}: skipped (torch is not installed)")
            continue
        with tempfile.TemporaryDirectory() as cache:
            progress(f"  {case}: compiling from an empty cache ...")
            cold = _run(_program(case), cache)
            warm = _run(_program(case), cache)
        progress(f"    {cold[0]:.1f} s; a later process's first call {warm[0]:.2f} s")
        results[case] = cold + warm
    return results


def cold_markdown(results):
    rows = ["First calls from an empty Numba cache (fresh process, `NUMBA_CACHE_DIR` empty; "
            "the call alone, then the whole process), then a later process's first call "
            "(cache hit):", "",
            "| first call | cold call s | cold process s | cache hit call s | "
            "cache hit process s |",
            "|---|---|---|---|---|"]
    for case, (cc, cp, wc, wp) in results.items():
        rows.append(f"| {case} | {cc:.1f} | {cp:.1f} | {wc:.2f} | {wp:.2f} |")
    return "\n".join(rows)
