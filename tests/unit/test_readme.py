"""Every ```python block of README.md runs, and prints what the README shows it prints.

The README reads as one walk-through, so its blocks run in document order in one shared
namespace, as a reader pasting them into one session would (a later block may use the
``model`` or imports of an earlier one). Conventions, in HTML comments that the rendered
README hides, placed right before a block:

* ``<!-- readme-test: not run: REASON -->``: the block is skipped, and says why;
* ``<!-- readme-test: setup`` ... ``-->``: Python run just before the block, for the
  data a block only names (``trees``, ``inputs``): tiny sizes, so the file takes seconds.

A ```text block right after a python block is its printed output, compared exactly.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

# A python block, with an optional readme-test comment before it and an optional text
# block (its output) after it; only blank lines may stand between them.
_BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<note>.*?)-->\n\s*)?"
    r"^```python\n(?P<code>.*?)^```\n"
    r"(?:\s*^```text\n(?P<output>.*?)^```\n)?",
    re.S | re.M,
)
_NOT_RUN = "not run:"
_SETUP = "setup\n"
_MODULE = "readme_walkthrough"


@dataclass(frozen=True)
class Block:
    line: int  # of the block's first code line in README.md
    code: str
    setup: str = ""
    setup_line: int = 0
    not_run: str | None = None
    output: str | None = None

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The python blocks of ``text`` with their notes, in document order."""
    blocks = []
    for match in _BLOCK.finditer(text):
        note = match["note"] or ""
        line = text.count("\n", 0, match.start("code")) + 1
        if note and not (note.startswith(_NOT_RUN) or note.startswith(_SETUP)):
            raise ValueError(f"README.md:{line}: unknown readme-test note {note!r}")
        blocks.append(
            Block(
                line=line,
                code=match["code"],
                setup=note[len(_SETUP) :] if note.startswith(_SETUP) else "",
                setup_line=text.count("\n", 0, match.start("note")) + 2 if note else 0,
                not_run=note[len(_NOT_RUN) :].strip() if note.startswith(_NOT_RUN) else None,
                output=match["output"],
            )
        )
    return blocks


def _compiled(code: str, line: int) -> Any:
    # Padding with newlines makes tracebacks name the README's own line numbers.
    return compile("\n" * (line - 1) + code, str(README), "exec")


@dataclass(repr=False)  # a namespace and tensors: too long for a failure report
class _Session:
    """The shared namespace, and which blocks have run in it."""

    # The namespace of a module registered in sys.modules, as a script's __main__ is:
    # the README's classes then pickle by name (GraphCollate sends a model's structure).
    module: types.ModuleType = field(default_factory=lambda: types.ModuleType(_MODULE))
    failed: dict[Block, str] = field(default_factory=dict)
    done: set[Block] = field(default_factory=set)

    def run(self, block: Block) -> str:
        """Run ``block``; returns what it printed."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if block.setup:
                exec(_compiled(block.setup, block.setup_line), self.module.__dict__)
            exec(_compiled(block.code, block.line), self.module.__dict__)
        return out.getvalue()

    def run_before(self, block: Block, blocks: list[Block]) -> list[str]:
        """Run the runnable blocks before ``block`` not run yet (so ``-k`` works too).

        Returns the failures of those before it, to explain a failure of ``block``.
        """
        for earlier in blocks:
            if earlier.line >= block.line:
                break
            if earlier.not_run is None and earlier not in self.done:
                self.done.add(earlier)
                try:
                    self.run(earlier)
                except Exception as err:
                    self.failed[earlier] = repr(err)
        return [f"{b}: {err}" for b, err in self.failed.items() if b.line < block.line]


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def session() -> Iterator[_Session]:
    session = _Session()
    sys.modules[_MODULE] = session.module
    yield session
    del sys.modules[_MODULE]


def test_the_readme_has_blocks_and_every_note_is_attached() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(BLOCKS) >= 6
    # A note separated from its block (text between) would silently stop applying.
    notes = text.count("<!-- readme-test:")
    assert notes == sum(bool(b.setup or b.not_run is not None) for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_readme_block(block: Block, session: _Session) -> None:
    if block.not_run is not None:
        pytest.skip(f"{block}: {block.not_run}")
    failed_before = session.run_before(block, BLOCKS)
    session.done.add(block)
    try:
        printed = session.run(block)
    except Exception as err:
        session.failed[block] = repr(err)
        raise AssertionError(
            f"{block} raised; earlier blocks that failed: {failed_before}"
        ) from err
    if block.output is not None:
        assert printed == block.output


def test_notes_parse() -> None:
    text = (
        "<!-- readme-test: setup\nx = 2\n-->\n```python\nprint(x)\n```\n\n```text\n2\n```\n"
        "<!-- readme-test: not run: needs torchrun -->\n\n```python\nboom()\n```\n"
    )
    first, second = readme_blocks(text)
    assert (first.line, first.setup_line, first.code, first.output) == (5, 2, "print(x)\n", "2\n")
    assert first.setup == "x = 2\n"
    assert (second.line, second.not_run, second.output) == (14, "needs torchrun", None)
    session = _Session()
    assert session.run(first) == first.output
    with pytest.raises(ValueError, match="unknown readme-test note"):
        readme_blocks("<!-- readme-test: skip -->\n```python\npass\n```\n")
