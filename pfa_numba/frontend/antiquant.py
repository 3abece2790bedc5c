"""int8 key/value with a float query (docs/fia.md, 'KV antiquant'): the checks of the scale and
offset arguments, and their normal form for the kernels.

Every mode becomes, for key and for value, a *channel plane* (scale and offset per kv head and
channel, Nkv * D float32 values: per-tensor and per-head modes repeat theirs) and *token
planes* (scales, and offsets where given, per kv row and head: float32 (R0, Nkv, R1) views of
the arguments shaped like the rows, (B, S) for the contiguous token modes, (num_blocks,
block_size) for the paged ones, the head axis of stride 0 where a mode has one value for all
heads). The token planes are read where they lie: a cache's scales are as large as a sixteenth
of it or more, and copying them would grow a call's memory with the cache. A load computes
``(int8 + offset_channel + offset_token) * scale_channel * scale_token``, one of each pair
being the identity, which is ``(int8 + offset) * scale`` for every mode.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import checks
from ..numerics.dtypes import F32, I8, dtype_name

#: kinds of the separate modes; the merged ones are 0 (tensor or channel) and 1 (token)
SEPARATE = {0: None, 1: "token", 2: "head", 3: "token-head", 4: "paged-token",
            5: "paged-token-head"}
TOKEN_KINDS = ("token", "token-head", "paged-token", "paged-token-head")
#: the separate modes of those kinds
TOKEN_MODES = tuple(mode for mode, kind in SEPARATE.items() if kind in TOKEN_KINDS)


@dataclass
class Planes:
    """One tensor's dequantization, as the kernels read it."""
    channel: np.ndarray                  # (2, Nkv * D) float32: scales, offsets
    token_scale: Optional[np.ndarray]    # (R0, Nkv, R1) float32 view of the argument, or None
    token_offset: Optional[np.ndarray]   # the same of the offsets, or None (offsets 0)
    paged: bool                          # the token planes are addressed by (block, slot)


#: the merged and the separate scale and offset arguments
MERGED_ARGS = ("antiquant_scale", "antiquant_offset")
SEPARATE_ARGS = ("key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
                 "value_antiquant_offset")


def token_arguments(kwargs):
    """The names among fused_infer_attention_score's keywords ``kwargs`` of the scale and
    offset arguments their modes index by token (as large as the cache they scale)."""
    def by_token(mode, modes):
        return isinstance(mode, (int, np.integer)) and mode in modes
    names = MERGED_ARGS if by_token(kwargs.get("antiquant_mode", 0), (1,)) else ()
    for tensor in ("key", "value"):
        if by_token(kwargs.get(f"{tensor}_antiquant_mode", 0), TOKEN_MODES):
            names += (f"{tensor}_antiquant_scale", f"{tensor}_antiquant_offset")
    return names


def any_given(call, names=MERGED_ARGS + SEPARATE_ARGS):
    return any(getattr(call, n) is not None for n in names)


def applies(call, qdtype, kdtype):
    """Whether key/value are dequantized (int8 with a float query); raises where the antiquant
    arguments and the dtypes do not go together."""
    given = any_given(call)
    if kdtype != I8:
        if given:
            raise RuntimeError(f"antiquant scales need int8 key/value, got "
                               f"{dtype_name(kdtype)}")
        return False
    if qdtype == I8:
        if given:
            raise RuntimeError("antiquant arguments do not go with an int8 query (full "
                               "quantization: dequant_scale1 / quant_scale1 / dequant_scale2)")
        return False
    if not given:
        raise RuntimeError(f"int8 key/value with a {dtype_name(qdtype)} query need antiquant "
                           f"scales (antiquant_scale, or key_/value_antiquant_scale), got none")
    return True


