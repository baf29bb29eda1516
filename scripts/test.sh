#!/usr/bin/env bash
# Sets up on first run, then runs the tests. Default: the fast suite; `-m unit` for its part that
# needs no server and no compile of a real model (minutes); `-m slow` for the slow suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
