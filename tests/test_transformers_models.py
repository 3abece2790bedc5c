"""The decoder families of transformers on pfa_numba against their own "eager" attention: tiny
random configs built with transformers' classes (nothing is downloaded), sliding windows shorter
than the prompts, head dims 16 and 8 (bfloat16 below Ascend's multiple of 16), multi-head latent
attention (a value head dim of its own: DeepSeek-V3, MiniCPM3), prefill logits
with and without padding, in float32 and bfloat16, with grad mode off and on, greedy
generation with the KV cache, and a fine-tuning step's gradients; and an encoder-decoder,
Whisper (head dim 4, cross-attention).

Tolerances: float32 results within 32 float32 ulps of the eager result's largest magnitude;
bfloat16 logits within twice the error of eager's own bfloat16 run (both against eager in
float32)."""
import pytest

torch = pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
transformers = pytest.importorskip("transformers",
                                   reason="transformers comes with the [transformers] extra")

import pfa_numba.integrations.transformers as pfa_hf   # noqa: E402
from test_transformers import VOCAB, _batch as padded_batch   # noqa: E402

NAME = pfa_hf.register()
WINDOW = 8                          # shorter than every prompt below
LAYERS = ["sliding_attention", "full_attention"]
F32_TOL = 32 * torch.finfo(torch.float32).eps


def _configs():
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0)
    small = dict(common, hidden_size=32, bos_token_id=1, eos_token_id=2)
    mla = dict(common, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, bos_token_id=1,
               eos_token_id=2)
    return {
        "llama": lambda: transformers.LlamaConfig(head_dim=16, **common),
        "mistral": lambda: transformers.MistralConfig(head_dim=16, sliding_window=WINDOW,
                                                      **common),
        "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=True, layer_types=LAYERS,
                                                  sliding_window=WINDOW, **common),
        "gemma2": lambda: transformers.Gemma2Config(head_dim=16, sliding_window=WINDOW,
                                                    layer_types=LAYERS,
                                                    attn_logit_softcapping=2.0, **common),
        "gemma3": lambda: transformers.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW,
                                                        layer_types=LAYERS, **common),
        "phi3": lambda: transformers.Phi3Config(sliding_window=WINDOW, **common),
        "gpt_oss": lambda: transformers.GptOssConfig(head_dim=16, sliding_window=WINDOW,
                                                     layer_types=LAYERS, num_local_experts=4,
                                                     num_experts_per_tok=2, **common),
        # head dim 8: bfloat16 below Ascend's multiple of 16, which the drop-in takes
        "granite": lambda: transformers.GraniteConfig(**small),
        "cohere2": lambda: transformers.Cohere2Config(sliding_window=WINDOW, layer_types=LAYERS,
                                                      **small),
        # multi-head latent attention: query / key head dim 16 + 8 (rope), value's 12
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, moe_intermediate_size=32, **mla),
        "minicpm3": lambda: transformers.MiniCPM3Config(**mla),
    }


CONFIGS = _configs()
FAMILIES = list(CONFIGS)
_MODELS = {}


def _model(family, dtype=torch.float32):
    """The family's model with the same random weights for every dtype; gemma2's cap and
    gpt-oss's sinks at the scores' size, so that they shape the results."""
    if family not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](),
                                                              attn_implementation="eager")
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.self_attn, "sinks"):
                    layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
        _MODELS[family] = model.eval()
    base = _MODELS[family]
    model = type(base)(base.config).eval()
    model.load_state_dict(base.state_dict())
    return model.to(dtype)


def _batch(padding, length=21):
    """Three rows of ``length`` tokens with ``padding`` ('left', 'right' or 'none'): row 1
    loses 6, row 2 loses 2."""
    return padded_batch(padding, length, pads=((1, 6), (2, 2)))


def _logits(model, attn, ids, mask, grad):
    model.set_attn_implementation(attn)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.requires_grad == grad
    return logits.detach().float()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_eager(family, padding, grad):
    model = _model(family)
    ids, mask = _batch(padding)
    real = mask.bool()                # padded positions' logits are not defined by either
    want = _logits(model, "eager", ids, mask, grad)[real]
    got = _logits(model, NAME, ids, mask, grad)[real]
    assert (got - want).abs().max() <= F32_TOL * want.abs().max()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_within_twice_eagers_own_error(family, grad):
    ids, mask = _batch("left")
    real = mask.bool()
    exact = _logits(_model(family), "eager", ids, mask, False)[real]
    model = _model(family, torch.bfloat16)
    eager_error = (_logits(model, "eager", ids, mask, grad)[real] - exact).abs().max()
    ours_error = (_logits(model, NAME, ids, mask, grad)[real] - exact).abs().max()
    assert 0 < ours_error <= 2 * eager_error


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(family):
    """Prefill, then decode steps against the KV cache (query length 1), the prompt longer
    than the sliding window."""
    model = _model(family)
    ids, mask = _batch("left", length=13)
    runs = {}
    for attn in ("eager", NAME):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            runs[attn] = model.generate(ids, attention_mask=mask, max_new_tokens=10,
                                        do_sample=False, pad_token_id=0)
    assert runs[NAME].shape == (ids.shape[0], ids.shape[1] + 10)
    assert torch.equal(runs[NAME], runs["eager"])


