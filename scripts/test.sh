#!/usr/bin/env bash
# Sets up on first run, then runs the tests. Default: the fast suite; `-m slow` for the slow one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
