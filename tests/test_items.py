"""Work items of the CPU kernels: every (batch, kv head, query block) once, most expensive
first; tiles no larger than the problem."""
from types import SimpleNamespace

import numpy as np
import pytest

from pfa_numba import config
from pfa_numba.numerics.band import BAND_INF
from pfa_numba.cpu.items import (W_B, W_G, W_I0, W_JHI, W_JLO, W_SLOT, work_items, kv_head_runs,
                                 tile_shape)


def _problem(rng, B, Nkv=2, G=4):
    edge = lambda: np.where(rng.random(B) < 0.5, BAND_INF,
                            rng.integers(-3, 60, B)).astype(np.int64)
    return SimpleNamespace(B=B, Nkv=Nkv, G=G, qlen=rng.integers(0, 90, B).astype(np.int64),
                           klen=rng.integers(0, 200, B).astype(np.int64), pre_e=edge(),
                           next_e=edge())


def _expected_blocks(p, rows):
    """[(cost, b, i0)] of every query block, cost = kept band columns x rows, in (b, i0) order."""
    blocks = []
    for b in range(p.B):
        for i0 in range(0, int(p.qlen[b]), rows):
            i1 = min(i0 + rows, int(p.qlen[b]))
            lo = max(i0 - int(p.pre_e[b]), 0)
            hi = min(i1 - 1 + int(p.next_e[b]) + 1, int(p.klen[b]))
            blocks.append((max(hi - lo, 0) * (i1 - i0), b, i0))
    return blocks


@pytest.mark.parametrize("seed", range(40))
def test_every_block_once_most_expensive_first(seed):
    rng = np.random.default_rng(seed)
    p = _problem(rng, int(rng.integers(0, 6)), Nkv=int(rng.integers(1, 4)))
    rows = int(rng.integers(1, 40))
    work = work_items(p, rows)
    blocks = _expected_blocks(p, rows)
    order = sorted(range(len(blocks)), key=lambda x: -blocks[x][0])    # stable: ties in order
    want = [(blocks[x][1], g, blocks[x][2]) for x in order for g in range(p.Nkv)]
    assert work.dtype == np.int64 and work.shape == (len(want), 6)
    assert [tuple(r) for r in work[:, [W_B, W_G, W_I0]].tolist()] == want
    assert (work[:, W_JLO] == 0).all() and (work[:, W_JHI] == BAND_INF).all()
    assert (work[:, W_SLOT] == -1).all()


def test_tiles_are_cut_to_a_short_problem(monkeypatch):
    monkeypatch.setattr(config, "CPU_Q_ROWS", 1024)
    monkeypatch.setattr(config, "CPU_KV_COLS", 512)
    inf = np.full(2, BAND_INF, np.int64)
    bnsd = np.zeros((2, 1, 100, 8), np.float16)
    decode = SimpleNamespace(B=2, G=4, Nkv=1, D=8, qlen=np.array([1, 1]),
                             klen=np.array([16, 100]), pre_e=inf, next_e=inf, k=bnsd,
                             kv_rows_hold_heads=False)
    assert tile_shape(decode) == (4, 128)           # G rows of one position; 100 -> 128 columns
    long = SimpleNamespace(B=1, G=4, qlen=np.array([3000]), klen=np.array([9000]), pre_e=inf[:1],
                           next_e=inf[:1], k=bnsd, kv_rows_hold_heads=False)
    assert tile_shape(long) == (1024, 512)
    monkeypatch.setattr(config, "CPU_KV_COLS", 7)    # an odd configured tile is kept
    assert tile_shape(decode) == (4, 7)


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "paged BSH", "TND"])
def test_streaming_tiles_of_rows_holding_every_head_fit_the_byte_budget(monkeypatch, layout):
    """Decode tiles are CPU_KV_COLS wide where a head's rows lie together (BNSD), and hold
    CPU_STREAM_TILE_BYTES of K and V (whole panels) where a row holds every kv head; items of
    more rows than stream keep CPU_KV_COLS."""
    monkeypatch.setattr(config, "CPU_KV_COLS", 512)
    monkeypatch.setattr(config, "CPU_STREAM_TILE_BYTES", 1 << 19)
    Nkv, D, S = 8, 128, 4096
    rows = np.zeros((2, S, Nkv, D), np.float16)                # (B | blocks, S, Nkv, D)
    k = {"BNSD": rows.transpose(0, 2, 1, 3).copy(), "BSH": rows.transpose(0, 2, 1, 3),
         "paged BSH": rows[:, :128].transpose(0, 2, 1, 3), "TND": rows[0]}[layout]
    inf = np.full(2, BAND_INF, np.int64)
    p = SimpleNamespace(B=2, G=4, Nkv=Nkv, D=D, qlen=np.array([1, 1]), klen=np.array([S, 9]),
                        pre_e=inf, next_e=inf, k=k, kv_rows_hold_heads=layout != "BNSD")
    assert tile_shape(p) == (4, 512 if layout == "BNSD" else 128)   # 2 x 8 x 128 x 2 B a row
    monkeypatch.setattr(config, "CPU_STREAM_TILE_BYTES", 1)
    assert tile_shape(p)[1] == (512 if layout == "BNSD" else 64)      # one panel at least
    p.qlen = np.array([1, 9])                                         # 36 rows: no streaming
    assert tile_shape(p)[1] == 512


@pytest.mark.parametrize("seed", range(20))
def test_streaming_items_run_their_kv_heads_together(seed):
    """A run is up to ``most`` kv heads of one block of at most stream_rows rows (in order);
    every other item is a run of its own."""
    rng = np.random.default_rng(seed)
    p = _problem(rng, int(rng.integers(1, 6)), Nkv=int(rng.integers(1, 4)))
    rows, stream_rows = int(rng.integers(1, 12)), int(rng.integers(0, 20))
    most = int(rng.integers(1, 5))
    work = work_items(p, rows)
    runs = kv_head_runs(work, p.qlen, p.G, rows, stream_rows, most)
    starts = []
    for x in range(0, work.shape[0], p.Nkv):
        b, i0 = work[x, W_B], work[x, W_I0]
        streams = p.G * (min(i0 + rows, p.qlen[b]) - i0) <= stream_rows
        starts += list(range(x, x + p.Nkv, most if streams else 1))
    want = [[a, z] for a, z in zip(starts, starts[1:] + [work.shape[0]])]
    assert runs.dtype == np.int64 and runs.tolist() == want
