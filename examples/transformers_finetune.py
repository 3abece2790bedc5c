"""Fine-tuning a Hugging Face model on the CPU with pfa_numba's attention: its backward is
pfa_numba's (FlashAttention-2's, in Numba), so a training loop needs nothing but the name.

A randomly initialised Gemma 2 (softcapped attention logits, a sliding window on every other
layer; nothing is downloaded) takes a few AdamW steps on a padded batch with
attn_implementation="pfa_numba", and the same steps from the same weights with "eager"; the
losses of the two runs agree step by step. Needs the [transformers] extra.
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

config = transformers.Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, sliding_window=16,
                                   pad_token_id=0)
torch.manual_seed(0)
initial = transformers.AutoModelForCausalLM.from_config(config).state_dict()

# four sequences of 40 tokens, the last two left-padded; the loss skips what padding predicts
ids = torch.randint(1, 512, (4, 40), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(ids)
mask[2, :7], mask[3, :15] = 0, 0
ids = ids.masked_fill(mask == 0, 0)
labels = ids.masked_fill(mask == 0, -100)
labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)


def train(attn, steps=4):
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.load_state_dict(initial)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()                          # through pfa_numba's backward
        optimizer.step()
        losses.append(loss.item())
    return losses


ours, eager = train("pfa_numba"), train("eager")
for step, (a, b) in enumerate(zip(ours, eager)):
    print(f"step {step}: loss {a:.6f} (pfa_numba)  {b:.6f} (eager)")
assert ours[-1] < ours[0], "the loss went down"
assert max(abs(a - b) for a, b in zip(ours, eager)) <= 1e-4 * abs(eager[0])
print("OK")
