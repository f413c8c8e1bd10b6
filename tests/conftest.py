import sys
from pathlib import Path

# Test helpers (fixture-tree writers) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
