"""Grad mode on the SDPA drop-in: its backward (pfa_numba.cpu.backward) against torch's autograd
through the eager attention written out below, in float64 on the same (rounded) inputs; the
tolerance is twice the error of that same eager attention run in the inputs' dtype."""
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")

from pfa_numba import prompt_flash_attention, scaled_dot_product_attention   # noqa: E402


def eager_attention(q, k, v, keep=None, bias=None, causal=False, scale=None, softcap=None,
                    sinks=None):
    """softmax(capped scaled scores + bias, over the kept columns and a sink) @ V, with torch's
    ops (GQA by repeating kv heads); a row keeping nothing is zeros."""
    if q.dim() >= 3:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    kept = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        kept = kept.tril()
    if keep is not None:
        kept = kept & keep
    kept = kept & (s != -torch.inf)
    any_kept = kept.any(-1, keepdim=True)
    s = torch.where(kept, s, -torch.inf)
    s = torch.where(any_kept, s, torch.zeros_like(s))       # rows keeping nothing: no NaN
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(-1, 1, 1).to(s.dtype).expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)[..., :kept.shape[-1]]
    return (p * (kept & any_kept)) @ v


def _inputs(dtype, shapes, grads, seed=0):
    """Tensors of ``shapes`` (name -> shape), rounded to ``dtype``; those named in ``grads``
    require grad."""
    g = torch.Generator().manual_seed(seed)
    made = {}
    for name, shape in shapes.items():
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        made[name] = x.to(dtype).requires_grad_(name in grads)
    return made


def _grads(fn, inputs, dout):
    out = fn(**inputs)
    wrt = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
    return out, torch.autograd.grad(out, wrt, dout.to(out.dtype))


def _as(x, dtype):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    return x.detach().to(dtype).requires_grad_(x.requires_grad)


def check_against_eager(dtype, shapes, grads, ours, eager, others=None, seed=0):
    """ours(**inputs) and its gradients against eager(**inputs) in float64 (same rounded inputs),
    within twice the error of eager(**inputs) in ``dtype`` (or 4 ulps of the call's largest
    output or gradient, where eager's error is below that); ``others`` are passed unchanged
    (a bool mask)."""
    inputs = dict(_inputs(dtype, shapes, grads, seed), **(others or {}))
    dout = torch.randn(*_out_shape(shapes), generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64)
    exact, exact_grads = _grads(eager, {n: _as(x, torch.float64) for n, x in inputs.items()},
                                dout)
    low, low_grads = _grads(eager, inputs, dout)
    got, got_grads = _grads(ours, inputs, dout)
    assert got.dtype == dtype and got.shape == exact.shape
    # a gradient exactly 0 (a row of one kept score) is measured against the call's largest
    largest = max(x.abs().max().item() for x in (exact, *exact_grads) if x.numel())
    for name, g, low_g, exact_g in zip(["out", *grads], (got, *got_grads), (low, *low_grads),
                                       (exact, *exact_grads)):
        assert g.dtype == dtype and g.shape == exact_g.shape, name
        err = (g.double() - exact_g).abs().max().item()
        eager_err = (low_g.double() - exact_g).abs().max().item()
        floor = 4 * torch.finfo(dtype).eps * largest
        assert err <= 2 * max(eager_err, floor), (name, err, eager_err)
    return got, got_grads


def _out_shape(shapes):
    return shapes["q"][:-1] + shapes["v"][-1:]


def _sdpa(**kw):
    def ours(q, k, v, mask=None, sinks=None):
        return scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, sinks=sinks, **kw)
    return ours


def _eager(**kw):
    def eager(q, k, v, mask=None, sinks=None):
        keep, bias = (mask, None) if mask is not None and mask.dtype == torch.bool \
            else (None, mask)
        return eager_attention(q, k, v, keep=keep, bias=bias, sinks=sinks, **kw)
    return eager


#: GQA 4:2, Sq != Skv, sizes that leave partial tiles on both sides (64-row / column tiles)
SHAPES = dict(q=(2, 4, 70, 24), k=(2, 2, 90, 24), v=(2, 2, 90, 24))


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(scale=0.3),
                                dict(softcap=2.0), dict(is_causal=True, softcap=5.0)],
                         ids=["plain", "causal", "scale", "softcap", "causal-softcap"])
def test_float32_gradients_match_eager(kw):
    eager_kw = {("causal" if n == "is_causal" else n): x for n, x in kw.items()}
    check_against_eager(torch.float32, SHAPES, "qkv", _sdpa(**kw), _eager(**eager_kw))


