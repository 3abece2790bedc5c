"""PfaPlan: a prompt_flash_attention call planned once and run on other layers' query, key and
value: what the whole call gives (bit for bit, and within the reference's bound), its errors,
the arguments it keeps and those it reads at each call."""
import numpy as np
import pytest

from pfa_numba import PfaPlan, prompt_flash_attention as pfa
from _cases import assert_matches_reference

B, N, NKV, SQ, SKV, D = 2, 4, 2, 37, 53, 64


def _layer(seed, dtype=np.float16, layout="BNSD"):
    rng = np.random.default_rng(seed)
    shapes = {"BNSD": ((B, N, SQ, D), (B, NKV, SKV, D)),
              "BSH": ((B, SQ, N * D), (B, SKV, NKV * D))}[layout]
    return tuple(rng.standard_normal(s).astype(np.float32).astype(dtype)
                 for s in (shapes[0], shapes[1], shapes[1]))


def _same(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("layout, mode", [("BNSD", 0), ("BSH", 3), ("BNSD", 4)])
def test_layers_through_a_plan_are_the_whole_calls(layout, mode):
    mask = np.triu(np.ones((2048, 2048), bool), 1) if mode else None
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout=layout, scale_value=D ** -0.5,
              sparse_mode=mode, pre_tokens=20, next_tokens=5, actual_seq_lengths=[SQ, 30],
              return_softmax_lse=True)
    plan = PfaPlan(*_layer(0, layout=layout), mask, **kw)
    assert plan._launch is not None
    for seed in (1, 2, 3):
        q, k, v = _layer(seed, layout=layout)
        out, lse = plan(q, k, v)
        want, want_lse = pfa(q, k, v, mask, **kw)
        assert _same(out, want) and np.array_equal(lse, want_lse)
        args = dict(kw)
        del args["return_softmax_lse"]
        assert_matches_reference(out, (q, k, v, mask), args, np.dtype(np.float16), lse=lse)


def test_positional_arguments_and_the_output_alone():
    q, k, v = _layer(4, np.float32)
    args = (None, None, None, None, None, None, None, None, None, N, 0.125, 2147483647, 0,
            "BNSD", NKV)
    plan = PfaPlan(q, k, v, *args)
    q2, k2, v2 = _layer(5, np.float32)
    assert _same(plan(q2, k2, v2), pfa(q2, k2, v2, *args))


def test_masks_are_read_at_each_call_lengths_as_planned():
    q, k, v = _layer(6)
    mask = np.zeros((B, SQ, SKV), bool)
    lens = [SQ, 20]
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD", sparse_mode=0)
    plan = PfaPlan(q, k, v, mask, lens, **kw)
    want = pfa(q, k, v, mask, [SQ, 20], **kw)
    lens[1] = 3
    mask[:, :, :10] = True
    assert _same(plan(q, k, v), pfa(q, k, v, mask, [SQ, 20], **kw))
    assert not _same(plan(q, k, v), want)


def test_torch_tensors():
    torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD")
    plan = PfaPlan(*(torch.from_numpy(x) for x in _layer(7)), **kw)
    layer = [torch.from_numpy(x) for x in _layer(8)]
    out = plan(*layer)
    assert isinstance(out, torch.Tensor) and torch.equal(out, pfa(*layer, **kw))


def test_errors_and_whole_calls():
    q, k, v = _layer(9)
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD")
    with pytest.raises(TypeError, match="PfaPlan takes prompt_flash_attention's arguments"):
        PfaPlan(q, k, v, not_an_arg=1)
    with pytest.raises(RuntimeError, match="num_heads"):
        PfaPlan(q, k, v, num_heads=3, input_layout="BNSD")
    plan = PfaPlan(q, k, v, **kw)
    with pytest.raises(TypeError, match="query must be a float16 NumPy array .* got a float32"):
        plan(q.astype(np.float32), k, v)
    with pytest.raises(RuntimeError, match="key must be .* shape .* got .* shape"):
        plan(q, k[:, :, :-1], v)
    # the planned strides from other memory: a misaligned copy runs a whole call
    words = k.size + 1
    odd = np.zeros(2 * words + 1, np.uint8)[1:].view(np.float16)[:k.size].reshape(k.shape)
    odd[...] = k
    assert not odd.flags.aligned
    assert _same(plan(q, odd, v), pfa(q, k, v, **kw))