def plan(call, qdtype, B, Nkv, dims, extent, paged, pool_blocks, block_size, prefixed):
    """The (key, value) :class:`Planes` of a call that :func:`applies` to; ``dims``: the head
    dims (D, Dv) of key and value. Raises the errors of docs/fia.md, 'KV antiquant'."""
    D, Dv = dims
    shape = dict(B=B, Nkv=Nkv, D=D, Dv=Dv, extent=extent, blocks=pool_blocks,
                 block_size=block_size, paged=paged)
    # the separate arguments, where any is given, win: the merged ones are not read
    pairs = (_separate if any_given(call, SEPARATE_ARGS) else _merged)(call, qdtype, shape)
    for (kind, _, _), name in zip(pairs, ("key", "value")):
        if kind in TOKEN_KINDS and prefixed:
            raise RuntimeError(f"a per-token {name} antiquant mode does not go with a shared "
                               f"prefix")
    return tuple(_planes(kind, s, o, Nkv, d) for (kind, s, o), d in zip(pairs, dims))


def _array(name, x):
    return None if x is None else checks.check_array(name, checks.plain(name, x))


def _merged(call, qdtype, shape):
    mode = checks.check_int("antiquant_mode", call.antiquant_mode)
    if mode not in (0, 1):
        raise RuntimeError(f"antiquant_mode must be 0 or 1, got {mode}")
    s = _array("antiquant_scale", call.antiquant_scale)
    o = _array("antiquant_offset", call.antiquant_offset)
    if s is None:
        raise RuntimeError("antiquant_offset needs antiquant_scale, got no scale")
    _pair_rules("antiquant_scale", s, "antiquant_offset", o)
    if mode == 1:
        _dtype("antiquant_scale", s, F32)
        if s.ndim != 3 or s.shape[:2] != (2, shape["B"]) or s.shape[2] < shape["extent"]:
            raise RuntimeError(f"antiquant_scale for antiquant_mode 1 (per token) must be "
                               f"(2, B, S) with B = {shape['B']}, S >= {shape['extent']}, got "
                               f"{checks.shape_str(s.shape)}")
        return [("token", s[i], None if o is None else o[i]) for i in (0, 1)]
    _dtype("antiquant_scale", s, qdtype)
    hkv = shape["Nkv"] * shape["D"]
    if s.shape == (2,):
        return [("tensor", s[i:i + 1], None if o is None else o[i:i + 1]) for i in (0, 1)]
    ok = s.shape in ((2, shape["Nkv"], 1, shape["D"]), (2, shape["Nkv"], shape["D"]), (2, hkv))
    if ok and shape["Dv"] != shape["D"]:
        raise RuntimeError(f"antiquant_scale per channel holds key's and value's channels in one "
                           f"array: it takes value's head dim Dv = D, got D = {shape['D']} and "
                           f"Dv = {shape['Dv']} (pass key_antiquant_scale and "
                           f"value_antiquant_scale)")
    if not ok:
        raise RuntimeError(f"antiquant_scale for antiquant_mode 0 must be (2,) or per channel "
                           f"(2, Nkv, 1, D), (2, Nkv, D), (2, Hkv) with Nkv = {shape['Nkv']}, "
                           f"D = {shape['D']}, got {checks.shape_str(s.shape)}")
    return [("channel", s[i].reshape(-1), None if o is None else o[i].reshape(-1))
            for i in (0, 1)]


def _separate(call, qdtype, shape):
    kmode = checks.check_int("key_antiquant_mode", call.key_antiquant_mode)
    vmode = checks.check_int("value_antiquant_mode", call.value_antiquant_mode)
    for name, mode in (("key_antiquant_mode", kmode), ("value_antiquant_mode", vmode)):
        if mode not in SEPARATE:
            raise RuntimeError(f"{name} must be in 0..5, got {mode}")
        if SEPARATE[mode] in ("paged-token", "paged-token-head") and not shape["paged"]:
            raise RuntimeError(f"{name} {mode} ({SEPARATE[mode]}) needs a block_table")
    if kmode != vmode and (kmode, vmode) != (0, 1):
        raise RuntimeError(f"key_antiquant_mode and value_antiquant_mode must be equal (or key "
                           f"0 with value 1), got {kmode} and {vmode}")
    ks, ko, vs, vo = (_array(n, getattr(call, n)) for n in SEPARATE_ARGS)
    if (ks is None) != (vs is None):
        raise RuntimeError("key_antiquant_scale and value_antiquant_scale come together, got "
                           "only " + ("key" if ks is not None else "value") + "_antiquant_scale")
    if (ko is None) != (vo is None):
        raise RuntimeError("key_antiquant_offset and value_antiquant_offset come together")
    _pair_rules("key_antiquant_scale", ks, "key_antiquant_offset", ko)
    _pair_rules("value_antiquant_scale", vs, "value_antiquant_offset", vo)
    if kmode == vmode and (shape["D"] == shape["Dv"] or ks.shape == (1,)
                           or SEPARATE[kmode] is not None):
        checks.check_same("shape", "key_antiquant_scale", ks, "value_antiquant_scale", vs)
    return [_separate_one(name, mode, s, o, qdtype, shape)
            for name, mode, s, o in (("key", kmode, ks, ko), ("value", vmode, vs, vo))]


