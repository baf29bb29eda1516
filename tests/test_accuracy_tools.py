"""Accuracy tooling: tolerance overrides, HTML report, tensor capture/compare/replace, KV analysis.

The broken variants are the bugs the tools exist for, planted by monkeypatching (tests only):
a flipped rotary half-rotation, and padding that writes into a live KV block instead of the
dummy block 0. Both run on a tiny seeded model with the eager backend, in a few seconds; both
fail the teacher-forced logit check.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.accuracy.capture import Capture, capture_hf, capture_ours
from vllm_aot.accuracy.kv_analysis import analyse_kv
from vllm_aot.accuracy.logit_tolerance import DEFAULT_TOLERANCES, Tolerance, parse_tolerances
from vllm_aot.accuracy.logits import validate
from vllm_aot.accuracy.prompts import chat_prompt_token_ids
from vllm_aot.accuracy.report import render_html
from vllm_aot.accuracy.teacher_forcing import HFReference
from vllm_aot.accuracy.tensor_compare import compare_captures
from vllm_aot.cli.main import main
from vllm_aot.loading.startup import load_model
from vllm_aot.models import layers
from vllm_aot.runtime import inputs

TINY_CLI_CONFIG = [
    "--backend=eager",
    "--dtype=float32",
    "--batch-size=4",
    "--max-model-len=256",
    "--max-num-batched-tokens=64",
]


def flipped_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The classic bring-up bug: the half-rotation with its sign on the wrong half."""
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], -x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.fixture
def flip_rope(monkeypatch):
    monkeypatch.setattr(layers, "apply_rotary", flipped_rotary)


@pytest.fixture
def pad_into_live_block(monkeypatch):
    """Padded tokens write into block 1 (the first block a fresh allocator hands out)."""
    monkeypatch.setattr(inputs, "DUMMY_BLOCK", 1)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs) -> HFReference:
    return HFReference(tiny_model_dirs("llama"))


@pytest.fixture(scope="module")
def prompt(reference) -> list[int]:
    """One chat prompt, 35 tokens: one prefill chunk padded to tiny_config's 64-token bucket."""
    return chat_prompt_token_ids(reference.model_dir)[0]


@pytest.fixture(scope="module")
def sequence(reference, prompt) -> list[int]:
    """The prompt plus 32 HF greedy tokens: 67 tokens. Prefilled whole (capture, KV analysis)
    in chunks of 64 and 3; validated as 35 prefilled and 32 decoded."""
    return prompt + reference.greedy(prompt, 32)


@pytest.fixture
def model(tiny_model_dirs):
    return load_model(tiny_model_dirs("llama"), tiny_config(), show_progress=False)[0]


# --------------------------------------------------------------------------------------------
# Tolerance overrides and the HTML report


def test_tolerance_overrides_replace_and_add_slices():
    tolerances = parse_tolerances(["top5=0.02", "all=0.1:1e-4", "10=0.015"])
    assert tolerances[5] == Tolerance(atol=1e-5, rtol=0.02)
    assert tolerances[None] == Tolerance(atol=1e-4, rtol=0.1)
    assert tolerances[10] == Tolerance(atol=1e-5, rtol=0.015)
    assert tolerances[50] == DEFAULT_TOLERANCES[50]
    for bad in ("top5", "top5=x", "topx=0.1", "0=0.1", "all=-1"):
        with pytest.raises(ValueError, match="tolerance"):
            parse_tolerances([bad])


def test_html_report_holds_the_table_and_the_plot(model, reference, prompt, sequence):
    report = validate(
        reference.model_dir,
        model,
        [sequence],
        prompt_lengths=[len(prompt)],
        three_way=False,
        reference=reference,
    )
    page = render_html(report, title="tiny <llama>")
    assert "<table>" in page and "top 5" in page and ">PASS<" in page
    assert "tiny &lt;llama&gt;" in page
    assert page.count('src="data:image/png;base64,') == 1


# --------------------------------------------------------------------------------------------
# Tensor capture, compare, replace


