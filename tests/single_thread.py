"""Running test code on one intra-op thread: the context manager :func:`one_thread` and the fixture
:func:`single_thread` (a test on one thread).

The Riemannion tests use tiny models, where a second OpenMP thread only adds synchronization, and on a busy shared
machine a waiting thread stalls every small operator by a scheduler time slice (milliseconds per QR or matmul).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block on ``threads`` intra-op threads; torch's earlier thread count is restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread() -> AbstractContextManager[None]:
    """Run the block on one intra-op thread (module fixtures, which run outside the function-scoped fixture)."""
    return torch_threads(1)


@pytest.fixture
def single_thread() -> Iterator[None]:
    with one_thread():
        yield
