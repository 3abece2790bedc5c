"""torch CUDA tensors through the SDPA drop-in and the transformers integration: the reshapes
and the mask's conversion as torch operations on the tensors' device, the CUDA kernels, the
results as new tensors there, grad mode's forward (its backward: NotImplementedError) and the
attention weights, against pfa_numba.reference and against the model on "sdpa".

On a GPU with a CUDA build of torch the tensors are CUDA tensors. Under the CUDA simulator the
device's memory is the host's: CPU tensors stand for CUDA tensors (the ``cuda_tensors`` fixture
has them reported as CUDA tensors and staged as the simulator's arrays are, by host copies), so
every step but the reading of device memory in place runs as on a GPU.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
from numba import cuda  # noqa: E402

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")

from pfa_numba import config, scaled_dot_product_attention  # noqa: E402
from pfa_numba.interop import cuda_arrays, torch_tensors  # noqa: E402
from pfa_numba.sdpa import attention_with_weights  # noqa: E402
from _cases import assert_matches_reference  # noqa: E402

ON_GPU = cuda.is_available() and not numba.config.ENABLE_CUDASIM and torch.cuda.is_available()
if not ON_GPU and not numba.config.ENABLE_CUDASIM:
    pytest.skip("no GPU with a CUDA build of torch here: run with NUMBA_ENABLE_CUDASIM=1 "
                "(scripts/run_tests.py does)", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture
def device(monkeypatch):
    """The device the test's tensors go to; under the simulator 'cpu', with CPU tensors
    reported as CUDA tensors and staged by host copies."""
    monkeypatch.setattr(config, "CUDA_Q_ROWS", 4)          # several query blocks and kv tiles
    monkeypatch.setattr(config, "CUDA_KV_COLS", 3)
    if ON_GPU:
        return "cuda"
    monkeypatch.setattr(torch_tensors, "on_cuda", lambda t: True)
    monkeypatch.setattr(cuda_arrays, "simulated", lambda x: True)
    return "cpu"


def _qkv(dtype, device, n=4, nkv=2, sq=7, skv=9, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, n, sq, d), (2, nkv, skv, d), (2, nkv, skv, d))
    return [(torch.randn(s, generator=g) * 2).to(dtype).to(device) for s in shapes]


def _numpy(x):
    return cuda_arrays.to_host(x)


def _reference_kwargs(softcap=None, sinks=None, **kw):
    """The reference's arguments for an SDPA call of _qkv's shapes (no mask: every column)."""
    return dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale_value=0.25,
                inner_precise=2, next_tokens=2147483647, softcap=softcap,
                sinks=None if sinks is None else _numpy(sinks), **kw)


def _keep(device):
    """A bool mask (2, 1, 7, 9), True = take part: causal with the second batch's first three
    columns padded, and one row that keeps nothing."""
    keep = torch.ones(2, 1, 7, 9, dtype=torch.bool).tril(2)
    keep[1, :, :, :3] = False
    keep[1, :, 0] = False
    return keep.to(device)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", ["dense", "bool-mask", "causal", "float-mask"])
def test_sdpa_on_cuda_tensors_matches_the_reference(form, dtype, device):
    q, k, v = _qkv(DTYPES[dtype], device)
    before = [x.clone() for x in (q, k, v)]
    sinks = torch.tensor([0.5, -1.0, 2.0, 6.0]).to(device)
    kw = dict(enable_gqa=True, softcap=3.0, sinks=sinks)
    ref = _reference_kwargs(3.0, sinks)
    if form == "bool-mask":
        kw["attn_mask"] = _keep(device)
        ref.update(attn_mask=~_numpy(kw["attn_mask"])[:, 0], sparse_mode=1)
    elif form == "causal":
        kw["is_causal"] = True
        ref.update(attn_mask=np.triu(np.ones((2048, 2048), bool), 1), sparse_mode=2)
    elif form == "float-mask":
        bias = torch.linspace(-3.0, 1.0, 9).to(DTYPES[dtype]).to(device)
        kw["attn_mask"] = bias.expand(1, 4, 7, 9)
        ref.update(pse_shift=np.broadcast_to(_numpy(bias), (1, 4, 7, 9)))
    got = scaled_dot_product_attention(q, k, v, scale=0.25, **kw)
    assert isinstance(got, torch.Tensor) and got.dtype == q.dtype and got.shape == q.shape
    assert got.device == q.device
    assert_matches_reference(_numpy(got), [_numpy(x) for x in (q, k, v)], ref, _numpy(q).dtype)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
    if form == "bool-mask":
        assert not got[1, :, 0].any()                        # the row that keeps nothing


def test_grad_mode_runs_the_forward_and_its_backward_is_not_implemented(device):
    q, k, v = _qkv(torch.float32, device)
    with torch.no_grad():
        want = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q.requires_grad_(True)
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert got.requires_grad and torch.equal(got.detach(), want)
    with pytest.raises(NotImplementedError, match="runs on CPU tensors: on CUDA"):
        got.sum().backward()


def test_attention_weights_of_cuda_tensors(device):
    q, k, v = _qkv(torch.float32, device)
    keep = _keep(device)
    out, weights = attention_with_weights(q, k, v, keep, scale=0.25, enable_gqa=True)
    assert weights.device == q.device and weights.shape == (2, 4, 7, 9)
    q64, k64, v64 = (torch.from_numpy(_numpy(x)).double() for x in (q, k, v))
    k64, v64 = (x.repeat_interleave(2, dim=1) for x in (k64, v64))
    s = (q64 @ k64.transpose(-1, -2) * 0.25).masked_fill(~keep.cpu(), -torch.inf)
    want = torch.softmax(s, -1).nan_to_num(0.0)              # the row that keeps nothing: 0
    np.testing.assert_allclose(_numpy(weights), want.numpy(), atol=2e-6)
    np.testing.assert_allclose(_numpy(out), (want @ v64).numpy(), atol=2e-5)


def test_tensors_on_two_devices_or_another_device_are_refused(device):
    q, k, v = _qkv(torch.float32, device)
    with pytest.raises(ValueError, match="device='cpu' but the tensors live on cuda"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True, device="cpu")
    with pytest.raises(TypeError, match="attn_mask is a CUDA array of"):
        scaled_dot_product_attention(q, k, v, cuda_arrays.numba_device_array(np.ones(9, bool)),
                                     enable_gqa=True)


def test_a_transformers_model_on_cuda_tensors_matches_sdpa(device):
    """A tiny llama (grouped-query attention) on the tensors' device: a left-padded prefill's
    logits, then greedy generation with the KV cache."""
    transformers = pytest.importorskip("transformers")
    import pfa_numba.integrations.transformers as pfa_hf
    name = pfa_hf.register()
    config_ = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_).eval().to(device)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids, mask = ids.to(device), mask.to(device)
    results = {}
    for attn in ("sdpa", name):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                    do_sample=False)
        results[attn] = logits[mask.bool()].float(), tokens
    np.testing.assert_allclose(_numpy(results[name][0]), _numpy(results["sdpa"][0]), atol=1e-4)
    assert torch.equal(results[name][1], results["sdpa"][1])
