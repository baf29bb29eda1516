#!/usr/bin/env bash
# Sets up on first run, then runs the bundled SmolLM2-135M-Instruct.
# Until the vLLM plugin lands this is the runtime's own chat demo (`vllm-aot demo`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/vllm-aot" demo "$@"