def test_capture_of_a_correct_model_matches_hf_at_every_module(
    model, reference, sequence, tmp_path
):
    ours = capture_ours(model, sequence)
    hf = capture_hf(reference, sequence, torch.float32)
    assert ours.names == hf.names  # every module both sides know, eager sub-layers included
    assert {"model.layers.1.mlp", "model.layers.0.self_attn.key_states", "lm_head"} <= set(
        ours.names
    )
    assert ours.tensors["model.layers.0"].shape == (len(sequence), model.arch.hidden_size)
    comparison = compare_captures(ours, hf)
    assert comparison.passed, comparison.verdict()
    loaded = Capture.load(ours.save(tmp_path / "ours"))
    assert loaded.names == ours.names and loaded.token_ids == tuple(sequence)
    assert torch.equal(loaded.tensors["lm_head"], ours.tensors["lm_head"])


def test_capture_patterns_select_the_same_modules_on_both_sides(model, reference, sequence):
    patterns = ["model.layers.1", "model.layers.*.self_attn.*"]
    ours = capture_ours(model, sequence, patterns)
    hf = capture_hf(reference, sequence, torch.float32, patterns)
    expected = [
        "model.layers.0.self_attn.key_states",
        "model.layers.0.self_attn.value_states",
        "model.layers.1.self_attn.key_states",
        "model.layers.1.self_attn.value_states",
        "model.layers.1",
    ]
    assert ours.names == hf.names == expected


def test_flipped_rope_fails_validation_and_compare_names_the_first_keys(
    flip_rope, model, reference, prompt, sequence
):
    report = validate(
        reference.model_dir,
        model,
        [sequence],
        prompt_lengths=[len(prompt)],
        three_way=False,
        reference=reference,
    )
    assert not report.passed
    comparison = compare_captures(
        capture_ours(model, sequence), capture_hf(reference, sequence, "float32")
    )
    first = comparison.first_divergence
    assert first is not None and first.name == "model.layers.0.self_attn.key_states"
    assert first.first_bad_position == 1  # position 0 does not rotate, so it cannot be wrong
    assert comparison.module("model.layers.0.input_layernorm").first_bad_position is None


def test_replacing_a_broken_layer_output_removes_the_divergence_downstream(
    model, reference, sequence
):
    # In place: the programs receive this very tensor.
    model.weights.layers[0]["o_proj.weight"].mul_(1.05)
    hf = capture_hf(reference, sequence, "float32")
    broken = compare_captures(capture_ours(model, sequence), hf)
    assert broken.first_divergence.name == "model.layers.0.self_attn"
    assert broken.module("lm_head").is_diverged
    fixed = compare_captures(
        capture_ours(
            model, sequence, replacements={"model.layers.0": hf.tensors["model.layers.0"]}
        ),
        hf,
    )
    # The error enters in layer 0's attention output and nowhere else: with that layer's output
    # replaced, everything after it (layer 1, the logits) matches HF again.
    assert fixed.first_divergence.name == "model.layers.0.self_attn"
    downstream = [m for m in fixed.modules if not m.name.startswith("model.layers.0")]
    assert downstream and not any(m.is_diverged for m in downstream)


def test_only_program_boundaries_can_be_replaced(model, sequence):
    with pytest.raises(ValueError, match="program-boundary"):
        capture_ours(model, sequence, replacements={"model.layers.0.mlp": torch.zeros(1)})


# --------------------------------------------------------------------------------------------
# KV cache analysis


def test_kv_analysis_of_a_correct_model_finds_no_corrupted_block(model, reference, sequence):
    report = analyse_kv(model, reference, sequence)
    assert report.passed
    assert len(report.layers) == model.arch.num_layers
    assert report.num_tokens == len(sequence)
    assert max(d.k_rel_linf for d in report.layers) < 1e-5


def test_padding_into_a_live_block_is_flagged_by_kv_analysis(
    pad_into_live_block, model, reference, sequence
):
    report = analyse_kv(model, reference, sequence)
    assert report.block_table[0] == 1
    # The block the padding overwrote; and the last chunk's own block: a layer program writes
    # its K/V (the padding's too) before it attends, so from the second layer on the last
    # chunk's tokens read the overwritten position 0 and their K/V differ as well.
    assert report.corrupted_blocks == (1, 5)
    assert [d.corrupted_blocks for d in report.layers] == [
        (1,),
        *[(1, 5)] * (len(report.layers) - 1),
    ]


