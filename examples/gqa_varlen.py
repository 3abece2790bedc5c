"""GQA with a variable-length batch: 16 query heads share 4 kv heads, and each batch entry has
its own query and kv length (rows past the actual query length are exact zeros)."""
import numpy as np

from pfa_numba import prompt_flash_attention, reference

rng = np.random.default_rng(0)
B, N, NKV, S, D = 3, 16, 4, 256, 64
q = rng.standard_normal((B, S, N, D)).astype(np.float32)
k = rng.standard_normal((B, S, NKV, D)).astype(np.float32)
v = rng.standard_normal((B, S, NKV, D)).astype(np.float32)
q_lens, kv_lens = [256, 100, 7], [256, 180, 0]
kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BSND", scale_value=D ** -0.5)
out, lse = prompt_flash_attention(q, k, v, None, q_lens, kv_lens, **kw, return_softmax_lse=True)
print("output", out.shape, "- batch 1 rows >= 100 zero:", bool(np.all(out[1, 100:] == 0)),
      "- batch 2 (kL = 0) all zero:", bool(np.all(out[2] == 0)))
ref = reference.prompt_flash_attention(q, k, v, None, q_lens, kv_lens, **kw)
err = np.abs(out - ref).max()
print(f"max |error| vs reference {err:.1e}")
assert err < 1e-5
print("OK")
