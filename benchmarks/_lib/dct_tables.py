"""Tables 1, 2, 4 and 5 of benchmarks/dct_vs_galore.py, the ones without the fine-tuning protocol: refresh time of
every basis, the gradient energy each one captures, the ablation of DCT-AdamW's ``column_bias_correction`` and the
optimizer step alone (dct_vs_galore.py runs table 3, the fine-tuning, and prints them all).

Bases compared (``r`` directions of a projected ``(R, C)`` gradient, ``n`` = its smaller side):

* DCT, best ``r`` columns (DCT-AdamW's selection; L1 score as the paper, L2 the best any DCT choice can do).
* A random orthonormal basis, best ``r`` of its ``n`` vectors (what a fixed basis without structure captures).
* The best ``r`` plain coordinates (``projection="coordinates"``).
* The power-iteration basis (``projection="power"``, SubspaceAdamW) after ``k`` warm-started refreshes on
  consecutive gradients, started from the DCT selection: measured on the gradient after the last refresh (stale, as
  between two refreshes) and on the gradient of the last refresh itself (as at a refresh step).
* SVD top-``r`` (GaLore's basis; the optimum).
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from peft_ext.optim.choices import GaLoreAdamWChoice
from peft_ext.optim.dct import dct2, dct_matrix, dct_select, projection_side
from peft_ext.optim.subspace import coordinate_select, power_refresh

from .data import minilm, wordnet_all_classes
from .tables import fmt_s, markdown_table
from .timing import Interleaved, median_time, timed

TARGETS = ["query", "key", "value", "dense"]
#: Matrices with a dimension at least this large (embeddings, LM heads) are never projected, by any optimizer.
MAX_SHAPE = 32_000


def is_projected(name: str, p: torch.Tensor, targets: list[str]) -> bool:
    """Whether every low-rank optimizer here projects ``name``: a 2-D weight below :data:`MAX_SHAPE` in ``targets``."""
    return GaLoreAdamWChoice.projects(name, p, {"max_shape": MAX_SHAPE, "target_modules": targets})


# ----------------------------------------------------------------------------------------------------------------
# refresh time


#: ``--scale-rules``: projected-update scale ``scale * (r0 / r) ** power`` at rank ``r`` (``r0``: ``--scale-ref-rank``)
#: so that the lr tuned at ``r0`` carries over. ``sqrt``: the Adam direction's Frobenius norm grows as ``sqrt(r)``
#: (each of its ``r`` columns has entries of size about 1); ``linear``: a stronger cut (the update's norm then falls as
#: ``1 / sqrt(r)``), since the full run's best lr fell about tenfold from rank 8 to 64.
RANK_SCALE_RULES = {"sqrt": 0.5, "linear": 1.0}


def add_rank_variants(
    specs: dict[str, dict[str, Any]],
    ranks: list[int],
    scale: float,
    dct_gaps: tuple[int, ...],
    scale_rules: tuple[str, ...],
    scale_ref_rank: int,
) -> None:
    """Add to ``specs`` (dct_vs_galore's ``{label: spec}``) the DCT-basis options refreshed every ``gap`` steps
    (``"DCT-AdamW r=8 gap=10"``, ``"DCT channel r=8 gap=10"``; gap 1, the paper's, keeps its label) and, per rule of
    ``scale_rules``, DCT-AdamW at every rank but ``scale_ref_rank`` with the scale that rule gives
    (``"DCT-AdamW r=64 scale sqrt"``), its lr grid centred where the reference rank's is."""
    for r in ranks:
        for gap in dct_gaps:  # the DCT-basis options refreshed less often (gap 1, the paper's, keeps its label)
            for base in (f"DCT-AdamW r={r}", f"DCT channel r={r}"):
                if gap != 1:
                    specs[f"{base} gap={gap}"] = {**specs[base], "gap": gap}
        for rule, power in RANK_SCALE_RULES.items():  # rank-dependent scale: the reference rank's lr carries over
            if rule in scale_rules and r != scale_ref_rank:
                # the reference rank's grid centre (3e-3, DCT-AdamW's own, when that rank is not run)
                ref = specs.get(f"DCT-AdamW r={scale_ref_rank}", {"center": 3e-3})
                rule_scale = scale * (scale_ref_rank / r) ** power
                specs[f"DCT-AdamW r={r} scale {rule}"] = {
                    **specs[f"DCT-AdamW r={r}"], "scale": rule_scale, "center": ref["center"]
                }  # fmt: skip


def random_orthonormal(n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An ``n x n`` random orthonormal matrix (QR of a Gaussian), rows as basis vectors."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=dtype))
    return q.T.contiguous()


def refresh_timers(grad: torch.Tensor, r: int) -> dict[str, Any]:
    """One refresh of every basis on ``grad`` at rank ``r``, as zero-argument callables (timed by the caller)."""
    from apollo_torch.random_projector import GradientProjector
    from galore_torch.galore_projector import GaLoreProjector

    side = projection_side(grad.shape)
    warm, _ = dct_select(grad, r, method="fft")
    q = dct_matrix(min(grad.shape))
    start = q.index_select(0, warm)
    return {
        "dct_matmul": lambda: dct_select(grad, r, method="matmul"),
        "dct_fft": lambda: dct_select(grad, r, method="fft"),
        "coordinates": lambda: coordinate_select(grad, r),
        "power": lambda: power_refresh(grad, start, side),
        "apollo_random": lambda: GradientProjector(r, update_proj_gap=200, scale=1.0, seed=0).project(grad, 0),
        "galore_svd": lambda: GaLoreProjector(r, update_proj_gap=200, scale=1.0).project(grad, 0),
    }


REFRESH_COLUMNS = {
    "galore_svd": "GaLore SVD",
    "apollo_random": "APOLLO random",
    "dct_matmul": "DCT matmul",
    "dct_fft": "DCT FFT",
    "coordinates": "coordinates",
    "power": "power (1 refresh)",
}


def table_refresh(sizes: list[int], rank: int, repeats: int) -> tuple[str, list[dict[str, Any]]]:
    """Median time of one refresh of every basis, square and 4:1 gradients of each size."""
    torch.linalg.svd(torch.randn(256, 256), full_matrices=False)  # LAPACK's one-time set-up is not a refresh cost
    rows, records = [], []
    for n in sizes:
        for shape, kind in (((n, n), "square"), ((n, n // 4), "rectangular")):
            grad = torch.randn(*shape, generator=torch.Generator().manual_seed(n))
            r = min(rank, min(shape))
            build = timed(lambda shape=shape: dct_matrix(min(shape)))  # once per size for the whole model
            timers = refresh_timers(grad, r)
            record: dict[str, Any] = {"shape": list(shape), "rank": r, "dct_matrix_build_s": build}
            for key, fn in timers.items():
                slow = key == "galore_svd" and n >= 4096
                record[f"{key}_s"] = median_time(fn, max(1, repeats // 2) if slow else repeats)
            records.append(record)
            svd = record["galore_svd_s"]
            best_free = min(record[f"{k}_s"] for k in ("dct_fft", "dct_matmul", "coordinates", "power"))
            rows.append(
                [f"{shape[0]} x {shape[1]} ({kind})"]
                + [fmt_s(record[f"{k}_s"]) for k in REFRESH_COLUMNS]
                + [f"{svd / record['dct_fft_s']:.0f}x", f"{svd / record['power_s']:.0f}x", f"{svd / best_free:.0f}x"]
                + [fmt_s(build)]
            )
            print(f"  refresh {shape}: " + ", ".join(f"{k} {record[f'{k}_s']:.4f}s" for k in timers), flush=True)
    header = ["gradient", *REFRESH_COLUMNS.values(), "SVD / DCT FFT", "SVD / power", "SVD / best SVD-free"]
    return markdown_table(header + ["DCT matrix (once)"], rows), records


# ----------------------------------------------------------------------------------------------------------------
# captured energy


ENERGY_COLUMNS = {
    "dct_l1": "DCT best r (L1, paper)",
    "dct_l2": "DCT best r (L2)",
    "random": "random orthonormal, best r",
    "coordinates": "best r coordinates",
    "power_stale": "power, k refreshes, next gradient",
    "power": "power, k refreshes incl. this gradient",
    "svd": "SVD top-r",
}


def _best_r(coeff_energy: torch.Tensor, r: int, total: torch.Tensor) -> float:
    return (torch.topk(coeff_energy, r).values.sum() / total).item()


def _captured(g: torch.Tensor, basis: torch.Tensor, side: str, total: torch.Tensor) -> float:
    low = g @ basis.T if side == "right" else basis @ g
    return ((low**2).sum() / total).item()


def energies(grad: torch.Tensor, ranks: list[int], rotation: torch.Tensor) -> dict[str, list[float]]:
    """Captured energy of the fixed bases (DCT L1 / L2, random orthonormal ``rotation``, coordinates, SVD)."""
    g = grad.double()
    side = projection_side(g.shape)
    dim = 1 if side == "right" else 0
    coeffs = dct2(g, dim=dim, method="matmul")
    col_energy = (coeffs**2).sum(1 - dim)
    l1 = coeffs.abs().sum(1 - dim)
    total = col_energy.sum()
    rand = g @ rotation.T if side == "right" else rotation @ g
    rand_energy = (rand**2).sum(1 - dim)
    coord_energy = (g**2).sum(1 - dim)
    sv2 = torch.linalg.svdvals(g) ** 2
    out: dict[str, list[float]] = {k: [] for k in ("dct_l1", "dct_l2", "random", "coordinates", "svd")}
    for r in ranks:
        out["dct_l1"].append((col_energy[torch.topk(l1, r).indices].sum() / total).item())
        out["dct_l2"].append(_best_r(col_energy, r, total))
        out["random"].append(_best_r(rand_energy, r, total))
        out["coordinates"].append(_best_r(coord_energy, r, total))
        out["svd"].append((sv2[:r].sum() / sv2.sum()).item())
    return out


def table_energy(
    ranks: list[int],
    snapshot_steps: list[int],
    power_refreshes: int,
    train_per_class: int,
    test_per_class: int,
    max_length: int,
    batch_size: int,
    lr: float,
) -> tuple[str, dict[str, Any]]:
    """Energy captured on real gradients of AdamW fine-tuning of MiniLM-L6 at ``snapshot_steps``.

    The power basis of each matrix and rank starts ``power_refreshes`` steps before a snapshot from the DCT selection
    of that step's gradient (as SubspaceAdamW's first basis) and is refreshed once per step on consecutive gradients.
    """
    if min(snapshot_steps) < power_refreshes:
        raise ValueError(f"every energy step needs >= {power_refreshes} earlier steps, got {snapshot_steps}")
    sequence = wordnet_all_classes(train_per_class, test_per_class)
    model, collate = minilm(sequence.num_classes, max_length)
    examples = sequence.tasks[0].train
    named = [(n, p) for n, p in model.named_parameters() if is_projected(n, p, TARGETS)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    collected: dict[str, list[list[float]]] = {k: [] for k in ENERGY_COLUMNS}
    sizes = {min(p.shape) for _, p in named}
    n = sizes.pop() if len(sizes) == 1 else None  # MiniLM-L6: every projected matrix has 384 as its smaller side
    rotations: dict[int, torch.Tensor] = {}
    bases: dict[tuple[str, int], torch.Tensor] = {}
    starts = {s - power_refreshes for s in snapshot_steps}
    n_matrices = 0
    for step in range(max(snapshot_steps) + 1):
        start = (step * batch_size) % len(examples)
        batch = collate(examples[start : start + batch_size])
        labels = batch.pop("labels")
        loss = nn.functional.cross_entropy(model(**batch).logits, labels)
        opt.zero_grad()
        loss.backward()
        used = [(name, p) for name, p in named if p.grad is not None]  # the unused BERT pooler has no gradient
        snapshot = step in snapshot_steps
        for name, p in used:
            g = p.grad.double()
            side = projection_side(g.shape)
            total = (g**2).sum()
            stale, fresh = [], []
            for r in ranks:
                key = (name, r)
                if step in starts:  # a new chain: the DCT selection of this gradient, as SubspaceAdamW starts
                    indices, _ = dct_select(g, r, method="matmul")
                    bases[key] = dct_matrix(min(g.shape), dtype=torch.float64).index_select(0, indices)
                elif key not in bases:
                    continue
                stale.append(_captured(g, bases[key], side, total))
                bases[key] = power_refresh(g, bases[key], side)
                fresh.append(_captured(g, bases[key], side, total))
            if snapshot:
                m = min(g.shape)
                rotations.setdefault(m, random_orthonormal(m))
                for k, values in energies(p.grad, ranks, rotations[m]).items():
                    collected[k].append(values)
                collected["power_stale"].append(stale)
                collected["power"].append(fresh)
        if snapshot:
            n_matrices += len(used)
            print(f"  energy snapshot at step {step}: {len(used)} matrices, loss {loss.item():.3f}", flush=True)
        opt.step()
    mean = {key: [statistics.fmean(v[i] for v in vals) for i in range(len(ranks))] for key, vals in collected.items()}
    rows = [
        [str(r)] + [f"{mean[k][i]:.3f}" for k in ENERGY_COLUMNS] + [f"{r / n:.3f}" if n else "-"]
        for i, r in enumerate(ranks)
    ]
    header = ["rank", *(c.replace("k refreshes", f"{power_refreshes} refreshes") for c in ENERGY_COLUMNS.values())]
    record = {
        "ranks": ranks,
        "snapshot_steps": snapshot_steps,
        "power_refreshes": power_refreshes,
        "matrices": n_matrices,
        "mean": mean,
    }
    return markdown_table(header + ["r / n (random r-dim subspace)"], rows), record


# ----------------------------------------------------------------------------------------------------------------
# table 4: ablation of DCTAdamW's column_bias_correction on a small MLP


def linear_task_mlp(seed: int = 0) -> nn.Sequential:
    """The 3-layer MLP (64 -> 128 -> 96 -> 10, tanh) that :func:`fit_linear_task` trains, seeded with ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 96), nn.Tanh(), nn.Linear(96, 10))


def fit_linear_task(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` minibatch steps of ``optimizer`` on a fixed random linear 10-class task of 64 features (the same task
    and batch order for every call: a generator of its own, seeded 1); returns the losses."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=gen)
    y = (x @ torch.randn(64, 10, generator=gen)).argmax(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 512, (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _mlp_tail_loss(make_optimizer, steps: int = 150) -> float:
    model = linear_task_mlp()
    return statistics.fmean(fit_linear_task(model, make_optimizer(model), steps)[-20:])


def table_column_bias(lrs: list[float], ranks: list[int]) -> tuple[str, list[dict[str, Any]]]:
    from peft_ext.optim import DCTAdamW

    rows, records = [], []
    for lr in lrs:
        adamw = _mlp_tail_loss(lambda m, lr=lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0))
        for rank in ranks:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the 10-row head is clamped to rank 10
                losses = {
                    flag: _mlp_tail_loss(
                        lambda m, lr=lr, rank=rank, flag=flag: DCTAdamW(
                            m.parameters(), lr=lr, rank=rank, column_bias_correction=flag
                        )
                    )
                    for flag in (False, True)
                }
            records.append(
                {"lr": lr, "rank": rank, "adamw": adamw, "global_step": losses[False], "per_column": losses[True]}
            )
            rows.append([f"{lr:g}", str(rank), f"{adamw:.4f}", f"{losses[False]:.4f}", f"{losses[True]:.4f}"])
    header = ["lr", "rank", "AdamW", "DCT-AdamW, global step (default)", "DCT-AdamW, per-column ages"]
    return markdown_table(header, rows), records


# ----------------------------------------------------------------------------------------------------------------
# table 5: the optimizer step alone


def table_step_time(
    specs: dict[str, dict[str, Any]],
    build: Callable[[dict[str, Any], list[tuple[str, nn.Parameter]], float], torch.optim.Optimizer],
    rounds: int,
    data: dict[str, int],
    batch_size: int,
    lr: float,
) -> tuple[str, list[dict[str, Any]]]:
    """Optimizer-step time alone, on one fixed MiniLM gradient, the optimizers ``build(spec, named, lr)`` makes
    interleaved round by round.

    Table 3's per-step times include forward and backward and are measured one optimizer after another, so load
    from other processes on a shared machine shifts them. Here every round times one step of each optimizer back to
    back on the same gradients, and the median over rounds is reported; a step of an optimizer whose gap is below
    the window includes its refreshes; for a gap > 1 (GaLore, APOLLO, power) the first step's excess over the median
    (state creation and a refresh) is amortized over the gap. The mean over the rounds holds every refresh that
    fell inside them (the whole cost for a gap up to the number of rounds), and is given as a ratio to AdamW's mean
    over the same rounds when AdamW is among ``specs``.
    """
    sequence = wordnet_all_classes(data["train_per_class"], data["test_per_class"])
    model, collate = minilm(sequence.num_classes, data["max_length"])
    batch = collate(sequence.tasks[0].train[:batch_size])
    labels = batch.pop("labels")
    nn.functional.cross_entropy(model(**batch).logits, labels).backward()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]  # the unused pooler has none
    params = [p for _, p in named]
    grads = [p.grad.clone() for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        optimizers = {label: build(spec, named, lr) for label, spec in specs.items()}
    backup = [p.detach().clone() for p in params]

    def fresh_gradients(_: str) -> None:
        for p, g in zip(params, grads):
            p.grad = g.clone()

    def same_weights(_: str) -> None:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)  # every optimizer sees the same weights; only its own state advances

    # the first round (state creation and the first refresh) is not part of the median
    timer = Interleaved(list(specs), warmup=1)
    for _ in range(rounds + 1):
        timer.round({label: opt.step for label, opt in optimizers.items()}, fresh_gradients, same_weights)
    rows, records = [], []
    base = next((label for label, spec in specs.items() if spec["kind"] == "adamw"), None)
    for label, spec in specs.items():
        t0, median = timer.all_rounds[0][label], timer.median(label)
        gap = spec.get("gap", 0)
        # a refresh every `gap` > 1 steps mostly falls outside the median: amortize the first step's excess instead
        refresh = max(t0 - median, 0.0) if gap > 1 else 0.0
        amortized = median + (refresh / gap if gap else 0.0)
        # the mean over the recorded rounds holds every refresh that fell inside them (exact for gap <= rounds)
        mean = statistics.fmean(timer.times(label))
        record = {"label": label, "median_s": median, "first_step_s": t0, "amortized_s": amortized, "mean_s": mean}
        row = [label, fmt_s(median), fmt_s(t0), fmt_s(amortized), fmt_s(mean)]
        if base is not None:  # both means over the same interleaved rounds, so load shifts them alike
            record["mean_vs_adamw"] = mean / statistics.fmean(timer.times(base))
            row.append(f"{record['mean_vs_adamw']:.2f}")
        records.append(record)
        rows.append(row)
    header = ["optimizer", "step (median)", "first step (state + refresh)", "amortized incl. refresh (gap > 1)"]
    header.append("mean over rounds (refreshes inside)")
    if base is not None:
        header.append(f"mean / {base}'s")
    return markdown_table(header, rows), records


def refresh_verdicts(refresh: list[dict[str, Any]], bases: dict[str, str]) -> list[str]:
    """Refresh-time targets at the largest square gradient measured; ``bases``: ``{option: table-1 basis}``."""
    square = [r for r in refresh if r["shape"][0] == r["shape"][1]]
    if not square:
        return []
    big = max(square, key=lambda r: r["shape"][0])
    n = big["shape"][0]
    where = "" if n == 4096 else f" (measured at {n} x {n}; the target is set at 4096)"
    svd = big["galore_svd_s"]
    dct = svd / min(big["dct_fft_s"], big["dct_matmul_s"])
    lines = [f"target: DCT-AdamW refresh vs SVD at {n} x {n} = {dct:.0f}x (>= 50x){where}: {met(dct >= 50)}"]
    for option, basis in bases.items():
        ratio = svd / big[f"{basis}_s"]
        lines.append(
            f"target: best SVD-free option ({option}, basis {basis}) refresh vs GaLore's SVD at {n} x {n} = "
            f"{ratio:.0f}x (>= 20x){where}: {met(ratio >= 20)}"
        )
    return lines


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"
