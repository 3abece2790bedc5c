"""Split-kv: items cut into kv pieces, computed in parallel and merged, give what the whole
items give (the reference), for every feature a row can meet; and the cut itself."""
import numpy as np
import pytest

from pfa_numba import config, prompt_flash_attention
from pfa_numba.cpu import driver, split_kv
from pfa_numba.cpu.items import W_JHI, W_JLO, W_SLOT
from _cases import DTYPES, assert_matches_reference, qkv
from test_kernel import _call_args, _matrix


def _record_splits(monkeypatch):
    """[(work items, groups)] of every call's split_work from now on."""
    seen = []

    def recording(*args):
        work, groups, runs = split_kv.split_work(*args)
        seen.append((work.shape[0], groups.shape[0]))
        return work, groups, runs
    monkeypatch.setattr(driver, "split_work", recording)
    return seen


@pytest.fixture
def pieces(monkeypatch):
    """Split every call into pieces of at least 5 kv columns; the groups of each call."""
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 10 ** 6)
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 5)
    return _record_splits(monkeypatch)


# the case matrix of test_kernel with kv long enough to cut (every mode, layout, dtype, length
# rule and GQA shape): 1 in 3 of its cases
SPLIT_CASES = [c for i, c in enumerate(_matrix()) if i % 3 == 0 and c.values[7] >= 20]


@pytest.mark.parametrize("dt,layout,mode,b,n,nkv,sq,skv,d,tok,lens", SPLIT_CASES)
def test_split_items_match_the_reference(pieces, products, dt, layout, mode, b, n, nkv, sq, skv,
                                         d, tok, lens):
    rng = np.random.default_rng(abs(hash((dt, layout, mode, sq, skv, d, "split"))) % 2 ** 32)
    args, kw = _call_args(rng, dt, layout, mode, b, n, nkv, sq, skv, d, tok, lens)
    out, lse = prompt_flash_attention(*args, **kw, return_softmax_lse=True)
    assert_matches_reference(out, args, kw, DTYPES[dt], lse=lse)
    assert pieces and pieces[-1][1] > 0, "the call was not split"


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("inner_precise", [0, 2])
def test_decode_with_padding_and_a_piece_that_keeps_nothing(pieces, dt, inner_precise):
    """Query length 1 against a padded cache: batch 0's first 300 columns are masked (whole
    pieces keep nothing), batch 1 masks every column (contract 'Empty rows': the mean of V or
    zeros)."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, "BNSD", DTYPES[dt], 2, 8, 2, 1, 1000, 64)
    mask = np.zeros((2, 1, 1, 1000), bool)
    mask[0, ..., :300] = True
    mask[1] = True
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale_value=0.125,
              sparse_mode=1, inner_precise=inner_precise)
    out, lse = prompt_flash_attention(q, k, v, mask, **kw, return_softmax_lse=True)
    assert_matches_reference(out, (q, k, v, mask), kw, DTYPES[dt], lse=lse)
    assert pieces[-1][1] == 4
    assert np.isneginf(lse[1]).all()


def test_decode_splits_by_default_when_items_are_fewer_than_threads(monkeypatch):
    """B = 1, one kv head, work divided for 4 threads: one work item, cut into 4 pieces (1 per
    thread), whatever number of threads runs them."""
    seen = _record_splits(monkeypatch)
    monkeypatch.setattr(config, "CPU_WORK_THREADS", 4)
    monkeypatch.setattr(config, "CPU_THREADS", 1)
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, "BNSD", np.float32, 1, 4, 1, 1, 4096, 64)
    kw = dict(num_heads=4, num_key_value_heads=1, input_layout="BNSD", scale_value=0.125)
    out = prompt_flash_attention(q, k, v, **kw)
    assert_matches_reference(out, (q, k, v), kw, np.float32)
    assert seen == [(4, 1)]


class _Problem:
    """The fields of a planned problem that split_work reads."""
    def __init__(self, qlen, klen, pre_e, next_e):
        self.qlen, self.klen, self.pre_e, self.next_e = (np.asarray(x, np.int64) for x in
                                                         (qlen, klen, pre_e, next_e))


def test_pieces_tile_each_items_band_exactly(monkeypatch):
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 4)
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 100)
    inf = 1 << 62
    p = _Problem(qlen=[1, 1, 1], klen=[1000, 150, 5000], pre_e=[inf] * 3, next_e=[inf, inf, 700])
    work = np.array([[b, 0, 0, 0, inf, -1] for b in range(3)], np.int64)
    runs = np.array([[0, 1], [1, 2], [2, 3]], np.int64)
    out, groups, out_runs = split_kv.split_work(p, work, runs, 1, 2)
    assert out_runs.tolist() == [[x, x + 1] for x in range(out.shape[0])]   # one item a run
    assert groups.shape[0] == 2                       # batch 1: 150 columns, too short to cut
    assert out[out[:, 0] == 1, W_SLOT].tolist() == [-1]
    for (b, _, _, slot0, n), (lo, hi) in zip(groups, [(0, 1000), (0, 701)]):
        mine = out[out[:, 0] == b]
        assert mine[:, W_SLOT].tolist() == list(range(slot0, slot0 + n))
        assert mine[0, W_JLO] == lo and mine[-1, W_JHI] == hi
        assert (mine[1:, W_JLO] == mine[:-1, W_JHI]).all()
        assert n == 3 and (mine[:, W_JHI] > mine[:, W_JLO]).all()
    # enough items per thread (3 >= 1 x 2): nothing is cut
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 1)
    same, none, same_runs = split_kv.split_work(p, work, runs, 1, 2)
    assert none.shape[0] == 0 and same is work and same_runs is runs


def test_a_run_of_kv_heads_is_cut_into_runs_of_the_same_pieces(monkeypatch):
    """Both kv heads of one decode block run together: each piece is one run of the two
    heads' pieces over the same columns; each head's pieces take consecutive slots."""
    monkeypatch.setattr(config, "CPU_SPLIT_KV_ITEMS", 3)
    monkeypatch.setattr(config, "CPU_SPLIT_KV_MIN_COLS", 100)
    inf = 1 << 62
    p = _Problem(qlen=[1], klen=[1000], pre_e=[inf], next_e=[inf])
    work = np.array([[0, g, 0, 0, inf, -1] for g in range(2)], np.int64)
    out, groups, runs = split_kv.split_work(p, work, np.array([[0, 2]]), 1, 2)
    assert groups.tolist() == [[0, 0, 0, 0, 6], [0, 1, 0, 6, 6]]
    assert runs.tolist() == [[a, a + 2] for a in range(0, 12, 2)]
    for a, z in runs:
        piece = out[a:z]
        assert piece[:, 1].tolist() == [0, 1]
        assert (piece[:, W_JLO] == piece[0, W_JLO]).all()
        assert (piece[:, W_JHI] == piece[0, W_JHI]).all()
    for g, (_, _, _, slot0, n) in enumerate(groups):
        mine = out[out[:, 1] == g]
        assert mine[:, W_SLOT].tolist() == list(range(slot0, slot0 + n))
        assert mine[0, W_JLO] == 0 and mine[-1, W_JHI] == 1000
        assert (mine[1:, W_JLO] == mine[:-1, W_JHI]).all()
