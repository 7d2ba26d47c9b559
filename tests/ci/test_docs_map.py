"""docs/architecture.md's map matches the tree: every folder of code has its section, every file
of code its row, and every repository path or ``paged_serve`` module the page names exists; the
other pages name no path the tree does not hold."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
CODE_FOLDERS = ("engine", "kernels", "server", "perf")
# A repository path as the page writes it: a top-level folder, then path parts, no spaces.
PATH = re.compile(r"(?<![\w./-])((?:engine|kernels|server|perf|tests|ci|docs)/[\w./-]*\w)")
MODULE = re.compile(r"\bpaged_serve(?:\.\w+)+")


def _code_files() -> list[Path]:
    """Every Python or C source under the code folders, ``__init__.py`` and the package
    ``paged_serve`` face excepted (its folder's section says what it holds)."""
    files = []
    for top in CODE_FOLDERS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".c") or path.name == "__init__.py":
                continue
            if "__pycache__" in path.parts:
                continue
            files.append(path.relative_to(ROOT))
    return files


def test_every_folder_of_code_has_its_section() -> None:
    page = PAGE.read_text()
    folders = sorted({f.parent for f in _code_files()} | {Path(top) for top in CODE_FOLDERS})
    missing = [str(f) for f in folders if f"### `{f.as_posix()}/`" not in page]
    assert not missing, f"docs/architecture.md has no '### `folder/`' section for {missing}"


def test_every_file_of_code_is_named() -> None:
    named = set(PATH.findall(PAGE.read_text()))
    missing = []
    for f in _code_files():
        path = f.as_posix()
        # "`kernels/cpu/decode_attention.py` (`.c`)" names the C source beside its loader
        stem = path.removesuffix(".c") + ".py" if path.endswith(".c") else path
        if path not in named and stem not in named:
            missing.append(path)
    assert not missing, f"docs/architecture.md names no row for {missing}"


def _exists(path: str) -> bool:
    """A file or folder of the tree, or a name in a module (``server/http/sse.Outbox``)."""
    if (ROOT / path).exists():
        return True
    module, _, _name = path.rpartition(".")
    return bool(module) and (ROOT / f"{module}.py").exists()


def test_every_page_names_only_paths_that_exist() -> None:
    """README.md and docs/*.md; the measurement log quotes paths as they were at its commits."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    stale = {
        page.name: missing
        for page in pages
        if (missing := [p for p in sorted(set(PATH.findall(page.read_text()))) if not _exists(p)])
    }
    assert not stale, f"pages name paths the tree does not hold: {stale}"


def test_every_path_and_module_the_page_names_exists() -> None:
    page = PAGE.read_text()
    stale = [p for p in sorted(set(PATH.findall(page))) if not _exists(p)]
    for module in sorted(set(MODULE.findall(page))):
        parts = module.split(".")[1:]
        if not parts:
            continue
        top, rest = parts[0], parts[1:]
        if top not in ("engine", "kernels", "server"):
            continue  # a name of the package's face (``paged_serve.__version__``)
        base = ROOT / top
        # a module, a package, or a name inside a module (``...sse.Outbox``)
        found = any(
            (base.joinpath(*rest[:n]).with_suffix(".py")).exists()
            or (base.joinpath(*rest[:n]) / "__init__.py").exists()
            or (n == 0 and base.is_dir())
            for n in range(len(rest), -1, -1)
            if n >= len(rest) - 1
        )
        if not found:
            stale.append(module)
    assert not stale, f"docs/architecture.md names what the tree does not hold: {stale}"
