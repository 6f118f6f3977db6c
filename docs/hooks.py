"""MkDocs hook: links into the code that cannot rot.

A page links to code as `[text](src:nanoserve/engine.py#Engine.step)`: a file, and optionally a
symbol in it (a class, a function, a method as `Class.method`, or a module-level name). At build
time the hook

- adds a page for each file a link names (`src/<path>.md`: the file's code with line numbers,
  each line an anchor), so the site carries the code it describes;
- rewrites the link to that page and the symbol's line, found in the file as it is now.

A file or symbol that no longer exists stops the build (`mkdocs build --strict` runs in
`make lint`), so a page that describes code which moved is caught the day it moves.
"""
from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.source_links")
LINK = re.compile(r"\]\(src:([\w/.\-]+)(?:#([\w.]+))?\)")
ROOT = Path(__file__).resolve().parents[1]


def _referenced(docs_dir: Path) -> set[str]:
    paths = set()
    for page in docs_dir.rglob("*.md"):
        paths.update(match.group(1) for match in LINK.finditer(page.read_text()))
    return paths


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(_referenced(Path(config["docs_dir"]))):
        source = ROOT / path
        if not source.is_file():
            raise PluginError(f"a page links to src:{path}, which does not exist")
        language = "python" if path.endswith(".py") else "c" if path.endswith((".c", ".h")) else "text"
        content = f"# `{path}`\n\n```{language} linenums=\"1\"\n{source.read_text()}```\n"
        files.append(File.generated(config, f"src/{path}.md", content=content))
    return files


def symbol_line(path: str, symbol: str) -> int:
    """The 1-based line where `symbol` is defined in `path`: `Class`, `function`, `Class.method`
    or a module-level `NAME = ...`."""
    lines = (ROOT / path).read_text().splitlines()
    start, parts = 0, symbol.split(".")
    for depth, name in enumerate(parts):
        found = _definition(lines, start, name, inside=depth > 0)
        if found is None:
            raise PluginError(f"src:{path}#{symbol}: no {'.'.join(parts[:depth + 1])} in {path}")
        start = found
    return start + 1


def _definition(lines: list[str], start: int, name: str, inside: bool) -> int | None:
    """The index of the line from `start` on that defines `name`: at the top level, or, `inside`
    the class defined at `start`, indented and before the class ends (the next top-level line)."""
    indent, word = (r"\s+" if inside else ""), re.escape(name)
    pattern = re.compile(rf"^{indent}(?:async\s+def|def|class)\s+{word}\b|^{indent}{word}\s*[:=]")
    for number in range(start, len(lines)):
        if inside and number > start and re.match(r"[^\s#)]", lines[number]):
            return None  # left the class
        if pattern.match(lines[number]):
            return number
    return None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def link(match: re.Match[str]) -> str:
        path, symbol = match.group(1), match.group(2)
        target = posixpath.relpath(f"src/{path}.md", here or ".")
        if symbol:
            target += f"#__codelineno-0-{symbol_line(path, symbol)}"
        return f"]({target})"

    return LINK.sub(link, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Tell the link checker about a code page's line anchors: they come in the highlighter's
    HTML, which MkDocs does not read for anchors."""
    if page.file.src_uri.startswith("src/"):
        page.present_anchor_ids.update(re.findall(r'id="(__codelineno-[^"]+)"', html))
    return html
