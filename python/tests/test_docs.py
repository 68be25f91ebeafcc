"""Every Python block of README.md and docs/*.md runs as written, in page
order, in one namespace per page (a block may use what an earlier block of
its page defined, as a reader going down the page would), from the
repository root — so what a newcomer copies works. A block that needs what
this machine lacks carries ``<!-- not run: REASON -->`` on the line
directly above it; there are few (at most ``MAX_NOT_RUN``), each with a
reason."""

import re
import time

import pytest

from conftest import REPO

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
MAX_NOT_RUN = 3
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\n$")


def page_blocks(page):
    """``(line, code, reason)`` of each Python block of ``page`` in order;
    ``reason`` is the ``not run`` marker's text, else ``None``."""
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()]
        line = before.count("\n") + 1
        marker = NOT_RUN.search(before[-300:])
        out.append((line, m.group(1), marker.group(1) if marker else None))
    return out


PAGES_WITH_CODE = [p for p in PAGES if page_blocks(p)]


def test_the_pages_have_blocks_and_few_are_not_run():
    blocks = {p.name: page_blocks(p) for p in PAGES_WITH_CODE}
    assert {"README.md", "python.md"} <= set(blocks), sorted(blocks)
    not_run = [(name, line, why) for name, bs in blocks.items() for line, _, why in bs if why is not None]
    assert len(not_run) <= MAX_NOT_RUN, not_run
    assert all(len(why) > 20 for *_, why in not_run), not_run
    assert sum(len(bs) for bs in blocks.values()) - len(not_run) >= 13
    # No block is marked in a way this test does not read.
    for p in PAGES:
        text = p.read_text()
        assert "<!-- tested -->" not in text, f"{p.name}: every block runs now; drop the marker"
        for m in re.finditer(r"<!-- not run", text):
            assert NOT_RUN.match(text[m.start():text.index("\n", m.start()) + 1]), f"{p.name}: malformed marker"
            assert text[text.index("\n", m.start()) + 1:].startswith("```python\n"), (
                f"{p.name}: a not-run marker must be directly above a Python block"
            )


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_page_runs_in_order(page, monkeypatch):
    pytest.importorskip("transformers")
    import torch.distributed as dist

    monkeypatch.chdir(REPO)
    ns = {"__name__": "__doc_page__"}
    try:
        for line, code, why in page_blocks(page):
            if why is not None:
                continue
            t0 = time.perf_counter()
            try:
                exec(compile(code, f"{page.name}:{line}", "exec"), ns)
            except Exception as e:
                raise AssertionError(f"{page.name}, the block at line {line}: {type(e).__name__}: {e}") from e
            took = time.perf_counter() - t0
            assert took < 20, f"{page.name}:{line} took {took:.1f} s: keep the page's blocks small"
    finally:
        # A block may start a one-process gloo group (as torchrun would).
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def test_transformers_range_is_cis_pin():
    """python/pyproject.toml's extras admit the transformers CI pins (and
    the one installed here), and say the same range in both extras."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    specs = {str(Requirement(r).specifier) for name in ("hf", "test") for r in extras[name]
             if Requirement(r).name == "transformers"}
    assert len(specs) == 1, specs
    (spec,) = specs
    pin = re.search(r"transformers==([0-9.]+)", (REPO / ".ci" / "run").read_text()).group(1)
    req = Requirement(f"transformers{spec}")
    assert req.specifier.contains(pin), (spec, pin)
    assert req.specifier.contains(importlib.metadata.version("transformers")), spec
    # Not open-ended: an untested minor is not admitted.
    major, minor = (int(x) for x in pin.split(".")[:2])
    assert not req.specifier.contains(f"{major}.{minor + 1}.0"), spec
