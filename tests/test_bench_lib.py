"""benchmarks/_lib: the run cache, the table writer, the interleaved timer, the shared options and the machine record
(fast: no benchmark runs, no subprocess)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks._lib import continual as bench
from benchmarks._lib import machine
from benchmarks._lib.cache import RunCache
from benchmarks._lib.cli import benchmark_parser, parse
from benchmarks._lib.protocol import Protocol, Study
from benchmarks._lib.tables import fmt_bytes, fmt_mib, fmt_s, markdown_table, mean_sd
from benchmarks._lib.timing import Interleaved, median_time, timed

# -- the run cache ---------------------------------------------------------------------------------------------------


def test_cache_round_trip_and_a_resumed_job_reuses_every_run(tmp_path):
    path = tmp_path / "runs.json"
    cache = RunCache(path, {"epochs": 2, "data": (1, 2)})
    assert len(cache) == 0 and not path.exists()  # nothing written before the first run
    kept = cache.put(("a", 0.01, 0, "test"), {"acc": 0.5, "curve": [(1, math.inf)], "lr": 0.01})
    cache.put("b|seed=1", [0.25, {}])  # a string key is kept as it is (the continual checkpoint's keys)
    assert kept == {"acc": 0.5, "curve": [[1, math.inf]], "lr": 0.01}  # as JSON gives it back: tuples are lists
    saved = json.loads(path.read_text())
    assert saved["settings"] == {"data": [1, 2], "epochs": 2}
    assert set(saved["runs"]) == {'["a", 0.01, 0, "test"]', "b|seed=1"}
    assert not (tmp_path / "runs.json.tmp").exists()

    again = RunCache(path, {"data": [1, 2], "epochs": 2})  # the same settings (a tuple and its list are the same)
    assert len(again) == 2 and again.reused == 0
    assert ("a", 0.01, 0, "test") in again and ("a", 0.01, 1, "test") not in again
    assert again.get(("a", 0.01, 0, "test"))["curve"] == [[1, math.inf]] and again.reused == 1
    assert again.get(("a", 0.01, 1, "test")) is None and again.reused == 1
    assert again["b|seed=1"] == [0.25, {}] and again.values() == [kept, [0.25, {}]]
    again.pop("b|seed=1")
    assert "b|seed=1" not in again and "b|seed=1" in json.loads(path.read_text())["runs"]  # file: at the next put
    again.put(("c",), 1)
    assert set(json.loads(path.read_text())["runs"]) == {'["a", 0.01, 0, "test"]', '["c"]'}


def test_cache_refuses_other_settings_and_files_that_are_not_caches(tmp_path):
    path = tmp_path / "runs.json"
    RunCache(path, {"epochs": 2, "batch": 8}).put(("x",), 1)
    with pytest.raises(SystemExit, match=r"other settings \(differing: batch, seed\); pass another path or delete"):
        RunCache(path, {"epochs": 2, "batch": 4, "seed": 0})
    with pytest.raises(SystemExit, match="drop --resume"):
        RunCache(path, {"epochs": 3}, hint="drop --resume")
    assert RunCache(path, {"epochs": 3}, resume=False).runs == {}  # not resumed: the file is not even read
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="is not a run cache"):
        RunCache(path, {})
    path.write_text(json.dumps({"runs": {}}))
    with pytest.raises(SystemExit, match="is not a run cache"):
        RunCache(path, {})
    memory = RunCache(None, {"epochs": 2})  # no path: nothing written anywhere
    memory.put(("x",), 1)
    assert memory[("x",)] == 1 and list(tmp_path.iterdir()) == [path]


def test_cache_merges_per_method_settings(tmp_path):
    """With ``merge``, runs of other methods stay (and their settings with them); a method whose own settings
    changed is refused, naming it."""
    path = tmp_path / "checkpoint.json"
    first = RunCache(path, {"size": 1, "options": {"a": {"r": 4}, "b": {"r": 8}}}, merge="options")
    first.put("a|0", 1)
    second = RunCache(path, {"size": 1, "options": {"b": {"r": 8}, "c": {"r": 2}}}, merge="options")
    assert second.runs == {"a|0": 1}
    assert second.settings["options"] == {"a": {"r": 4}, "b": {"r": 8}, "c": {"r": 2}}
    second.put("c|0", 2)
    assert json.loads(path.read_text())["settings"]["options"] == second.settings["options"]
    with pytest.raises(SystemExit, match=r"differing: options\.b\)"):
        RunCache(path, {"size": 1, "options": {"b": {"r": 16}}}, merge="options")
    with pytest.raises(SystemExit, match=r"differing: size\)"):
        RunCache(path, {"size": 2, "options": {}}, merge="options")


def test_cache_reads_a_file_that_kept_its_runs_as_a_list(tmp_path):
    path = tmp_path / "runs.json"
    runs = [{"method": "m", "lr": 0.03, "seed": 0, "acc": 0.5}, {"method": "m", "lr": 0.03, "seed": 1, "acc": 0.7}]
    path.write_text(json.dumps({"settings": {"k": 1}, "runs": runs}))
    cache = RunCache(path, {"k": 1}, index=lambda run: (run["method"], run["lr"], run["seed"]))
    assert cache[("m", 0.03, 1)]["acc"] == 0.7 and cache.values() == runs
    with pytest.raises(SystemExit, match="is not a run cache"):  # without an index a list is not a cache
        RunCache(path, {"k": 1})


def test_cache_wrap_trains_each_protocol_run_once(tmp_path):
    calls = []

    def score(method, lr, seed, split):
        calls.append((method, lr, seed, split))
        return 0.5 + lr, {"seed": seed}

    cache = RunCache(tmp_path / "runs.json", {})
    wrapped = cache.wrap(score)
    assert wrapped("a", 0.1, 0, "test") == (0.6, {"seed": 0})
    assert wrapped("a", 0.1, 0, "test") == (0.6, {"seed": 0}) and len(calls) == 1 and cache.reused == 1
    assert RunCache(tmp_path / "runs.json", {}).wrap(score)("a", 0.1, 0, "test") == (0.6, {"seed": 0})
    assert len(calls) == 1


# -- the table writer ------------------------------------------------------------------------------------------------


def test_markdown_table_exact_output():
    text = markdown_table(["method", "acc", "time"], [["ours", "51.0", "1.2 s"], ["theirs", 49, ""]])
    assert text == (
        "| method | acc | time |\n"
        "|---|---:|---:|\n"
        "| ours | 51.0 | 1.2 s |\n"
        "| theirs | 49 |  |"  # cells are str()-ed; an empty cell keeps its spaces
    )
    assert markdown_table(["a", "b", "c"], [], align="lrl") == "| a | b | c |\n|---|---:|---|"
    with pytest.raises(ValueError, match="one of 'l' / 'r' per column"):
        markdown_table(["a", "b"], [], align="l")
    with pytest.raises(ValueError, match="one of 'l' / 'r' per column"):
        markdown_table(["a"], [], align="c")
    with pytest.raises(ValueError, match="a row of 1 cells under 2 columns"):
        markdown_table(["a", "b"], [["x"]])


def test_cell_formats():
    assert mean_sd([]) == "—" and mean_sd([0.5]) == "50.0" and mean_sd([0.5, 0.7]) == "60.0 ± 14.1"
    assert mean_sd([1.23456, 1.3], scale=1.0, digits=3) == "1.267 ± 0.046"
    assert fmt_s(0.0123) == "12.3 ms" and fmt_s(1.234) == "1.23 s"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 * 2**20) == "3.00 MiB" and fmt_mib(3 * 2**20) == "3.0"


def test_study_table_goes_through_the_writer():
    study = Study(Protocol(test_seeds=(0, 1)), {"a": {0.01: [0.5]}, "b": {0.01: [0.4]}}, {"a": 0.01, "b": 0.01})
    study.test, study.extras = {"a": [0.6, 0.7], "b": [0.5, 0.5]}, {"a": [{}, {}], "b": [{}, {}]}
    lines = study.table(baseline="b").splitlines()
    assert lines[1] == "|---|---|---:|---:|---:|---:|---:|"
    assert lines[2] == "| a | 0.01 | 0.01 | 50.0 | 65.0 ± 7.1 | 0.0 decades | +15.0 [-48.5, +78.5] |"
    assert lines[3].endswith("| — |")
    assert list(study.subset(["b"]).chosen) == ["b"] and list(study.subset(["b", "a"]).test) == ["a", "b"]


# -- the interleaved timer -------------------------------------------------------------------------------------------


class FakeClock:
    """A clock that only moves when a timed call says how long it took."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _calls(clock: FakeClock, seconds: dict[str, float], ran: list[str]) -> dict:
    def call(label: str):
        def run():
            ran.append(label)
            clock.now += seconds[label]
            return label.upper()

        return run

    return {label: call(label) for label in seconds}