@pytest.mark.parametrize("mask_shape", [(70, 90), (2, 1, 70, 90), (1, 4, 1, 90)])
def test_float_mask_gradient_is_summed_over_its_broadcast(mask_shape):
    shapes = dict(SHAPES, mask=mask_shape)
    _, grads = check_against_eager(torch.float32, shapes, ["q", "k", "v", "mask"], _sdpa(),
                                   _eager())
    assert grads[-1].shape == mask_shape


def test_bool_masks_with_rows_that_keep_nothing():
    """A mask the same for every head (the discard-mask path) and one per head (the -inf bias
    path), with query rows that keep nothing: their gradients are zeros."""
    rng = np.random.default_rng(3)
    for shape in [(2, 1, 70, 90), (2, 4, 70, 90)]:
        keep = torch.from_numpy(rng.random(shape) < 0.4)
        keep[..., 5, :] = False
        keep[..., 66, :] = False
        _, (dq, _, _) = check_against_eager(torch.float32, SHAPES, "qkv", _sdpa(), _eager(),
                                            others=dict(mask=keep))
        assert torch.all(dq[:, :, [5, 66]] == 0)


@pytest.mark.parametrize("window", [2, 10, 100])
def test_sliding_window_masks(window):
    """A causal sliding-window bool mask: the band from it skips the tiles outside (a window
    of 2 reaches back exactly one column into the previous tile)."""
    i, j = torch.arange(150)[:, None], torch.arange(150)[None, :]
    keep = (j <= i) & (j > i - window)
    shapes = dict(q=(1, 4, 150, 16), k=(1, 2, 150, 16), v=(1, 2, 150, 16))
    check_against_eager(torch.float32, shapes, "qkv", _sdpa(), _eager(), others=dict(mask=keep))


def test_sinks_softcap_and_a_float_mask_together():
    shapes = dict(SHAPES, mask=(2, 1, 70, 90), sinks=(4,))
    check_against_eager(torch.float32, shapes, ["q", "k", "v", "mask", "sinks"],
                        _sdpa(softcap=3.0), _eager(softcap=3.0))


def test_sink_gradient_of_rows_that_keep_nothing_is_zero():
    keep = torch.ones(70, 90, dtype=torch.bool)
    keep[:, :] = False                            # every row empty: nothing to differentiate
    shapes = dict(SHAPES, sinks=(4,))
    _, grads = check_against_eager(torch.float32, shapes, ["q", "sinks"], _sdpa(), _eager(),
                                   others=dict(mask=keep))
    assert torch.all(grads[0] == 0) and torch.all(grads[1] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16bit_gradients_within_twice_eagers_own_error(dtype):
    shapes = dict(q=(1, 4, 100, 32), k=(1, 2, 130, 32), v=(1, 2, 130, 32), sinks=(4,))
    check_against_eager(dtype, shapes, ["q", "k", "v", "sinks"], _sdpa(softcap=4.0),
                        _eager(softcap=4.0))
    check_against_eager(dtype, dict(q=(2, 3, 67, 16), k=(2, 3, 67, 16), v=(2, 3, 67, 16)),
                        "qkv", _sdpa(is_causal=True), _eager(causal=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("d", [1, 4, 8, 24, 100])
def test_every_head_dim_in_every_dtype(d, dtype):
    """The drop-in takes any head dim in each float dtype (whisper's 4, bert's and granite's
    8), bfloat16's too, which Ascend's operators refuse unless a multiple of 16: the output and
    its gradients, causal, GQA, Sq != Skv."""
    shapes = dict(q=(2, 4, 37, d), k=(2, 2, 45, d), v=(2, 2, 45, d))
    check_against_eager(dtype, shapes, "qkv", _sdpa(is_causal=True), _eager(causal=True),
                        seed=d)
    if dtype == torch.bfloat16 and d % 16:
        q = torch.zeros(1, 2, 4, d).numpy().astype(ml_dtypes.bfloat16)
        with pytest.raises(RuntimeError, match="bfloat16 needs head dim D % 16 == 0"):
            prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD")


@pytest.mark.parametrize("shapes", [dict(q=(9, 16), k=(12, 16), v=(12, 16)),
                                    dict(q=(3, 9, 16), k=(3, 12, 16), v=(3, 12, 16)),
                                    dict(q=(2, 2, 2, 9, 16), k=(2, 2, 1, 12, 16),
                                         v=(2, 2, 1, 12, 16))],
                         ids=["2d", "3d", "5d"])
def test_gradients_take_the_arguments_shapes(shapes):
    check_against_eager(torch.float32, shapes, "qkv", _sdpa(), _eager())


def test_only_the_arguments_that_require_grad_get_one():
    inputs = _inputs(torch.float32, SHAPES, ["v"])
    out = scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], enable_gqa=True)
    out.sum().backward()
    assert inputs["q"].grad is None and inputs["k"].grad is None
    assert inputs["v"].grad.shape == SHAPES["v"]


def test_no_kv_rows_gives_zero_gradients():
    inputs = _inputs(torch.float32, dict(q=(1, 2, 5, 8), k=(1, 2, 0, 8), v=(1, 2, 0, 8)), "qkv")
    out = scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"])
    out.sum().backward()
    assert torch.all(out == 0) and torch.all(inputs["q"].grad == 0)
    assert inputs["k"].grad.shape == (1, 2, 0, 8)


def test_forward_values_equal_the_no_grad_call_and_inputs_are_not_written():
    inputs = _inputs(torch.float32, SHAPES, "qkv")
    before = {n: x.detach().clone() for n, x in inputs.items()}
    with torch.no_grad():
        plain = scaled_dot_product_attention(**_positional(inputs), enable_gqa=True)
    out = scaled_dot_product_attention(**_positional(inputs), enable_gqa=True)
    assert out.requires_grad and out.grad_fn is not None
    assert torch.equal(out.detach(), plain)
    out.sum().backward()
    assert all(torch.equal(x.detach(), before[n]) for n, x in inputs.items())


def _positional(inputs):
    return dict(query=inputs["q"], key=inputs["k"], value=inputs["v"])


def test_second_derivatives_are_refused():
    inputs = _inputs(torch.float32, dict(q=(1, 1, 4, 8), k=(1, 1, 4, 8), v=(1, 1, 4, 8)), "qkv")
    out = scaled_dot_product_attention(**_positional(inputs))
    (dq,) = torch.autograd.grad((out ** 2).sum(), [inputs["q"]], create_graph=True)
    with pytest.raises(RuntimeError, match="backward through pfa_numba.sdpa_backward"):
        dq.sum().backward()


def test_the_ascend_operators_still_refuse_grad_mode():
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="query requires grad .*forward pass only"):
        prompt_flash_attention(q, q.detach(), q.detach(), num_heads=1, input_layout="BNSD")


