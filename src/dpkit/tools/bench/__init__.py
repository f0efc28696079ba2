"""`dpkit bench`: one model under several strategies and device counts, measured in one run.

    from dpkit.tools.bench.run import run_bench
    from dpkit.tools.bench.spec import BenchSpec

    result = run_bench(BenchSpec(example="wide-output", strategies=["single", "dp", "ddp"], device_counts=[1, 2]))
    print(result.format_table())

Each configuration trains the same model from the same initial weights with the same per-device batch
(weak scaling: N devices take N times the samples per step). The strategies that run in one process take
turns, one step each per round, so that drift of a shared machine hits every contender alike (run.py,
contender.py); a strategy with one process per device runs in its own processes through dpkit's launcher,
one launch per device count, with a small worker (processes.py). Step times are medians over the measured
steps after the warm-up ones. A few more steps run under an `dpkit.observe.Observer` for the time by
phase; they do not count in the medians, since observing costs time itself. The results, side by side, are
results.py's: the table, the JSON, the figure.
"""
