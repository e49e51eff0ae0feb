"""The DSV4 model as swappable components (see docs/naming.md for the dotted names)."""
from .model import DSV4Model
from .state import DecodeState

__all__ = ["DSV4Model", "DecodeState"]
