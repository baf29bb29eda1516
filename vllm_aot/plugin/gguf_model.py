"""A `.gguf` file as vLLM's model: `vllm serve ./Model.gguf [--tokenizer DIR]`, `LLM(model=...)`.

vLLM 0.32 reads no GGUF: its model must be a directory (or hub repository) with a config.json,
and its tokenizer one transformers opens by path. `install`, run by the platform before vLLM
builds its configuration, makes vLLM's `EngineArgs.create_model_config` take a `.gguf` file as
the model: vLLM serves the file's companion directory (`models/gguf_config.py`: config.json from
the file's metadata, the tokenizer converted from them, chat template included, and a link to
the file, whose blocks our runtime reads), its tokenizer that directory's unless --tokenizer
names one, quantization "gguf", under the file's name (--served-model-name aside). A file we
cannot serve (an architecture or rotary scaling we do not run) is refused there, a tensor type
we do not read when the platform resolves the weight formats (`plugin/options.py`): both in the
front end, naming what is supported.
"""

from __future__ import annotations

import functools

from vllm_aot.models.gguf import GgufFile
from vllm_aot.models.gguf_config import companion_dir, is_gguf_file
from vllm_aot.models.source import implied_quantization, load_arch

_METHOD = "create_model_config"
_SPECULATORS = "maybe_override_with_speculators"


def install() -> None:
    """Wrap vLLM's `EngineArgs.create_model_config`, and its look for a speculators config
    (which reads the model as a config.json before it), once per process."""
    from vllm.engine import arg_utils

    create = getattr(arg_utils.EngineArgs, _METHOD, None)
    look = getattr(arg_utils, _SPECULATORS, None)
    if create is None or look is None:
        raise RuntimeError(f"vllm-aot needs vLLM's EngineArgs.{_METHOD} and {_SPECULATORS}")
    if getattr(create, "reads_gguf", False):
        return

    @functools.wraps(create)
    def reading_gguf(self, *args, **kwargs):
        if isinstance(self.model, str) and is_gguf_file(self.model):
            point_at_companion(self)
        return create(self, *args, **kwargs)

    @functools.wraps(look)
    def looking_past_gguf(model, tokenizer, *args, **kwargs):
        if isinstance(model, str) and is_gguf_file(model):  # a GGUF is no speculator
            return model, tokenizer, kwargs.get("vllm_speculative_config")
        return look(model, tokenizer, *args, **kwargs)

    reading_gguf.reads_gguf = True
    setattr(arg_utils.EngineArgs, _METHOD, reading_gguf)
    setattr(arg_utils, _SPECULATORS, looking_past_gguf)


def point_at_companion(engine_args) -> None:
    """EngineArgs of a `.gguf` model -> of its companion directory (its tokenizer too, unless
    one is given), quantization "gguf", served under the file's name unless one is given.
    ValueError naming what is supported."""
    model = engine_args.model
    engine_args.quantization = implied_quantization(model, engine_args.quantization)
    try:
        load_arch(model)  # what the families refuse (a rotary scaling), before any tokenizer
        needs_tokenizer = not (engine_args.tokenizer or engine_args.skip_tokenizer_init)
        if needs_tokenizer and "tokenizer.ggml.model" not in GgufFile(model).metadata:
            raise ValueError("the file carries no tokenizer; give one with --tokenizer DIR")
        directory = str(companion_dir(model))
    except (ValueError, KeyError) as exc:
        raise ValueError(f"vllm-aot cannot serve {model}: {exc}") from None
    engine_args.served_model_name = engine_args.served_model_name or model
    engine_args.model = directory
    engine_args.tokenizer = engine_args.tokenizer or directory
