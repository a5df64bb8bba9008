"""LOI: locally optimal, gradient-informed initialization of Riemannion adapters (docs/methods.md (Riemannion)).

LOI picks the starting point ``X0`` of rank r that maximizes the norm of the first Riemannian gradient
``||P_T(G)||_F``, where ``G = dL/dW`` is the loss gradient of the layer's weight. With ``G = U S V^T``, the maximizer
is ``X0 = alpha * U[:, :r] V[:, r:2r]^T``: its tangent space contains the top 2r singular directions, so the first
Riemannian gradient is the best rank-2r approximation of G.

Only the top 2r singular vectors of G are needed, and G itself is never formed: :func:`backprop_rsvd` runs Halko's
randomized range finder with power iterations where every product with G comes from a backward pass. A zero probe
``Zp`` added to the layer's output as ``Zp (N^T x)`` has gradient ``dL/dZp = G N``; added as ``M (Zp^T x)`` it has
gradient ``G^T M``. All layers are probed at once, so the whole model costs ``2 (q + 1)`` products, with every weight
frozen (no weight gradient, of any size, is computed). Only the first is a pass (forward + backward) over the
calibration batches: it records each layer's input and output gradient, which every later pass would see again
unchanged, and the later products replay the probes on the recording (bit for bit a pass's result; a memory budget,
``max_cached_bytes``, falls back to passes).

Unlike LoRA-GA (which forms G, rewrites ``W <- W - X0`` and so needs a full-precision base and special saving), the
initial point stays inside the adapter (``riemannion_X0_A/B``): the base weight is untouched, a 4-bit base works, and
the adapter saves and loads like any other.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ...distributed import all_reduce_, write_full_
from .layer import AdapterRef, find_adapters

__all__ = ["LoiResult", "backprop_rsvd", "initialize_loi"]

Products = Callable[[dict[Hashable, Tensor]], dict[Hashable, Tensor]]


def backprop_rsvd(
    right: Products,
    left: Products,
    shapes: Mapping[Hashable, tuple[int, int]],
    rank: int,
    *,
    oversampling: int = 16,
    power_iters: int = 1,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> dict[Hashable, tuple[Tensor, Tensor, Tensor]]:
    """Top-``rank`` SVDs of several matrices ``G_key`` known only through products (randomized SVD, Halko et al.).

    Randomized subspace iteration (Halko, Martinsson & Tropp 2011, Alg. 4.4): ``k = rank + oversampling`` Gaussian
    probes, ``power_iters`` rounds of ``G^T`` / ``G`` products with re-orthonormalization, then the small SVD of
    ``Q^T G``. Every call of ``right``/``left`` handles all matrices at once; there are ``2 (power_iters + 1)`` calls.

    Args:
        right: Maps ``{key: N}`` (n x k) to ``{key: G N}`` (m x k).
        left: Maps ``{key: M}`` (m x k) to ``{key: G^T M}`` (n x k).
        shapes: ``{key: (m, n)}``.
        rank: Singular triplets to return per matrix (at most min(m, n)).
        oversampling: Extra probes beyond ``rank`` (paper default 16).
        power_iters: Power iterations ``q`` (paper default 1).
        generator: RNG for the Gaussian probes.
        dtype: Floating dtype of the probes.
        device: Device of the probes.

    Returns:
        ``{key: (U, S, V)}`` with ``G ~ U diag(S) V^T``, ``U`` (m x rank), ``S`` (rank,), ``V`` (n x rank).
    """
    if oversampling < 0 or power_iters < 0:
        raise ValueError(f"`oversampling` and `power_iters` must be >= 0, got {oversampling} and {power_iters}")
    widths = {}
    for key, (m, n) in shapes.items():
        if not 1 <= rank <= min(m, n):
            raise ValueError(f"rank {rank} must be in [1, min(m, n)] = [1, {min(m, n)}] for {key!r} ({m} x {n})")
        widths[key] = min(rank + oversampling, m, n)
    omega = {
        key: torch.randn(n, widths[key], generator=generator, dtype=dtype).to(device) for key, (m, n) in shapes.items()
    }
    Q = {key: torch.linalg.qr(y).Q for key, y in right(omega).items()}
    for _ in range(power_iters):
        Qt = {key: torch.linalg.qr(y).Q for key, y in left(Q).items()}
        Q = {key: torch.linalg.qr(y).Q for key, y in right(Qt).items()}
    result = {}
    for key, Bt in left(Q).items():  # Bt = G^T Q, so Q^T G = Bt^T
        Ub, S, Vh = torch.linalg.svd(Bt.mT, full_matrices=False)
        result[key] = ((Q[key] @ Ub)[:, :rank], S[:rank], Vh[:rank].mT)
    return result


@dataclass
class LoiResult:
    """What :func:`initialize_loi` did.

    Args:
        singular_values: Per adapted layer, the estimated top-2r singular values of its weight gradient.
        passes: Forward + backward passes of the model over the calibration batches: 1 when the first pass's
            recording fit ``max_cached_bytes``, else ``2 (q + 1)``.
        batches: Calibration batches per pass.
        seconds: Wall time.
    """

    singular_values: dict[str, Tensor]
    passes: int
    batches: int
    seconds: float


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise ValueError(
            "initialize_loi: the model output has no `loss` (pass labels in the batch, or pass "
            "loss_fn=lambda model, batch: ... returning a scalar)"
        )
    return loss


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def initialize_loi(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    adapter_name: Optional[str] = None,
    loss_fn: Optional[Callable[[nn.Module, Any], Tensor]] = None,
    num_batches: Optional[int] = None,
    oversampling: int = 16,
    power_iters: int = 1,
    init_scale: Optional[float] = None,
    seed: int = 0,
    max_cached_bytes: int = 2**30,
) -> LoiResult:
    """Move every Riemannion adapter named ``adapter_name`` to its LOI point, keeping the model's output unchanged.

    Per layer, with ``U, V`` the top-2r singular vectors of ``G = dL/dW`` (summed over the batches; estimated by
    :func:`backprop_rsvd` through backward passes), it sets ``A = U[:, :r]``, ``B = init_scale * V[:, r:2r]`` and
    stores the same point as ``X0``, so the adapter's delta ``X - X0`` is zero and the output equals the base model's.
    Call it before building the optimizer (it overwrites the adapter, so old momentum would be stale).

    The model runs in eval mode (dropout off) so that every pass sees the same G; the batches are cached for the same
    reason, and the later products are replayed from the first pass's recorded layer inputs and output gradients.
    All parameters are frozen while it runs (their ``requires_grad`` is restored afterwards), so no weight gradient is
    computed; only the zero probes receive gradients.

    Under ``torch.distributed`` (DDP) every process passes its own calibration batches and the probes' gradients are
    averaged over the processes, so all of them reach the same point (that of G over all batches, with each process's
    batches weighted equally). Every process must call it, with the same number of layers and ``seed``. Under FSDP2
    (``fully_shard``) it works before or after sharding: the probes are outside the sharded parameters and each
    process writes its rows of the new factors. DeepSpeed ZeRO-3 partitions are not supported.

    Args:
        model: A model with Riemannion adapters (e.g. the ``PeftModel`` from ``get_peft_model``).
        batches: Calibration batches: dicts of tensors the model accepts (``model(**batch)``), or anything
            ``loss_fn`` accepts. Tensors are moved to the adapters' device.
        adapter_name: Which adapter to initialize; default: the single adapter present.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``.
        num_batches: Use only the first ``num_batches`` batches.
        oversampling: Extra random probes beyond 2r (paper: 16).
        power_iters: Power iterations q (paper: 1; 15 for diffusion models).
        init_scale: Singular values of the LOI point; default the adapter config's ``init_scale``
            (``1e-2 / sqrt(r)``).
        seed: Seed of the random probes.
        max_cached_bytes: Memory for the recorded layer inputs and output gradients (per process). Within it, the
            model runs once over the batches and the later products are replayed from the recording; beyond it (or
            with 0), every product is a pass over the model. Same result either way.

    Returns:
        A :class:`LoiResult`.
    """
    start = time.perf_counter()
    refs = _select_adapters(model, adapter_name)
    if num_batches is not None and num_batches < 1:
        raise ValueError(f"`num_batches` must be a positive integer or None, got {num_batches}")
    if not (isinstance(max_cached_bytes, int) and max_cached_bytes >= 0):
        raise ValueError(f"`max_cached_bytes` must be an integer >= 0, got {max_cached_bytes!r}")
    cached = list(itertools.islice(batches, num_batches))
    if not cached:
        raise ValueError("initialize_loi needs at least one calibration batch; `batches` was empty")
    for ref in refs:
        if ref.layer.merged:
            raise ValueError(f"{ref}: unmerge the adapters before initialize_loi")
        r, m, n = ref.layer.r[ref.adapter_name], ref.layer.out_features, ref.layer.in_features
        if 2 * r > min(m, n):
            raise ValueError(f"{ref}: LOI needs 2r = {2 * r} <= min(out, in) = {min(m, n)}; lower r")

    device = refs[0].A.device
    dtype = torch.promote_types(refs[0].A.dtype, torch.float32)
    cached = [_to_device(batch, device) for batch in cached]
    loss_fn = loss_fn or _default_loss
    layers = {ref.layer_name: ref.layer for ref in refs}
    shapes = {name: (layer.out_features, layer.in_features) for name, layer in layers.items()}
    passes = 0

    # the first pass records what every later pass would recompute identically (see _Recording)
    recording = _Recording(layers, max_cached_bytes)

    def products(kind: str, bases: dict[Hashable, Tensor]) -> dict[Hashable, Tensor]:
        nonlocal passes
        if passes > 0 and recording.complete:
            result = recording.replay(kind, {name: basis.to(dtype) for name, basis in bases.items()}, shapes)
        else:
            passes += 1
            probes = {}
            for name, layer in layers.items():
                m, n = shapes[name]
                rows = m if kind == "right" else n
                probes[name] = torch.zeros(rows, bases[name].shape[1], dtype=dtype, device=device, requires_grad=True)
                layer._riemannion_probe = (kind, bases[name].to(dtype), probes[name])
            try:
                with recording.active(passes == 1):
                    for batch in cached:
                        loss_fn(model, batch).backward()
            finally:
                for layer in layers.values():
                    layer._riemannion_probe = None
            # a layer the loss does not reach has G = 0 (its probe gets no gradient at all)
            result = {
                name: probe.grad if probe.grad is not None else torch.zeros_like(probe)
                for name, probe in probes.items()
            }
            if passes == 1:
                recording.agree(device)
        # Under data parallelism each process sees its own batches: average G's products over the processes (as DDP
        # averages gradients), so every process finds the same point, the one G of all the batches gives.
        all_reduce_(list(result.values()), mean=True)
        return result

    rank = 2 * refs[0].layer.r[refs[0].adapter_name]
    if any(2 * ref.layer.r[ref.adapter_name] != rank for ref in refs):
        ranks = sorted({ref.layer.r[ref.adapter_name] for ref in refs})
        raise ValueError(f"initialize_loi needs one rank for all layers of the adapter, got ranks {ranks}")
    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    generator = torch.Generator().manual_seed(seed)
    try:
        model.requires_grad_(False)
        model.eval()
        with torch.enable_grad():
            svds = backprop_rsvd(
                lambda bases: products("right", bases),
                lambda bases: products("left", bases),
                shapes,
                rank,
                oversampling=oversampling,
                power_iters=power_iters,
                generator=generator,
                dtype=dtype,
                device=device,
            )
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)

    r = rank // 2
    with torch.no_grad():
        for ref in refs:
            U, S, V = svds[ref.layer_name]
            scale = init_scale if init_scale is not None else _config_init_scale(model, ref)
            A, B = U[:, :r], V[:, r:] * scale
            # an FSDP2-sharded factor gets its rows of the point (the same on every process)
            write_full_(ref.A, A)
            write_full_(ref.B, B)
            ref.Z.zero_()
            ref.layer.riemannion_X0_A[ref.adapter_name].copy_(A)
            ref.layer.riemannion_X0_B[ref.adapter_name].copy_(B)
    return LoiResult(
        singular_values={name: svd[1] for name, svd in svds.items()},
        passes=passes,
        batches=len(cached),
        seconds=time.perf_counter() - start,
    )


class _Recording:
    """The first pass's layer inputs ``x`` and output gradients ``dy``, from which later products are replayed.

    Every pass of :func:`initialize_loi` runs the same frozen model in eval mode on the same batches, and the zero
    probes change neither the outputs nor the gradients that flow past them, so every pass sees the same ``x`` and
    ``dy`` at each layer; only the probe's basis differs. Replaying a probe on the recorded tensors (the same
    product, the same backward) gives the probe's gradient bit for bit, for a product with the probe's size instead
    of a pass over the model. Recording stops, and the passes go on as before, once it would hold more than
    ``budget`` bytes.

    Args:
        layers: The probed layers by name.
        budget: Bytes the recording may hold.
    """

    def __init__(self, layers: Mapping[str, nn.Module], budget: int) -> None:
        self.layers = layers
        self.budget = budget
        self.used = 0
        self.complete = False
        self.calls: dict[str, list[list[Optional[Tensor]]]] = {name: [] for name in layers}

    @contextlib.contextmanager
    def active(self, record: bool) -> Iterator[None]:
        """Record ``x`` and ``dy`` of every call of the layers in the block (when ``record``)."""
        if not record or self.budget == 0:
            yield
            return
        self.complete = True
        handles = [
            layer.register_forward_hook(functools.partial(self._forward_hook, name), with_kwargs=True)
            for name, layer in self.layers.items()
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def agree(self, device: torch.device) -> None:
        """Replay only if every process recorded everything (the passes' collectives must match; FSDP2)."""
        flag = torch.tensor([float(self.complete)], dtype=torch.float64, device=device)
        all_reduce_([flag], mean=True)
        self.complete = bool(flag.item() == 1.0)
        if not self.complete:
            self.calls = {name: [] for name in self.layers}

    def _take(self, t: Tensor) -> Optional[Tensor]:
        self.used += t.numel() * t.element_size()
        if not self.complete or self.used > self.budget:
            self.complete = False
            self.calls = {name: [] for name in self.layers}
            return None
        return t.detach().clone()  # the model may reuse the memory of either in place

    def _forward_hook(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        if not self.complete or not isinstance(x, Tensor) or not isinstance(output, Tensor):
            self.complete = False
            return
        x = self._take(x)
        if x is None:
            return
        call = [x, None]
        self.calls[name].append(call)
        if output.requires_grad:
            output.register_hook(functools.partial(self._grad_hook, call))

    def _grad_hook(self, call: list[Optional[Tensor]], grad: Tensor) -> None:
        if self.complete:
            call[1] = self._take(grad)

    def replay(
        self, kind: str, bases: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, int]]
    ) -> dict[Hashable, Tensor]:
        """The probes' gradients of a pass of ``kind`` with ``bases`` (in the probes' dtype), from the recording."""
        result: dict[Hashable, Tensor] = {}
        for name, basis in bases.items():
            m, n = shapes[name]
            probe = torch.zeros(m if kind == "right" else n, basis.shape[1], dtype=basis.dtype, device=basis.device)
            probe.requires_grad_(True)
            for x, dy in self.calls[name]:
                if dy is None:
                    continue  # that call's output did not reach the loss
                # RiemannionLayer._add_probe's product and backward, on the recorded x and dy
                x = x.to(probe.dtype)
                extra = (x @ basis) @ probe.mT if kind == "right" else (x @ probe) @ basis.mT
                extra.backward(dy.to(extra.dtype))
            result[name] = probe.grad if probe.grad is not None else torch.zeros_like(probe)
        return result


def _select_adapters(model: nn.Module, adapter_name: Optional[str]) -> list[AdapterRef]:
    refs = find_adapters(model)
    names = sorted({ref.adapter_name for ref in refs})
    if not refs:
        raise ValueError("initialize_loi: the model has no Riemannion adapters (build it with RiemannionConfig)")
    if adapter_name is None:
        if len(names) > 1:
            raise ValueError(f"the model has several Riemannion adapters {names}; pass adapter_name=")
        adapter_name = names[0]
    selected = [ref for ref in refs if ref.adapter_name == adapter_name]
    if not selected:
        raise ValueError(f"no Riemannion adapter named {adapter_name!r}; the model has {names}")
    return selected


def _config_init_scale(model: nn.Module, ref: AdapterRef) -> float:
    config = getattr(model, "peft_config", {}).get(ref.adapter_name)
    if config is None or not hasattr(config, "resolved_init_scale"):
        raise ValueError(f"cannot find the RiemannionConfig of {ref}; pass init_scale= to initialize_loi")
    return config.resolved_init_scale
