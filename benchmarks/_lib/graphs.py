"""A ``torch.compile`` backend that counts graphs: compile_speed.py's graph column and tests/test_compile.py."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GraphCounter"]


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it (one per piece between graph breaks) and
    runs each with ``backend`` (``inductor``, ``aot_eager``, ...)."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        self.graphs += 1
        return self.backend(gm, example_inputs)
