"""Manifolds in factored form, with geoopt's vocabulary (``proju``, ``egrad2rgrad``, ``retr``, ``transp``).

Everything public of :mod:`.fixed_rank` is exported here; its ``__all__`` is the one list of those names.
"""

from __future__ import annotations

from . import fixed_rank
from .fixed_rank import *  # noqa: F403  (the names of fixed_rank.__all__)

__all__ = list(fixed_rank.__all__)
