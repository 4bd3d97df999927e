#!/usr/bin/env bash
# Run the black-box HTTP tests against build/specd (the servers are started by conftest.py).
# Usage: tests/http/run.sh [pytest args]. Exits non-zero on any failure, and also when no
# test ran (pytest exit code 5).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export SPECD_BIN="${SPECD_BIN:-$repo/build/specd}"
export SPECD_FIXTURES="${SPECD_FIXTURES:-$repo/../shared/fixtures}"
export SPECD_TEST_MODEL="${SPECD_TEST_MODEL:-$repo/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
cd "$here"
if [ "$#" -eq 0 ]; then set -- .; fi
python3 -m pytest -q -rs -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "tests/http/run.sh: no tests ran" >&2
  exit 1
fi
exit "$rc"
