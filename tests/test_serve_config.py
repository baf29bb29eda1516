"""`vllm-aot serve` before anything starts: configuration choice, refusals (core lists:
test_placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_aot.cli.main import build_parser, main, reclaim_flag_value
from vllm_aot.plugin.engine_flags import parse_vllm_flags
from vllm_aot.plugin.server_guard import REPLICA_KEY_ENV, REPLICA_KEY_MIDDLEWARE
from vllm_aot.serve.auth import ApiKeys
from vllm_aot.serve.launch import (
    check_replica_keys,
    hand_key_to_server,
    new_replica_key,
    private_rpc_dir,
    replica_launch,
)
from vllm_aot.serve.metrics import label_sample
from vllm_aot.serve.replicas import RestartPolicy
from vllm_aot.serve.settings import (
    RegistryPick,
    ShapeFlags,
    api_keys_given,
    choose_config,
    flag_value,
    masked,
    without_api_key,
)

pytestmark = pytest.mark.unit

MANIFEST = {"config": {"max_num_seqs": 8, "max_model_len": 512, "dtype": "float32",
                       "block_size": 16, "max_num_batched_tokens": 128}}  # fmt: skip


def test_configuration_order_flags_then_registry_then_defaults():
    registry = RegistryPick(
        {
            "max_num_seqs": 8,
            "max_model_len": 1024,
            "dtype": "bfloat16",
            "block_size": 32,
            "decode_batch_buckets": (1, 8),
        },
        why="cached configuration abc (local)",
    )
    chosen = choose_config(ShapeFlags(batch_size=8), registry_choice=registry)
    assert chosen.vllm_args == ("--max-num-seqs", "8", "--max-model-len", "1024", "--dtype",
                                "bfloat16")  # fmt: skip
    assert chosen.additional_config == {"block_size": 32, "decode_batch_buckets": (1, 8)}
    assert "max_num_seqs = 8 (from --batch-size)" in chosen.reasons
    assert "cached configuration abc (local)" in chosen.reasons
    assert any("max_model_len = 1024 (compiled configuration" in r for r in chosen.reasons)
    defaults = choose_config(ShapeFlags())
    assert defaults.vllm_args == ()  # the platform's defaults: the same cache keys as plain vLLM
    assert all("default" in r for r in defaults.reasons[:2])


def test_exported_directory_fixes_the_shapes_and_refuses_contradictions():
    chosen = choose_config(ShapeFlags(batch_size=8), manifest=MANIFEST, artifact_dir="/x")
    assert chosen.vllm_args == ()
    assert "max_num_seqs = 8 (from the exported directory /x)" in chosen.reasons
    assert "dtype = float32 (from the exported directory /x)" in chosen.reasons
    with pytest.raises(ValueError, match=r"--max-model-len 1024 \(it was compiled for 512\)"):
        choose_config(ShapeFlags(max_model_len=1024), manifest=MANIFEST)
    with pytest.raises(ValueError, match=r"--block-size 32 \(it was compiled for 16\)"):
        choose_config(ShapeFlags(), passthrough=("--block-size", "32"), manifest=MANIFEST)
    # The registry never overrides an exported directory.
    registry = RegistryPick({"max_num_seqs": 32, "max_model_len": 512, "dtype": "float32"})
    assert choose_config(ShapeFlags(), manifest=MANIFEST, registry_choice=registry).vllm_args == ()


def test_serving_an_exported_directory_chooses_no_backend(monkeypatch, tmp_path):
    """Its programs are compiled: `--backend` (inductor by default) is not passed on, where
    the plugin would refuse it as a shape option; `--backend eager` is refused by name."""
    from vllm_aot.loading import export_dir
    from vllm_aot.serve.launch import choose_from_args

    monkeypatch.setattr(export_dir, "is_artifact_dir", lambda path: True)
    monkeypatch.setattr(export_dir, "read_manifest", lambda path: MANIFEST)
    args, passthrough = build_parser().parse_known_args(["serve", str(tmp_path)])
    chosen = choose_from_args(args, passthrough, tmp_path, cores_per_replica=2)
    assert "backend" not in chosen.additional_config
    args, passthrough = build_parser().parse_known_args(
        ["serve", str(tmp_path), "--backend", "eager"]
    )
    with pytest.raises(ValueError, match="--backend eager needs a model directory"):
        choose_from_args(args, passthrough, tmp_path, cores_per_replica=2)


def test_passthrough_flags_are_kept_and_contradictions_refused():
    chosen = choose_config(
        ShapeFlags(),
        passthrough=("--max_num_seqs=4", "--api-key", "k", "--additional-config", '{"x": 1}'),
        additional_config={"backend": "eager"},
    )
    assert chosen.vllm_args == ("--max_num_seqs=4", "--api-key", "k")
    assert chosen.additional_config == {"backend": "eager", "x": 1}
    assert "max_num_seqs = 4 (from --max-num-seqs)" in chosen.reasons
    assert flag_value(chosen.vllm_args, "--max-num-seqs") == "4"
    with pytest.raises(ValueError, match="--batch-size 8 contradicts --max-num-seqs 4"):
        choose_config(ShapeFlags(batch_size=8), passthrough=("--max-num-seqs", "4"))
    with pytest.raises(ValueError, match="backend"):
        choose_config(
            ShapeFlags(),
            passthrough=("--additional-config", '{"backend": "inductor"}'),
            additional_config={"backend": "eager"},
        )


def test_tensor_parallelism_is_vllms_flag_and_an_exported_directorys_own():
    chosen = choose_config(ShapeFlags(tensor_parallel_size=2))
    assert chosen.vllm_args[-2:] == ("--tensor-parallel-size", "2")
    assert any(r.startswith("tensor_parallel_size = 2") for r in chosen.reasons)
    manifest = {"config": {"max_num_seqs": 4, "tensor_parallel_size": 3}}
    chosen = choose_config(ShapeFlags(), manifest=manifest)
    assert chosen.vllm_args[:2] == ("--tensor-parallel-size", "3")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 \(it was compiled for 3\)"):
        choose_config(ShapeFlags(tensor_parallel_size=2), manifest=manifest)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "3", "--cores", "0-1"], "need at least 3 cores; only 2 given"),
        (["--tensor-parallel-size", "3", "--cores", "0-1"], "tensor parallel 3 need at least 3"),
        (["--batch-size", "8", "--max-num-seqs", "4"], "contradicts --max-num-seqs 4"),
        (["--cores", "1-0"], "bad core list"),
        (["--cores", "2-5"], "cores 4-5 are outside the cores this process may use (0-3"),
    ],
)
def test_serve_refuses_before_starting_anything(tiny_model_dir, argv, message, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tiny_model_dir), "--backend", "eager", *argv])
    assert message in str(exit_info.value)


def proxy_keys(args, environ=None) -> ApiKeys:
    return ApiKeys.from_vllm(parse_vllm_flags(args).api_key, environ or {})


def test_the_proxy_takes_the_api_keys_vllm_would(tmp_path):
    keys = proxy_keys(("--api-key", "a", "b", "--dtype", "float32"))
    assert keys.is_required and keys.accepts("Bearer b") and keys.accepts("bearer a")
    assert not any(keys.accepts(h) for h in (None, "", "Bearer", "Bearer c", "Basic a", "a"))
    assert "'a'" not in repr(keys) and "b'" not in repr(keys)  # no key in logs
    assert proxy_keys(("--api_key=a", "--api-key", "c")) == ApiKeys.of(["c"])  # last wins
    assert proxy_keys((), {"VLLM_API_KEY": "e"}) == ApiKeys.of(["e"])
    assert proxy_keys(("--api-key", "a"), {"VLLM_API_KEY": "e"}) == ApiKeys.of(["a"])
    assert not proxy_keys((), {}).is_required
    assert not proxy_keys((), {"VLLM_API_KEY": ""}).is_required
    # However vLLM's own parser takes them: an abbreviation, a --config file.
    assert proxy_keys(("--api-k", "x", "y")) == ApiKeys.of(["x", "y"])
    assert proxy_keys(("--api-ke=x",)) == ApiKeys.of(["x"])
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-yaml\n")
    assert proxy_keys(("--config", str(config))) == ApiKeys.of(["from-yaml"])
    assert proxy_keys(("--config", str(config)), {"VLLM_API_KEY": "e"}) == ApiKeys.of(["from-yaml"])


def test_keys_leave_the_command_line_however_they_are_spelt():
    for args in (
        ("--api-key", "a", "b", "--dtype", "float32"),
        ("--api-k", "a", "b", "--dtype", "float32"),
        ("--api_key=a", "--dtype", "float32"),
        ("--api-key", "old", "--dtype", "float32", "--api-ke", "a", "b"),
    ):
        assert without_api_key(args) == ("--dtype", "float32"), args
        assert parse_vllm_flags(without_api_key(args)).api_key is None
        assert "a" not in masked(args) and "b" not in masked(args) and "float32" in masked(args)
    assert api_keys_given(("--api-k", "a", "b", "--dtype", "float32")) == ("a", "b")
    assert api_keys_given(("--api_key=a", "--api-key", "c")) == ("c",)
    assert api_keys_given(("--api-server-count", "2")) is None
    assert without_api_key(("--api-server-count", "2")) == ("--api-server-count", "2")
    assert masked(("--api-key=k", "--port", "1")) == ["--api-key=***", "--port", "1"]


def test_the_key_goes_through_the_environment_never_argv(tmp_path):
    command = ["python", "-m", "vllm_aot.plugin.vllm_serve", "--api-k", "sekret", "--dtype", "x"]
    argv, env = hand_key_to_server(command, {"PATH": "/bin"})
    assert "sekret" not in argv and env == {"PATH": "/bin", "VLLM_API_KEY": "sekret"}
    argv, env = replica_launch(command, {"VLLM_API_KEY": "user", "PATH": "/bin"}, "rk")
    assert "sekret" not in argv and "user" not in env.values()
    assert argv[-2:] == ["--middleware", REPLICA_KEY_MIDDLEWARE]
    assert env == {"PATH": "/bin", REPLICA_KEY_ENV: "rk"}
    assert new_replica_key() != new_replica_key() and len(new_replica_key()) >= 32
    # The replicas' vLLM still reads a --config file's key: serve refuses where it differs.
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-yaml\n")
    given = ("--config", str(config))
    check_replica_keys(given, proxy_keys(given))
    check_replica_keys((*given, "--api-key", "from-yaml"), ApiKeys.of(["from-yaml"]))
    with pytest.raises(ValueError, match="both in --config and on the command line"):
        check_replica_keys((*given, "--api-key", "other"), ApiKeys.of(["other"]))


def test_serve_lifecycle_flags_reach_the_policy_and_are_checked():
    args = build_parser().parse_args(["serve", "--replica-hang-timeout", "5", "--expose-metrics"])
    assert args.replica_hang_timeout == 5.0 and args.expose_metrics
    assert RestartPolicy().hang_timeout == 30.0
    with pytest.raises(ValueError, match="hang_timeout must be positive"):
        RestartPolicy(hang_timeout=0)


def test_replica_label_and_restart_backoff():
    assert label_sample('a_total{b="c"} 1', "0") == 'a_total{replica="0",b="c"} 1'
    assert label_sample("a 2.5", "1") == 'a{replica="1"} 2.5'
    assert label_sample("a{} 2", "1") == 'a{replica="1"} 2'
    policy = RestartPolicy(initial_backoff=1, max_backoff=30)
    assert [policy.backoff(n) for n in (1, 2, 3, 6, 9)] == [1, 2, 4, 30, 30]


def test_serve_picks_the_registry_configuration_that_matches_the_flags(tmp_path, tiny_model_dir):
    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
    from vllm_aot.cache.registry import CompiledConfiguration
    from vllm_aot.models.source import load_arch
    from vllm_aot.runtime.config import RuntimeConfig
    from vllm_aot.serve.selection import pick_from_registry

    settings = CacheSettings(root=tmp_path)
    arch = load_arch(tiny_model_dir)
    for batch, length, dtype, kv in (
        (8, 1024, "bfloat16", "auto"),
        (32, 512, "bfloat16", "auto"),
        (64, 256, "float32", "auto"),
        (16, 512, "bfloat16", "fp8"),
    ):
        config = RuntimeConfig(
            max_num_seqs=batch, max_model_len=length, dtype=dtype, kv_cache_dtype=kv
        )
        ProgramCache(settings).registry.record(CompiledConfiguration.build(arch, config, {}))

    def pick(flags=None, passthrough=()):
        flags = flags or ShapeFlags()
        return pick_from_registry(tiny_model_dir, flags, passthrough, backend="inductor",
                                  cores_per_replica=2, cache_settings=settings)  # fmt: skip

    best, why = pick()  # dtype left open means vLLM's bfloat16; then the largest batch
    assert (best.runtime["max_num_seqs"], best.runtime["dtype"]) == (32, "bfloat16")
    assert "largest TP, then batch, then length" in why
    assert pick(ShapeFlags(max_model_len=1024))[0].runtime["max_num_seqs"] == 8
    assert pick(passthrough=("--dtype", "float32"))[0].runtime["max_num_seqs"] == 64
    none, why = pick(ShapeFlags(batch_size=4))
    assert none is None and "defaults apply" in why
    fp8, _ = pick(passthrough=("--kv-cache-dtype", "fp8"))  # only the same KV dtype matches
    assert (fp8.runtime["max_num_seqs"], fp8.runtime["kv_cache_dtype"]) == (16, "fp8_e4m3")
    assert pick(passthrough=("--kv-cache-dtype=fp8_e5m2",))[0] is None
    assert pick(ShapeFlags(kv_cache_dtype="fp8"))[0] == fp8
    for flags, passthrough in (
        (ShapeFlags(kv_cache_dtype="fp8"), ()),
        (ShapeFlags(), ("--kv-cache-dtype", "fp8")),
    ):  # serve's own flag, or vLLM's passed through: every replica's vLLM gets it
        chosen = choose_config(flags, passthrough=passthrough, registry_choice=fp8)
        assert flag_value(chosen.vllm_args, "--kv-cache-dtype") == "fp8"
    chosen = choose_config(ShapeFlags(), registry_choice=best)
    assert chosen.vllm_args == ("--max-num-seqs", "32", "--max-model-len", "512", "--dtype",
                                "bfloat16")  # fmt: skip
    assert chosen.additional_config["decode_batch_buckets"] == [1, 2, 4, 8, 16, 32]


def test_serve_never_picks_a_configuration_longer_than_the_model_declares(tmp_path, tiny_model_dir):
    """vLLM takes a sentence-transformers directory's max_seq_length as the model's limit and
    refuses a longer --max-model-len, so a configuration compiled longer is not offered."""
    import shutil

    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
    from vllm_aot.cache.registry import CompiledConfiguration
    from vllm_aot.models.source import load_arch
    from vllm_aot.runtime.config import RuntimeConfig
    from vllm_aot.serve.selection import pick_from_registry

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    settings = CacheSettings(root=tmp_path / "cache")
    arch = load_arch(model_dir)
    for length in (256, 512):
        config = RuntimeConfig(max_num_seqs=8, max_model_len=length)
        ProgramCache(settings).registry.record(CompiledConfiguration.build(arch, config, {}))

    def pick():
        return pick_from_registry(model_dir, ShapeFlags(), (), backend="inductor",
                                  cores_per_replica=2, cache_settings=settings)[0]  # fmt: skip

    assert pick().runtime["max_model_len"] == 512
    (model_dir / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    assert pick().runtime["max_model_len"] == 256


@pytest.mark.parametrize(
    ("argv", "model", "passed"),
    [
        (["serve", "--profiler-config", '{"profiler": "torch"}'], None,
         ["--profiler-config", '{"profiler": "torch"}']),
        (["serve", "--profiler-config={}", "."], ".", ["--profiler-config={}"]),
        (["serve", ".", "--enable-prefix-caching"], ".", ["--enable-prefix-caching"]),
        (["serve", "--config", __file__], None, ["--config", __file__]),  # a file, not a model
        (["serve", "--max-num-seqs", "1", "."], ".", ["--max-num-seqs", "1"]),
        (["serve", "--max-num-seqs", "1", "--tokenizer", ".", "."], ".",
         ["--max-num-seqs", "1", "--tokenizer", "."]),
    ],
)  # fmt: skip
def test_serve_gives_a_passed_through_flag_its_value_back(argv, model, passed):
    """argparse takes a value of a vLLM flag it does not know for the optional model."""
    args, unknown = build_parser().parse_known_args(argv)
    reclaim_flag_value(argv, args, unknown)
    assert args.model == model and unknown == passed


def test_replicas_start_with_short_spins_huge_pages_and_a_lowered_front_end_unless_set(
    monkeypatch,
):
    from vllm_aot.serve.launch import server_env

    for name in ("GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE", "VLLM_AOT_FRONT_END_NICE"):
        monkeypatch.delenv(name, raising=False)
    env = server_env()
    assert (env["GOMP_SPINCOUNT"], env["THP_MEM_ALLOC_ENABLE"]) == ("10000", "1")
    assert env["VLLM_AOT_FRONT_END_NICE"] == "idle"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the user's choice stands
    assert server_env()["THP_MEM_ALLOC_ENABLE"] == "0"


def test_serve_pins_vllms_flags_as_vllm_parses_them_and_the_platform_resolves_them():
    """A vLLM flag passed through is read by vLLM's parser (underscores, `=`, JSON) and pinned
    for the registry as the platform will resolve it; an explicit 128 is 128."""
    from vllm_aot.serve.selection import requested_shapes

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    passthrough = ("--max_num_seqs=128", "--kv-cache-dtype", "fp8", "--speculative-config", spec)
    requested = requested_shapes(ShapeFlags(max_model_len=512), passthrough)
    assert requested["max_num_seqs"] == 128 and requested["max_model_len"] == 512
    assert requested["kv_cache_dtype"] == "fp8_e4m3" and requested["num_speculative_tokens"] == 3
    assert (requested["dtype"], requested["quantization"]) == ("bfloat16", "none")
    assert requested["block_size"] is None and requested["runner"] is None


def test_replicas_socket_files_go_to_a_directory_of_the_launch_removed_at_its_end(tmp_path):
    with private_rpc_dir({"VLLM_RPC_BASE_PATH": str(tmp_path), "A": "1"}) as env:
        directory = Path(env["VLLM_RPC_BASE_PATH"])
        assert directory.parent == tmp_path and env["A"] == "1"
        assert directory.stat().st_mode & 0o777 == 0o700
        (directory / "engine-socket").write_bytes(b"")  # as a killed engine leaves it
    assert list(tmp_path.iterdir()) == []
