"""Packed variable-length batches (input_layout 'TND'): sequences of very different lengths
in one (T, N, D) tensor, no padding, against the same batch padded to its longest sequence."""
import time

import numpy as np

from pfa_numba import prompt_flash_attention, reference

rng = np.random.default_rng(0)
N, D = 8, 64
lengths = np.array([2048, 64, 300, 17, 1000, 5, 700])
ends = np.cumsum(lengths)
T = int(ends[-1])
q, k, v = (rng.standard_normal((T, N, D)).astype(np.float16) for _ in range(3))
mask = np.triu(np.ones((2048, 2048), dtype=bool), 1)
kw = dict(num_heads=N, scale_value=D ** -0.5, sparse_mode=3)


def timed(fn, repeats=3):
    fn()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


packed = prompt_flash_attention(q, k, v, mask, ends, ends, input_layout="TND", **kw)
t_packed = timed(lambda: prompt_flash_attention(q, k, v, mask, ends, ends, input_layout="TND",
                                                **kw))

# the same batch padded to the longest sequence (B, N, Smax, D)
B, S = len(lengths), int(lengths.max())
starts = ends - lengths
pad = [np.zeros((B, N, S, D), np.float16) for _ in range(3)]
for b, (s0, n) in enumerate(zip(starts, lengths)):
    for p, x in zip(pad, (q, k, v)):
        p[b, :, :n] = x[s0:s0 + n].transpose(1, 0, 2)
t_padded = timed(lambda: prompt_flash_attention(*pad, mask, None, None, input_layout="BNSD",
                                                **kw))
padded_lens = timed(lambda: prompt_flash_attention(*pad, mask, lengths, lengths,
                                                   input_layout="BNSD", **kw))
print(f"{B} sequences, {T} tokens (padded: {B * S}):")
print(f"  TND packed                 {t_packed * 1e3:7.1f} ms")
print(f"  BNSD padded, full lengths  {t_padded * 1e3:7.1f} ms  ({t_padded / t_packed:.1f}x)")
print(f"  BNSD padded + actual lens  {padded_lens * 1e3:7.1f} ms  ({padded_lens / t_packed:.1f}x)")

# packed equals each sequence computed alone
err = 0.0
for s0, n in zip(starts, lengths):
    ref = reference.prompt_flash_attention(q[s0:s0 + n], k[s0:s0 + n], v[s0:s0 + n], mask,
                                           [n], [n], input_layout="TND", **kw)
    err = max(err, float(np.abs(packed[s0:s0 + n].astype(np.float64) - ref).max()))
print(f"max |packed - reference per sequence| = {err:.1e}")
assert err < 2e-3
print("OK")
