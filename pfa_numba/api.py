"""prompt_flash_attention: validate -> plan -> dispatch -> result in the caller's layout."""
import numpy as np

from .frontend import checks

from .frontend import pfa as PV
from .frontend.fia import FIA_NAMES
from . import dispatch
from .frontend.problem import plan
from .interop import torch_tensors
from .interop.cuda_arrays import Staged
from .plans import Plan


@checks.spelled(FIA_NAMES)
def prompt_flash_attention(query, key, value, attn_mask=None, actual_seq_lengths=None,
                           actual_seq_lengths_kv=None, pse_shift=None, deq_scale1=None,
                           quant_scale1=None, deq_scale2=None, quant_scale2=None,
                           quant_offset2=None, num_heads=1, scale_value=1.0,
                           pre_tokens=2147483647, next_tokens=0, input_layout='BSH',
                           num_key_value_heads=0, sparse_mode=0, inner_precise=1, *,
                           device=None, return_softmax_lse=False):
    """Fused attention forward for the prompt (prefill) phase, as Ascend's PromptFlashAttention.

    The arguments, their order and defaults are ``mindspore.ops.prompt_flash_attention``'s, so
    MindSpore code runs unchanged with NumPy arrays in place of Tensors::

        out = prompt_flash_attention(q, k, v, None, None, None, None, None, None, None, None,
                                     None, num_heads, input_layout='BNSD')

    Letters
    -------
    B batch, N query heads (``num_heads``), Nkv key/value heads (``num_key_value_heads``, 0 means
    N), G = N / Nkv query heads per kv head (GQA; query head n reads kv head n // G), Sq query
    length, Skv key/value length, D head dim, H = N*D, Hkv = Nkv*D. Per batch b: qL = actual
    query length (``actual_seq_lengths``), kL = actual kv length (``actual_seq_lengths_kv``).

    What it computes
    ----------------
    For each b, n, query row i < qL and kv column j < kL::

        s[i, j] = scale_value * dot(Q[b, n, i, :], K[b, n // G, j, :])  (+ pse_shift[b|0, n, i, j])
        keep(i, j) = band(i, j) and not attn_mask[b|0, i, j]
        O[b, n, i, :] = sum over kept j of softmax_j(s[i, :]) * V[b, n // G, j, :]

    computed tile by tile with an online softmax (running max, running sum, one division at
    the end), in float32 whatever the input dtype; no Sq x Skv matrix is ever formed.
    ``scale_value`` is used as given (pass 1/sqrt(D) for the usual scaling). Masked scores are
    removed from the softmax, not added as a large negative: a masked position contributes
    nothing and masking never produces NaN. A kept score of -inf counts as masked; +inf or NaN
    scores make their row NaN. K/V columns j >= kL are never read.

    Layouts (``input_layout``)
    --------------------------
    ============  ================  ====================  ================
    layout        query             key / value           output
    ============  ================  ====================  ================
    'BSH'         (B, Sq, H)        (B, Skv, Hkv)         (B, Sq, H)
    'BNSD'        (B, N, Sq, D)     (B, Nkv, Skv, D)      (B, N, Sq, D)
    'BSND'        (B, Sq, N, D)     (B, Skv, Nkv, D)      (B, Sq, N, D)
    'BNSD_BSND'   (B, N, Sq, D)     (B, Nkv, Skv, D)      (B, Sq, N, D)
    'TND'         (T, N, D)         (Tkv, Nkv, D)         (T, N, D)
    ============  ================  ====================  ================

    BSH head n is columns [n*D, (n+1)*D). TND packs sequences: ``actual_seq_lengths`` and
    ``actual_seq_lengths_kv`` are then required cumulative ends. Strided views are read in
    place (a transposed or sliced input is not copied).

    Dtypes: float16 -> float16, bfloat16 (``ml_dtypes.bfloat16``, D % 16 == 0) -> bfloat16,
    float32 -> float32; results are rounded to nearest, ties to even.

    int8 quantization (contract 'Quantization'): int8 query/key/value with ``deq_scale1``,
    ``quant_scale1``, ``deq_scale2`` give a float16 output, and with ``quant_scale2`` (and
    optionally ``quant_offset2``) an int8 output; float query/key/value with ``quant_scale2``
    give an int8 output. ``deq_scale1/2`` are float32 or Ascend's packed uint64
    (:func:`trans_quant_param`); ``quant_scale2/offset2`` are per tensor (1,) or per channel (H
    elements, D % 32 == 0). The int8 pipeline is exact in its integer sums, rounds to float16
    where the spec says, and quantizes the softmax weights against each row's maximum (a second
    pass over K), so results do not depend on tiling. Rows with nothing to attend to stay 0 in an
    int8 output.

    Sparse modes: the band
    ----------------------
    ``band(i, j)`` holds iff ``0 <= j < kL`` and ``i - preE <= j <= i + nextE``; pictures for
    qL = 4, kL = 6 ('x' kept, '.' dropped)::

        mode 0, no mask     mode 0 + mask,        mode 2 leftUpCausal  mode 3 rightDownCausal
        (pre/next unused)   pre=1, next=0         (preE=inf, nextE=0)  (nextE = kL - qL)
        xxxxxx              x.....                x.....               xxx...
        xxxxxx              xx....                xx....               xxxx..
        xxxxxx              .xx...                xxx...               xxxxx.
        xxxxxx              ..xx..                xxxx..               xxxxxx
        (user mask: none)   (then attn_mask)      (mask not read)      (mask not read)

        mode 1 allMask      mode 4 band, pre=1, next=0 (preE = pre - (kL - qL),
        (band: everything,   nextE = next + (kL - qL): anchored bottom-right)
         then attn_mask)    .xx...
                            ..xx..
                            ...xx.
                            ....xx

    Modes 2, 3 and 4 require a (2048, 2048)-class bool/int8/uint8 ``attn_mask`` (Ascend's
    ``triu(ones, 1)``) and derive the band from the table above without reading it. Modes 3
    and 4 anchor at each batch's actual (qL, kL). pre/next >= 2147483647 mean unlimited.
    In modes 0 (with a mask) and 1, ``attn_mask`` is bool/int8/uint8 (nonzero = discard), of
    shape (Sq, Skv), (B|1, Sq, Skv) or (B|1, 1, Sq, Skv), possibly larger in its last two axes
    (the window [:Sq, :Skv] is used); a float16 mask (float16 query only, deprecated) is
    additive: ``s += -10000 * mask``.

    Rows with nothing to attend to
    ------------------------------
    Rows i >= qL, and rows whose band is empty (or kL = 0), are exact zeros. A row whose band is
    non-empty but whose every band column is masked (user mask, or -inf score) is zero with
    ``inner_precise`` 2 or 3, and the mean of V over its band columns with 0 or 1 (Ascend's
    behaviour, defined here without reference to tiles).

    Returns
    -------
    The attention output, of the query's kind (NumPy in, NumPy out) in the output layout; with
    ``return_softmax_lse=True`` the pair ``(out, softmax_lse)`` where softmax_lse is float32
    (B, N, Sq, 1) ((T, N, 1) for TND): ``m + log(l)`` over the kept scores, -inf for rows that
    kept nothing. Two results over disjoint kv ranges merge exactly with
    ``lse = logaddexp(lse1, lse2)``, ``o = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``.

    Differences from Ascend
    -----------------------
    * float32 inputs are accepted (Ascend rejects them);
    * ``inner_precise`` 0 and 1 give bit-identical results (always float32 compute), as do 2
      and 3; bit 1 selects the fully-masked-row rule above;
    * results do not depend on tile sizes: the fully-masked-row mean covers the whole band and
      int8 softmax weights are quantized against the row max (Ascend: a running per-tile max);
    * the int8 -> float16 output divides by l before its single rounding to float16 (Ascend
      rounds deq2 * sum per tile, which can overflow on long rows);
    * softmax_lse is -inf (not +inf) for rows with nothing kept, so merging works;
    * ``device`` ('cpu', 'cuda', None = where the query lives) and ``return_softmax_lse`` are
      keyword-only extensions.

    Errors
    ------
    TypeError for wrong types and dtypes, ValueError for wrong layout names, ranks, lengths and
    non-finite ``scale_value``, RuntimeError for the shape and argument rules of the Ascend
    kernel (heads, head dim, masks, sparse_mode, inner_precise, pre/next signs). Every message
    names the argument and the value received; invalid input never writes into any array.
    """
    valid = PV.validate(PV.Call(
        query, key, value, attn_mask=attn_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=actual_seq_lengths_kv, pse_shift=pse_shift, deq_scale1=deq_scale1,
        quant_scale1=quant_scale1, deq_scale2=deq_scale2, quant_scale2=quant_scale2,
        quant_offset2=quant_offset2, num_heads=num_heads, scale_value=scale_value,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
        inner_precise=inner_precise, device=device, return_softmax_lse=return_softmax_lse),
        stage=_stage)
    problem = plan(valid)
    out, lse = dispatch.choose(problem, valid.device, valid.staged).run(problem,
                                                                       valid.staged)
    if valid.staged is not None:
        out, lse = valid.staged.results(out, lse)
    return (out, lse) if problem.want_lse else out


