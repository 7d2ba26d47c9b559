"""The generic top-level package names refuse a foreign sibling at import time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _import_with_foreign(tmp_path: Path, foreign: str, target: str) -> subprocess.CompletedProcess:
    """Import ``target`` with a package named ``foreign`` from elsewhere first on sys.path."""
    fake = tmp_path / foreign
    fake.mkdir()
    (fake / "__init__.py").write_text("VALUE = 'someone else'\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; import {target}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize("foreign, target", [("kernels", "engine"), ("engine", "server")])
def test_a_foreign_sibling_package_fails_at_import_naming_it(tmp_path, foreign, target):
    result = _import_with_foreign(tmp_path, foreign, target)
    assert result.returncode != 0
    assert f"the {foreign!r} package imported from" in result.stderr
    assert str(tmp_path / foreign) in result.stderr
    assert "not paged-serve's" in result.stderr


def test_our_own_packages_import_together():
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import server, engine, kernels"
    subprocess.run([sys.executable, "-c", code], check=True)
