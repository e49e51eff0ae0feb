"""Engine dumps: a small safetensors format any engine can write (``Dumper``), name and layout
mappings onto dsv4lab hook points, and the hook-by-hook comparison with the reference
(``compare_dump``; ``python -m dsv4lab compare-dump``). See docs/dumps.md."""
from .compare import DumpComparison, compare_dump, parse_tol
from .mapping import BUILTIN, Mapping, load_mapping
from .reader import DumpError, DumpReader
from .writer import Dumper

__all__ = ["BUILTIN", "DumpComparison", "DumpError", "DumpReader", "Dumper", "Mapping", "compare_dump",
           "load_mapping", "parse_tol"]
