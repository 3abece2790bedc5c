"""An int8 KV cache: keys quantized per channel (one scale per kv head and channel, symmetric),
values per token (one scale per cached row, asymmetric), dequantized by the kernels as they
load; decoded with fused_infer_attention_score, checked against the float64 reference and
against attention over the float16 cache it approximates."""
import numpy as np

from pfa_numba import fused_infer_attention_score, reference

rng = np.random.default_rng(0)
B, N, NKV, D, S = 2, 8, 2, 64, 300
key = rng.standard_normal((B, NKV, S, D)).astype(np.float16)
value = rng.standard_normal((B, NKV, S, D)).astype(np.float16)
query = rng.standard_normal((B, N, 1, D)).astype(np.float16)

# keys: per channel, symmetric (scale = max |k| / 127 over batches and rows)
k_scale = (np.abs(key.astype(np.float32)).max(axis=(0, 2)) / 127).astype(np.float16)  # (Nkv, D)
k8 = np.clip(np.round(key / k_scale[None, :, None, :]), -127, 127).astype(np.int8)
# values: per token, asymmetric (x = (int8 + offset) * scale), offsets shared by the kv heads
v32 = value.astype(np.float32)
lo, hi = v32.min(axis=(1, 3)), v32.max(axis=(1, 3))                               # (B, S)
v_scale = ((hi - lo) / 255).astype(np.float32)
v_offset = (-128 - lo / v_scale).astype(np.float32)
v8 = np.clip(np.round(v32 / v_scale[:, None, :, None] - v_offset[:, None, :, None]),
             -128, 127).astype(np.int8)

kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD", scale=D ** -0.5,
          key_antiquant_scale=k_scale, key_antiquant_mode=0,
          key_antiquant_offset=np.zeros_like(k_scale),      # offsets come in pairs too
          value_antiquant_scale=v_scale, value_antiquant_offset=v_offset,
          value_antiquant_mode=1, actual_seq_lengths_kv=[S, 180], softmax_lse_flag=True)
out, lse = fused_infer_attention_score(query, k8, v8, **kw)
ref, _ = reference.fused_infer_attention_score(query, k8, v8, **kw)
err = np.abs(out.astype(np.float64) - ref).max()
print(f"int8 cache: max |kernel - reference| = {err:.1e}")
assert err < 2e-3, err

plain = dict(kw)
for name in ("key_antiquant_scale", "key_antiquant_mode", "key_antiquant_offset",
             "value_antiquant_scale", "value_antiquant_offset", "value_antiquant_mode"):
    plain.pop(name)
exact, _ = fused_infer_attention_score(query, key, value, **plain)
q_err = np.abs(out.astype(np.float32) - exact.astype(np.float32)).max()
print(f"against the float16 cache it stands for: max |difference| = {q_err:.1e} "
      f"({k8.nbytes + v8.nbytes} bytes of cache instead of {key.nbytes + value.nbytes})")
assert q_err < 0.1, q_err          # int8 rounding of K and V, not a kernel error
print("OK")
