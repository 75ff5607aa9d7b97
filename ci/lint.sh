#!/usr/bin/env bash
# Lint and formatting checks (ruff, configured in the root pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
uv run --frozen ruff check .
uv run --frozen ruff format --check .
