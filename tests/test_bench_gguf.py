"""The weight bytes a decode step reads, as perf_bench counts them from a GGUF file."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from llamacpp import gguf_decode_bytes

pytestmark = pytest.mark.unit


def write_gguf(path: Path, names: list[str]) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    for name in names:
        writer.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tied_embeddings_count_whole_as_the_output_layer(tmp_path):
    gguf = write_gguf(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.ffn_up.weight"])
    assert gguf_decode_bytes(gguf) == 2 * 4 * 8 * 4


def test_untied_embedding_table_is_left_out(tmp_path):
    names = ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"]
    gguf = write_gguf(tmp_path / "untied.gguf", names)
    assert gguf_decode_bytes(gguf) == 2 * 4 * 8 * 4
