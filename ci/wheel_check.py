"""The installed wheel's checks (ci/wheel-check.sh runs this with the fresh environment's Python,
from a folder outside the checkout).

1. The sdist holds every file git tracks under engine/, kernels/ and server/; the wheel holds
   every one of those folders' modules and data files under ``paged_serve/``, and its only
   top-level import name is ``paged_serve``.
2. ``paged_serve`` imports from the environment, not the checkout; ``from paged_serve import
   LLM, SamplingParams`` works; ``import kernels`` is Hugging Face's distribution.
3. ``paged-serve --help``; ``paged-generate`` answers one prompt on the default model;
   ``paged-serve`` starts and answers one chat request.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

# repository folder -> its place in the wheel (pyproject.toml's package-dir)
FOLDERS = {name: f"paged_serve/{name}" for name in ("engine", "kernels", "server")}
ROOT_INIT = ("engine/paged_serve/__init__.py", "paged_serve/__init__.py")
SHIPPED = (".py", ".html", ".c")
START_TIMEOUT_S = 300.0  # a cold start converts the embedded GGUF model first


def fail(message: str) -> None:
    print(f"wheel-check: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def tracked_files(repo: Path) -> list[str]:
    """The files git tracks under the three package folders, as repository paths."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", *FOLDERS], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if line]


def wheel_path(repo_path: str) -> str:
    """Where a repository file lands in the wheel."""
    if repo_path == ROOT_INIT[0]:
        return ROOT_INIT[1]
    top, rest = repo_path.split("/", 1)
    return f"{FOLDERS[top]}/{rest}"


def check_archives(repo: Path, dist: Path) -> None:
    tracked = tracked_files(repo)
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = sorted(set(tracked) - names)
    if missing:
        fail(f"the sdist lacks {missing[:5]} ({len(missing)} files)")
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        top_level = next(n for n in members if n.endswith(".dist-info/top_level.txt"))
        tops = archive.read(top_level).decode().split()
    expected = {wheel_path(p) for p in tracked if p.endswith(SHIPPED)}
    missing = sorted(expected - members)
    if missing:
        fail(f"the wheel lacks {missing[:5]} ({len(missing)} files)")
    if tops != ["paged_serve"]:
        fail(f"the wheel's top-level names are {tops}, not ['paged_serve']")
    print(f"wheel-check: sdist {sdist.name} and wheel {wheel.name} hold all {len(tracked)} files")


def check_imports(repo: Path) -> None:
    import transformers

    import kernels
    import paged_serve
    from paged_serve import LLM, SamplingParams

    origin = Path(paged_serve.__file__).resolve()
    if repo in origin.parents:
        fail(f"paged_serve was imported from the checkout ({origin})")
    if not hasattr(kernels, "get_kernel"):
        fail(f"`import kernels` is not Hugging Face's distribution ({kernels.__file__})")
    print(
        f"wheel-check: paged_serve {paged_serve.__version__} from {origin.parent}, "
        f"{LLM.__name__} and {SamplingParams.__name__} import; transformers "
        f"{transformers.__version__}, Hugging Face kernels from {Path(kernels.__file__).parent}"
    )


def run(command: list[str], timeout: float) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        fail(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chat_once(url: str, proc: subprocess.Popen) -> dict:
    """POST one chat request once /health answers; the reply's JSON."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            fail(f"paged-serve exited {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            fail(f"paged-serve did not answer /health within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def check_commands(bin_dir: Path) -> None:
    if "--port" not in run([str(bin_dir / "paged-serve"), "--help"], 120):
        fail("paged-serve --help does not list --port")
    prompt = "The capital of France is"
    text = run([str(bin_dir / "paged-generate"), "--prompt", prompt, "--max-tokens", "4"], 600)
    if not text.strip():
        fail("paged-generate printed no completion")
    print(f"wheel-check: paged-generate {prompt!r} -> {text.strip()!r}")
    port = free_port()
    command = [str(bin_dir / "paged-serve"), "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        reply = chat_once(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    choice = reply["choices"][0]
    if not choice["message"]["content"] or choice["finish_reason"] not in ("stop", "length"):
        fail(f"the chat reply is not an answer: {reply}")
    print(f"wheel-check: paged-serve answered {choice['message']['content']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--dist", type=Path, required=True)
    parser.add_argument("--bin", type=Path, required=True)
    args = parser.parse_args()
    repo = args.repo.resolve()
    check_archives(repo, args.dist)
    check_imports(repo)
    check_commands(args.bin)


if __name__ == "__main__":
    main()
