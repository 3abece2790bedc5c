"""fused_infer_attention_score's own errors (docs/fia.md, 'Errors'): one case a rule, the type
and the words the message must hold; and what decode ignores."""
import numpy as np
import pytest

from pfa_numba import fused_infer_attention_score as fia

B, N, NKV, D = 2, 4, 2, 16


def _base(sq=1, **kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, N, sq, D)).astype(np.float16)
    k = rng.standard_normal((B, NKV, 24, D)).astype(np.float16)
    return (q, k, k.copy()), dict(dict(num_heads=N, num_key_value_heads=NKV,
                                       input_layout="BNSD"), **kw)


def _pool(layout="BNSD", nb=6, bs=4):
    pool = np.zeros((nb, NKV, bs, D), np.float16)
    return pool if layout == "BNSD" else pool.transpose(0, 2, 1, 3).reshape(nb, bs, NKV * D)


TABLE = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
PAGED = dict(block_table=TABLE, block_size=4, actual_seq_lengths_kv=[12, 5])
PREFIX = dict(key_shared_prefix=np.zeros((1, NKV, 3, D), np.float16),
              value_shared_prefix=np.zeros((1, NKV, 3, D), np.float16))
QUANT = dict(dequant_scale1=np.ones(1, np.float32), quant_scale1=np.ones(1, np.float32),
             dequant_scale2=np.ones(1, np.float32))

