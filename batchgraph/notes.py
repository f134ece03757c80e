"""``add_note`` for every supported Python, 3.10 included.

``BaseException.add_note`` (PEP 678) exists only from Python 3.11; on 3.10 calling it
raises ``AttributeError``, which would replace the error being annotated (a failing
example would end a whole ``run_all`` instead of failing alone). Where it is missing,
the note goes into ``__notes__`` by hand: the very list ``add_note`` appends to, so
code reading notes (``pytest``, the ``exceptiongroup`` backport, which also prints them
in tracebacks on 3.10, and batchgraph's own tests) finds it the same way on every
version, and the exception keeps its type, message and arguments.
"""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(err: BaseException, note: str) -> None:
    """Add ``note`` to ``err``'s notes, as ``err.add_note(note)`` does on Python 3.11+.

    Never raises: a note only explains an error, so an error whose notes cannot be
    written (a ``__notes__`` that is not a list, say) is left as it was.

        >>> err = ValueError("bad width")
        >>> add_note(err, "widths must match the layer")
        >>> err.__notes__
        ['widths must match the layer']
    """
    # Looked up on the object, not by version number: an error type that hides
    # add_note (or a 3.10 interpreter, where no error has it) takes the same path.
    native = getattr(err, "add_note", None)
    try:
        if native is not None:
            native(note)
            return
        notes = getattr(err, "__notes__", None)
        if notes is None:
            notes = []
            err.__notes__ = notes  # type: ignore[attr-defined,unused-ignore]
        if isinstance(notes, list):
            notes.append(note)
    except (AttributeError, TypeError):
        pass  # add_note's own TypeError for a non-list __notes__, or a read-only error
