"""Step statistics, profiler spans and the stats file behind /metrics, on a tiny eager model."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.plugin.metrics import StatsCollector, StatsFile, model_stats
from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.kv_cache import BlockAllocator
from vllm_aot.runtime.sampler import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0).normalized()


def run_steps(model) -> None:
    """Two prefill passes (a packed one, then a second chunk reading 20 cached tokens) and a
    decode of three rows; buckets: tokens (32, 64), rows (1, 2, 4), contexts (256,)."""
    allocator = BlockAllocator(model.kv.num_blocks)
    tables = [allocator.allocate(2) for _ in range(3)]
    lengths = (20, 9, 3)
    chunks = [PrefillChunk([7] * n, 0, table) for n, table in zip(lengths, tables, strict=True)]
    model.prefill(chunks, [RowSampling(GREEDY, 0, n) for n in lengths])  # 32 of 32 tokens
    model.prefill([PrefillChunk([8] * 10, 20, tables[0])], [RowSampling(GREEDY, 0, 30)])
    positions = (30, 9, 3)
    rows = [DecodeRow(5, p, table) for p, table in zip(positions, tables, strict=True)]
    model.decode(rows, [RowSampling(GREEDY, 0, p + 1) for p in positions])


@pytest.fixture
def model(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    return model


def test_step_stats_count_real_and_padded_rows_tokens_and_context(model):
    run_steps(model)
    executed = {key.name: n for key, n in model.num_executions.items() if n}
    assert executed == {
        "prefill_t32_c0": 1,  # fresh prompts: no cache read
        "prefill_t32_c256": 1,
        "decode_b4_c256": 1,
        "greedy_r4": 2,
        "greedy_r1": 1,
    }
    stats = model.step_stats.to_dict()
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill["rows"] == {"real": 4, "padding": 1}  # 3 chunks in a row bucket of 4, then 1
    assert prefill["tokens"] == {"real": 42, "padding": 22}  # 32/32, then 10/32
    assert prefill["context_tokens"] == {"real": 20, "padding": 256 - 20}  # buckets 0, 256
    assert prefill["padding_fraction"]["counts"] == [1, 0, 0, 0, 1, 0]  # 0, then 22/32
    assert prefill["padding_fraction"]["sum"] == pytest.approx(22 / 32)
    assert decode["rows"] == decode["tokens"] == {"real": 3, "padding": 1}
    # Four rows read 256 cached tokens each; the real ones attend to their positions.
    assert decode["context_tokens"] == {"real": 42, "padding": 4 * 256 - 42}
    assert decode["padding_fraction"]["counts"] == [0, 0, 1, 0, 0, 0]  # 1/4 <= 0.25


def test_profiled_steps_name_each_program_call_and_phase(model):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as quiet:
        run_steps(model)
    model.spans.is_enabled = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as traced:
        run_steps(model)
    names = [event.name for event in traced.events()]
    assert names.count("decode_b4_c256") == model.arch.num_layers  # one range per layer call
    assert names.count("prefill_t32_c0") == names.count("prefill_t32_c256") == model.arch.num_layers
    for phase in ("prepare_inputs", "layers", "prepare_sampling", "greedy_r4"):
        assert phase in names
    assert not {"decode_b4_c256", "layers"} & {event.name for event in quiet.events()}


def scrape(path) -> dict[str, float]:
    """Every sample the collector serves, as `name{label="value",...}` (labels sorted) -> value."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(path))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_stats_file_serves_start_up_and_step_counters_and_follows_the_model(model, tmp_path):
    path = tmp_path / "stats.json"
    stats_file = StatsFile(path, {"hits": {"local": 3}, "misses": 1})
    before = scrape(path)
    assert before['vllm_aot:cache_hits_total{tier="local"}'] == 3
    assert not any(name.startswith("vllm_aot:program_executions") for name in before)

    stats_file.follow(lambda: model_stats(model), interval=0.05)
    run_steps(model)
    decode_padding = 'vllm_aot:bucket_rows_total{kind="decode",slot="padding"}'
    deadline = time.monotonic() + 5
    while scrape(path).get(decode_padding) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(path)
    stats_file.close()
    assert after["vllm_aot:cache_misses_total"] == 1
    assert after['vllm_aot:program_executions_total{kind="decode",program="decode_b4_c256"}'] == 1
    prefill = 'vllm_aot:program_executions_total{kind="prefill",program="prefill_t32_c%d"}'
    assert after[prefill % 0] == after[prefill % 256] == 1
    assert after['vllm_aot:program_executions_total{kind="decode",program="decode_b1_c256"}'] == 0
    assert after[decode_padding] == 1
    assert after['vllm_aot:bucket_tokens_total{kind="prefill",slot="padding"}'] == 22
    assert after['vllm_aot:context_tokens_total{kind="decode",slot="real"}'] == 42
    assert after['vllm_aot:padding_fraction_bucket{kind="prefill",le="0.1"}'] == 1
    assert after['vllm_aot:padding_fraction_bucket{kind="prefill",le="+Inf"}'] == 2
    assert after['vllm_aot:padding_fraction_count{kind="decode"}'] == 1


def test_stats_file_writes_the_last_counters_on_close(model, tmp_path):
    path = tmp_path / "stats.json"
    stats_file = StatsFile(path, {})
    stats_file.follow(lambda: model_stats(model), interval=60)  # only close() will write
    model.decode([DecodeRow(5, 0, [1])], [RowSampling(GREEDY, 0, 1)])
    assert scrape(path).get('vllm_aot:bucket_rows_total{kind="decode",slot="real"}') == 0
    stats_file.close()
    assert scrape(path)['vllm_aot:bucket_rows_total{kind="decode",slot="real"}'] == 1


def test_metrics_name_the_configurations_weights_and_kv(tmp_path):
    from vllm_aot.loading.program_sources import LoadReport
    from vllm_aot.plugin.metrics import load_stats
    from vllm_aot.runtime.config import RuntimeConfig

    config = RuntimeConfig(
        quantization="gguf",
        weight_formats=(("*", "q4_1"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0")),
    )
    path = tmp_path / "stats.json"
    StatsFile(path, load_stats(LoadReport(), config))
    info = (
        'vllm_aot:configuration_info{dtype="bfloat16",kv_cache_dtype="auto",'
        'weights="q4_1 (embed_tokens, lm_head: q8_0)"}'
    )
    assert scrape(path)[info] == 1
