"""The SDPA drop-in in grad mode against torch's CPU SDPA, side by side in one run: forward plus
backward of causal attention, and what the transformers features cost on top of the plain
forward (softcap, sinks, the attention weights of output_attentions).

    python benchmarks/sdpa_training.py [--quick] [--repeats 5] [--out FILE.md]

Repeats alternate between the implementations; the tables give medians and the ratio
torch / pfa_numba (> 1: pfa_numba is faster). torch has no softcap, sinks or weights in its
SDPA: those rows compare with the eager attention written with torch's ops (as transformers'
"eager" computes them). Needs the [transformers] extra (torch).
"""
import argparse
import statistics
import time

import torch

from pfa_numba import scaled_dot_product_attention
from pfa_numba.cli.bench import environment
from pfa_numba.sdpa import attention_with_weights

SHAPES = [(1, 16, 2048, 128, 4), (4, 16, 512, 64, 4)]       # B, Hq, S, D, Hq / Hkv
QUICK = [(1, 8, 512, 64, 4)]


def _inputs(b, hq, s, d, group, dtype, grad):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, s, d, generator=g).to(dtype).requires_grad_(grad)
    k, v = (torch.randn(b, hq // group, s, d, generator=g).to(dtype).requires_grad_(grad)
            for _ in range(2))
    return q, k, v


def _eager(q, k, v, softcap=None, sinks=None, weights=False):
    """transformers' eager attention, causal, in torch's ops."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1).to(s.dtype)], -1)
    p = torch.softmax(s, -1)[..., :k.shape[-2]]
    return (p @ v, p) if weights else p @ v


def _time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _side_by_side(cases, repeats):
    """{name: median seconds} of each case, the cases' repeats alternating."""
    for fn in cases.values():
        fn()                                    # compiles, warms caches
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name] += _time(fn, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def training_rows(shapes, repeats):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            q, k, v = _inputs(*shape, dtype, True)
            dout = torch.randn(q.shape).to(dtype)

            def ours():
                scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=True).backward(dout)

            def peer():
                torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True).backward(dout)
            t = _side_by_side({"ours": ours, "torch": peer}, repeats)
            rows.append((str(dtype).split(".")[1], shape, t["ours"], t["torch"]))
    return rows


def feature_rows(shape, repeats):
    q, k, v = _inputs(*shape, torch.float32, False)
    sinks = torch.linspace(-1.0, 2.0, q.shape[1])
    kw = dict(is_causal=True, enable_gqa=True)
    cases = {
        "plain forward": (lambda: scaled_dot_product_attention(q, k, v, **kw),
                          lambda: _eager(q, k, v)),
        "softcap 50": (lambda: scaled_dot_product_attention(q, k, v, softcap=50.0, **kw),
                       lambda: _eager(q, k, v, softcap=50.0)),
        "sinks": (lambda: scaled_dot_product_attention(q, k, v, sinks=sinks, **kw),
                  lambda: _eager(q, k, v, sinks=sinks)),
        "output + weights": (lambda: attention_with_weights(q, k, v, **kw),
                             lambda: _eager(q, k, v, weights=True)),
    }
    rows = []
    with torch.no_grad():
        for name, (ours, eager) in cases.items():
            t = _side_by_side({"ours": ours, "eager": eager}, repeats)
            rows.append((name, t["ours"], t["eager"]))
    return rows


def report(train, features, shape):
    lines = ["## Forward + backward, causal, GQA: pfa_numba vs torch SDPA (CPU)", "",
             "| dtype | (B, Hq, S, D, group) | pfa_numba ms | torch ms | torch / pfa_numba |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {dt} | {sh} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |"
              for dt, sh, a, b in train]
    lines += ["", f"## Feature costs, float32 forward {shape}: pfa_numba vs eager torch ops",
              "", "| call | pfa_numba ms | eager ms | eager / pfa_numba |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |"
              for name, a, b in features]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes = QUICK if args.quick else SHAPES
    text = environment() + "\n" + report(training_rows(shapes, args.repeats),
                                         feature_rows(shapes[-1], args.repeats), shapes[-1])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
