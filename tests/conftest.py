import faulthandler
import os
import sys

# Test helpers (fixture-tree writers, tool_loader...) in tests/ are imported as plain
# modules: pytest.ini puts tests/ on sys.path (`pythonpath = tests`).
import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of small CPU models, restored after.

    On a few shared cores, oversubscribed threads make tiny forwards many times
    slower. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    """A hard crash (SIGSEGV, SIGABRT in a C extension) prints the crashing thread's Python stack only.

    pytest's own faulthandler plugin (off in pytest.ini) dumps every thread first (torch, grpc,
    uvicorn), which pushed the crashing test out of the last lines CI keeps when CI once aborted.
    As that plugin does, the dump goes to a copy of stderr taken before output capture starts.
    """
    faulthandler.enable(file=os.dup(sys.__stderr__.fileno()), all_threads=False)


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests where torch sees no CUDA device (the marker: pytest.ini)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
