"""One import name: ``paged_serve`` maps the layout's folders, lists every one of them, and
leaves every other top-level name (Hugging Face's ``kernels`` above all) to its owner."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIRS = SETUPTOOLS["package-dir"]


def _folder_of(package: str) -> Path:
    """The folder setuptools builds ``package`` from: its longest mapped prefix's folder."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in PACKAGE_DIRS:
            return ROOT / PACKAGE_DIRS[prefix] / Path(*parts[n:])
    raise AssertionError(f"{package} is under no mapped folder")


def _python_folders() -> set[Path]:
    """Every folder under engine/, kernels/ and server/ that holds a .py file or the static page."""
    folders = {
        path.parent
        for top in ("engine", "kernels", "server")
        for path in (ROOT / top).rglob("*")
        if path.suffix in (".py", ".html", ".c") and "__pycache__" not in path.parts
    }
    return folders


def test_every_folder_holding_code_is_a_listed_package():
    listed = {_folder_of(package) for package in SETUPTOOLS["packages"]}
    assert _python_folders() - listed == set(), "a folder the wheel would leave out"
    assert listed - _python_folders() == set(), "a listed package with no folder"


def test_every_listed_package_but_kernels_has_an_init():
    without = {
        package
        for package in SETUPTOOLS["packages"]
        if not (_folder_of(package) / "__init__.py").is_file()
    }
    assert without == {"paged_serve.kernels", "paged_serve.server.ops.static"}


def test_the_scripts_name_the_one_import_name():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {
        "paged-serve": "paged_serve.server.cli:main",
        "paged-generate": "paged_serve.engine.cli:main",
    }


def _run(code: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_the_offline_api_and_every_subpackage_import_from_outside_the_checkout(tmp_path):
    code = (
        "import paged_serve, paged_serve.engine, paged_serve.kernels.reference, "
        "paged_serve.server.app; from paged_serve import LLM, SamplingParams; "
        "print(LLM.__module__, SamplingParams.__module__)"
    )
    assert _run(code, tmp_path) == "paged_serve.engine.llm paged_serve.engine.sampling_params"


def test_importing_the_kernels_loads_no_engine(tmp_path):
    code = (
        "import sys, paged_serve.kernels.reference; "
        "print(sorted(m for m in sys.modules if m.startswith('paged_serve.engine')))"
    )
    assert _run(code, tmp_path) == "[]"


@pytest.mark.skipif(
    importlib.util.find_spec("kernels") is None
    or not (Path(importlib.util.find_spec("kernels").origin or "").name == "__init__.py"),
    reason="Hugging Face's kernels distribution is not installed",
)
def test_hugging_face_kernels_stays_theirs_from_the_repository_root():
    """With the repository first on sys.path (python -m perf..., pytest), ``import kernels`` is
    Hugging Face's, and transformers' hub-kernel module (which imports it) loads."""
    code = (
        "import sys; sys.path.insert(0, '.'); import kernels; "
        "import transformers.integrations.hub_kernels; "
        "print(kernels.__file__)"
    )
    origin = _run(code, ROOT)
    assert "site-packages" in origin and not origin.startswith(str(ROOT / "kernels"))


def test_a_source_tree_with_no_install_serves_the_package(tmp_path):
    """ci/gpu-check.sh's way: a link to engine/paged_serve on PYTHONPATH (found before any
    installed copy) gives the whole package from the checkout."""
    (tmp_path / "paged_serve").symlink_to(ROOT / "engine" / "paged_serve")
    code = (
        "import paged_serve, paged_serve.kernels.reference as r, "
        "paged_serve.server.http.sse as s; print(paged_serve.__file__, r.__file__, s.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    root, reference, sse = result.stdout.split()
    assert root == str(tmp_path / "paged_serve" / "__init__.py")
    assert (reference, sse) == (
        str(ROOT / "kernels" / "reference.py"),
        str(ROOT / "server" / "http" / "sse.py"),
    )
