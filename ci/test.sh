#!/usr/bin/env bash
# The test suite, as CI runs it (see .ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
uv sync --locked
uv run pytest -n auto "$@"
