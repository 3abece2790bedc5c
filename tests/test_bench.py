"""The benchmark harness on a tiny case: every implementation timed and checked, the table and
the plot written. (Times are reported, never asserted.)"""
import dataclasses
import pathlib

import numpy as np
import pytest

from pfa_numba.cli import bench as _bench


def test_harness_times_checks_and_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(_bench, "QUIET_S", 0.0)
    cases = [_bench.Case("fp32 causal tiny", 1, 2, 64, 16, mode="causal"),
             _bench.Case("fp16 band tiny", 1, 2, 64, 16, dtype="fp16", mode="band", band=8),
             _bench.Case("fp32 GQA BSH varlen tiny", 1, 4, 64, 16, nkv=2, layout="BSH",
                         varlen=True)]
    results = _bench.run(cases, repeats=2, progress=False, gemm_n=64)
    assert [r["case"].name for r in results] == [c.name for c in cases]
    for r in results:
        assert r["err"] < 1e-2                          # checked against the reference
        assert r["ratio"]["pfa_numba"] == 1.0
        assert all(t > 0 for t in r["med"].values())
        assert ("numpy" in r["med"]) == (r["case"].dtype == "fp32")
        # against NumPy's sgemm timed in the same repeats: (F / t_pfa) / (2 n^3 / t_sgemm)
        t = {name: np.array(x) for name, x in r["times"].items()}
        assert len(t["sgemm"]) == len(t["pfa_numba"]) == 2 and "sgemm" not in r["tflops"]
        assert np.isclose(r["gemm_share"], np.median(t["sgemm"] / t["pfa_numba"])
                          * r["case"].useful_flops() / (2 * 64 ** 3))
        # GQA / BSH / varlen cases: time per useful FLOP against dense BNSD MHA, same repeats
        assert (r["per_flop"] is not None) == (r["case"].baseline() is not None)
    assert results[2]["per_flop"] > 0 and "baseline" in results[2]["med"]
    table = _bench.markdown(results, peak_tflops=0.1)
    assert all(c.name in table for c in cases)
    _bench.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_useful_flops_count_kept_pairs_only():
    dense = _bench.Case("d", 1, 1, 8, 4)
    causal = dataclasses.replace(dense, mode="causal")
    band = dataclasses.replace(dense, mode="band", band=1)
    assert dense.useful_flops() == 4 * 4 * 64
    assert causal.useful_flops() == 4 * 4 * 36
    i = np.arange(8)
    assert band.useful_flops() == 4 * 4 * int(((np.abs(i[:, None] - i[None, :])) <= 1).sum())


def test_baseline_is_the_dense_bnsd_mha_case_of_the_same_shape():
    gqa = _bench.Case("g", 1, 4, 8, 4, nkv=2, layout="BSH")
    base = gqa.baseline()
    assert (base.B, base.N, base.S, base.D, base.dtype, base.mode) == (1, 4, 8, 4, "fp32", "dense")
    assert (base.kv_heads, base.layout, base.varlen) == (4, "BNSD", False)
    assert base.useful_flops() == gqa.useful_flops()
    assert base.baseline() is None
    varlen = _bench.Case("v", 1, 4, 8, 4, varlen=True)      # lengths 4 of 8
    base = varlen.baseline()
    assert (base.S, base.varlen) == (4, False)
    assert base.useful_flops() == varlen.useful_flops()


def test_first_call_runs_both_programs_in_fresh_processes():
    pfa, floor = _bench.first_call(repeats=1)
    assert len(pfa) == len(floor) == 1 and pfa[0] > 0 and floor[0] > 0
    text = _bench.first_call_markdown(pfa, floor)
    assert "pfa_numba" in text and "one-line cached Numba function" in text


def _smoke_run(script, tmp_path, starts):
    """Run benchmarks/<script> --quick once; the table rows of its output file that start
    with ``starts``."""
    import subprocess
    import sys
    out = tmp_path / "table.md"
    res = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent.parent / "benchmarks"
                                              / script), "--quick", "--repeats", "1", "--out",
                          str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return [line for line in out.read_text().splitlines() if line.startswith(starts)]


def test_transformers_benchmark_runs_and_reports_both(tmp_path):
    """The model benchmark's smoke run: both implementations timed, every table row filled."""
    pytest.importorskip("transformers", reason="transformers comes with the [transformers] extra")
    rows = _smoke_run("transformers_llama.py", tmp_path, "| ")
    assert len(rows) == 2 + 2 + 4 and not any("nan" in r for r in rows)


