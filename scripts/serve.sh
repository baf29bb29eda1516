#!/usr/bin/env bash
# Sets up on first run, then serves the bundled SmolLM2-135M-Instruct on an OpenAI-compatible
# port (vLLM's server on the vllm-aot platform). The first start compiles the model's programs
# (a few minutes, once); later starts load them. Options pass through: see `vllm-aot serve -h`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/vllm-aot" serve "$@"
