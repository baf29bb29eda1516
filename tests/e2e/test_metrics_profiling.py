"""What we tune, seen from outside: bucket metrics on /metrics and profiler traces of our programs
from /start_profile and /stop_profile (the session's `tiny_server`)."""

from __future__ import annotations

import gzip
import json
import re
import time
import urllib.request

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The quick brown fox"


def scrape(url: str) -> dict[str, float]:
    """Our samples on /metrics as `name{label="value",...}` (labels sorted) -> value."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm_aot:"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def executions(samples: dict[str, float], kind: str) -> float:
    prefix = f'vllm_aot:program_executions_total{{kind="{kind}",'
    return sum(value for name, value in samples.items() if name.startswith(prefix))


def complete(client, max_tokens: int = 4) -> None:
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == max_tokens


def test_metrics_count_program_runs_and_bucket_padding(client, tiny_server):
    before = scrape(tiny_server)
    for _ in range(2):
        complete(client)  # one prefill pass and three decode passes each
    # The engine writes its counters about once a second; the file is written whole, so once
    # the last decode pass shows, every earlier pass does too.
    deadline = time.monotonic() + 10
    after = scrape(tiny_server)
    while executions(after, "decode") - executions(before, "decode") < 6:
        assert time.monotonic() < deadline, "decode passes missing from /metrics"
        time.sleep(0.25)
        after = scrape(tiny_server)
    assert executions(after, "prefill") - executions(before, "prefill") >= 2
    ran = {name for name, value in after.items() if "program_executions" in name and value}
    assert any('program="prefill_t32_c0"' in name for name in ran), ran  # 5 fresh tokens -> 32
    assert any('program="decode_b1_c' in name for name in ran), ran
    assert any('program="greedy_r1"' in name for name in ran), ran

    def grown(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grown('vllm_aot:bucket_tokens_total{kind="prefill",slot="real"}') >= 2 * 4
    assert grown('vllm_aot:bucket_tokens_total{kind="prefill",slot="padding"}') >= 2 * 20
    assert grown('vllm_aot:context_tokens_total{kind="decode",slot="real"}') > 0
    assert grown('vllm_aot:context_tokens_total{kind="decode",slot="padding"}') > 0
    assert grown('vllm_aot:padding_fraction_count{kind="prefill"}') >= 2
    # A lone 5-token prompt pads more than three quarters of its 32-token bucket.
    assert grown('vllm_aot:padding_fraction_bucket{kind="prefill",le="1.0"}') >= 2
    assert (
        after['vllm_aot:padding_fraction_bucket{kind="prefill",le="0.75"}']
        < (after['vllm_aot:padding_fraction_bucket{kind="prefill",le="1.0"}'])
    )
    # Where the step time went: programs, the worker's host work, and vLLM between steps.
    for part in ("layer_programs", "head_programs", "host", "between_steps"):
        assert grown(f'vllm_aot:step_seconds_total{{part="{part}"}}') > 0, part


def test_profile_endpoints_write_a_trace_of_our_programs(
    client, tiny_server, profiler_dir, tiny_server_log
):
    with httpx.Client(base_url=tiny_server, timeout=120) as http:
        http.post("/start_profile", json={"profile_prefix": "e2e"}).raise_for_status()
        complete(client)
        http.post("/stop_profile").raise_for_status()
    (trace,) = profiler_dir.glob("e2e_vllm_aot_rank0.*.pt.trace.json.gz")  # written by then
    with gzip.open(trace, "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert any(re.fullmatch(r"prefill_t\d+_c\d+", str(n)) for n in names), "no prefill program"
    assert any(re.fullmatch(r"decode_b\d+_c\d+", str(n)) for n in names), "no decode program"
    for phase in ("execute_model", "sample_tokens", "prepare_inputs", "layers"):
        assert phase in names
    assert f"torch profiler trace written to {trace}" in tiny_server_log.read_text()
