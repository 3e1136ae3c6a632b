"""The benchmarks import their shared cases (bench/cases.py) as a plain module: pytest puts bench/ on the path."""