def _labels(ids, mask):
    """The next-token labels of a left-padded batch, -100 where the input or the position
    predicting it is padding (padded rows' outputs are not defined by either attention)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fine_tuning_step_has_eagers_gradients(family):
    model = _model(family).train()
    ids, mask = _batch("left")
    losses, grads = {}, {}
    for attn in ("eager", NAME):
        model.set_attn_implementation(attn)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask)).loss
        loss.backward()
        losses[attn] = loss.item()
        grads[attn] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    assert abs(losses[NAME] - losses["eager"]) <= F32_TOL * abs(losses["eager"])
    assert grads[NAME].keys() == grads["eager"].keys()
    attention_params = [n for n in grads["eager"] if "self_attn" in n]
    assert attention_params
    for name, want in grads["eager"].items():
        err = (grads[NAME][name] - want).abs().max()
        assert err <= F32_TOL * want.abs().max(), name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()                  # and the tuned model still runs on it
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()


def test_gpt_oss_sinks_get_gradients():
    model = _model("gpt_oss").train()
    model.set_attn_implementation(NAME)
    ids, mask = _batch("none")
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    sinks = [layer.self_attn.sinks.grad for layer in model.model.layers]
    assert all(g is not None and g.abs().max() > 0 for g in sinks)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_output_attentions_match_eagers_weights(family):
    model = _model(family)
    ids, mask = _batch("left")
    runs = {}
    for attn in ("eager", NAME):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            runs[attn] = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(runs[NAME].attentions) == len(runs["eager"].attentions) == 2
    real = mask.bool()
    for got, want in zip(runs[NAME].attentions, runs["eager"].attentions):
        assert got.shape == want.shape and got.dtype == want.dtype
        rows = real[:, None, :, None].expand_as(want)          # the real query rows
        assert (got - want)[rows].abs().max() <= F32_TOL
    assert torch.equal(runs[NAME].logits.float(), _logits(model, NAME, ids, mask, False))


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_a_compiled_model_runs_on_it_without_graph_breaks(family):
    """torch.compile(fullgraph=True) of a model's forward (transformers' own compile tests
    do this with "sdpa"): the attention is one opaque operator to the compiler."""
    model = _model(family)
    ids, mask = _batch("left")
    real = mask.bool()
    want = _logits(model, "eager", ids, mask, False)[real]
    model.set_attn_implementation(NAME)
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).logits.float()[real]
    assert (got - want).abs().max() <= F32_TOL * want.abs().max()


def test_output_attentions_under_torch_compile():
    """The weights' slow pass runs outside the compiled graph (no crash, eager's weights)."""
    model = _model("llama")
    ids, mask = _batch("left")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model.set_attn_implementation(NAME)
    compiled = torch.compile(model.forward, backend="aot_eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    rows = mask.bool()[:, None, :, None].expand_as(want[0])
    assert all((a - b)[rows].abs().max() <= F32_TOL for a, b in zip(got, want))


def _whisper(dtype=torch.float32):
    """A tiny random Whisper (head dim 4): an encoder, a causal decoder and its cross-attention
    over the encoder's states, the same weights for every dtype."""
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=30, max_target_positions=40,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config).eval().to(dtype)


def _whisper_logits(model, attn, dtype, grad=False):
    """Logits of two clips' features and their left-padded decoder tokens (row 1 loses 2),
    at the decoder's real positions."""
    g = torch.Generator().manual_seed(1)
    features = torch.randn(2, 8, 60, generator=g).to(dtype)
    tokens = torch.randint(4, VOCAB, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    model.set_attn_implementation(attn)
    with torch.set_grad_enabled(grad):
        logits = model(input_features=features, decoder_input_ids=tokens,
                       decoder_attention_mask=mask).logits
    return logits.detach().float()[mask.bool()]


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_whisper_encoder_decoder_and_cross_attention_match_eager(grad):
    """float32 within 32 ulps of eager's largest logit; bfloat16 at head dim 4 within twice
    eager's own bfloat16 error."""
    exact = _whisper_logits(_whisper(), "eager", torch.float32)
    got = _whisper_logits(_whisper(), NAME, torch.float32, grad)
    assert (got - exact).abs().max() <= F32_TOL * exact.abs().max()
    half = _whisper(torch.bfloat16)
    eager_error = (_whisper_logits(half, "eager", torch.bfloat16, grad) - exact).abs().max()
    ours_error = (_whisper_logits(half, NAME, torch.bfloat16, grad) - exact).abs().max()
    assert 0 < ours_error <= 2 * eager_error


def test_whisper_generation_matches_eager():
    model = _whisper()
    features = torch.randn(2, 8, 60, generator=torch.Generator().manual_seed(2))
    runs = {}
    for attn in ("eager", NAME):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            runs[attn] = model.generate(input_features=features, max_new_tokens=8,
                                        do_sample=False)
    assert torch.equal(runs[NAME], runs["eager"])
