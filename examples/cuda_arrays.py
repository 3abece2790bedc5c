"""CUDA arrays in, the same kind out: CuPy arrays, PyTorch CUDA tensors and Numba device arrays
go to the GPU kernel without host round-trips; checked against the CPU result."""
import sys

import numpy as np

from pfa_numba import prompt_flash_attention

try:
    from numba import cuda
    available = cuda.is_available()
except ImportError:
    available = False
if not available:
    print("SKIP: no CUDA device (or numba-cuda not installed): this example needs a GPU")
    sys.exit(0)

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 512, 64)).astype(np.float16) for _ in range(3))
kw = dict(num_heads=8, input_layout="BNSD", scale_value=0.125)
cpu = prompt_flash_attention(q, k, v, **kw)

out = prompt_flash_attention(*(cuda.to_device(x) for x in (q, k, v)), **kw)
print("Numba device arrays ->", type(out).__name__)
err = np.abs(out.copy_to_host().astype(np.float32) - cpu.astype(np.float32)).max()
try:
    import cupy as cp
    out_cp = prompt_flash_attention(*(cp.asarray(x) for x in (q, k, v)), **kw)
    print("CuPy arrays ->", type(out_cp).__name__)
    err = max(err, float(np.abs(cp.asnumpy(out_cp).astype(np.float32) - cpu).max()))
except ImportError:
    print("CuPy not installed: skipped that part")
try:
    import torch
    out_t = prompt_flash_attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), **kw)
    print("torch CUDA tensors ->", type(out_t).__name__, out_t.device)
    err = max(err, float(np.abs(out_t.cpu().numpy().astype(np.float32) - cpu).max()))
except ImportError:
    print("torch not installed: skipped that part")
print(f"max |GPU - CPU| = {err:.1e}")
assert err < 2e-3
print("OK")