CASES = {
    # name: (call changes, error type, words in the message)
    "lse flag not bool": (dict(softmax_lse_flag=1), TypeError, "softmax_lse_flag"),
    "block_size bool": (dict(block_size=True), TypeError, "block_size"),
    "antiquant_mode str": (dict(antiquant_mode="0"), TypeError, "antiquant_mode"),
    "scale complex": (dict(scale=1j), TypeError, "scale"),
    "scale nan": (dict(scale=float("nan")), ValueError, "scale"),
    "float16 mask": (dict(atten_mask=np.zeros((B, 24), np.float16)), TypeError, "float16"),
    "decode mask rank 3, middle not 1": (dict(atten_mask=np.zeros((B, 2, 24), bool)),
                                         RuntimeError, "decode"),
    "decode mask too short": (dict(atten_mask=np.zeros((B, 10), bool)), RuntimeError,
                              r"atten_mask shape \(2, 10\) .* decode"),
    "decode mask batch": (dict(atten_mask=np.zeros((3, 24), bool)), RuntimeError,
                          r"atten_mask shape \(3, 24\) .* decode"),
    "int32 mask": (dict(atten_mask=np.zeros((B, 24), np.int32)), TypeError, "atten_mask.*int32"),
    "prefill float16 mask": (dict(sq=3, atten_mask=np.zeros((3, 24), np.float16)), TypeError,
                             "atten_mask.*float16"),
    "prefill mask named as FIA's": (dict(sq=3, sparse_mode=2), RuntimeError,
                                    "requires atten_mask"),
    "prefill mask shape": (dict(sq=3, atten_mask=np.zeros((3, 5), bool)), RuntimeError,
                           "atten_mask shape"),
    "dequant_scale1 named as FIA's": (dict(dequant_scale1=np.ones(1, np.float32)),
                                      RuntimeError, "dequant_scale1"),
    "prefill sparse_mode 5": (dict(sq=3, sparse_mode=5), RuntimeError, "sparse_mode"),
    "decode inner_precise 4": (dict(inner_precise=4), RuntimeError, "inner_precise"),
    "prefill inner_precise 4": (dict(sq=3, inner_precise=4), RuntimeError, "inner_precise"),
    "prefill band signs": (dict(sq=3, atten_mask=np.zeros((3, 24), bool), pre_tokens=-3,
                                next_tokens=1), RuntimeError, "pre_tokens"),
    "prefill lengths count": (dict(sq=3, actual_seq_lengths=[1, 2, 3]), ValueError,
                              "actual_seq_lengths"),
    "kv length past the cache": (dict(actual_seq_lengths_kv=[5, 70]), ValueError,
                                 r"actual_seq_lengths_kv\[1\] = 70"),
    "key / value dtypes differ": (dict(kv="value float32"), TypeError, "value dtype"),
    "query padding two values": (dict(sq=3, query_padding_size=np.array([1, 2])),
                                 RuntimeError, "query_padding_size"),
    "query padding float": (dict(sq=3, query_padding_size=np.array([1.0])), TypeError,
                            "query_padding_size"),
    "padding float": (dict(kv_padding_size=np.array([1.0])), TypeError, "kv_padding_size"),
    "padding two values": (dict(kv_padding_size=np.array([1, 2])), RuntimeError,
                           "kv_padding_size"),
    "table float": (dict(PAGED, block_table=TABLE.astype(np.float32), paged=True), TypeError,
                    "block_table"),
    "table rows": (dict(PAGED, block_table=TABLE[:1], paged=True), RuntimeError, "block_table"),
    "block_size 0": (dict(PAGED, block_size=0, paged=True), RuntimeError, "block_size"),
    "block axis": (dict(PAGED, block_size=2, paged=True), RuntimeError, "block axis"),
    "paged without lengths": (dict(PAGED, actual_seq_lengths_kv=None, paged=True), ValueError,
                              "actual_seq_lengths_kv"),
    "paged length past the table": (dict(PAGED, actual_seq_lengths_kv=[13, 5], paged=True),
                                    ValueError, "actual_seq_lengths_kv"),
    "block id past the pool": (dict(PAGED, block_table=np.array([[0, 1, 9], [3, 4, 5]]),
                                    paged=True), ValueError, "block"),
    "negative block id": (dict(PAGED, block_table=np.array([[0, -1, 2], [3, 4, 5]]),
                               paged=True), ValueError, "block -1"),
    "table 1-D": (dict(PAGED, block_table=TABLE[0], paged=True), RuntimeError, "block_table"),
    "pool rank 2": (dict(PAGED, paged="rank 2"), RuntimeError, "num_blocks"),
    "pool shapes differ": (dict(PAGED, paged="shapes differ"), RuntimeError,
                           "pool shapes differ"),
    "3-D pool Hkv not Nkv * D": (dict(PAGED, paged="hkv 40"), RuntimeError, "Hkv"),
    "paged with an int8 query": (dict(PAGED, paged=True, kv="int8 query"), RuntimeError,
                                 "int8 query"),
    "4-d pool with BSH": (dict(PAGED, paged="4-d with BSH"), RuntimeError, "4-D"),
    "paged with padding": (dict(PAGED, kv_padding_size=np.array([1]), paged=True),
                           RuntimeError, "left padding"),
    "prefix alone": (dict(key_shared_prefix=np.zeros((1, NKV, 3, D), np.float16)),
                     RuntimeError, "value_shared_prefix"),
    "prefix dtype": (dict(key_shared_prefix=np.zeros((1, NKV, 3, D), np.float32),
                          value_shared_prefix=np.zeros((1, NKV, 3, D), np.float32)),
                     TypeError, "key_shared_prefix"),
    "prefix batch 2": (dict(key_shared_prefix=np.zeros((2, NKV, 3, D), np.float16),
                            value_shared_prefix=np.zeros((2, NKV, 3, D), np.float16)),
                       RuntimeError, "batch 1"),
    "prefix length": (dict(PREFIX, actual_shared_prefix_len=4), ValueError,
                      "actual_shared_prefix_len"),
    "prefix length negative": (dict(PREFIX, actual_shared_prefix_len=-1), ValueError,
                               "actual_shared_prefix_len"),
    "prefix length float": (dict(PREFIX, actual_shared_prefix_len=1.0), ValueError,
                            "actual_shared_prefix_len"),
    "prefix length bool": (dict(PREFIX, actual_shared_prefix_len=True), ValueError,
                           "actual_shared_prefix_len"),
    "prefix length two values": (dict(PREFIX, actual_shared_prefix_len=[1, 2]), ValueError,
                                 "actual_shared_prefix_len"),
    "prefix heads": (dict(key_shared_prefix=np.zeros((1, 1, 3, D), np.float16),
                          value_shared_prefix=np.zeros((1, 1, 3, D), np.float16)),
                     RuntimeError, "heads"),
    "prefix with paged": (dict(PREFIX, **PAGED, paged=True), RuntimeError, "shared prefix"),
    "prefix with an int8 query": (dict(PREFIX, kv="int8 query"), RuntimeError, "int8 query"),
    "prefix with padding": (dict(key_shared_prefix=np.zeros((1, NKV, 3, D), np.float16),
                                 value_shared_prefix=np.zeros((1, NKV, 3, D), np.float16),
                                 kv_padding_size=np.array([1])), RuntimeError, "left padding"),
    "heads from PFA's rules": (dict(num_heads=3), RuntimeError, "num_heads"),
    # dtypes come before the rules of the features they select (docs/fia.md, 'Errors')
    "int8 key with a float value": (dict(kv="int8 key", antiquant_scale=np.ones(2, np.float16)),
                                    TypeError, "value dtype must be key's"),
    "int8 key with a float value, no scales": (dict(kv="int8 key"), TypeError, "value dtype"),
    "int32 query with an int8 cache": (dict(kv="int32 query"), TypeError, "query dtype.*int32"),
    "uint8 query with an int8 cache": (dict(kv="uint8 query"), TypeError, "query dtype.*uint8"),
    "float64 query with an int8 cache": (dict(kv="float64 query"), TypeError,
                                         "query dtype.*float64"),
    "float32 key under a float16 query": (dict(kv="float32 kv"), TypeError, "key dtype"),
    "value rank with a prefix": (dict(PREFIX, kv="value rank 2"), ValueError,
                                 "value must have rank 4"),
    "value rank with an int8 cache": (dict(kv="int8 value rank 2",
                                           antiquant_scale=np.ones(2, np.float16)), ValueError,
                                      "value must have rank 4"),
    "prefix with padding names both": (dict(PREFIX, kv_padding_size=np.array([1])),
                                       RuntimeError, "key_shared_prefix.*kv_padding_size"),
    "paged with padding names both": (dict(PAGED, query_padding_size=np.array([1]), sq=3,
                                           paged=True), RuntimeError,
                                      "block_table.*query_padding_size"),
    # the pool's own rules come before a decode mask's, which the pool's extent sizes
    "block axis with a decode mask": (dict(PAGED, block_size=5, atten_mask=np.zeros((B, 12), bool),
                                           paged=True), RuntimeError,
                                      r"block axis \(4\) must equal block_size \(5\)"),
    "zero-stride pools of 2^62 values": (dict(PAGED, block_size=1 << 31, paged="2^62"),
                                         RuntimeError, "block_table.*block_size.*2\\^62"),
}