def test_interleaved_rotates_the_order_and_leaves_the_warmup_out():
    clock, ran = FakeClock(), []
    timer = Interleaved(["a", "b", "c"], warmup=1, clock=clock)
    results = [timer.round(_calls(clock, {"a": 1.0, "b": 2.0, "c": 4.0}, ran)) for _ in range(4)]
    assert ran == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]  # one label on every round
    assert results[0] == {"a": "A", "b": "B", "c": "C"}
    assert len(timer.all_rounds) == 4 and len(timer.rounds) == 3  # the warm-up round is kept apart
    assert timer.times("c") == [4.0, 4.0, 4.0] and timer.median("b") == 2.0
    assert [timer.order(r) for r in range(3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    fixed = Interleaved(["a", "b"], rotate=False, clock=clock)
    assert [fixed.order(r) for r in range(3)] == [["a", "b"]] * 3


def test_interleaved_ratios_pair_each_round_with_itself():
    clock, ran = FakeClock(), []
    timer = Interleaved(["fast", "slow"], clock=clock)
    for fast, slow in ((1.0, 2.0), (3.0, 3.0), (1.0, 4.0)):  # a slow round for both, then a fast one
        timer.round(_calls(clock, {"fast": fast, "slow": slow}, ran))
    timer.round(_calls(clock, {"slow": 10.0}, ran))  # "fast" sits this round out: it pairs with nothing
    ratio = timer.ratio("fast", "slow")
    assert ratio.per_round == [0.5, 1.0, 0.25]
    assert ratio.median == 0.5
    assert ratio.of_medians == 1.0 / 3.0  # median(1, 3, 1) / median(2, 3, 4): only the rounds that ran both
    mean, lo, hi = ratio.interval
    assert mean == pytest.approx((0.5 * 1.0 * 0.25) ** (1 / 3)) and lo < mean < hi
    assert timer.times("slow") == [2.0, 3.0, 4.0, 10.0]
    with pytest.raises(ValueError, match="no recorded round ran both"):
        Interleaved(["x", "y"], clock=clock).ratio("x", "y")
    with pytest.raises(KeyError, match="not timed here"):
        timer.round({"other": lambda: None})


def test_interleaved_hooks_run_off_the_clock():
    clock, log = FakeClock(), []

    def hook(kind):
        def run(label):
            log.append(f"{kind} {label}")
            clock.now += 50.0  # set-up and clean-up cost nothing on the timer

        return run

    timer = Interleaved(["a", "b"], clock=clock)
    timer.round(_calls(clock, {"a": 1.0, "b": 2.0}, log), before=hook("before"), after=hook("after"))
    assert log == ["before a", "a", "after a", "before b", "b", "after b"]
    assert timer.rounds == [{"a": 1.0, "b": 2.0}]


def test_timed_and_median_time():
    clock = FakeClock()
    assert timed(lambda: setattr(clock, "now", clock.now + 3.0), clock=clock) == 3.0
    calls, syncs = [], []
    assert median_time(lambda: calls.append(1), repeats=3, warmup=2, sync=lambda: syncs.append(1)) >= 0
    assert len(calls) == 5 and len(syncs) == 6  # warm-up calls untimed and unsynchronized; 2 syncs per timed call


# -- the shared options ----------------------------------------------------------------------------------------------


def test_parser_has_the_shared_options_asked_for(tmp_path):
    doc = "First paragraph.\n\nMore text."
    parser = benchmark_parser(doc, quick="smoke run", json=True, threads=1, runs=True)
    assert parser.description == "First paragraph."
    parser.add_argument("--epochs", type=int, default=6)
    args = parse(parser, [])
    assert (args.quick, args.json, args.threads, args.runs, args.epochs) == (False, None, 1, None, 6)
    args = parse(parser, ["--quick", "--json", str(tmp_path / "r.json"), "--threads", "2", "--epochs", "3"])
    assert args.quick and args.json == tmp_path / "r.json" and args.threads == 2 and args.epochs == 3
    args = parse(parser, ["--quick", "--epochs", "3"], quick={"epochs": 1, "threads": 4})
    assert args.epochs == 1 and args.threads == 4  # --quick's values win over the options'
    assert parse(parser, ["--epochs", "3"], quick={"epochs": 1}).epochs == 3  # no --quick: the options'
    with pytest.raises(AttributeError, match="'batch'"):
        parse(parser, ["--quick"], quick={"batch": 1})

    bare = benchmark_parser(doc)
    assert vars(bare.parse_args([])) == {}
    with pytest.raises(SystemExit):
        bare.parse_args(["--quick"])
    assert "--runs" not in benchmark_parser(doc, json=True).format_help()
    assert "also write x" in benchmark_parser(doc, json="also write x").format_help()


def test_machine_record_and_lines():
    record = machine.record(command="python -m benchmarks.x")
    assert {"torch", "threads", "machine", "cpu", "cores", "gpu", "python", "argv"} <= set(record)
    assert record["command"] == "python -m benchmarks.x" and json.loads(json.dumps(record)) == record
    assert f"{record['cores']} CPU cores ({record['cpu']})" in machine.summary()
    assert machine.torch_platform() == f"torch {record['torch']}, {record['machine']}"
    assert machine.load_average() >= 0 or math.isnan(machine.load_average())


def test_the_protocol_runs_on_either_shipped_data_set():
    wordnet = bench.parse_args([])
    assert wordnet.dataset == "wordnet" and wordnet.classes_per_task == 4
    assert wordnet.out == "runs/benchmark_continual_wordnet" and "dataset" not in bench.settings(wordnet)
    fortunes = bench.parse_args(["--dataset", "fortunes", "--tasks", "4"])
    assert fortunes.classes_per_task == 3 and fortunes.out == "runs/benchmark_continual_wordnet_fortunes"
    assert bench.settings(fortunes)["dataset"] == "fortunes"  # a WordNet cache is never read for fortunes
    fortunes.train_per_class, fortunes.test_per_class, fortunes.val_per_class = 5, 3, 2
    sequence = bench.Runs(fortunes).sequence(0)
    assert len(sequence.tasks) == 4 and sequence.num_classes == 12
    assert set(sequence.class_names) <= set(bench.SHIPPED["fortunes"].names())


def _toy_score(method: str, lr: float, seed: int, split: str) -> tuple[float, dict]:
    """A deterministic run for the job tests (module level: worker processes import it)."""
    best = {"a": 0.01, "b": 0.1}[method]
    value = 1.0 - abs(math.log10(lr / best)) + 0.01 * seed + (0.001 if split == "test" else 0.0)
    return value, {"split": split}


@pytest.mark.slow  # spawns two worker processes (each imports this module: torch, transformers)
def test_protocol_runs_trained_in_worker_processes_give_the_sequential_study():
    """missing_runs asks for the validation grid first, then only the chosen lrs' test seeds; trained two at a time in
    spawned processes, the runs make the study a sequential tune_and_test makes, and no run is trained twice."""
    from benchmarks._lib.jobs import in_workers, missing_runs
    from benchmarks._lib.protocol import tune_and_test

    grids = {"a": [0.001, 0.01, 0.1], "b": [0.01, 0.1, 1.0]}
    protocol = Protocol(tune_seeds=(0,), test_seeds=(0, 1))
    sequential = tune_and_test(grids, _toy_score, protocol, echo=lambda line: None)
    cache = RunCache(None, {})
    known = lambda key: (cache[key][0], cache[key][1]) if key in cache else None  # noqa: E731
    batches = []
    while todo := missing_runs(grids, protocol, known):
        batches.append(sorted(todo))
        in_workers(todo, _toy_score, jobs=2, threads=1, done=lambda key, value: cache.put(key, value))
    assert [len(b) for b in batches] == [6, 4]  # the grid (3 lrs x 2 methods), then 2 test seeds x 2 methods
    assert all(split == "validation" for *_, split in batches[0])
    assert sorted((m, lr) for m, lr, _, _ in batches[1]) == [("a", 0.01), ("a", 0.01), ("b", 0.1), ("b", 0.1)]
    parallel = tune_and_test(grids, cache.wrap(_toy_score), protocol, echo=lambda line: None)
    assert len(cache) == 10 and cache.reused == 10  # every run the study needed came from the workers
    assert parallel.chosen == sequential.chosen == {"a": 0.01, "b": 0.1}
    assert parallel.test == sequential.test and parallel.validation == sequential.validation
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        in_workers([], _toy_score, jobs=0, threads=1, done=lambda key, value: None)


def test_missing_runs_asks_for_a_point_past_the_grid_only_once_the_grid_is_known():
    """With Protocol.extend_edges, the point past an end is asked for after the grid's own points are known (never
    chosen from placeholders), then the chosen lr's test seeds; the rounds make the sequential study."""
    from benchmarks._lib.jobs import missing_runs
    from benchmarks._lib.protocol import tune_and_test

    def score(method, lr, seed, split):  # best at 0.1 for "a": past its grid's top; "b" peaks inside
        return 0.9 - 0.1 * abs(math.log10(lr / (0.1 if method == "a" else 0.01))) + 0.01 * seed

    grids = {"a": [0.001, 0.003, 0.01], "b": [0.003, 0.01, 0.03]}
    protocol = Protocol(tune_seeds=(0,), test_seeds=(0, 1), extend_edges=2)
    cache = RunCache(None, {})
    known = lambda key: (cache[key], {}) if key in cache else None  # noqa: E731
    batches = []
    while todo := missing_runs(grids, protocol, known):
        batches.append(sorted(todo))
        for key in todo:
            cache.put(key, score(*key))
    assert [(m, lr) for m, lr, _, _ in batches[0]] == [("a", 0.001), ("a", 0.003), ("a", 0.01)] + [
        ("b", 0.003), ("b", 0.01), ("b", 0.03)]  # fmt: skip
    assert [(m, lr, split) for m, lr, _, split in batches[1]] == [
        ("a", 0.033, "validation"), ("b", 0.01, "test"), ("b", 0.01, "test")]  # fmt: skip
    assert [(m, lr, split) for m, lr, _, split in batches[2]] == [("a", 0.11, "validation")]
    assert [(m, lr) for m, lr, _, _ in batches[3]] == [("a", 0.11), ("a", 0.11)]
    sequential = tune_and_test(grids, score, protocol, echo=lambda line: None)
    assert sequential.chosen == {"a": 0.11, "b": 0.01}
    assert tune_and_test(grids, lambda *key: known(key), protocol, echo=lambda line: None).test == sequential.test