def _stage(call, device):
    """CUDA arguments (any library) or torch CPU tensors made readable on the host, or None."""
    if checks.is_cuda_array(call.query):
        return Staged(call, device)
    if any(torch_tensors.is_cpu_tensor(getattr(call, name)) for name in PV.ARRAY_ARGS):
        return torch_tensors.HostTensors(call, PV.ARRAY_ARGS)
    return None


class PfaPlan(Plan):
    """A :func:`prompt_flash_attention` call checked and planned once, to run on many query /
    key / value arrays of the same geometry (the layers of a model's prefill).

    ``PfaPlan(query, key, value, *args, **kwargs)`` takes prompt_flash_attention's arguments and
    raises its errors; ``plan(query, key, value)`` returns what
    ``prompt_flash_attention(query, key, value, *args, **kwargs)`` returns (bit for bit under
    the configuration the plan was made with) for arrays of the planned kind, dtype, device,
    shape and strides (a TypeError names a kind or dtype that differs, a RuntimeError a
    device, shape or strides). Every other argument is the plan's as it was when the plan was
    made, except attn_mask and pse_shift, which are read at each call. On the CPU a call costs
    the kernel and a few checks; on CUDA (CUDA arrays) it queues the planned kernels on the
    caller's stream with nothing copied, allocated or synchronised but the results; arrays the
    planned kernels cannot read as they read the planned ones (misaligned) and NumPy inputs
    run with ``device='cuda'`` run whole calls. A plan holds the arrays it was made with.
    """
    operator = staticmethod(prompt_flash_attention)

    @classmethod
    def _checked(cls, arguments):
        valid = PV.validate(PV.Call(**arguments), stage=_stage)
        return plan(valid), valid.staged, valid.want_lse, valid.device

    def _read_at_each_call(self, kwargs):
        return ("attn_mask", "pse_shift")

    def _results(self, query, out, lse, on_device):
        if not on_device and torch_tensors.is_tensor(query):
            out = torch_tensors.as_tensor(out)
            lse = None if lse is None else torch_tensors.as_tensor(lse)
        return (out, lse) if self._lse_flag else out