def test_numpy_arguments_beside_tensors_that_require_grad_are_refused():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(TypeError, match="query, key and value .* as torch tensors, got query "
                                        "ndarray"):
        scaled_dot_product_attention(q.detach().numpy(), q, q.detach())


def test_tensors_off_the_cpu_that_require_grad_are_not_implemented():
    """No backward kernel off the CPU (a CUDA tensor on a GPU machine; a meta tensor here):
    NotImplementedError naming the argument and its device."""
    q = torch.randn(1, 1, 4, 8, device="meta", requires_grad=True)
    with pytest.raises(NotImplementedError, match="query is on device 'meta'.*CPU tensors"):
        scaled_dot_product_attention(q, q.detach(), q.detach())


def _random_case(draw):
    """A random grad-mode call: shapes (GQA, Sq != Skv, partial tiles), causal or a bool /
    float mask, softcap, sinks, the dtype, and which arguments require grad."""
    from hypothesis import strategies as st
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    sq, skv = draw(st.integers(1, 80)), draw(st.integers(1, 80))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    e = draw(st.sampled_from([16, 32] if dtype == torch.bfloat16 else [8, 16, 24]))
    shapes = dict(q=(b, hkv * group, sq, e), k=(b, hkv, skv, e), v=(b, hkv, skv, e))
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    others, grads = {}, ["q", "k", "v"]
    if kind == "bool":
        g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        others["mask"] = torch.rand(b, 1, sq, skv, generator=g) < draw(st.floats(0.1, 0.9))
    elif kind == "float":
        shapes["mask"] = (1, hkv * group, sq, skv)
        grads.append("mask")
    if draw(st.booleans()):
        shapes["sinks"] = (hkv * group,)
        grads.append("sinks")
    softcap = draw(st.sampled_from([None, 1.0, 30.0]))
    return dtype, shapes, grads, others, dict(softcap=softcap, causal=kind == "causal")


def test_random_calls_match_eager():
    """Random calls (the ``ci`` profile: the same 25 examples on every run)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(st.data())
    def check(data):
        dtype, shapes, grads, others, kw = _random_case(data.draw)
        eager_kw = dict(softcap=kw["softcap"], causal=kw["causal"])
        ours_kw = dict(softcap=kw["softcap"], is_causal=kw["causal"])
        check_against_eager(dtype, shapes, grads, _sdpa(**ours_kw), _eager(**eager_kw),
                            others=others)
    check()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_through_the_operator(backend):
    """One opaque operator to torch.compile (fullgraph: no graph break): forward and
    gradients as the uncompiled call's."""
    inputs = _inputs(torch.float32, SHAPES, "qkv")
    keep = torch.rand(70, 90, generator=torch.Generator().manual_seed(4)) < 0.6

    def f(q, k, v):
        return scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, softcap=5.0)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    runs = []
    for fn in (compiled, f):
        out = fn(inputs["q"], inputs["k"], inputs["v"])
        grads = torch.autograd.grad(out.square().sum(), list(inputs.values()))
        runs.append((out, *grads))
    for got, want in zip(*runs):
        assert torch.equal(got, want)