def test_padding_into_a_live_block_fails_the_teacher_forced_logits(
    pad_into_live_block, model, reference, prompt, sequence
):
    # The prompt's padded chunk overwrites position 0 (block 1), which its own tokens read from
    # their chunk's keys, not the pool, so the prompt's logits are right; the decode steps after
    # it read the damage.
    decoded = validate(
        reference.model_dir,
        model,
        [sequence],
        prompt_lengths=[len(prompt)],
        three_way=False,
        reference=reference,
    )
    assert not decoded.passed
    top5 = decoded.prompts[0].slice(5)
    assert max(top5.position_ratios[: len(prompt)]) <= 1.0
    assert min(top5.position_ratios[len(prompt) :]) > 1.0
    # Prefilling the whole sequence (chunks of 64 and 3) shows it in the last chunk alone: its
    # layers write their padding into position 0 before they attend to it.
    prefilled = validate(
        reference.model_dir,
        model,
        [sequence],
        prompt_lengths=None,
        three_way=False,
        reference=reference,
    )
    assert not prefilled.passed
    ratios = prefilled.prompts[0].slice(5).position_ratios
    assert max(ratios[:64]) <= 1.0 and max(ratios[64:]) > 1.0


# --------------------------------------------------------------------------------------------
# The commands


def test_validate_command_writes_a_report_and_fails_on_flipped_rope(
    tiny_model_dirs, tmp_path, monkeypatch
):
    model_dir = str(tiny_model_dirs("llama"))
    page = tmp_path / "report.html"
    args = ["validate", model_dir, *TINY_CLI_CONFIG, "--num-tokens=8", f"--report={page}"]
    assert main(args) == 0
    assert "<table>" in page.read_text() and "data:image/png;base64," in page.read_text()
    assert main([*args, "--tolerance=top5=1e-9:0"]) == 1  # an impossible tolerance fails
    monkeypatch.setattr(layers, "apply_rotary", flipped_rotary)
    assert main(args) == 1


def test_validate_command_fails_when_padding_writes_into_a_live_block(
    pad_into_live_block, tiny_model_dirs, capsys
):
    args = ["validate", str(tiny_model_dirs("llama")), *TINY_CLI_CONFIG, "--num-tokens=16"]
    assert main(args) == 1
    out = " ".join(capsys.readouterr().out.split())  # undo the console's line wrapping
    # The teacher-forced logits fail on their own (decode steps read the overwritten block), not
    # only the greedy check after them.
    table = out[out.index("teacher-forced logits") : out.index("argmax agreement")]
    assert re.search(r"\bFAIL\b", table), out
    assert "(decode programs)" in out and "decode_b4_c256" in out


def test_tensors_commands_capture_compare_and_name_the_divergence(
    tiny_model_dirs, tmp_path, monkeypatch, capsys
):
    model_dir = str(tiny_model_dirs("llama"))
    out = tmp_path / "capture"
    common = [*TINY_CLI_CONFIG, "--num-tokens=8"]
    assert main(["tensors", "capture", model_dir, "-o", str(out), *common]) == 0
    assert (out / "ours" / "index.json").is_file() and (out / "hf" / "index.json").is_file()
    assert main(["tensors", "compare", str(out / "ours"), str(out / "hf")]) == 0
    assert main(["tensors", "kv", model_dir, *common]) == 0
    monkeypatch.setattr(layers, "apply_rotary", flipped_rotary)
    capsys.readouterr()
    assert main(["tensors", "capture", model_dir, "-o", str(out), *common]) == 1
    assert "first divergence: model.layers.0.self_attn.key_states" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# SmolLM2 through the command line (slow)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm_validate_command_passes_and_renders(default_model_dir, dtype, tmp_path: Path):
    page = tmp_path / f"{dtype}.html"
    command = [
        sys.executable,
        "-m",
        "vllm_aot.cli.main",
        "validate",
        str(default_model_dir),
        "--backend=eager",
        f"--dtype={dtype}",
        "--batch-size=8",
        "--max-model-len=512",
        "--max-num-batched-tokens=128",
        f"--report={page}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
    html = page.read_text()
    assert "<table>" in html and ">PASS<" in html and ">FAIL<" not in html
    assert "data:image/png;base64," in html
    if dtype == "bfloat16":
        assert "three-way" in html and "HF bfloat16" in html
