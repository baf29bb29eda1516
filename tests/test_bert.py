"""The BERT family and the encode programs against sentence-transformers (fp32), in the runtime
alone: all-MiniLM-L6-v2's embeddings of sentences of mixed lengths, packed into batches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from vllm_aot.loading.program_sources import check_fits
from vllm_aot.loading.startup import load_model
from vllm_aot.models.config import load_hf_config
from vllm_aot.models.embedding_model import embedding_model_dir, prepare_embedding_model
from vllm_aot.models.pooling import Pooling, pool, read_pooling
from vllm_aot.models.registry import arch_from_hf_config
from vllm_aot.models.source import load_arch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.encode_inputs import EncoderSequence

SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Sentence embeddings map text to vectors whose cosine similarity tracks meaning, "
    "so that paraphrases land close together and unrelated sentences far apart, even when "
    "they share many words or none at all.",
    "Paris is the capital of France.",
    "What is the capital of France?",
    "Static shapes are declared once and padded once.",
    "🙂 emoji, numbers 12345 and punctuation!?",
] * 5  # 40 sentences: more than one 32-row batch


def config(**fields) -> RuntimeConfig:
    shapes = {"max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 32}
    return RuntimeConfig(runner="pooling", dtype="float32", **{**shapes, **fields})


@pytest.fixture(scope="module")
def reference(embedding_model_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(embedding_model_dir), device="cpu")
    return torch.as_tensor(model.encode(SENTENCES, batch_size=16))


@pytest.fixture(scope="module")
def sequences(embedding_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedding_model_dir)
    return [EncoderSequence(tokenizer(s)["input_ids"]) for s in SENTENCES]


def embed_in_batches(model, sequences, pooling, batch: int) -> torch.Tensor:
    parts = [
        model.embed(sequences[i : i + batch], pooling) for i in range(0, len(sequences), batch)
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("max_model_len", [256, 64], ids=["one-window", "windows-of-64"])
def test_embeddings_match_sentence_transformers(
    embedding_model_dir, sequences, reference, max_model_len
):
    """Buckets of 32 to 256 tokens; with max_model_len 64 the 128- and 256-token programs
    attend in windows of 64 that no sentence crosses."""
    assert max(len(s.token_ids) for s in sequences) <= 64
    model, _ = load_model(embedding_model_dir, config(backend="eager", max_model_len=max_model_len))
    pooling = read_pooling(embedding_model_dir)
    assert pooling == Pooling("MEAN", normalize=True)
    for batch in (1, 7, 32):
        ours = embed_in_batches(model, sequences, pooling, batch)
        cosine = F.cosine_similarity(ours, reference)
        assert cosine.min() >= 0.9999, (batch, cosine.min())
    # Several encode steps when a batch's tokens exceed the largest bucket (256 here).
    assert sum(model.num_executions.values()) > 3 * len(SENTENCES) // 32


@pytest.mark.slow  # compiles MiniLM's programs again; the embeddings server test compares them
def test_compiled_programs_match_sentence_transformers(embedding_model_dir, sequences, reference):
    shapes = {"max_num_batched_tokens": 64, "prefill_token_buckets": (64,)}
    model, _ = load_model(embedding_model_dir, config(backend="inductor", **shapes))
    assert sorted(k.name for k in model.programs) == ["encode_t64_w64"]
    short = [i for i, s in enumerate(sequences) if len(s.token_ids) <= 64]
    ours = model.embed([sequences[i] for i in short], read_pooling(embedding_model_dir))
    assert F.cosine_similarity(ours, reference[short]).min() >= 0.9999


def test_sequence_beyond_the_largest_bucket_is_refused(embedding_model_dir):
    model, _ = load_model(embedding_model_dir, config(backend="eager"))
    with pytest.raises(ValueError, match="1 to 256 tokens"):
        model.embed([EncoderSequence([101] * 257)], Pooling("CLS", normalize=False))


def test_pooling_kinds():
    states = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])
    assert pool(states, Pooling("CLS", normalize=False)).tolist() == [3.0, 4.0]
    assert pool(states, Pooling("LAST", normalize=False)).tolist() == [0.0, 2.0]
    assert pool(states, Pooling("MEAN", normalize=False)).tolist() == pytest.approx([4 / 3, 2.0])
    assert pool(states, Pooling("CLS", normalize=True)).tolist() == pytest.approx([0.6, 0.8])
    with pytest.raises(ValueError, match="supported: CLS, MEAN, LAST"):
        Pooling("MAX", normalize=False)


def test_sentence_transformers_pooling_config(embedding_model_dir, tmp_path):
    model_dir = tmp_path / "cls"
    shutil.copytree(embedding_model_dir, model_dir)
    pooling_config = model_dir / "1_Pooling" / "config.json"
    fields = json.loads(pooling_config.read_text())
    fields.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    pooling_config.write_text(json.dumps(fields))
    assert read_pooling(model_dir) == Pooling("CLS", normalize=True)
    fields.update(pooling_mode_max_tokens=True)
    pooling_config.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="not supported"):
        read_pooling(model_dir)


def test_runner_and_architecture_refusals(embedding_model_dir, tiny_model_dir):
    encoder = load_arch(embedding_model_dir)
    assert encoder.is_encoder and encoder.family == "bert"
    with pytest.raises(ValueError, match="encoder: it serves runner 'pooling'"):
        check_fits(encoder, RuntimeConfig(max_model_len=256))
    with pytest.raises(ValueError, match="needs convert 'embed'"):
        check_fits(load_arch(tiny_model_dir), RuntimeConfig(runner="pooling"))
    with pytest.raises(ValueError, match="not runner 'pooling' with convert 'embed'"):
        check_fits(encoder, RuntimeConfig(max_model_len=256, runner="pooling", convert="embed"))
    with pytest.raises(ValueError, match="supported: \\['generate', 'pooling'\\]"):
        RuntimeConfig(runner="draft")
    with pytest.raises(ValueError, match="supported: embed with runner 'pooling'"):
        RuntimeConfig(convert="embed")
    hf = load_hf_config(embedding_model_dir)
    with pytest.raises(ValueError, match="supported: absolute"):
        arch_from_hf_config({**hf, "position_embedding_type": "relative_key"})


def test_prepared_once(tmp_path):
    target = prepare_embedding_model(tmp_path)
    assert target == embedding_model_dir(tmp_path)
    assert (target / "model.safetensors").is_file() and (target / "modules.json").is_file()
    stamp = (target / "config.json").stat().st_mtime_ns
    assert prepare_embedding_model(tmp_path) == target
    assert (target / "config.json").stat().st_mtime_ns == stamp  # not unpacked again
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
