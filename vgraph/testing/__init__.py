"""Fixtures shared by the test suite and the perf suites: checkpoints built on demand."""
