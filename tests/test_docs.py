"""The documentation's snippets cannot rot: every `pycon` block on a page of `docs/` is a
doctest, run here in page order in one namespace (a page reads like one session), and what it
prints must match what the page shows. The site itself is built with `mkdocs build --strict` by
`make lint`, which fails on a broken link or a link to code that moved (docs/hooks.py); the hook's
symbol lookup is checked here."""
from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```pycon[^\n]*\n(.*?)^```", re.S | re.M)
PAGES = sorted(p for p in DOCS.rglob("*.md") if BLOCK.search(p.read_text()))


def page_blocks(page: Path) -> list[tuple[int, str]]:
    """Each pycon block of the page: (its first line's number, its text)."""
    text = page.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_docs_have_snippets():
    assert PAGES, "no page of docs/ has a pycon block"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_snippets_print_what_the_page_shows(page: Path, monkeypatch):
    monkeypatch.chdir(ROOT)
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace: dict = {"__name__": "__docs__"}
    name = str(page.relative_to(ROOT))
    for line, block in page_blocks(page):
        test = parser.get_doctest(block, namespace, name, name, line)
        result = runner.run(test, clear_globs=False)
        namespace = test.globs  # the next block goes on from here (DocTest copies its globals)
        assert result.failed == 0, f"{name}: the pycon block at line {line} does not print what the page shows"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_links_land_on_the_symbol_and_refuse_one_that_moved():
    pytest.importorskip("mkdocs")
    hooks = _hooks()
    lines = (ROOT / "nanoserve/engine.py").read_text().splitlines()
    assert lines[hooks.symbol_line("nanoserve/engine.py", "Engine.step") - 1].strip().startswith("def step(")
    assert lines[hooks.symbol_line("nanoserve/engine.py", "Engine") - 1].startswith("class Engine(")
    from mkdocs.exceptions import PluginError
    with pytest.raises(PluginError, match="no Engine.no_such_method"):
        hooks.symbol_line("nanoserve/engine.py", "Engine.no_such_method")
    with pytest.raises(PluginError, match="no Handover.step"):  # a method of another class is not its
        hooks.symbol_line("nanoserve/engine.py", "Handover.step")
