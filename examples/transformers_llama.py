"""A Hugging Face model on pfa_numba: one line registers it, one argument selects it.

A randomly initialised Llama with grouped-query attention (nothing is downloaded) runs a
padded batch and a greedy generation with attn_implementation="pfa_numba", checked against
the same model on torch's "sdpa". Needs the [transformers] extra.
"""
try:
    import torch
    import transformers
except ImportError:
    print("SKIP: needs torch and transformers (the transformers extra: "
          "python -m pip install -e '.[transformers]' in a checkout)")
    raise SystemExit(0)

import pfa_numba.integrations.transformers as pfa_hf

pfa_hf.register()                     # attention + mask function, under the name "pfa_numba"

config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=2, pad_token_id=0)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="pfa_numba")
model.eval()

# a batch of two prompts, the second left-padded by 6 tokens
ids = torch.randint(1, 1000, (2, 24))
mask = torch.ones_like(ids)
ids[1, :6], mask[1, :6] = 0, 0

with torch.inference_mode():
    logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    model.set_attn_implementation("sdpa")           # the same weights on torch's attention
    want_logits = model(input_ids=ids, attention_mask=mask).logits
    want_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)

err = (logits - want_logits)[mask.bool()].abs().max().item()
print(f"logits: max |pfa_numba - sdpa| = {err:.1e} over the real tokens")
print(f"generated: {tokens[0, 24:].tolist()}")
assert err <= 1e-4, err
assert torch.equal(tokens, want_tokens), "greedy generations differ"
print("OK")
