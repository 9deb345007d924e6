#!/usr/bin/env bash
# The test command from README.md. pytest exit code 5 (no tests collected) is a failure.
# pyproject.toml's addopts already has -q; a second -q would hide the "N passed" summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pytest tests -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
