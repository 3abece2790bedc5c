"""Numba's thread pool as a guest in its host process: the threads a step takes, and the pool
started without changing the host's thread settings.

Numba's OpenMP threading layer sets OpenMP's thread count to NUMBA_NUM_THREADS when it starts
its pool (``omp_set_num_threads``). The call binds to the first OpenMP runtime the process
loaded, torch's own where torch came first, so a first pfa_numba call would change
``torch.get_num_threads()``. The pool is started here, once, and every OpenMP runtime loaded
then gets back the thread count it had."""
import threading

import numba

from .. import config

_started = threading.Event()
_starting = threading.Lock()


def start_pool():
    """Start Numba's thread pool (once a process) and leave the OpenMP runtimes' thread counts
    as they were."""
    if _started.is_set():
        return
    with _starting:
        if _started.is_set():
            return
        from threadpoolctl import ThreadpoolController
        openmp = ThreadpoolController().select(user_api="openmp").lib_controllers
        before = [lib.get_num_threads() for lib in openmp]
        numba.get_num_threads()                     # starts the pool
        for lib, n in zip(openmp, before):
            if lib.get_num_threads() != n:
                lib.set_num_threads(n)
        _started.set()


def pool_size():
    """Numba's threads (numba.get_num_threads()), the pool started by :func:`start_pool`."""
    start_pool()
    return numba.get_num_threads()


def threads_for(n):
    """The threads a step of ``n`` runs takes (config.CPU_THREADS; None: Numba's)."""
    return max(1, min(int(config.CPU_THREADS or pool_size()), n))
