"""vLLM's flags as the user gave them: read with vLLM's own parser, before vLLM's defaults.

vLLM leaves --max-num-seqs and --max-num-batched-tokens None until `EngineArgs` fills in its
usage defaults (`_set_default_max_num_seqs_and_batched_tokens_args`: 128 sequences and 2048
tokens for a CPU's API server, 256 and 4096 for the LLM class, times the ranks), and the
platform's `check_and_update_config` sees only the result. `record_given`, installed by the
platform before vLLM builds its configuration, records every option the user gave
(`given_options`: an EngineArgs value other than its field's default) in the configuration's
`additional_config[GIVEN_KEY]`, where the platform reads it: an explicit `--max-num-seqs 128`
is 128, never taken for vLLM's default.

`vllm-aot serve` reads a command line the same way (`parse_vllm_flags`: vLLM's serve parser,
then `AsyncEngineArgs.from_cli_args`), so it pins what the platform will resolve.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_aot.plugin.server_guard import CorsSettings
from vllm_aot.runtime.options import VLLM_OPTIONS

GIVEN_KEY = "vllm_aot_given"
_DEFAULTING = "_set_default_max_num_seqs_and_batched_tokens_args"


@dataclass(frozen=True)
class VllmFlags:
    """A vLLM command line, parsed by vLLM: the options it sets (`runtime/options.py` names),
    its --additional-config and --speculative-config, and its server's --api-key (None when not
    given; a key may be None or empty, which vLLM skips) and CORS flags."""

    given: dict[str, Any] = field(default_factory=dict)
    additional_config: dict[str, Any] = field(default_factory=dict)
    speculative_config: dict[str, Any] | None = None
    api_key: tuple[str | None, ...] | None = None
    cors: CorsSettings = field(default_factory=CorsSettings)


def given_options(engine_args) -> dict[str, Any]:
    """The options an EngineArgs sets to other than its defaults (option name -> value), and
    the drafts of its --speculative-config."""
    defaults = {f.name: f.default for f in dataclasses.fields(engine_args)}
    given: dict[str, Any] = {}
    for option in VLLM_OPTIONS:
        if option.engine_arg is not None:
            value = getattr(engine_args, option.engine_arg)
            if value != defaults[option.engine_arg]:
                given[option.name] = value
    spec = engine_args.speculative_config
    if isinstance(spec, dict) and spec.get("num_speculative_tokens") is not None:
        given["num_speculative_tokens"] = int(spec["num_speculative_tokens"])
    return given


def record_given() -> None:
    """Make vLLM's EngineArgs record the options the user gave, before its defaults fill them,
    in the `additional_config` it builds the configuration with (once per process)."""
    from vllm.engine.arg_utils import EngineArgs

    fill_defaults = getattr(EngineArgs, _DEFAULTING, None)
    if fill_defaults is None:
        raise RuntimeError(f"vllm-aot needs vLLM's EngineArgs.{_DEFAULTING} (vLLM 0.32)")
    if getattr(fill_defaults, "records_given", False):
        return

    @functools.wraps(fill_defaults)
    def recording(self, *args, **kwargs):
        if isinstance(self.additional_config, dict) and GIVEN_KEY not in self.additional_config:
            self.additional_config = {**self.additional_config, GIVEN_KEY: given_options(self)}
        return fill_defaults(self, *args, **kwargs)

    recording.records_given = True
    setattr(EngineArgs, _DEFAULTING, recording)


def given_in_config(vllm_config) -> dict[str, Any]:
    """The options a configuration built without EngineArgs (no record) holds: its values as
    they are, every one honoured."""
    model_config = vllm_config.model_config
    scheduler_config = vllm_config.scheduler_config
    given = {
        "max_num_seqs": scheduler_config.max_num_seqs,
        "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
    }
    if model_config.original_max_model_len is not None:
        given["max_model_len"] = model_config.max_model_len
    if vllm_config.cache_config.user_specified_block_size:
        given["block_size"] = vllm_config.cache_config.block_size
    return given


@functools.cache
def serve_parser():
    """vLLM's `vllm serve` argument parser (front-end and engine flags)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    return parser


def parse_vllm_flags(args: Sequence[str], model: str = "model") -> VllmFlags:
    """`vllm serve MODEL ARGS` as vLLM parses it (SystemExit naming a flag it refuses): its
    `--config FILE.yaml`, its abbreviations (`--api-k`), its spellings (`--api_key`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    namespace = serve_parser().parse_args(["serve", model, *args])
    namespace.model = namespace.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    return VllmFlags(
        given=given_options(engine_args),
        additional_config=dict(engine_args.additional_config or {}),
        speculative_config=engine_args.speculative_config,
        api_key=None if namespace.api_key is None else tuple(namespace.api_key),
        cors=CorsSettings.from_namespace(namespace),
    )
