"""Makes the project root importable so tests can read build_ffi.py."""

import sys
from pathlib import Path

_root = str(Path(__file__).resolve().parent.parent)
if _root not in sys.path:
    sys.path.append(_root)
