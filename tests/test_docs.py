"""The documentation's snippets cannot rot: every `pycon` and `python` block of the README and of
the pages under `docs/` runs here, a page's blocks in order in one namespace (a page reads like
one session). A `pycon` block is a doctest: what it prints must match what the page shows. A
`python` block must run without error; one that talks to "http://127.0.0.1:8000" (the server
`make serve` starts) is pointed at a live server on the embedded model instead. Shell blocks name
commands and are not run. The site itself is built with `mkdocs build --strict` by `make lint`,
which fails on a broken link or a link to code that moved (docs/hooks.py); the hook's symbol
lookup is checked here. So is every `pytest …` command a page names (an exercise's check): each
must select at least one test."""
from __future__ import annotations

import contextlib
import doctest
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import live_server

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```(pycon|python)[^\n]*\n(.*?)^```", re.S | re.M)
SERVER = "http://127.0.0.1:8000"  # where `make serve` listens, as the snippets say
PAGES = sorted(p for p in [ROOT / "README.md", *DOCS.rglob("*.md")] if BLOCK.search(p.read_text()))


def page_blocks(page: Path) -> list[tuple[str, int, str]]:
    """Each pycon or python block of the page: (its kind, its first line's number, its text)."""
    text = page.read_text()
    return [(m.group(1), text[:m.start(2)].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(text)]


def test_the_docs_have_snippets():
    assert any("tour" in p.parts for p in PAGES), "no page of the tour has a snippet"


@pytest.fixture(scope="module")
def served():
    """A live server on the embedded model, for the snippets that talk to one."""
    with live_server() as live:
        yield live


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_snippets_run_and_print_what_the_page_shows(page: Path, monkeypatch, request):
    monkeypatch.chdir(ROOT)
    # The suite's per-step allocator checks (conftest.py) would make the pages' simulations ten
    # times slower; the snippets show what a reader runs, without them.
    monkeypatch.setenv("NANOSERVE_CHECK_INVARIANTS", "0")
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace: dict = {"__name__": "__docs__"}
    name = str(page.relative_to(ROOT))
    for kind, line, block in page_blocks(page):
        if kind == "pycon":
            test = parser.get_doctest(block, namespace, name, name, line)
            result = runner.run(test, clear_globs=False)
            namespace = test.globs  # the next block goes on from here (DocTest copies its globals)
            assert result.failed == 0, f"{name}: the pycon block at line {line} does not print what the page shows"
            continue
        if SERVER in block:
            block = block.replace(SERVER, request.getfixturevalue("served").url)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, f"{name}:{line}", "exec"), namespace)


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


def _pytest_commands() -> list[str]:
    """The arguments of every `pytest …` command the README and the docs name, line breaks folded."""
    found: set[str] = set()
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        found |= set(re.findall(r"`pytest ([^`]+)`", re.sub(r"\s+", " ", page.read_text())))
    return sorted(found)


def _keyword_match(expression: str, node_id: str) -> bool:
    """pytest's `-k`: case-insensitive substrings of the test's node id, with and, or, not and
    parentheses."""
    python = []
    for token in re.findall(r"\(|\)|[^\s()]+", expression):
        python.append(token if token in ("(", ")", "and", "or", "not") else repr(token.lower()) + " in node")
    return bool(eval(" ".join(python), {"__builtins__": {}}, {"node": node_id.lower()}))


def test_every_pytest_command_the_docs_name_selects_tests():
    commands = [shlex.split(c) for c in _pytest_commands()]
    assert len(commands) >= 20, "the exercises' checks were not found"
    files = sorted({a for c in commands for a in c if a.startswith("tests/")})
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    collected = subprocess.run(collect, cwd=ROOT, capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-2000:]
    node_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    for command in commands:
        args = iter(command)
        paths, keyword, marker = [], None, None
        for arg in args:
            if arg == "-k":
                keyword = next(args)
            elif arg == "-m":
                marker = next(args)
            else:
                paths.append(arg)
        if marker is not None:  # a marker: some test must carry it
            assert f"pytest.mark.{marker}" in tests_text, command
        chosen = [n for n in node_ids if any(n.startswith(p + "::") for p in paths)] if paths else node_ids
        if paths:
            assert all(any(n.startswith(p + "::") for n in node_ids) for p in paths), f"{command}: a file has no tests"
        if keyword is not None:
            chosen = [n for n in chosen if _keyword_match(keyword, n)]
        assert chosen, f"`pytest {shlex.join(command)}` selects no test"
