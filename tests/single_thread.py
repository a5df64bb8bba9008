"""A fixture that runs a test on one intra-op thread.

The Riemannion tests use tiny models, where a second OpenMP thread only adds synchronization, and on a busy shared
machine a waiting thread stalls every small operator by a scheduler time slice (milliseconds per QR or matmul).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
