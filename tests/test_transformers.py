"""Hugging Face models with attn_implementation="pfa_numba" against the same models on "sdpa":
randomly initialised from configs (nothing is downloaded), logits and greedy generations."""
import pytest

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
transformers = pytest.importorskip("transformers",
                                   reason="transformers comes with the [transformers] extra")

import pfa_numba.integrations.transformers as pfa_hf   # noqa: E402

NAME = pfa_hf.register()
VOCAB = 256
#: the same model tests on the CPU and, where torch has a GPU, on CUDA tensors
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA tensors need a GPU and a CUDA build of torch"))]


def _config(family):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0)
    if family == "llama":                               # grouped-query attention, 4 per kv head
        return transformers.LlamaConfig(**common)
    return transformers.MistralConfig(sliding_window=12, **common)   # window < the sequences


_MODELS = {}


def _model(family, dtype, device="cpu"):
    """The same random weights for every dtype, device and attention of one family."""
    if family not in _MODELS:
        torch.manual_seed(0)
        _MODELS[family] = transformers.AutoModelForCausalLM.from_config(
            _config(family), attn_implementation="sdpa").eval()
    base = _MODELS[family]
    model = type(base)(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model.to(device=device, dtype=dtype)


def _batch(padding, length=29, batch=3, device="cpu", pads=((1, 9), (2, 3))):
    """Token ids and attention mask with ``padding`` ('left', 'right' or 'none'): each (row,
    count) of ``pads`` loses count tokens (row 1 loses 9, row 2 loses 3)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padding != "none":
        for row, pad in pads:
            cols = slice(0, pad) if padding == "left" else slice(length - pad, length)
            mask[row, cols] = 0
            ids[row, cols] = 0
    return ids.to(device), mask.to(device)


def _logits(model, attn, ids, mask):
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_float32_logits_match_sdpa(family, padding, device):
    model = _model(family, torch.float32, device)
    ids, mask = _batch(padding, device=device)
    want = _logits(model, "sdpa", ids, mask)
    got = _logits(model, NAME, ids, mask)
    real = mask.bool()                # padded positions' logits are not defined by either
    assert (got[real] - want[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_16bit_logits_within_twice_sdpas_own_error(family, dtype, device):
    ids, mask = _batch("left", device=device)
    real = mask.bool()
    exact = _logits(_model(family, torch.float32, device), "sdpa", ids, mask)[real]
    model = _model(family, dtype, device)
    sdpa_error = (_logits(model, "sdpa", ids, mask)[real] - exact).abs().max()
    ours_error = (_logits(model, NAME, ids, mask)[real] - exact).abs().max()
    assert 0 < ours_error <= 2 * sdpa_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_generation_matches_sdpa(family, padding, device):
    """Prefill and then decode steps against the KV cache (query length 1), the sliding window
    passing the prompt's length on the way."""
    model = _model(family, torch.float32, device)
    ids, mask = _batch(padding, length=9, device=device)
    runs = {}
    for attn in ("sdpa", NAME):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            runs[attn] = model.generate(ids, attention_mask=mask, max_new_tokens=12,
                                        do_sample=False, pad_token_id=0)
    assert runs[NAME].shape == (ids.shape[0], ids.shape[1] + 12)
    assert torch.equal(runs[NAME], runs["sdpa"])


def test_from_config_selects_it_by_name():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"),
                                                          attn_implementation=NAME)
    assert model.config._attn_implementation == NAME


def _attention_inputs():
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    return torch.nn.Module(), q, k, v


@pytest.mark.parametrize("kwargs, named", [
    (dict(dropout=0.1), "dropout"),
    (dict(position_bias=torch.zeros(1, 4, 5, 5)), "position_bias"),
    (dict(position_bias=torch.zeros(2, 4, 5, 5)),
     r"position_bias \(given position_bias=tensor of shape \(2, 4, 5, 5\)"),
    (dict(sinks=torch.zeros(4)), "sinks"),
    (dict(head_mask=torch.ones(4)), "head_mask"),
    (dict(a_keyword_of_tomorrow=1), "a_keyword_of_tomorrow"),
])
def test_arguments_it_cannot_honour_are_refused_by_name(kwargs, named):
    """An allow-list: whatever changes the computation and is not done is refused, a keyword
    it does not know included."""
    with pytest.raises(ValueError, match=f"does not support {named}"):
        pfa_hf.attention_forward(*_attention_inputs(), None, **kwargs)


def test_keywords_that_change_nothing_are_taken():
    """The model's bookkeeping, the hints the mask already holds, and features asked off."""
    module, q, k, v = _attention_inputs()
    want, _ = pfa_hf.attention_forward(module, q, k, v, None)
    got, _ = pfa_hf.attention_forward(
        module, q, k, v, None, sliding_window=3, position_ids=torch.arange(5)[None],
        use_cache=True, output_router_logits=False, cu_seq_lens_q=None, softcap=None,
        s_aux=None, output_attentions=False, position_bias=None)
    assert torch.equal(got, want)


def test_gemma2_logit_softcapping_matches_eager():
    """Gemma 2 passes its attention logit softcapping as ``softcap`` (a small cap here, so that
    it shapes the result), with sliding windows on every other layer."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        pad_token_id=0, attn_logit_softcapping=1.5, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():             # scores of a few units: the cap shapes them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
    ids, mask = _batch("left", length=20)
    want = _logits(model, "eager", ids, mask)
    got = _logits(model, NAME, ids, mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() <= 1e-4
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = _logits(model, NAME, ids, mask)
    assert (uncapped[real] - want[real]).abs().max() > 1e-2


def test_matches_sdpa_attention_forward_directly():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module, q, k, v = _attention_inputs()
    module.num_key_value_groups = 2
    mask = torch.rand(1, 1, 5, 5) < 0.8
    mask[..., 0] = True
    for attention_mask in (None, mask):
        got, _ = pfa_hf.attention_forward(module, q, k, v, attention_mask, scaling=0.3)
        want, _ = sdpa_attention_forward(module, q, k, v, attention_mask, scaling=0.3)
        assert got.shape == want.shape == (1, 5, 4, 16)
        assert (got - want).abs().max() <= 2e-6


def test_the_plugin_for_transformers_own_tests_routes_sdpa_here():
    """scripts/transformers_as_sdpa.py, in a process of its own (it changes transformers'
    global mapping): a model on "sdpa" then calls pfa_numba's attention."""
    import pathlib
    import subprocess
    import sys
    scripts = pathlib.Path(__file__).resolve().parent.parent / "scripts"
    program = (
        "import sys; sys.path.insert(0, sys.argv[1]); import transformers_as_sdpa\n"
        "import torch, transformers, pfa_numba.sdpa as s\n"
        "calls = []\n"
        "real = s.scaled_dot_product_attention\n"
        "import pfa_numba.integrations.transformers as h\n"
        "h.scaled_dot_product_attention = lambda *a, **k: calls.append(1) or real(*a, **k)\n"
        "c = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.AutoModelForCausalLM.from_config(c, attn_implementation='sdpa')\n"
        "with torch.no_grad(): m(input_ids=torch.ones(1, 5, dtype=torch.long))\n"
        "assert len(calls) == 2, calls\n")
    res = subprocess.run([sys.executable, "-c", program, str(scripts)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
