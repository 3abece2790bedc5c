"""pfa_numba.distributed on a LocalCluster with separate worker processes."""
import numpy as np
import pytest

distributed = pytest.importorskip("distributed", reason="the 'distributed' extra")

from pfa_numba import prompt_flash_attention  # noqa: E402
from pfa_numba import distributed as pfa_dist  # noqa: E402
from _cases import qkv  # noqa: E402


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=":0", worker_dashboard_address=None)
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


def _close(a, b, dtype):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    eps = float(np.finfo(np.float16).eps if dtype == np.float16 else np.finfo(np.float32).eps)
    assert np.abs(a64 - b64).max() <= 4 * eps * max(1.0, np.abs(b64).max())


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_matches_the_single_call(client, mode):
    rng = np.random.default_rng(mode)
    q, k, v = qkv(rng, "BNSD", np.float32, 3, 4, 2, 40, 70, 16)
    mask = None
    if mode == 1:
        mask = rng.random((3, 1, 40, 70)) < 0.3
    elif mode in (2, 3, 4):
        mask = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", sparse_mode=mode,
              pre_tokens=9, next_tokens=3, inner_precise=2, scale_value=0.25)
    lens = ([40, 31, 40], [70, 55, 20]) if mode != 0 else (None, None)
    single, lse1 = prompt_flash_attention(q, k, v, mask, *lens, **kw, return_softmax_lse=True)
    out, lse = pfa_dist.prompt_flash_attention(client, q, k, v, mask, *lens, **kw, kv_splits=3,
                                               batch_splits=2, return_softmax_lse=True)
    _close(out, single, np.float32)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse1))


def test_bsh_fp16_long_sequence(client):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, "BSH", np.float16, 1, 2, 2, 64, 300, 32)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=2, input_layout="BSH", sparse_mode=3, scale_value=0.2)
    single = prompt_flash_attention(q, k, v, m, **kw)
    out = pfa_dist.prompt_flash_attention(client, q, k, v, m, **kw, kv_splits=5)
    _close(out, single, np.float16)


class _FailingParts(distributed.WorkerPlugin):
    def setup(self, worker):
        import pfa_numba.distributed as d

        def broken(*args, **kwargs):
            raise MemoryError("simulated worker failure")
        d._part = broken


def test_worker_failure_is_a_clear_error():
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                       dashboard_address=":0", worker_dashboard_address=None)
    with distributed.Client(cluster) as c:
        c.register_plugin(_FailingParts())
        q, k, v = qkv(np.random.default_rng(0), "BNSD", np.float32, 1, 1, 1, 8, 8, 16)
        with pytest.raises(RuntimeError, match="failed on a worker.*simulated worker failure"):
            pfa_dist.prompt_flash_attention(c, q, k, v, num_heads=1, input_layout="BNSD")
    cluster.close()


def test_bad_input_fails_before_any_task(client):
    q, k, v = qkv(np.random.default_rng(0), "BNSD", np.float32, 1, 2, 2, 8, 8, 16)
    with pytest.raises(RuntimeError, match="num_heads"):
        pfa_dist.prompt_flash_attention(client, q, k, v, num_heads=3, input_layout="BNSD")
    with pytest.raises(ValueError, match="kv_splits"):
        pfa_dist.prompt_flash_attention(client, q, k, v, num_heads=2, input_layout="BNSD",
                                        kv_splits=0)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_a_value_head_dim_of_its_own(client, layout):
    """Value's head dim (24) other than query / key's (16): the parts and their merge."""
    from _cases import to_layout
    rng = np.random.default_rng(11)
    q, k = (to_layout(rng.standard_normal(s).astype(np.float32), layout)
            for s in ((2, 4, 30, 16), (2, 2, 80, 16)))
    v = to_layout(rng.standard_normal((2, 2, 80, 24)).astype(np.float32), layout)
    m = np.triu(np.ones((2048, 2048), bool), 1)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout=layout, sparse_mode=3)
    single = prompt_flash_attention(q, k, v, m, **kw)
    out = pfa_dist.prompt_flash_attention(client, q, k, v, m, **kw, kv_splits=3, batch_splits=2)
    assert out.shape == single.shape
    _close(out, single, np.float32)
