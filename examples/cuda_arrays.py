"""CUDA arrays in, the same kind out: CuPy arrays, PyTorch CUDA tensors and Numba device arrays
go to the GPU kernel without host round-trips; checked against the CPU result. bf16 comes as
torch bfloat16 tensors or as Numba device arrays made from the uint16 bits."""
import sys

import ml_dtypes
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
try:
    import torch
    if not torch.cuda.is_available():
        torch = None
except ImportError:
    torch = None
try:
    import cupy as cp
except ImportError:
    cp = None


def max_err(a, b):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


rng = np.random.default_rng(0)
kw = dict(num_heads=8, input_layout="BNSD", scale_value=0.125)
err = 0.0

# float16: Numba device arrays, CuPy arrays, torch CUDA tensors
q, k, v = (rng.standard_normal((1, 8, 512, 64)).astype(np.float16) for _ in range(3))
cpu = prompt_flash_attention(q, k, v, **kw)
out = prompt_flash_attention(*(cuda.to_device(x) for x in (q, k, v)), **kw)
print("Numba device arrays ->", type(out).__name__)
err = max(err, max_err(out.copy_to_host(), cpu))
if cp is not None:
    out_cp = prompt_flash_attention(*(cp.asarray(x) for x in (q, k, v)), **kw)
    print("CuPy arrays ->", type(out_cp).__name__)
    err = max(err, max_err(cp.asnumpy(out_cp), cpu))
else:
    print("CuPy not installed: skipped that part")
if torch is not None:
    out_t = prompt_flash_attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), **kw)
    print("torch CUDA tensors ->", type(out_t).__name__, out_t.device)
    err = max(err, max_err(out_t.cpu().numpy(), cpu))
else:
    print("torch with CUDA not installed: skipped that part")

# bfloat16: Numba device arrays from the uint16 bits (numba-cuda cannot copy ml_dtypes'
# bfloat16 directly), torch bfloat16 tensors
qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
cpu_b = prompt_flash_attention(qb, kb, vb, **kw)
out_b = prompt_flash_attention(*(cuda.to_device(x.view(np.uint16)).view(ml_dtypes.bfloat16)
                                 for x in (qb, kb, vb)), **kw)
print("bf16 Numba device arrays ->", type(out_b).__name__, out_b.dtype)
err_b = max_err(out_b.copy_to_host(), cpu_b)
if torch is not None:
    tb = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in (qb, kb, vb)]
    out_tb = prompt_flash_attention(*tb, **kw)
    print("bf16 torch CUDA tensors ->", out_tb.dtype)
    err_b = max(err_b, max_err(out_tb.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16),
                               cpu_b))
print(f"max |GPU - CPU| = {err:.1e} (float16), {err_b:.1e} (bfloat16)")
assert err < 2e-3 and err_b < 1.6e-2
print("OK")
