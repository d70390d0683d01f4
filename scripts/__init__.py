"""The repository's scripts: benchmarks (scripts/bench/), data generators (scripts/tools/) and the
library they share (scripts/benchlib/). Each runs as `python3 scripts/<folder>/<name>.py` from the
repository's root; this file makes `scripts.benchlib` importable as a regular package."""