def test_one_pass_and_two_pass_plans_give_the_same_bits(monkeypatch):
    """The gradients do not depend on the threads: a call with fewer (batch, kv head)s than
    threads takes two passes, else one, and every dQ row sums its kv tiles in one order."""
    from pfa_numba.cpu import backward
    inputs = _inputs(torch.float32, dict(q=(2, 4, 130, 32), k=(2, 2, 150, 32),
                                         v=(2, 2, 150, 32), sinks=(4,)), ["q", "k", "v", "sinks"])
    runs = []
    for whole in (True, False):
        monkeypatch.setattr(backward, "owns_whole_heads", lambda p, whole=whole: whole)
        out = scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"],
                                           enable_gqa=True, softcap=4.0, sinks=inputs["sinks"])
        runs.append(torch.autograd.grad(out.square().sum(), list(inputs.values())))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_compiled_training_step_on_transposed_inputs():
    """What every transformers model passes: q, k, v as transposed views. The inductor-compiled
    backward checks the gradients' layout against the fake implementation's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 30, 4 * 16, generator=g, requires_grad=True)
    proj = torch.randn(4 * 16, 8 * 16, generator=g) * 0.1

    def step(x):
        q, kv = (x @ proj).split([4 * 16, 4 * 16], dim=-1)
        q = q.view(2, 30, 4, 16).transpose(1, 2)
        k, v = (t.reshape(2, 30, 2, 16).transpose(1, 2) for t in kv.split(32, dim=-1))
        out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.square().sum()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    (want,) = torch.autograd.grad(step(x), [x])
    (got,) = torch.autograd.grad(compiled(x), [x])
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_the_operators_pass_torchs_opcheck(mask):
    """torch.library.opcheck: schema, fake implementations (shapes, dtypes, strides) and
    autograd registration, on transposed inputs."""
    import pfa_numba.interop.torch_ops  # noqa: F401  (registers the operators)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 9, 4, 16, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 11, 2, 16, generator=g).transpose(1, 2).requires_grad_()
            for _ in range(2))
    attn_mask = {"none": None, "bool": torch.rand(9, 11, generator=g) < 0.7,
                 "float": torch.randn(1, 4, 9, 11, generator=g).requires_grad_()}[mask]
    sinks = torch.zeros(4, requires_grad=True)
    options = (None, False, True, 3.0)
    torch.library.opcheck(torch.ops.pfa_numba.sdpa.default, (q, k, v, attn_mask, sinks, *options))
    out, lse = torch.ops.pfa_numba.sdpa(q, k, v, attn_mask, sinks, *options)
    dout = torch.randn(out.shape, generator=g)
    data = [None if x is None else x.detach() for x in (q, k, v, attn_mask, sinks, out, lse)]
    for want_dmask in {False, mask == "float"}:      # the backward has no backward of its own
        torch.library.opcheck(torch.ops.pfa_numba.sdpa_backward.default,
                              (dout, *data, *options, want_dmask),
                              test_utils=("test_schema", "test_faketensor",
                                          "test_aot_dispatch_static"))


@pytest.mark.parametrize("whole_heads", [True, False], ids=["backward-heads", "backward-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d, dv", [(24, 16), (16, 40), (192, 128)])
def test_a_value_head_dim_of_its_own(d, dv, dtype, whole_heads, monkeypatch):
    """Multi-head latent attention's shapes (DeepSeek's prefill: D 192, Dv 128): the output has
    value's head dim, dV value's shape, dQ and dK the query's head dim; both backward
    kernels, with a mask, sinks and a softcap."""
    from pfa_numba.cpu import backward
    monkeypatch.setattr(backward, "owns_whole_heads", lambda p: whole_heads)
    shapes = dict(q=(2, 4, 37, d), k=(2, 2, 45, d), v=(2, 2, 45, dv))
    check_against_eager(dtype, shapes, "qkv", _sdpa(is_causal=True), _eager(causal=True),
                        seed=dv)
    keep = torch.rand(37, 45, generator=torch.Generator().manual_seed(1)) < 0.7
    check_against_eager(dtype, dict(shapes, sinks=(4,)), ["q", "k", "v", "sinks"],
                        _sdpa(softcap=4.0), _eager(softcap=4.0), others=dict(mask=keep))
