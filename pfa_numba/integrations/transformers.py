"""Hugging Face transformers models on pfa_numba: one call registers the attention.

    import pfa_numba.integrations.transformers as pfa_hf
    pfa_hf.register()                                   # name "pfa_numba"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="pfa_numba")
    # or: model.set_attn_implementation("pfa_numba")

:func:`register` registers two things under one name, because transformers needs both: the
attention function (:func:`attention_forward`, which runs
:func:`pfa_numba.scaled_dot_product_attention`) and the mask function that builds the masks
that function reads. The mask function is transformers' own ``sdpa_mask``: a bool
(batch, 1, q, kv) mask, True = take part, or None where the causal band alone says it all.
Without a registered mask function transformers passes ``attention_mask=None`` and padding is
silently ignored.

What a model then gets is what ``attn_implementation="sdpa"`` gives: causal prefill, left and
right padding, KV-cache decoding in ``generate()``, grouped-query attention (the kv heads are
read once per group, never repeated) and sliding windows (the band of the mask; the kernels
skip the kv tiles outside it), in float32, float16 and bfloat16 at any head dim, with
multi-head latent attention's value head dim of its own (DeepSeek-V3, MiniCPM3); in grad
mode too (training and fine-tuning on the CPU: the backward is pfa_numba's,
:mod:`pfa_numba.cpu.backward`). A model on CUDA tensors runs on the CUDA kernels (the
forward; a backward there raises NotImplementedError).
"""
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..interop import torch_ops  # noqa: F401  (the operator, registered before any compile)
from ..sdpa import attention_with_weights, scaled_dot_product_attention

#: the name :func:`register` uses unless told another
NAME = "pfa_numba"


def register(name=NAME):
    """Register pfa_numba's attention and its mask function with transformers as ``name``;
    then ``attn_implementation=name`` selects it. Returns ``name``."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function interface on pfa_numba.

    query (batch, heads, q, head_dim), key / value (batch, kv_heads, kv, head_dim);
    attention_mask the bool mask of ``sdpa_mask`` or a float mask added to the scores, or None.
    Returns (output (batch, q, heads, head_dim), None), or with ``output_attentions`` (output,
    attention weights (batch, heads, q, kv)), the weights by a slow second pass
    (:func:`pfa_numba.sdpa.attention_with_weights`; they carry no gradient, the output does).
    ``softcap`` (Gemma 2's attention logit softcapping) caps the scaled scores; ``s_aux``
    (gpt-oss's attention sinks, a logit a head) joins the softmax denominators. A keyword
    outside :data:`NEUTRAL_KEYWORDS` that asks for something (not None or False: other sinks,
    ``position_bias``, ...), and a nonzero dropout, are refused with a ValueError naming them:
    the result would otherwise be computed without them."""
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    with_weights = bool(kwargs.pop("output_attentions", False))
    _refuse_unsupported(dropout, kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length = query.shape[2]
    # the weights' second pass is NumPy work outside the operator: torch.compile runs it eagerly
    attend = torch.compiler.disable(attention_with_weights) if with_weights \
        else scaled_dot_product_attention
    result = attend(
        query, key, value, attention_mask, scale=scaling,
        # a single query row attends to the whole cache; a mask already holds the band
        is_causal=bool(is_causal and q_length > 1 and attention_mask is None),
        enable_gqa=query.shape[1] != key.shape[1], softcap=softcap, sinks=sinks)
    out, weights = result if with_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


#: the keywords models pass to an attention function that change nothing here: the mask holds
#: the sliding window and packed sequences' bounds (as for transformers' "sdpa"), the others
#: are the model's bookkeeping
NEUTRAL_KEYWORDS = frozenset({
    "sliding_window", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "position_ids", "cache_position", "past_key_values", "use_cache", "layer_idx",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict"})


def _refuse_unsupported(dropout, kwargs):
    named = ["dropout"] if dropout != 0.0 else []
    named += [name for name, value in kwargs.items()
              if name not in NEUTRAL_KEYWORDS and value is not None and value is not False]
    if named:
        given = ", ".join(f"{n}={_given(n, dropout, kwargs)}" for n in named)
        raise ValueError(f"pfa_numba attention does not support {', '.join(named)} (given "
                         f"{given}): use attn_implementation='eager' for them")


def _given(name, dropout, kwargs):
    value = dropout if name == "dropout" else kwargs.get(name)
    return f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
        else repr(value)
