"""The Python blocks of README.md and docs/*.md marked ``<!-- tested -->``
run as written (from the repository root, in a fresh namespace), so the
quickstart a newcomer copies works."""

import re

import pytest

from conftest import REPO

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def _tested_blocks():
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"<!-- tested -->\n```python\n(.*?)\n```", text, re.S):
            line = text[: m.start()].count("\n") + 2
            out.append(pytest.param(m.group(1), id=f"{page.name}:{line}"))
    return out


BLOCKS = _tested_blocks()


def test_the_pages_have_tested_blocks():
    # The README's quickstart and docs/python.md's batch example at least.
    assert len(BLOCKS) >= 2, [b.id for b in BLOCKS]


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code, monkeypatch):
    if "transformers" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(REPO)
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})
