"""Record the tensors that operators allocate, to prove that factored code paths never build an m x n matrix."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationRecorder(TorchDispatchMode):
    """Collects ``(op name, shape)`` of every tensor an operator returns in fresh storage.

    Views (``t()``, ``view``, slices) share storage with an existing tensor and allocate nothing, so outputs whose
    storage belongs to one of ``existing`` or to an input of the op are skipped.

    Args:
        existing: Tensors whose storage is not an allocation (e.g. the model's parameters).
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.allocations: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.known and ptr not in inputs:
                    self.allocations.append((str(func), tuple(t.shape)))
        return out

    def largest(self) -> tuple[str, tuple[int, ...]]:
        """The allocation with the most elements."""
        return max(self.allocations, key=lambda a: torch.Size(a[1]).numel())


def record_allocations(fn: Callable[[], Any], existing: Iterable[torch.Tensor] = ()) -> AllocationRecorder:
    """Run ``fn`` under an :class:`AllocationRecorder` and return the recorder.

    Args:
        fn: The code to watch.
        existing: Tensors whose storage does not count as allocated.
    """
    recorder = AllocationRecorder(existing)
    with recorder:
        fn()
    return recorder


def assert_no_allocation_of(recorder: AllocationRecorder, numel: int, what: str) -> None:
    """Fail if any recorded allocation has at least ``numel`` elements.

    Args:
        recorder: A recorder that has run.
        numel: The forbidden size (m * n of the layer).
        what: What the forbidden tensor would be, for the message.
    """
    assert recorder.allocations, "nothing was recorded: the recorder did not see the code"
    big = [a for a in recorder.allocations if torch.Size(a[1]).numel() >= numel]
    assert not big, f"{what}: allocated {big[:5]} (>= {numel} elements)"
