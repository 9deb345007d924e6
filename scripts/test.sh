#!/usr/bin/env bash
# The test command from README.md: the whole suite, or only the test paths given
# (scripts/test.sh tests/test_x.py -x). pytest exit code 5 (no tests collected) is a failure.
# pyproject.toml's addopts already has -q; a second -q would hide the "N passed" summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
has_path=0
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  if [ -e "${a%%::*}" ]; then has_path=1; fi  # a file, folder or file::test node
done
if [ "$has_path" -eq 1 ]; then
  python -m pytest -p no:cacheprovider "$@"
else
  python -m pytest tests -p no:cacheprovider "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
