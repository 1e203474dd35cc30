"""Shared pytest configuration: deterministic seeds and the `gpu` marker."""

import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("PYTHONHASHSEED", "0")
# Small CPU matmuls are far faster on one intra-op thread than contending for both cores.
torch.set_num_threads(1)
# Without CUDA the Triton kernels can only run in Triton's interpreter, and the switch is read when triton is first
# imported, which other test modules do indirectly (torchao, the ops dispatch): set it before any of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on a 2-core CPU (still runs in CI)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


class HostReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense inside its block: the op behind item() / float() / bool() of a tensor, which
    on a GPU is a host sync."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads():
    """``with host_reads() as r: ...`` then ``r.count``: how many device values the block read on the host."""
    return HostReads


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield
