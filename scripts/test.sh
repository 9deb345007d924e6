#!/usr/bin/env bash
# The test command from README.md: the whole suite, or only the test paths given
# (scripts/test.sh tests/test_x.py -x). pytest exit code 5 (no tests collected) is a failure.
# pyproject.toml's addopts already has -q; a second -q would hide the "N passed" summary line.
set -uo pipefail
cd "$(dirname "$0")/.."
has_path=0
for a in "$@"; do
  case "$a" in -*) continue ;; esac
  if [ -e "${a%%::*}" ]; then has_path=1  # a file, folder or file::test node
  elif [[ "${a%%::*}" == *.py || "${a%%::*}" == tests/* ]]; then
    echo "no such test path: ${a%%::*} (ls tests/ lists them; no path runs the whole suite)" >&2; exit 2
  fi
done
if [ "$has_path" -eq 1 ]; then
  python -m pytest -p no:cacheprovider "$@"
else
  # The whole suite runs on 2 pytest-xdist workers (UNMASK_TEST_WORKERS to change; 0 = one process):
  # its tests are single-threaded, so 2 workers halve it on 2 cores (7 min instead of 15).
  workers=${UNMASK_TEST_WORKERS:-2}
  if [ "$workers" != "0" ] && python -c "import xdist" 2>/dev/null; then
    python -m pytest tests -p no:cacheprovider -n "$workers" "$@"
  else
    python -m pytest tests -p no:cacheprovider "$@"
  fi
fi
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
