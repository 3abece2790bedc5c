"""Band attention for long sequences: sparse_mode 4 keeps 256 tokens on each side of the
diagonal; tiles outside the band are never computed, so the cost grows linearly with S."""
import time

import numpy as np

from pfa_numba import prompt_flash_attention, reference

rng = np.random.default_rng(0)
N, D, W = 4, 64, 256
mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
kw = dict(num_heads=N, input_layout="BNSD", scale_value=D ** -0.5, sparse_mode=4,
          pre_tokens=W, next_tokens=W)
for S in (2048, 8192, 32768):
    q, k, v = (rng.standard_normal((1, N, S, D)).astype(np.float16) for _ in range(3))
    prompt_flash_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], mask, **kw)
    t0 = time.perf_counter()
    out = prompt_flash_attention(q, k, v, mask, **kw)
    dt = time.perf_counter() - t0
    print(f"S = {S:6d}: {dt * 1e3:7.1f} ms ({dt / S * 1e6:.2f} us per query row)")
# check a window of rows against the reference: rows i0..i1 keep columns i - W .. i + W, which
# in the window of columns [i0 - W, i1 + W) is row r keeping r .. r + 2W (mode 0, pre 0, next 2W)
i0, i1 = S - 700, S - 500
window = slice(i0 - W, i1 + W)
ref = reference.prompt_flash_attention(
    q[:, :, i0:i1], k[:, :, window], v[:, :, window], np.zeros((i1 - i0, i1 - i0 + 2 * W), bool),
    **dict(kw, sparse_mode=0, pre_tokens=0, next_tokens=2 * W))
err = np.abs(out[:, :, i0:i1].astype(np.float64) - ref).max()
print(f"rows {i0}..{i1} vs reference: max |error| {err:.1e}")
assert err < 2e-3
print("OK")
