"""torch CPU tensors in and out (the contract's arguments, read without copies), forward only."""
import types

import numpy as np
import pytest

from pfa_numba import merge_attention, prompt_flash_attention, reference
from _cases import assert_matches_reference

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _numpy(t):
    from pfa_numba.interop.torch_tensors import as_numpy
    return as_numpy("t", t)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_tensors_in_tensors_out(name, layout):
    g = torch.Generator().manual_seed(0)
    shape = {"BNSD": (2, 4, 37, 32), "BSH": (2, 37, 4 * 32)}[layout]
    kv = {"BNSD": (2, 2, 45, 32), "BSH": (2, 45, 2 * 32)}[layout]
    q = torch.randn(shape, generator=g).to(DTYPES[name])
    k, v = (torch.randn(kv, generator=g).to(DTYPES[name]) for _ in range(2))
    mask = torch.rand(37, 45, generator=g) < 0.3
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout=layout, sparse_mode=1,
              scale_value=32 ** -0.5)
    before = [t.clone() for t in (q, k, v, mask)]
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    args = tuple(_numpy(t) for t in (q, k, v, mask))
    assert_matches_reference(_numpy(out), args, kw, args[0].dtype, lse=_numpy(lse))
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, mask)))


def test_tensors_are_read_in_place():
    """A strided tensor view is read through its memory: the NumPy view shares it."""
    base = torch.randn(2, 40, 4, 32)
    view = base.transpose(1, 2)                       # BNSD view of BSND memory
    arr = _numpy(view)
    assert np.shares_memory(arr, base.numpy()) and arr.strides == tuple(
        s * 4 for s in view.stride())


@pytest.mark.parametrize("mdtype", [torch.bool, torch.int8, torch.uint8])
def test_mask_tensors(mdtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    mask = (torch.rand(20, 20, generator=g) < 0.4).to(mdtype)
    kw = dict(num_heads=2, input_layout="BNSD", sparse_mode=1)
    got = prompt_flash_attention(q, k, v, mask, **kw)
    want = prompt_flash_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), **kw)
    np.testing.assert_array_equal(got.numpy(), want)


def test_lengths_and_scales_as_tensors():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 12, 16, generator=g) for _ in range(3))
    kw = dict(num_heads=2, input_layout="BNSD")
    got = prompt_flash_attention(q, k, v, None, torch.tensor([12, 5]), torch.tensor([7, 12]), **kw)
    want = reference.prompt_flash_attention(q.numpy(), k.numpy(), v.numpy(), None, [12, 5],
                                            [7, 12], **kw)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)


def test_grad_requires_no_grad_mode():
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    k = v = torch.randn(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="query requires grad .*torch.no_grad"):
        prompt_flash_attention(q, k, v, num_heads=1, input_layout="BNSD")
    with torch.no_grad():
        a = prompt_flash_attention(q, k, v, num_heads=1, input_layout="BNSD")
    with torch.inference_mode():
        b = prompt_flash_attention(q, k, v, num_heads=1, input_layout="BNSD")
    assert torch.equal(a, b) and not a.requires_grad


def test_rejected_objects_are_named_by_type_and_shape_not_values():
    k = v = np.zeros((1, 1, 8, 16), np.float32)
    secret = list(range(1000, 1300))
    with pytest.raises(TypeError) as err:
        prompt_flash_attention(secret, k, v, num_heads=1, input_layout="BNSD")
    assert "list" in str(err.value) and "1000" not in str(err.value)
    odd = types.SimpleNamespace(shape=(1, 1, 8, 16), data=secret)
    with pytest.raises(TypeError, match=r"SimpleNamespace of shape \(1, 1, 8, 16\)") as err:
        prompt_flash_attention(odd, k, v, num_heads=1, input_layout="BNSD")
    assert "1000" not in str(err.value)


def test_merge_attention_of_tensors():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))
    kw = dict(num_heads=2, input_layout="BNSD", return_softmax_lse=True)
    parts = [prompt_flash_attention(q, k[:, :, a:b], v[:, :, a:b], **kw)
             for a, b in ((0, 7), (7, 16))]
    out, lse = merge_attention(parts, input_layout="BNSD")
    whole, whole_lse = prompt_flash_attention(q, k, v, **kw)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), whole.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_tensor_on_another_device_is_a_runtime_error_naming_it(dtype):
    """A tensor on torch's meta device is neither the CPU's nor CUDA's: a RuntimeError naming
    the argument, whatever its dtype (NumPy cannot view some of them at all)."""
    q = torch.zeros(1, 2, 4, 16, dtype=DTYPES[dtype])
    meta = torch.empty(1, 2, 4, 16, dtype=DTYPES[dtype], device="meta")
    with pytest.raises(RuntimeError, match="value is a torch tensor on device 'meta'"):
        prompt_flash_attention(q, q, meta, num_heads=2, input_layout="BNSD")
    with pytest.raises(RuntimeError, match="query is a torch tensor on device 'meta'"):
        prompt_flash_attention(meta, q, q, num_heads=2, input_layout="BNSD")


def test_a_tensor_that_requires_grad_is_refused_by_name_before_its_device_memory_is_read():
    """A CUDA tensor's metadata and pointer are read through the same grad-mode rule as a CPU
    tensor's data (torch's own __cuda_array_interface__ would refuse it without the name, and
    under torch.no_grad() too): run here on a CPU tensor, refused before the interface."""
    from pfa_numba.interop.cuda_arrays import interface
    q = torch.zeros(1, 2, 4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="query requires grad .*torch.no_grad"):
        interface(q, "query")
    with torch.no_grad(), pytest.raises(AttributeError):     # read, detached: not a CUDA tensor
        interface(q, "query")