LISTS = {
    # name: (key list, value list, error type, words)
    "one of two lists": ("k2", "v", RuntimeError, "both be lists"),
    "wrong count": ("k3", "v3", RuntimeError, "one tensor a batch"),
    "element batch 2": ("kb2", "vb2", RuntimeError, "batch 1"),
    "element heads": ("kh", "vh", RuntimeError, "heads"),
    "key/value shapes": ("k2", "vs", RuntimeError, "shapes differ"),
    "element dtype": ("kd", "vd", TypeError, "dtype"),
}


@pytest.mark.parametrize("name", list(LISTS))
def test_list_rule(name):
    kname, vname, error, words = LISTS[name]
    (q, k, v), kw = _base()
    e = k[:1]
    lists = {"k2": [e, e], "v": v, "k3": [e, e, e], "v3": [e, e, e], "kb2": [k, k],
             "vb2": [k, k], "kh": [e, e[:, :1]], "vh": [e, e[:, :1]], "vs": [e, e[:, :, :5]],
             "kd": [e, e.astype(np.float32)], "vd": [e, e.astype(np.float32)]}
    with pytest.raises(error, match=words):
        fia(q, lists[kname], lists[vname], **kw)


def test_list_length_past_its_element():
    (q, k, v), kw = _base()
    with pytest.raises(ValueError, match="exceeds"):
        fia(q, [k[:1], k[1:, :, :5]], [v[:1], v[1:, :, :5]], actual_seq_lengths_kv=[3, 6], **kw)


def _pools(kind):
    """The key and value block pools of a CASES entry's ``paged`` kind."""
    pool = _pool()
    huge = np.broadcast_to(np.zeros((), np.float16), (6, 1 << 31, NKV * D))
    return {True: (pool, pool), "4-d with BSH": (pool, pool),
            "rank 2": (pool.reshape(-1, D),) * 2, "shapes differ": (pool, pool[:5]),
            "hkv 40": (np.zeros((6, 4, 40), np.float16),) * 2, "2^62": (huge, huge)}[kind]


