"""Scale-out on Dask: one call's key/value range (sequence parallelism) and its batch, split
across the workers of a ``dask.distributed`` client and merged exactly with softmax_lse.

    from dask.distributed import Client, LocalCluster
    from pfa_numba import distributed

    with Client(LocalCluster(n_workers=2)) as client:
        out = distributed.prompt_flash_attention(client, q, k, v, mask, num_heads=16,
                                                 input_layout="BNSD", sparse_mode=3,
                                                 kv_splits=4, batch_splits=1)

Every part is an ordinary ``pfa_numba.prompt_flash_attention`` call on a worker over a slice of
the kv range (and of the batch) with ``return_softmax_lse=True``; the band of each sparse mode
is re-expressed in the part's coordinates (sparse modes 2, 3 and 4 through mode 4's
bottom-right anchor, user masks sliced), and :func:`pfa_numba.merge_attention` combines the
parts. The result equals the single call up to the output dtype's rounding for every row with
kept mass (rows that keep nothing anywhere are zeros, as with ``inner_precise`` 2/3). If a
worker fails, the call raises RuntimeError and returns nothing. Install with the
``distributed`` extra (``dask[distributed]``). Supports NumPy inputs, float dtypes, the padded
layouts (not TND), no quantization.
"""
import numpy as np

from .frontend import checks

from .frontend import pfa as PV
from .numerics.band import TOKENS_INF as INF, reads_user_mask, shifted_edges, tokens_for_edges
from .api import prompt_flash_attention as _pfa
from .merge import merge_attention


def _part(q, k, v, mask, qlens, klens, pse, kwargs):
    """One part on a worker: a plain call with softmax_lse."""
    return _pfa(q, k, v, mask, qlens, klens, pse, **kwargs, return_softmax_lse=True)


def _kv_axis(layout):
    return 1 if layout in ("BSH", "BSND") else 2


def _take(x, axis, a, e):
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(a, e)
    return x[tuple(idx)]


def prompt_flash_attention(client, query, key, value, attn_mask=None, actual_seq_lengths=None,
                           actual_seq_lengths_kv=None, pse_shift=None, *, num_heads=1,
                           scale_value=1.0, pre_tokens=INF, next_tokens=0, input_layout="BSH",
                           num_key_value_heads=0, sparse_mode=0, inner_precise=1,
                           kv_splits=2, batch_splits=1, return_softmax_lse=False):
    """``pfa_numba.prompt_flash_attention`` computed on a Dask cluster (see the module doc).

    ``kv_splits`` parts of the kv range times ``batch_splits`` batch chunks run as separate
    tasks. Arguments are validated by a local planning pass first, so bad input fails here,
    not on a worker.
    """
    layout = checks.check_layout(input_layout)
    if layout == "TND":
        raise ValueError("input_layout 'TND' is not supported by pfa_numba.distributed; split "
                         "packed batches by sequence instead")
    kv_splits = checks.check_int("kv_splits", kv_splits)
    batch_splits = checks.check_int("batch_splits", batch_splits)
    if kv_splits < 1 or batch_splits < 1:
        raise ValueError(f"kv_splits and batch_splits must be >= 1, got {kv_splits} and "
                         f"{batch_splits}")
    from .frontend.problem import plan
    p = plan(PV.validate(PV.Call(query, key, value, attn_mask=attn_mask,
                               actual_seq_lengths=actual_seq_lengths,
                               actual_seq_lengths_kv=actual_seq_lengths_kv,
                               pse_shift=pse_shift, num_heads=num_heads,
                               scale_value=scale_value, pre_tokens=pre_tokens,
                               next_tokens=next_tokens, input_layout=input_layout,
                               num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
                               inner_precise=inner_precise)))
    B, Sq, Skv = p.B, p.Sq, p.Skv
    qlen, klen = p.qlen, p.klen
    axis_q = _kv_axis(layout)
    band_mask = np.triu(np.ones((2048, 2048), bool), 1)
    user_mask = reads_user_mask(sparse_mode, attn_mask is not None)

    # batch chunks; modes 2-4 re-anchor the band per part, which needs one (qL, kL) per chunk:
    # chunks whose batches differ in length are split into single batches
    chunks = [c for c in np.array_split(np.arange(B), min(batch_splits, max(B, 1))) if c.size]
    if sparse_mode in (2, 3, 4):
        fine = []
        for c in chunks:
            same = np.all(klen[c] == klen[c[0]]) and np.all(qlen[c] == qlen[c[0]])
            fine.extend([c] if same else [np.array([b]) for b in c])
        chunks = fine

    common = dict(num_heads=num_heads, scale_value=scale_value, input_layout=layout,
                  num_key_value_heads=num_key_value_heads, inner_precise=inner_precise)
    cuts = np.linspace(0, Skv, min(kv_splits, max(Skv, 1)) + 1).astype(int)
    futures = []
    for c in chunks:
        b0, b1 = int(c[0]), int(c[-1]) + 1
        q_c = query[b0:b1]
        q_ref = client.scatter(q_c)
        chunk_futures = []
        for a, e in zip(cuts[:-1], cuts[1:]):
            k_p = _take(key[b0:b1], axis_q, a, e)
            v_p = _take(value[b0:b1], axis_q, a, e)
            kl_p = np.clip(klen[b0:b1] - a, 0, e - a)
            kw = dict(common, sparse_mode=sparse_mode)
            mask_p = None
            # the chunk's band in part coordinates j - a, as tokens of mode 0 (user masks) or
            # of mode 4 (modes 2-4: anchored at the part's own (qL, kL'))
            edges = shifted_edges(int(p.pre_e[b0]), int(p.next_e[b0]), int(a))
            if user_mask:
                m = attn_mask
                m = m[b0:b1] if m.ndim >= 3 and m.shape[0] == B and B > 1 else m
                mask_p = m[..., :Sq, a:e]
                if sparse_mode == 0:
                    pre_p, next_p = tokens_for_edges(*edges, 0)
                    kw.update(pre_tokens=pre_p, next_tokens=next_p)
            elif sparse_mode in (2, 3, 4):
                pre_p, next_p = tokens_for_edges(*edges, int(kl_p[0] - qlen[b0]))
                kw.update(sparse_mode=4, pre_tokens=pre_p, next_tokens=next_p)
                mask_p = band_mask
            pse_p = None if pse_shift is None else \
                (pse_shift[b0:b1] if pse_shift.shape[0] == B and B > 1 else pse_shift)[..., :Sq, a:e]
            chunk_futures.append(((b0, b1, a, e), client.submit(
                _part, q_ref, k_p, v_p, mask_p, qlen[b0:b1], kl_p, pse_p, kw, pure=False)))
        futures.append(chunk_futures)

    outs, lses = [], []
    for chunk_futures in futures:
        parts = []
        for (b0, b1, a, e), fut in chunk_futures:
            try:
                parts.append(fut.result())
            except Exception as exc:
                for _, f in (x for cf in futures for x in cf):
                    f.cancel()
                raise RuntimeError(f"pfa_numba.distributed: the part for batch {b0}:{b1}, kv "
                                   f"{a}:{e} failed on a worker: {type(exc).__name__}: {exc}; "
                                   f"no result is returned") from exc
        out, lse = merge_attention(parts, input_layout=layout)
        outs.append(out)
        lses.append(lse)
    out = np.concatenate(outs, axis=0) if outs else np.zeros(p.out_shape, p.out_dtype)
    lse = np.concatenate(lses, axis=0) if lses else np.full(p.lse_shape, -np.inf, np.float32)
    return (out, lse) if return_softmax_lse else out
