"""A paged KV cache, as a serving stack keeps one: a pool of fixed-size blocks, a block table
per sequence, tokens appended one at a time, and a decode step of fused_infer_attention_score
after each, checked against the float64 reference and against the same cache laid out
contiguously."""
import numpy as np

from pfa_numba import fused_infer_attention_score, reference

rng = np.random.default_rng(0)
N, NKV, D, BLOCK = 8, 2, 64, 16
NUM_BLOCKS, MAX_BLOCKS = 64, 8                  # the pool, and the table's columns
prompts = [37, 5, 70]                           # three sequences of different lengths

# the pool starts as garbage (NaN): only the slots a table names are ever read
key_pool = np.full((NUM_BLOCKS, NKV, BLOCK, D), np.nan, np.float16)
value_pool = np.full((NUM_BLOCKS, NKV, BLOCK, D), np.nan, np.float16)
free = list(rng.permutation(NUM_BLOCKS))        # blocks are handed out in any order
table = np.full((len(prompts), MAX_BLOCKS), -1, np.int32)
lengths = [0] * len(prompts)


def append(b, k, v):
    """Write one token's key and value (Nkv, D) for sequence b, taking a block when needed."""
    t = lengths[b]
    if t % BLOCK == 0:
        table[b, t // BLOCK] = free.pop()
    blk = table[b, t // BLOCK]
    key_pool[blk, :, t % BLOCK], value_pool[blk, :, t % BLOCK] = k, v
    lengths[b] += 1


history = [[] for _ in prompts]                 # the same tokens, kept contiguously
for b, n in enumerate(prompts):
    for _ in range(n):
        k, v = rng.standard_normal((2, NKV, D)).astype(np.float16)
        append(b, k, v)
        history[b].append((k, v))

for step in range(3):
    for b in range(len(prompts)):               # every sequence gets its next token
        k, v = rng.standard_normal((2, NKV, D)).astype(np.float16)
        append(b, k, v)
        history[b].append((k, v))
    query = rng.standard_normal((len(prompts), N, 1, D)).astype(np.float16)
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD", scale=D ** -0.5,
              actual_seq_lengths_kv=list(lengths), softmax_lse_flag=True)
    out, lse = fused_infer_attention_score(query, key_pool, value_pool, block_table=table,
                                           block_size=BLOCK, **kw)
    ref, _ = reference.fused_infer_attention_score(query, key_pool, value_pool,
                                                   block_table=table, block_size=BLOCK, **kw)
    # the same cache, contiguous and padded to the longest sequence
    S = max(lengths)
    kc = np.zeros((len(prompts), NKV, S, D), np.float16)
    vc = np.zeros_like(kc)
    for b, tokens in enumerate(history):
        kc[b, :, :len(tokens)] = np.stack([k for k, _ in tokens], axis=1)
        vc[b, :, :len(tokens)] = np.stack([v for _, v in tokens], axis=1)
    contiguous, _ = fused_infer_attention_score(query, kc, vc, **kw)
    err = np.abs(out.astype(np.float64) - ref).max()
    print(f"step {step}: lengths {lengths}, blocks in use {int((table >= 0).sum())}, "
          f"max |kernel - reference| = {err:.1e}")
    assert np.isfinite(out).all() and err < 2e-3, err
    assert np.array_equal(out, contiguous), "paged and contiguous caches differ"
print("OK")