def _case_arrays(changes):
    """(q, k, v) and the keywords of a CASES entry; ``sq``: the query length (1: decode),
    ``paged``: pools (see _pools), ``kv``: int8 key/value with an int8 query, or a float32
    value."""
    changes = dict(changes)
    paged, kv = changes.pop("paged", False), changes.pop("kv", None)
    (q, k, v), kw = _base(sq=changes.pop("sq", 1), **changes)
    if paged:
        k, v = _pools(paged)
        if paged == "2^62":
            kw["block_table"] = np.broadcast_to(np.zeros((), np.int32), (B, 1 << 31))
        if paged == "4-d with BSH":
            q = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B, 1, N * D))
            kw["input_layout"] = "BSH"
    if kv == "int8 query":
        q, k, v = (x.astype(np.int8) for x in (q, k, v))
        kw.update(QUANT)
    elif kv == "value float32":
        v = v.astype(np.float32)
    elif kv == "int8 key":
        k = k.astype(np.int8)
    elif kv in ("int32 query", "uint8 query", "float64 query"):
        q, k, v = q.astype(kv.split()[0]), k.astype(np.int8), v.astype(np.int8)
    elif kv == "float32 kv":
        k, v = k.astype(np.float32), v.astype(np.float32)
    elif kv == "value rank 2":
        v = v[0, 0]
    elif kv == "int8 value rank 2":
        k, v = k.astype(np.int8), v[0, 0].astype(np.int8)
    return (q, k, v), kw


def _snapshot(args, kw):
    """(array, copy) of the writeable arrays (a read-only broadcast view cannot be written)."""
    return [(x, x.copy()) for x in list(args) + list(kw.values())
            if isinstance(x, np.ndarray) and x.flags.writeable]


@pytest.mark.parametrize("name", list(CASES))
def test_rule(name):
    """The error, and no input written into on the way (docs/fia.md, 'Errors')."""
    changes, error, words = CASES[name]
    (q, k, v), kw = _case_arrays(changes)
    before = _snapshot((q, k, v), kw)
    with pytest.raises(error, match=words):
        fia(q, k, v, **kw)
    assert all(np.array_equal(x, copy, equal_nan=True) for x, copy in before)


def test_a_fourth_positional_argument_is_pythons_type_error():
    (q, k, v), kw = _base()
    with pytest.raises(TypeError):
        fia(q, k, v, None, **kw)


def test_decode_ignores_what_it_does_not_read():
    """Any sparse_mode, pre/next tokens, query lengths and query padding run in decode."""
    (q, k, v), kw = _base()
    want, _ = fia(q, k, v, **kw)
    got, _ = fia(q, k, v, **kw, sparse_mode=7, pre_tokens=-9, next_tokens=-9,
                 actual_seq_lengths=[99], query_padding_size="anything")
    assert np.array_equal(got, want)


def test_padding_with_a_mask_ignores_the_band():
    """Left padding (given, active or not) with sparse_mode 0 and a mask reads no pre/next:
    signs that would leave an empty band run (docs/fia.md, 'Left padding'); they stay ints."""
    (q, k, v), kw = _base(sq=3)
    kw.update(atten_mask=np.zeros((3, 24), bool), kv_padding_size=np.array([0]))
    want, _ = fia(q, k, v, **kw)
    got, _ = fia(q, k, v, **kw, pre_tokens=-3, next_tokens=1)
    assert np.array_equal(got, want)
    with pytest.raises(TypeError, match="pre_tokens"):
        fia(q, k, v, **kw, pre_tokens=-3.0)


def test_padding_beyond_any_frame_leaves_the_window_empty():
    """A uint64 padding size past int64: the window does not fit, zeros and lse -inf."""
    (q, k, v), kw = _base()
    out, lse = fia(q, k, v, **kw, kv_padding_size=np.array([2 ** 64 - 1], np.uint64),
                   actual_seq_lengths_kv=[5, 6], softmax_lse_flag=True)
    assert not out.any() and np.all(lse == -np.inf)