def test_training_benchmark_runs_and_reports_both(tmp_path):
    """The training benchmark's smoke run: forward + backward of both dtypes, and the four
    feature rows, every one timed on both sides."""
    pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    rows = _smoke_run("sdpa_training.py", tmp_path, "| ")
    data = [r for r in rows if not r.startswith(("| dtype", "| call", "|---"))]
    assert len(data) == 2 + 4 and not any("nan" in r for r in data)


def test_decode_benchmark_runs(tmp_path):
    """The decode benchmark's smoke run: contiguous and paged in BNSD and BSH, both BNSD
    caches through a plan, int8, torch and the streaming floor; then the prefill table's
    contiguous and paged calls."""
    pytest.importorskip("torch", reason="torch comes with the [transformers] extra")
    rows = _smoke_run("decode.py", tmp_path, "| float16")
    assert len(rows) == 2 and not any("nan" in r for r in rows)
    assert len(rows[0].split("|")) == 23 and len(rows[1].split("|")) == 11


def test_decode_benchmark_evicts_the_last_level_cache(monkeypatch, tmp_path):
    """The decode benchmark's eviction buffer is sized by the largest cache sysfs names (its
    size units K / M / G), or by the fallback where none is named."""
    from pfa_numba.cli import bench_decode as _bench_decode
    for level, size in ((1, "48K"), (2, "2048K"), (3, "105M")):
        (tmp_path / f"index{level}").mkdir()
        (tmp_path / f"index{level}" / "size").write_text(size + "\n")
    pattern = str(tmp_path / "index*" / "size")
    real_glob = _bench_decode.glob.glob
    monkeypatch.setattr(_bench_decode.glob, "glob", lambda _: real_glob(pattern))
    assert _bench_decode.last_level_cache_bytes() == 105 << 20
    monkeypatch.setattr(_bench_decode.glob, "glob", lambda _: [])
    assert _bench_decode.last_level_cache_bytes() == _bench_decode._LLC_FALLBACK


def test_decode_benchmark_times_only_the_call_after_eviction_and_another_layer():
    """A cold call reads the eviction buffer, runs the other layer's call, then times its own."""
    from pfa_numba.cli import bench_decode as _bench_decode
    order = []
    cold = _bench_decode._cold_cache(lambda: order.append("call"),
                                     np.ones(1024, np.uint64), lambda: order.append("other"))
    assert cold() >= 0 and order == ["other", "call"]


#: ``python -m pfa_numba ARGS`` with the packages named in HIDE not importable
HIDDEN_RUN = """
import sys, importlib.abc
HIDE = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDE:
            raise ImportError(f"No module named {name!r}", name=name.split(".")[0])
sys.meta_path.insert(0, Hide())
from pfa_numba.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _run_without(hidden, *args):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", HIDDEN_RUN, ",".join(hidden), *args],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("hidden", [("matplotlib",), ("torch", "matplotlib", "tqdm")])
def test_bench_runs_on_a_base_install(hidden, tmp_path):
    """The bare benchmark commands need none of the bench extra's packages: without
    matplotlib the table is written and the plot left out with a note; without torch the
    torch columns are left out too, and bench-decode (which imports it otherwise) runs."""
    out = _run_without(hidden, "bench", "--quick", "--repeats", "1", "--no-cold", "--filter",
                       "fp32 causal", "--out", str(tmp_path))
    row = [r for r in (tmp_path / "results.md").read_text().splitlines()
           if r.startswith("| fp32 causal")]
    assert len(row) == 1 and not (tmp_path / "results.png").exists()
    if "torch" in hidden:
        assert "torch is not installed: no torch column" in out
        assert "no plot: it draws torch's time" in out and row[0].split("|")[6].strip() == "-"
        decode = _run_without(hidden, "bench-decode", "--quick", "--repeats", "1")
        assert "torch is not installed: no torch column" in decode
        assert "  decode float16 B=1 kv 1024: " in decode      # progress as the cases end
        table = [r for r in decode.splitlines() if r.startswith("| float16 | 1 | 1024")]
        assert len(table) == 1 and table[0].split("|")[12].strip() == "-"
    else:
        assert "no plot: matplotlib is not installed" in out
