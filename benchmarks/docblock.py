"""The generated blocks of the docs: what a benchmark writes between its markers."""

from __future__ import annotations

from pathlib import Path


def write_block(doc: Path, block: str, begin: str, end: str, heading: str) -> None:
    """Put ``block`` (from the ``begin`` marker to the ``end`` marker) in ``doc``.

    It replaces what lies between the markers, with them; a doc without them (or none yet) gets
    it at its end, under ``## heading``.
    """
    text = doc.read_text() if doc.exists() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        doc.write_text(head + block + rest.split(end, 1)[1])
    else:
        doc.write_text(text.rstrip() + f"\n\n## {heading}\n\n" + block + "\n")
