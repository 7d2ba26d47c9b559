"""The C kernel's build cache loads only a library this user alone could have written
(``kernels/cpu/native_cache.py``): a library planted at the predictable path, in a folder others can
write to or own, or as a file others can write to or own, or as a symbolic link, never runs.

The planted library is the real kernel plus a constructor that writes a marker file: loading it
would work, so only the marker tells that it ran. Where the cache folder is refused the kernel is
built in a private temporary folder (and works); where only the file is, it is rebuilt in place.
The ownership cases chown to uid 65534 and run as root only.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from paged_serve.kernels.cpu import decode_attention as cpu_decode_attention
from paged_serve.kernels.cpu.decode_attention import CpuDecodeAttention

NOBODY = 65534
CONSTRUCTOR = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen("%s", "a");
    if (marker) { fputs("the planted library ran\\n", marker); fclose(marker); }
}
"""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture(scope="module")
def planted_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a working kernel library whose constructor appends to ``marker``, marker)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler (the kernel needs one on every supported machine)"
    folder = tmp_path_factory.mktemp("planted")
    marker = folder / "marker"
    source = folder / "plant.c"
    source.write_text(CONSTRUCTOR % marker)
    library = folder / "planted.so"
    flags = ["-O0", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    src = str(cpu_decode_attention.SOURCE)
    done = subprocess.run(
        [compiler, *flags, src, str(source), "-o", str(library)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return library, marker


@pytest.fixture
def plant(planted_build: tuple[Path, Path]) -> Iterator[tuple[Path, Callable[[Path], Path]]]:
    """(marker, plant(at) -> copies the planted library to ``at``); the marker starts absent."""
    library, marker = planted_build
    marker.unlink(missing_ok=True)

    def place(at: Path) -> Path:
        shutil.copyfile(library, at)
        return at

    yield marker, place
    marker.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def fresh_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test loads as a new process would (no library remembered from another test)."""
    monkeypatch.setattr(cpu_decode_attention, "_loaded", {})


def private_builds() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("paged-serve-native-*"))


def assert_works(kernel: CpuDecodeAttention | None) -> None:
    """The kernel loaded and writes KV rows as ``write_kv_ref`` does."""
    assert isinstance(kernel, CpuDecodeAttention)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key, value = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    kernel.write_kv(key, value, k_cache, v_cache, slot_mapping=torch.tensor([1, 6]))
    assert torch.equal(k_cache.view(8, 1, 8)[[1, 6]], key)
    assert torch.equal(v_cache.view(8, 1, 8)[[1, 6]], value)


def assert_private_file(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert st.st_mode & 0o077 == 0, f"{path} mode {st.st_mode & 0o777:o}"


def load_with_warning(cache: Path, caplog: pytest.LogCaptureFixture) -> CpuDecodeAttention:
    with caplog.at_level(logging.WARNING, logger=cpu_decode_attention.__name__):
        return cpu_decode_attention.load(cache)


# ------------------------------------------------------------------ refused folders
@pytest.mark.parametrize("open_level", ["native", "cache", "above"])
def test_a_library_planted_under_a_world_writable_folder_is_never_loaded(
    tmp_path, plant, caplog, open_level
):
    """The library's folder, the cache folder, or a folder above it (not sticky) is 0777."""
    marker, place = plant
    cache = tmp_path / "above" / "cache"
    target = cpu_decode_attention._library_path(cache)
    target.parent.mkdir(parents=True)
    {"native": target.parent, "cache": cache, "above": cache.parent}[open_level].chmod(0o777)
    planted = place(target).read_bytes()
    before = private_builds()
    kernel = load_with_warning(cache, caplog)
    assert not marker.exists(), "the planted library's constructor ran"
    assert_works(kernel)  # built in a private temporary folder instead
    assert "writable by group or others (mode 777)" in caplog.text
    assert "private temporary folder" in caplog.text
    assert target.read_bytes() == planted  # a refused folder is not written to either
    assert private_builds() == before  # the temporary folder is gone once loaded


@needs_root
@pytest.mark.parametrize("owned_level", ["native", "cache"])
def test_a_library_planted_in_a_folder_another_user_owns_is_never_loaded(
    tmp_path, plant, caplog, owned_level
):
    marker, place = plant
    cache = tmp_path / "cache"
    target = cpu_decode_attention._library_path(cache)
    target.parent.mkdir(parents=True, mode=0o755)
    place(target)
    os.chown(target.parent if owned_level == "native" else cache, NOBODY, NOBODY)
    kernel = load_with_warning(cache, caplog)
    assert not marker.exists(), "the planted library's constructor ran"
    assert_works(kernel)
    assert f"is owned by uid {NOBODY}" in caplog.text


def test_a_folder_that_cannot_be_made_falls_back_to_a_private_one(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    kernel = load_with_warning(blocker / "cache", caplog)
    assert_works(kernel)
    assert "cannot prepare" in caplog.text and "private temporary folder" in caplog.text


def test_a_sticky_world_writable_folder_above_the_cache_is_accepted(tmp_path):
    """/tmp's mode (1777): others cannot rename or remove what we create there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    kernel = cpu_decode_attention.load(shared / "cache")
    assert_works(kernel)
    assert_private_file(cpu_decode_attention._library_path(shared / "cache"))


# ------------------------------------------------------------------ refused files
def _group_writable(target: Path, place) -> None:
    place(target).chmod(0o666)


def _linked(target: Path, place) -> None:
    target.symlink_to(place(target.with_name("elsewhere.so")))


def _owned_by_nobody(target: Path, place) -> None:
    os.chown(place(target), NOBODY, NOBODY)


@pytest.mark.parametrize(
    ("plant_as", "why"),
    [
        (_group_writable, "writable by group or others (mode 666)"),
        (_linked, "is a symbolic link"),
        pytest.param(_owned_by_nobody, f"is owned by uid {NOBODY}", marks=needs_root),
    ],
    ids=["group-writable", "symlink", "other-owner"],
)
def test_a_planted_file_in_a_private_folder_is_rebuilt_not_loaded(
    tmp_path, plant, caplog, plant_as, why
):
    marker, place = plant
    cache = tmp_path / "cache"
    target = cpu_decode_attention._library_path(cache)
    target.parent.mkdir(parents=True, mode=0o700)
    plant_as(target, place)
    kernel = load_with_warning(cache, caplog)
    assert not marker.exists(), "the planted library's constructor ran"
    assert_works(kernel)
    assert why in caplog.text and "rebuilding it" in caplog.text
    assert_private_file(target)  # replaced by our own build


# ------------------------------------------------------------------ what the build creates
def test_the_folders_it_creates_are_0700_and_the_library_is_private(tmp_path):
    old_umask = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        kernel = cpu_decode_attention.load(tmp_path / "home" / "cache")
    finally:
        os.umask(old_umask)
    assert_works(kernel)
    for folder in ("home", "home/cache", "home/cache/native"):
        assert stat.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700, folder
    library = cpu_decode_attention._library_path(tmp_path / "home" / "cache")
    assert_private_file(library)
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # no temporary left
