"""CUDA-array plumbing that needs no GPU: kinds, and the metadata-only planning of CUDA inputs
(the device pointer of every view the kernel reads is recovered exactly)."""
import numpy as np
import pytest

from pfa_numba.frontend import problem
from pfa_numba.frontend import checks
from pfa_numba.frontend import pfa as PV
from pfa_numba.interop import cuda_arrays as _arrays
from pfa_numba.numerics.kernel_args import geometry


class HostBackedCudaArray:
    """Stands in for a CUDA array: __cuda_array_interface__ over host memory."""

    def __init__(self, a):
        self.a = a
        self.dtype = a.dtype

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.__array_interface__["data"][0], False),
                "strides": self.a.strides}


def test_kinds():
    fake = HostBackedCudaArray(np.zeros(3, np.float32))
    assert checks.is_cuda_array(fake) and not checks.is_cuda_array(np.zeros(3))
    assert _arrays.array_kind(fake) == "cuda" and _arrays.array_kind(np.zeros(1)) == "numpy"


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND"])
def test_meta_planning_recovers_every_device_pointer(layout):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((2, 6, 40, 48)).astype(np.float16)
    q4, k4, v4 = big[:, ::3, 3:30, :32], big[:, 1::3, ::-1, 16:48][:, :, :33], big[:, 2::3, 5:38, :32]
    tr = {"BSH": lambda x: x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1),
          "BSND": lambda x: x.transpose(0, 2, 1, 3)}.get(layout, lambda x: x)
    q, k, v = tr(q4), tr(k4), tr(v4)
    mask = rng.random((2, 1, 30, 40)) < 0.5
    args = dict(num_heads=2, scale_value=0.1, pre_tokens=2147483647, next_tokens=0,
                input_layout=layout, num_key_value_heads=0, sparse_mode=1, inner_precise=1,
                return_softmax_lse=False)
    real = problem.plan(PV.validate(PV.Call(q, k, v, attn_mask=mask, **args)))
    meta = _arrays.Meta()
    mq, mk, mv, mm = (meta.make(name, HostBackedCudaArray(x)) for name, x in
                      zip(("query", "key", "value", "attn_mask"), (q, k, v, mask)))
    assert all(isinstance(x, np.ndarray) and not x.flags.writeable for x in (mq, mk, mv, mm))
    planned = problem.plan(PV.validate(PV.Call(mq, mk, mv, attn_mask=mm, **args)))
    out = np.zeros(real.out_shape, np.float16)
    lse = np.zeros(real.lse_shape, np.float32)
    g_real = geometry(real, out, lse)
    g_meta = geometry(planned, out, lse)
    for name, a, b in zip(("query", "key", "value", "attn_mask"), g_real[:3] + g_real[4:5],
                          g_meta[:3] + g_meta[4:5]):                  # q, k, v, mask8
        found, offset = meta.locate(b)
        assert found == name and a.size == b.size
        assert meta.pointers[name] + offset == a.__array_interface__["data"][0]
    for a, b in zip(g_real[7:], g_meta[7:]):                                 # strides, offsets
        assert np.array_equal(a, b)


def test_malformed_cuda_array_interface_is_a_type_error():
    from pfa_numba import prompt_flash_attention

    class Malformed:
        __cuda_array_interface__ = {}

    with pytest.raises(TypeError, match="query.*malformed"):
        prompt_flash_attention(Malformed(), Malformed(), Malformed())


def test_cuda_array_without_a_driver_is_a_runtime_error():
    from numba import cuda as numba_cuda

    from pfa_numba import prompt_flash_attention
    if numba_cuda.is_available():
        pytest.skip("a CUDA device is present")
    q = HostBackedCudaArray(np.ones((1, 1, 4, 16), np.float32))
    with pytest.raises(RuntimeError, match="query.*CUDA"):
        prompt_flash_attention(q, q, q, num_heads=1, input_layout="BNSD", device="cpu")
