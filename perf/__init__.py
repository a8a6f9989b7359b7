"""vgraph's benchmark suites: ``python -m perf run SUITE [--device cpu|cuda]``.

Every suite times the variants it compares side by side, interleaved in one process (the
machines are noisy; only ratios travel), and writes a JSON results file under perf/results/.
"""
