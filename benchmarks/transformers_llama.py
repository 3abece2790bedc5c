"""A random Llama (grouped-query attention) on the CPU with attn_implementation "pfa_numba"
against "sdpa", side by side in one run: a whole prefill, a decode loop (greedy generation
after the prompt), and single decode attention calls (query length 1 against a long cache).

    python benchmarks/transformers_llama.py [--quick] [--repeats 5] [--out FILE.md]

Repeats alternate between the two implementations; the tables give medians, the ratio
sdpa / pfa_numba of each (> 1: pfa_numba is faster) and the share of each run spent in the
attention function (timed around it). Needs the [transformers] extra.
"""
import argparse
import dataclasses
import statistics
import sys
import time

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import pfa_numba
from pfa_numba import config
from pfa_numba.cli.bench import environment
from pfa_numba.integrations import transformers as pfa_hf


@dataclasses.dataclass
class Setup:
    layers: int = 4
    hidden: int = 1024
    heads: int = 8              # head dim 128
    kv_heads: int = 2           # 4 query heads per kv head
    intermediate: int = 2816
    vocab: int = 8192
    prompt: int = 2048
    new_tokens: int = 64

    def config(self):
        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=self.prompt + 256)


QUICK = Setup(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=512, prompt=256,
              new_tokens=8)


class AttentionTimer:
    """The attention function of ``implementation`` registered under a new name, timed."""

    def __init__(self, implementation, forward):
        self.name = f"{implementation}-timed"
        self.seconds = 0.0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        AttentionInterface.register(self.name, timed)
        AttentionMaskInterface.register(self.name, sdpa_mask)


def _timed(model, timer, work):
    model.set_attn_implementation(timer.name)
    timer.seconds = 0.0
    t0 = time.perf_counter()
    with torch.inference_mode():
        work(model)
    return time.perf_counter() - t0, timer.seconds


def model_rows(setup, repeats):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(setup.config(),
                                                          attn_implementation="sdpa").eval()
    ids = torch.randint(0, setup.vocab, (1, setup.prompt))
    timers = {"sdpa": AttentionTimer("sdpa", sdpa_attention_forward),
              "pfa_numba": AttentionTimer("pfa_numba", pfa_hf.attention_forward)}

    def prefill(m):
        m(input_ids=ids, logits_to_keep=1)

    def decode(m):
        m.generate(ids, max_new_tokens=setup.new_tokens, do_sample=False,
                   min_new_tokens=setup.new_tokens, pad_token_id=0)

    rows = []
    for label, work in ((f"prefill, {setup.prompt} tokens", prefill),
                        (f"generate {setup.new_tokens} tokens after {setup.prompt}", decode)):
        times = {name: [] for name in timers}
        for r in range(repeats + 1):                   # round 0: warm-up (JIT, caches)
            for name, timer in timers.items():
                wall, attn = _timed(model, timer, work)
                if r:
                    times[name].append((wall, attn))
        rows.append((label, {name: _medians(t) for name, t in times.items()}))
    return rows


def _medians(pairs):
    return statistics.median(w for w, _ in pairs), statistics.median(a for _, a in pairs)


def decode_call_rows(setup, repeats, lengths):
    """One attention call, query length 1 against kv caches of ``lengths``, B = 1, the model's
    heads and one kv head: pfa_numba (split-kv, and with the split switched off) against torch
    SDPA."""
    rows = []
    d = setup.hidden // setup.heads
    for kv_heads, s in ((h, s) for h in (setup.kv_heads, 1) for s in lengths):
        g = torch.Generator().manual_seed(s)
        q = torch.randn(1, setup.heads, 1, d, generator=g)
        k, v = (torch.randn(1, kv_heads, s, d, generator=g) for _ in range(2))
        calls = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                             enable_gqa=True),
            "pfa_numba": lambda: pfa_numba.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "pfa_numba, no split": lambda: _without_split(
                lambda: pfa_numba.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        }
        want = calls["sdpa"]()
        assert (calls["pfa_numba"]() - want).abs().max() < 1e-5
        times = {name: [] for name in calls}
        for r in range(repeats + 1):
            for name, call in calls.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    call()
                if r:
                    times[name].append((time.perf_counter() - t0) / 10)
        rows.append((kv_heads, s, {name: statistics.median(t) for name, t in times.items()}))
    return rows


def _without_split(call):
    saved = config.CPU_SPLIT_KV_ITEMS
    config.CPU_SPLIT_KV_ITEMS = 0
    try:
        return call()
    finally:
        config.CPU_SPLIT_KV_ITEMS = saved


def markdown(setup, model, calls, repeats):
    lines = [f"Random Llama: {setup.layers} layers, hidden {setup.hidden}, {setup.heads} heads "
             f"of {setup.hidden // setup.heads}, {setup.kv_heads} kv heads, float32, batch 1; "
             f"medians of {repeats} alternating repeats. {environment()}.", "",
             "| run | sdpa s | pfa_numba s | sdpa / pfa_numba | attention share, sdpa | "
             "attention share, pfa_numba | attention, sdpa / pfa_numba |",
             "|---|---|---|---|---|---|---|"]
    for label, m in model:
        (ws, as_), (wp, ap) = m["sdpa"], m["pfa_numba"]
        lines.append(f"| {label} | {ws:.3f} | {wp:.3f} | {ws / wp:.2f} | {as_ / ws:.0%} | "
                     f"{ap / wp:.0%} | {as_ / ap:.2f} |")
    lines += ["", f"One decode attention call (B = 1, {setup.heads} query heads, head dim "
              f"{setup.hidden // setup.heads}, float32):", "",
              "| kv heads | kv length | sdpa us | pfa_numba us | pfa_numba without split-kv us | "
              "sdpa / pfa_numba |", "|---|---|---|---|---|---|"]
    for h, s, t in calls:
        lines.append(f"| {h} | {s} | {t['sdpa'] * 1e6:.0f} | {t['pfa_numba'] * 1e6:.0f} | "
                     f"{t['pfa_numba, no split'] * 1e6:.0f} | {t['sdpa'] / t['pfa_numba']:.2f} |")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    setup = QUICK if args.quick else Setup()
    torch.set_num_threads(pfa_numba_threads())
    lengths = (256, 1024) if args.quick else (2048, 8192, 32768)
    text = markdown(setup, model_rows(setup, args.repeats),
                    decode_call_rows(setup, args.repeats, lengths), args.repeats)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def pfa_numba_threads():
    """torch gets as many threads as pfa_numba's kernels use."""
    import numba
    return int(config.CPU_THREADS or numba.get_num_threads())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
