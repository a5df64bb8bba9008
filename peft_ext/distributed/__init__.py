"""What peft_ext's methods need from ``torch.distributed``, in one namespace (import from here).

Statistics that a method computes from data outside the DDP-wrapped forward/backward (LOI's gradient products,
PCLR's query prototypes, contribution scores and distillation gradients) would otherwise be computed from each
rank's local data only, so the ranks would diverge or silently use a fraction of the data. Every helper is a no-op
when ``torch.distributed`` is not initialized or has one process. docs/distributed.md says which method uses which.

- :mod:`.core`: the number of processes, this process's rank, the DTensor type check;
- :mod:`.processes`: reductions and broadcasts over the processes, and what keeps one job's processes identical;
- :mod:`.shards`: FSDP2 (DTensor) parameters: whole values, the local rows, reductions over row shards, and the
  layout checks that refuse everything else;
- :mod:`.buckets`: many row shards gathered (and written back) in one collective, and a counter of collectives.
"""

from __future__ import annotations

from .buckets import (
    all_gather_owned,
    count_collectives,
    full_tensors,
    owned_by,
    owners_by_group,
    row_split,
    write_full_tensors_,
)
from .core import is_dtensor, rank, world_size
from .processes import (
    all_reduce_,
    average_gradients,
    broadcast_,
    check_parameters_unchanged,
    on_rank_zero,
    raise_shared,
    rank_zero_first,
    registered_parameters,
    share_random_state,
    sync_model,
)
from .shards import (
    ROW_SHARDED,
    all_reduce_over_row_shards_,
    all_shards_agree,
    check_row_sharded,
    full_tensor,
    gathered_parameters,
    local_part,
    reject_zero3,
    sharding_of,
    write_full_,
)

__all__ = [
    "ROW_SHARDED",
    "all_gather_owned",
    "all_reduce_",
    "all_reduce_over_row_shards_",
    "all_shards_agree",
    "average_gradients",
    "broadcast_",
    "check_parameters_unchanged",
    "check_row_sharded",
    "count_collectives",
    "full_tensor",
    "full_tensors",
    "gathered_parameters",
    "is_dtensor",
    "local_part",
    "on_rank_zero",
    "owned_by",
    "owners_by_group",
    "raise_shared",
    "rank",
    "rank_zero_first",
    "registered_parameters",
    "reject_zero3",
    "row_split",
    "share_random_state",
    "sharding_of",
    "sync_model",
    "world_size",
    "write_full_",
    "write_full_tensors_",
]