def trans_quant_param(scale):
    """Ascend's packed uint64 form of float32 dequantization scales (``deq_scale1/2``).

    ``(bits(float32(scale)) & 0xFFFFE000) | (1 << 46)`` elementwise: the 13 low mantissa bits
    are dropped, bit 46 marks the packed form. ``prompt_flash_attention`` decodes it as
    ``float32_from_bits(u64 & 0xFFFFE000)``::

        >>> deq1 = trans_quant_param(np.array([0.05], np.float32))
        >>> deq1.dtype, hex(int(deq1[0]))
        (dtype('uint64'), '0x40003d4cc000')
    """
    bits = np.asarray(scale, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (bits & np.uint64(0xFFFFE000)) | np.uint64(1 << 46)


def explain(query, key, value, *args, **kwargs):
    """Which kernel ``prompt_flash_attention(query, key, value, *args, **kwargs)`` gets and why
    every other kernel of its device was not taken, as text; the call is checked (raising its
    errors) and planned, not run::

        >>> print(explain(q, k, v, num_heads=8, input_layout="BNSD"))   # doctest: +SKIP
        the cpu avx512-tiles kernel runs this call: tiles of query rows x kv columns, ...
          and: a plan (PfaPlan, FiaPlan) runs whole calls for arrays its planned kernels ...
          not int8: float16 inputs (it takes int8)
          ...

    The ``and:`` lines say what can run beside the kernel or instead of it. Keyword-only
    ``compute_capability`` ((major, minor)) and ``sms`` explain a ``device="cuda"`` call for
    such a GPU, none needed here.
    """
    return PfaPlan.explain(query, key, value, *args, **kwargs)