def _separate_one(name, mode, s, o, qdtype, shape):
    arg = f"{name}_antiquant_scale"
    B, Nkv, D = shape["B"], shape["Nkv"], shape["D" if name == "key" else "Dv"]
    kind = SEPARATE[mode] or ("tensor" if s.shape == (1,) else "channel")
    want = {
        "tensor": [(1,)],
        "channel": [(Nkv, 1, D), (Nkv, D), (Nkv * D,), (1, Nkv, 1, D), (1, Nkv, D),
                    (1, Nkv * D)],
        "head": [(Nkv,)],
        "token": [(B, None), (1, B, None)],
        "token-head": [(B, Nkv, None)],
        "paged-token": [(shape["blocks"], shape["block_size"])],
        "paged-token-head": [(shape["blocks"], Nkv, shape["block_size"])],
    }[kind]
    if not any(_fits(s.shape, w, shape["extent"]) for w in want):
        raise RuntimeError(f"{arg} for {name}_antiquant_mode {mode} ({kind}) must have a shape "
                           f"of {want} (None: S >= {shape['extent']}), got "
                           f"{checks.shape_str(s.shape)}")
    _dtype(arg, s, F32 if kind in TOKEN_KINDS else qdtype)
    if kind == "token" and s.ndim == 3:
        s, o = s[0], None if o is None else o[0]
    if kind in ("tensor", "channel", "head"):
        return kind, s.reshape(-1), None if o is None else o.reshape(-1)
    return kind, s, o


def _fits(got, want, extent):
    return len(got) == len(want) and all(w is None and g >= extent or g == w
                                         for g, w in zip(got, want))


def _pair_rules(sname, s, oname, o):
    if o is None:
        return
    if s is None:
        raise RuntimeError(f"{oname} needs {sname}, got no scale")
    checks.check_offset_like(oname, o, sname, s)


def _dtype(name, x, want):
    if x.dtype != want:
        raise TypeError(f"{name} dtype must be {dtype_name(want)} here, got "
                        f"{dtype_name(x.dtype)}")


def _planes(kind, s, o, Nkv, D):
    """The channel and token planes of one tensor's (kind, scale, offset)."""
    channel = np.stack([np.ones(Nkv * D, np.float32), np.zeros(Nkv * D, np.float32)])
    if kind in ("tensor", "channel", "head"):
        per = {"tensor": lambda x: np.full(Nkv * D, x[0]),
               "channel": lambda x: x,
               "head": lambda x: np.repeat(x, D)}[kind]
        channel[0] = per(s.astype(np.float32))
        if o is not None:
            channel[1] = per(o.astype(np.float32))
        return Planes(channel, None, None, False)
    return Planes(channel, _token_plane(kind, s, Nkv), _token_plane(kind, o, Nkv),
                  kind.startswith("paged"))


def _token_plane(kind, x, Nkv):
    """A float32 token scale or offset argument (already checked) as an (R0, Nkv, R1) view,
    the head axis of stride 0 where the mode has one value for every kv head; None for None."""
    if x is None:
        return None
    if kind in ("token", "paged-token"):
        x = x[:, None, :]
    return np.broadcast_to(x, (x.shape[0], Nkv, x.shape[2]))
