"""The one shape of an in-place change that can be undone.

At full scale nothing is copied: a component swap, a bug injection or a precision change edits the
model in place and hands back a :class:`Restorable`, whose ``restore()`` (or the end of a
``with`` block, also when the body raises) puts the model back.
"""
from __future__ import annotations


class Restorable:
    """Base of every undo handle: subclasses implement ``restore()``; ``with`` calls it on exit."""

    def restore(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.restore()
        return False
