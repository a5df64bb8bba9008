"""The learning checks catch a dead adapter: each method below runs the same small training twice, once as it is
("live") and once with its adapter's update zeroed ("dead": :func:`tests.helpers.dead_adapter` puts the adapter's
parameters back after every optimizer step), and the bound the live run meets is not met by the dead one.

The tests' token data (:func:`tests.helpers.token_sequence`) is separable by a trained head alone, so a check that an
adapter learns freezes the head (:func:`tests.helpers.training_only` with ``head=False``): what the model learns, it
learns through the adapter. The bound and the run are those of the PCLR plugin test (tests/test_pclr.py): the first
task's accuracy right after training it, 40 examples per class, 5 epochs, at least 0.9. Measured: every live run 1.0;
every dead run 0.575 (the random frozen head's own accuracy; the adapter is left as it was initialized).
"""

from __future__ import annotations

import pytest

from peft_ext.continual import TrainConfig, get_continual_method, run_sequence

from .helpers import (
    QUERY_VALUE,
    dead_adapter,
    lora_adapter,
    pclr_adapter,
    stack_collate,
    tiny_classifier,
    token_sequence,
    training_only,
)
from .single_thread import single_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

#: The first task's accuracy, head frozen, that a learning adapter reaches (measured 1.0 live, 0.575 dead)
ADAPTER_LEARNS = 0.9
TRAIN = TrainConfig(epochs=5, batch_size=8, progress=False, device="cpu")

#: method: (options, the names of its adapter's trained parameters). The rates let the adapter alone learn the task
#: in 5 epochs (and half or twice each still reaches 0.975 or more): SplitLoRA and InfLoRA train only B on a fixed A,
#: which at their usual 5e-3 leaves the task at the random head's accuracy
CASES = {
    "splitlora": ({"lr": 0.3, "adapter": {"r": 4, "target_modules": QUERY_VALUE}}, ("splitlora_B",)),
    "inflora": ({"lr": 2e-2, "r": 8, "target_modules": QUERY_VALUE}, ("lora_B",)),
    "seq_lora": ({"lr": 5e-3, "adapter": lora_adapter(4)}, ("lora_A", "lora_B")),
    "pclr": (
        {
            "lr": 5e-3,
            "adapter": pclr_adapter(
                pool_size=12, ranks_schedule=[4], compress_schedule=[0.0, 0.25], top_k=4, shared_r=2
            ),
        },
        ("pclr_A", "pclr_B"),  # its routing keys still train, as in tests/test_pclr.py's dead case
    ),
    "riemannion": ({"lr": 0.05, "adapter": {"r": 4, "target_modules": QUERY_VALUE}}, ("riemannion_",)),
}


@pytest.fixture(scope="module")
def seq():
    return token_sequence(n_tasks=1, per_class=40)


@pytest.mark.parametrize("adapter", ["live", "dead"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_adapter_alone_learns_the_task_and_a_dead_adapter_does_not(seq, name, adapter):
    options, markers = CASES[name]
    method = training_only(get_continual_method(name)(**options), head=False)
    if adapter == "dead":
        method = dead_adapter(method, markers)
    result = run_sequence(seq, method, tiny_classifier(seq.num_classes), stack_collate, TRAIN)
    accuracy = result.accuracy_matrix[0][0]
    assert (accuracy >= ADAPTER_LEARNS) is (adapter == "live"), (name, adapter, accuracy)
