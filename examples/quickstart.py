"""Quickstart: MindSpore's prompt_flash_attention call on NumPy arrays, checked against the
float64 reference."""
import numpy as np

from pfa_numba import prompt_flash_attention, reference

rng = np.random.default_rng(0)
B, N, S, D = 2, 8, 128, 64
q = rng.standard_normal((B, N, S, D)).astype(np.float16)
k = rng.standard_normal((B, N, S, D)).astype(np.float16)
v = rng.standard_normal((B, N, S, D)).astype(np.float16)

# exactly as in MindSpore: positional Nones for the optional tensors, then num_heads
out = prompt_flash_attention(q, k, v, None, None, None, None, None, None, None, None, None, N,
                             scale_value=1 / np.sqrt(D), input_layout="BNSD")
print("output", out.shape, out.dtype)

# causal attention (sparse_mode 2 takes Ascend's 2048x2048 triu mask and derives the band)
mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
causal, lse = prompt_flash_attention(q, k, v, mask, num_heads=N, scale_value=1 / np.sqrt(D),
                                     input_layout="BNSD", sparse_mode=2,
                                     return_softmax_lse=True)
ref = reference.prompt_flash_attention(q, k, v, mask, num_heads=N, scale_value=1 / np.sqrt(D),
                                       input_layout="BNSD", sparse_mode=2)
err = np.abs(causal.astype(np.float64) - ref).max()
print(f"causal: max |error| vs the float64 reference = {err:.2e}; lse shape {lse.shape}")
assert err < 2e-3, err
print("OK")
