import sys
from pathlib import Path

# Benchmarks import their shared cases as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
