"""The quantization arguments of a call (contract 'Quantization'): which are required and
forbidden for each kind, their dtypes and shapes, and their decoded scales."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..numerics.dtypes import F16, F32, I8, dtype_name, is_bf16
from .checks import check_array, check_offset_like, require, shape_str


@dataclass
class QuantParams:
    kind: str                 # 'int8->int8', 'int8->float16' or 'float->int8'
    out_dtype: np.dtype
    deq1: float               # decoded float32 scales (0 where unused)
    quant1: float
    deq2: float
    scale2: Optional[np.ndarray]    # float32 (H,) (per-channel) or (1,) (per-tensor)
    offset2: Optional[np.ndarray]


def decode_deq_scale(x):
    """deq_scale as float32: uint64 is Ascend's packed form float32_from_bits(u64 & 0xFFFFE000)."""
    if x.dtype == np.uint64:
        bits = (x.reshape(-1) & np.uint64(0xFFFFE000)).astype(np.uint32)
        return float(bits.view(np.float32)[0])
    return float(x.reshape(-1)[0])


def quant_params(dtype, quant, n, d):
    """Check the quantization arguments against the table of contract 'Quantization'; decode
    them."""
    given = {name: check_array(name, x) for name, x in quant.items() if x is not None}
    if dtype == I8:
        out_int8 = "quant_scale2" in given
        required = ["deq_scale1", "quant_scale1", "deq_scale2"] + (["quant_scale2"] if out_int8 else [])
        forbidden = [] if out_int8 else ["quant_offset2"]
        kind = "int8->int8" if out_int8 else "int8->float16"
        if not out_int8 and "quant_offset2" in given:
            raise RuntimeError("quant_offset2 needs quant_scale2 (int8 output); with int8 "
                               "query/key/value and float16 output quant_offset2 must be None, "
                               f"got shape {shape_str(given['quant_offset2'].shape)}")
    else:
        required = ["quant_scale2"]
        forbidden = ["deq_scale1", "quant_scale1", "deq_scale2"]
        kind = "float->int8"
        if "quant_scale2" not in given and "quant_offset2" in given:
            raise RuntimeError(f"quant_offset2 needs quant_scale2, got quant_offset2 of shape "
                               f"{shape_str(given['quant_offset2'].shape)} and quant_scale2 None")
    for name in forbidden:
        if name in given:
            raise RuntimeError(f"{name} must be None for {kind} ({dtype_name(dtype)} "
                               f"query/key/value), got an array of shape "
                               f"{shape_str(given[name].shape)}")
    for name in required:
        require(given.get(name), RuntimeError, f"{name} is required for {kind} "
                f"({dtype_name(dtype)} query/key/value)")

    deq1 = quant1 = deq2 = 0.0
    if dtype == I8:
        d1, q1, d2 = given["deq_scale1"], given["quant_scale1"], given["deq_scale2"]
        for name, x in (("deq_scale1", d1), ("deq_scale2", d2)):
            if x.dtype not in (np.dtype(np.uint64), F32):
                raise TypeError(f"{name} dtype must be uint64 or float32, got "
                                f"{dtype_name(x.dtype)}")
        if d1.dtype != d2.dtype:
            raise TypeError(f"deq_scale1 and deq_scale2 must have the same dtype, got deq_scale1 "
                            f"{dtype_name(d1.dtype)} and deq_scale2 {dtype_name(d2.dtype)}")
        if q1.dtype != F32:
            raise TypeError(f"quant_scale1 dtype must be float32, got {dtype_name(q1.dtype)}")
        for name, x in (("deq_scale1", d1), ("quant_scale1", q1), ("deq_scale2", d2)):
            if x.shape != (1,):
                raise RuntimeError(f"{name} must have shape (1,), got {shape_str(x.shape)}")
        deq1, quant1, deq2 = decode_deq_scale(d1), float(q1[0]), decode_deq_scale(d2)

    scale2 = offset2 = None
    out_dtype = F16
    if "quant_scale2" in given:
        out_dtype = I8
        s2 = given["quant_scale2"]
        bf16 = is_bf16(dtype)
        if not (s2.dtype == F32 or (bf16 and s2.dtype == dtype)):
            raise TypeError(f"quant_scale2 dtype must be float32{' or bfloat16' if bf16 else ''} "
                            f"for a {dtype_name(dtype)} query, got {dtype_name(s2.dtype)}")
        h = n * d
        per_channel_shapes = [(h,), (1, 1, h), (1, n, 1, d), (n, d), (1, 1, n, d)]
        if s2.shape == (1,):
            pass
        elif s2.shape in per_channel_shapes:
            if d % 32:
                raise RuntimeError(f"per-channel quant_scale2 (shape {shape_str(s2.shape)}) "
                                   f"needs head dim D % 32 == 0, got D = {d}")
        else:
            raise RuntimeError(f"quant_scale2 shape must be (1,) or one of "
                               f"{', '.join(shape_str(x) for x in per_channel_shapes)} (H = {h}), "
                               f"got {shape_str(s2.shape)}")
        scale2 = s2.astype(np.float32).reshape(-1)
        if "quant_offset2" in given:
            o2 = given["quant_offset2"]
            check_offset_like("quant_offset2", o2, "quant_scale2", s2)
            offset2 = o2.astype(np.float32).reshape(-1)
        else:
            offset2 = np.zeros_like(scale2)
    return QuantParams(kind=kind, out_dtype=out_dtype, deq1=deq1, quant1=quant1, deq2=deq2,
                       scale2=scale2, offset2=offset2)
