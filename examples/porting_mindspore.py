"""Porting MindSpore code: a function written against mindspore.ops runs unchanged when
`ops` and `Tensor` come from NumPy and pfa_numba instead."""
import types

import numpy as np

import pfa_numba
from pfa_numba import reference

# what `from mindspore import ops, Tensor` provided
ops = types.SimpleNamespace(prompt_flash_attention=pfa_numba.prompt_flash_attention)
Tensor = np.asarray


def attention_block(q, k, v, num_heads, causal_mask):
    """Unchanged MindSpore model code (BSH layout, causal prefill, GQA 8 -> 2 heads)."""
    out = ops.prompt_flash_attention(q, k, v, causal_mask, None, None, None, None, None, None,
                                     None, None, num_heads, 1.0 / 8.0, 2147483647, 0, 'BSH', 2,
                                     3)
    return out


rng = np.random.default_rng(0)
q = Tensor(rng.standard_normal((2, 100, 8 * 64)).astype(np.float16))
k = Tensor(rng.standard_normal((2, 100, 2 * 64)).astype(np.float16))
v = Tensor(rng.standard_normal((2, 100, 2 * 64)).astype(np.float16))
mask = Tensor(np.triu(np.ones((2048, 2048), dtype=np.uint8), 1))
out = attention_block(q, k, v, 8, mask)
ref = reference.prompt_flash_attention(q, k, v, mask, None, None, None, None, None, None, None,
                                       None, 8, 1.0 / 8.0, 2147483647, 0, 'BSH', 2, 3)
err = np.abs(out.astype(np.float64) - ref).max()
print(f"output {out.shape} {out.dtype}; max |error| vs reference {err:.1e}")
assert err < 2e-3
print("OK")
