"""What the benchmark scripts share, one module per piece (import the module you need; nothing is imported here):

- :mod:`.protocol`: choose on validation, test over seeds, judge targets by paired intervals (``tune_and_test``);
- :mod:`.cache`: :class:`~.cache.RunCache`, every finished run saved as it finishes and reused by a restarted job;
- :mod:`.tables`: :func:`~.tables.markdown_table`, the one markdown table writer, and its cell formats;
- :mod:`.timing`: :class:`~.timing.Interleaved`, calls timed side by side round by round, ratios pair by pair;
- :mod:`.machine`: the machine a run measured on, as a line and as a record;
- :mod:`.cli`: :func:`~.cli.benchmark_parser`, the options every script shares (``--quick --json --threads --runs``);
- :mod:`.data`: data, models and byte counts several benchmarks use;
- :mod:`.continual`: the continual WordNet benchmark's methods and runs (continual_wordnet, pclr_ablation), and the
  instrumented method wrapper of riemannion;
- :mod:`.dct_tables`: dct_vs_galore's tables that need no fine-tuning (refresh time, energy, ablation, step time);
- :mod:`.graphs`: :class:`~.graphs.GraphCounter`, a ``torch.compile`` backend counting graphs (compile_speed, tests).
"""