def test_tnd_takes_none_of_the_cache_features():
    """TND with int8 key/value and antiquant scales, paging, padding, lists or a prefix."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, N, D)).astype(np.float16)
    k = rng.standard_normal((7, NKV, D)).astype(np.float16)
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="TND",
              actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[3, 7])
    k8 = k.astype(np.int8)
    for args, extra in (((k8, k8), dict(antiquant_scale=S16)),
                        ((k8, k8), dict(key_antiquant_scale=S1, value_antiquant_scale=S1)),
                        ((k, k), dict(kv_padding_size=np.array([1]))),
                        ((k, k), dict(key_shared_prefix=k[None, :2],
                                      value_shared_prefix=k[None, :2])),
                        (([k[None, :3], k[None, 3:]],) * 2, {})):
        with pytest.raises(RuntimeError, match="TND"):
            fia(q, *args, **kw, **extra)


def test_padding_without_its_lengths_is_ignored():
    (q, k, v), kw = _base()
    want, _ = fia(q, k, v, **kw)
    got, _ = fia(q, k, v, **kw, kv_padding_size=np.array([5]))
    assert np.array_equal(got, want)


S1, S16, S32 = np.ones(1, np.float16), np.ones(2, np.float16), np.ones((B, 24), np.float32)
AQ = {
    # name: (keywords, int8 key/value, error type, words)
    "int8 kv without scales": ({}, True, RuntimeError, "need antiquant scales"),
    "scales with float kv": (dict(antiquant_scale=S16), False, RuntimeError, "int8 key/value"),
    "merged mode 2": (dict(antiquant_scale=S16, antiquant_mode=2), True, RuntimeError,
                      "antiquant_mode"),
    "merged offset dtype": (dict(antiquant_scale=S16, antiquant_offset=S16.astype(np.float32)),
                            True, TypeError, "antiquant_offset"),
    "merged offset shape": (dict(antiquant_scale=S16, antiquant_offset=np.ones(3, np.float16)),
                            True, RuntimeError, "antiquant_offset"),
    "offset without scale": (dict(antiquant_offset=S16), True, RuntimeError,
                             "needs antiquant_scale"),
    "merged scale dtype": (dict(antiquant_scale=S16.astype(np.float32)), True, TypeError,
                           "antiquant_scale"),
    "merged per-channel shape": (dict(antiquant_scale=np.ones((2, 3), np.float16)), True,
                                 RuntimeError, "antiquant_scale"),
    "per-token short": (dict(antiquant_scale=np.ones((2, B, 10), np.float32), antiquant_mode=1),
                        True, RuntimeError, "per token"),
    "key scale alone": (dict(key_antiquant_scale=np.ones(1, np.float16)), True, RuntimeError,
                        "value_antiquant_scale"),
    "modes differ": (dict(key_antiquant_scale=S32, value_antiquant_scale=S32,
                          key_antiquant_mode=1, value_antiquant_mode=0), True, RuntimeError,
                     "must be equal"),
    "mode 6": (dict(key_antiquant_scale=S32, value_antiquant_scale=S32, key_antiquant_mode=6,
                    value_antiquant_mode=6), True, RuntimeError, "0..5"),
    "paged mode without a table": (dict(key_antiquant_scale=np.ones((4, 4), np.float32),
                                        value_antiquant_scale=np.ones((4, 4), np.float32),
                                        key_antiquant_mode=4, value_antiquant_mode=4), True,
                                   RuntimeError, "needs a block_table"),
    "key offset without its scale, merged scale given": (
        dict(antiquant_scale=S16, key_antiquant_offset=S1, value_antiquant_offset=S1), True,
        RuntimeError, "key_antiquant_offset needs key_antiquant_scale"),
    "key offsets without scales": (dict(key_antiquant_offset=S1, value_antiquant_offset=S1),
                                   True, RuntimeError, "key_antiquant_offset needs"),
    "key offset alone": (dict(key_antiquant_scale=S1, value_antiquant_scale=S1,
                              key_antiquant_offset=S1), True, RuntimeError, "come together"),
    "key and value scale shapes": (dict(key_antiquant_scale=S1,
                                        value_antiquant_scale=np.ones(NKV * D, np.float16)),
                                   True, RuntimeError, "shapes differ"),
    "key offset dtype": (dict(key_antiquant_scale=S1, value_antiquant_scale=S1,
                              key_antiquant_offset=S1.astype(np.float32),
                              value_antiquant_offset=S1.astype(np.float32)), True, TypeError,
                         "key_antiquant_offset"),
    "per-token scales with a prefix": (dict(antiquant_scale=np.ones((2, B, 24), np.float32),
                                            antiquant_mode=1, int8_prefix=True), True,
                                       RuntimeError, "prefix"),
    "token scale float16": (dict(key_antiquant_scale=S32.astype(np.float16),
                                 value_antiquant_scale=S32.astype(np.float16),
                                 key_antiquant_mode=1, value_antiquant_mode=1), True, TypeError,
                            "float32"),
    "int8 query with antiquant": (dict(antiquant_scale=S16, int8_query=True), True,
                                  RuntimeError, "int8 query"),
}


@pytest.mark.parametrize("name", list(AQ))
def test_antiquant_rule(name):
    changes, int8_kv, error, words = AQ[name]
    changes = dict(changes)
    int8_query = changes.pop("int8_query", False)
    if changes.pop("int8_prefix", False):
        changes.update({n: x.astype(np.int8) for n, x in PREFIX.items()})
    (q, k, v), kw = _base(**changes)
    if int8_kv:
        k, v = (x.astype(np.int8) for x in (k, v))
    if int8_query:
        q = q.astype(np.int8)
        kw.update(dequant_scale1=np.ones(1, np.float32), quant_scale1=np.ones(1, np.float32),
                  dequant_scale2=np.ones(1, np.float32))
    with pytest.raises(error, match=words):
        fia(q, k, v, **kw)


def test_tensors_live_on_the_querys_device():
    class FakeCuda:
        __cuda_array_interface__ = {}
        shape = (B, N, 1, D)
    (q, k, v), kw = _base()
    with pytest.raises(RuntimeError, match="key is a host"):
        fia(FakeCuda(), k, v, **kw)
    with pytest.raises(RuntimeError, match="key_shared_prefix is a CUDA array"):
        fia(q, k, v, **kw, key_shared_prefix=FakeCuda(), value_shared_prefix=k[:1])
    keys = [k[b:b + 1] for b in range(B)]
    with pytest.raises(RuntimeError, match=r"value\[1\] is a CUDA array"):
        fia(q, keys, [keys[0], FakeCuda()] + keys[2:], **kw)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("where", ["query", "value", "kv_padding_size"])
def test_a_torch_tensor_on_another_device_is_a_runtime_error(dtype, where):
    """A tensor on torch's meta device (neither the CPU nor CUDA), named whatever its dtype."""
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    (q, k, v), kw = _base()
    args = {"query": torch.from_numpy(q).to(getattr(torch, dtype)), "key": torch.from_numpy(k),
            "value": torch.from_numpy(v), "kv_padding_size": np.array([1])}
    args["key"] = args["key"].to(args["query"].dtype)
    args["value"] = args["value"].to(args["query"].dtype)
    meta = torch.empty(tuple(args[where].shape), dtype=args[where].dtype
                       if where != "kv_padding_size" else torch.int64, device="meta")
    args[where] = meta
    with pytest.raises(RuntimeError, match=f"{where} is a torch tensor on device 'meta'"):
        fia(args.pop("query"), args.pop("key"), args.pop("value"), **kw,
            actual_seq_lengths_kv=[3, 4], **args)


@pytest.mark.parametrize("pfa_name, fia_name", [
    ("attn_mask", "atten_mask"), ("deq_scale1", "dequant_scale1"),
    ("deq_scale2", "dequant_scale2"), ("scale_value", "scale"),
    ("return_softmax_lse", "softmax_lse_flag")])
def test_a_keyword_the_other_operator_spells_names_this_ones(pfa_name, fia_name):
    """prompt_flash_attention's name of an argument FIA spells differently (and the other way
    round), given to the other operator or its plan, is a TypeError naming its own spelling."""
    from pfa_numba import FiaPlan, PfaPlan, prompt_flash_attention
    (q, k, v), kw = _base()
    calls = [(fia, pfa_name, fia_name), (FiaPlan, pfa_name, fia_name),
             (prompt_flash_attention, fia_name, pfa_name), (PfaPlan, fia_name, pfa_name)]
    for operator, given, own in calls:
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{given}': "
                                            rf"\w+ spells it '{own}'"):
            operator(q, k, v, **kw, **{given: None})
