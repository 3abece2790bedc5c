"""int8 quantization: a float32 attention problem quantized per tensor, run through the
int8 -> float16 and int8 -> int8 pipelines (and float32 -> int8), compared with the float32
result and checked against the reference."""
import numpy as np

from pfa_numba import prompt_flash_attention, reference, trans_quant_param

rng = np.random.default_rng(0)
B, N, S, D = 1, 8, 256, 64
q, k, v = (rng.standard_normal((B, N, S, D)).astype(np.float32) for _ in range(3))
scale = 1 / np.sqrt(D)
mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
common = dict(num_heads=N, input_layout="BNSD", scale_value=scale, sparse_mode=3)

exact = prompt_flash_attention(q, k, v, mask, **common)          # float32 result

# per-tensor scales chosen from the data: x ~ s_x * x8
s_q, s_k, s_v = (np.abs(x).max() / 127 for x in (q, k, v))
q8, k8, v8 = (np.clip(np.rint(x / s), -128, 127).astype(np.int8)
              for x, s in ((q, s_q), (k, s_k), (v, s_v)))
quant = dict(
    deq_scale1=trans_quant_param(np.float32(s_q * s_k)).reshape(1),  # Q.K^T back to scores
    quant_scale1=np.array([127.0], np.float32),                      # softmax weights -> int8
    deq_scale2=trans_quant_param(np.float32(s_v / 127)).reshape(1),  # P8.V8 back to values
)
out_fp16 = prompt_flash_attention(q8, k8, v8, mask, **common, **quant)
s_out = np.float32(127 / np.abs(exact).max())
out_int8 = prompt_flash_attention(q8, k8, v8, mask, **common, **quant,
                                  quant_scale2=np.array([s_out], np.float32))
out_f32_int8 = prompt_flash_attention(q, k, v, mask, **common,
                                      quant_scale2=np.array([s_out], np.float32))


def rel(x):
    return np.abs(x.astype(np.float64) - exact).max() / np.abs(exact).max()


print(f"int8 q/k/v -> float16 output : max error {rel(out_fp16):.2%} of max |output|")
print(f"int8 q/k/v -> int8 output    : max error {rel(out_int8 / s_out):.2%} (dequantized)")
print(f"float32    -> int8 output    : max error {rel(out_f32_int8 / s_out):.2%} (dequantized)")

# the kernels follow contract 'Quantization' step by step: check against the reference model
ref = reference.prompt_flash_attention(q8, k8, v8, mask, **common, **quant,
                                       quant_scale2=np.array([s_out], np.float32))
lsb = np.abs(out_int8.astype(np.int32) - ref.astype(np.int32))
print(f"int8 output vs reference: max {lsb.max()} LSB, {np.mean(lsb > 0):.3%} of elements differ")
assert lsb.max() <= 1 and rel(out_fp16) < 0.05 and rel(out_int8 / s_out) < 0.05
print("OK")
