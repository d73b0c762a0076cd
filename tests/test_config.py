"""ServerConfig.from_args: precedence flag > ROLLSERVE_* environment > default; validation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from rollserve.server.config import ConfigError, ServerConfig, build_parser, env_name, flag_name
from rollserve.server.serving.cli import main

MIB = 1 << 20


def test_defaults() -> None:
    config = ServerConfig.from_args([], {})
    assert config == ServerConfig()
    assert (config.host, config.port) == ("0.0.0.0", 50051)
    assert config.actor is None and config.reference is None
    assert config.critic is None and config.reward_model is None
    assert (config.device, config.dtype) == ("auto", "auto")
    assert config.max_message_bytes == 65 * MIB
    assert config.default_preset is None  # the algorithms package's DEFAULT_PRESET
    assert (config.shutdown_grace_s, config.drain_delay_s) == (10.0, 0.0)
    assert config.wait_for_weights is False and config.port_file is None


def test_every_field_has_a_flag_and_an_environment_variable() -> None:
    help_text = build_parser().format_help()
    for field in dataclasses.fields(ServerConfig):
        assert flag_name(field.name) in help_text
    assert env_name("reward_model") == "ROLLSERVE_REWARD_MODEL"
    assert flag_name("reward_model") == "--reward-model"


# One valid non-default value per field, as the text a flag or variable would carry.
SAMPLES = {
    "host": ("127.0.0.1", "127.0.0.1"),
    "port": ("0", 0),
    "actor": ("/models/actor", "/models/actor"),
    "reference": ("/models/ref", "/models/ref"),
    "critic": ("/models/critic", "/models/critic"),
    "reward_model": ("/models/rm", "/models/rm"),
    "device": ("cuda:1", "cuda:1"),
    "dtype": ("bf16", "bfloat16"),
    "generation_path": ("RollServe", "rollserve"),
    "kv_cache_tokens": ("4096", 4096),
    "gpu_memory_utilization": ("0.8", 0.8),
    "max_message_bytes": ("16MiB", 16 * MIB),
    "max_new_tokens": ("7", 7),
    "default_preset": ("coati", "coati"),
    "shutdown_grace_s": ("2.5", 2.5),
    "drain_delay_s": ("3", 3.0),
    "update_idle_timeout_s": ("0.5", 0.5),
    "weight_transports": ("dist, GRPC", "grpc,dist"),
    "parallel_part_wait_s": ("2", 2.0),
    "max_group_timeout_s": ("5", 5.0),
    "stream_send_timeout_s": ("4", 4.0),
    "max_workers": ("4", 4),
    "log_level": ("debug", "DEBUG"),
    "wait_for_weights": ("true", True),
    "port_file": ("/tmp/port", "/tmp/port"),
    "generate_batch_size": ("8", 8),
    "forward_batch_size": ("4", 4),
    "micro_batch_size": ("2", 2),
    "max_request_rows": ("10", 10),
    "max_queue_depth": ("3", 3),
    "reward_fn": ("len=pkg.mod:fn", ("len=pkg.mod:fn",)),
    "reward_endpoint": ("r=http://127.0.0.1:1/x", ("r=http://127.0.0.1:1/x",)),
    "reward_timeout_s": ("1.5", 1.5),
    "max_prompts": ("12", 12),
    "max_samples_per_prompt": ("5", 5),
    "max_new_tokens_limit": ("100", 100),
    "max_request_tokens": ("1000", 1000),
    "max_batch_tokens": ("500", 500),
    "metrics_port": ("0", 0),
    "tls_cert": ("/certs/server.pem", "/certs/server.pem"),
    "tls_key": ("/certs/server.key", "/certs/server.key"),
    "tls_client_ca": ("/certs/ca.pem", "/certs/ca.pem"),
    "data_token": ("d4ta-t0ken", "d4ta-t0ken"),
    "admin_token": ("adm1n-t0ken", "adm1n-t0ken"),
    "data_token_file": ("/run/secrets/data", "/run/secrets/data"),
    "admin_token_file": ("/run/secrets/admin", "/run/secrets/admin"),
    "rollout_prompts": ("/data/prompts.jsonl", "/data/prompts.jsonl"),
    "rollout_request": ("/data/request.json", "/data/request.json"),
    "rollout_prompts_per_batch": ("3", 3),
    "rollout_epochs": ("0", 0),
    "rollout_steps": ("20", 20),
    "rollout_seed": ("7", 7),
    "rollout_queue_batches": ("2", 2),
    "max_staleness": ("unlimited", None),
}
# Fields only valid together with others (as environment variables set alongside the sample).
COMPANIONS = {
    "tls_cert": {"ROLLSERVE_TLS_KEY": "/k.pem"},
    "tls_key": {"ROLLSERVE_TLS_CERT": "/c.pem"},
    "tls_client_ca": {"ROLLSERVE_TLS_CERT": "/c.pem", "ROLLSERVE_TLS_KEY": "/k.pem"},
    "rollout_request": {"ROLLSERVE_ROLLOUT_PROMPTS": "/p.jsonl"},
}


def test_weight_transports_refuse_unknown_names() -> None:
    with pytest.raises(ConfigError, match="carrier"):
        ServerConfig.from_args(["--weight-transports", "shm,carrier"], {})
    assert ServerConfig.from_args(["--weight-transports", "shm"], {}).weight_transports == (
        "grpc,shm"
    )


def test_samples_cover_every_field() -> None:
    assert set(SAMPLES) == {field.name for field in dataclasses.fields(ServerConfig)}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_field_from_environment(name: str) -> None:
    raw, expected = SAMPLES[name]
    config = ServerConfig.from_args([], {env_name(name): raw, **COMPANIONS.get(name, {})})
    assert getattr(config, name) == expected
    assert getattr(config, name) != getattr(ServerConfig(), name)


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - {"wait_for_weights"}))
def test_each_field_from_flag(name: str) -> None:
    raw, expected = SAMPLES[name]
    config = ServerConfig.from_args([flag_name(name), raw], COMPANIONS.get(name, {}))
    assert getattr(config, name) == expected


def test_flag_beats_environment_beats_default() -> None:
    environ = {"ROLLSERVE_PORT": "2000", "ROLLSERVE_HOST": "10.0.0.1"}
    config = ServerConfig.from_args(["--port", "1000"], environ)
    assert config.port == 1000  # flag over environment
    assert config.host == "10.0.0.1"  # environment over default
    assert config.max_new_tokens == 64  # default


def test_boolean_flag_overrides_environment_both_ways() -> None:
    assert (
        ServerConfig.from_args(
            ["--no-wait-for-weights"], {"ROLLSERVE_WAIT_FOR_WEIGHTS": "1"}
        ).wait_for_weights
        is False
    )
    assert (
        ServerConfig.from_args(
            ["--wait-for-weights"], {"ROLLSERVE_WAIT_FOR_WEIGHTS": "off"}
        ).wait_for_weights
        is True
    )


def test_empty_environment_variable_counts_as_unset() -> None:
    config = ServerConfig.from_args([], {"ROLLSERVE_CRITIC": "", "ROLLSERVE_PORT": ""})
    assert config.critic is None and config.port == 50051


def test_unrelated_environment_is_ignored() -> None:
    assert ServerConfig.from_args([], {"PORT": "1", "ROLLSERVE_TARGET": "x:1"}) == ServerConfig()


def test_from_args_reads_only_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSERVE_PORT", "1234")
    assert ServerConfig.from_args([], {}).port == 50051


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "-1"],
        ["--port", "65536"],
        ["--port", "http"],
        ["--dtype", "int8"],
        ["--device", "gpu"],
        ["--max-message-bytes", "0"],
        ["--max-message-bytes", "3GiB"],  # gRPC limits are 32-bit
        ["--max-message-bytes", "64 parsecs"],
        ["--max-new-tokens", "0"],
        ["--shutdown-grace-s", "-1"],
        ["--drain-delay-s", "nan"],
        ["--drain-delay-s", "inf"],
        ["--max-workers", "0"],
        ["--log-level", "loud"],
        ["--host", ""],
        ["--actor", ""],
        ["--no-such-flag", "1"],
        ["--generation-path", "vllm"],
        ["--kv-cache-tokens", "-1"],
        ["--gpu-memory-utilization", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--gpu-memory-utilization", "most"],
    ],
)
def test_invalid_flags_are_rejected(argv: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig.from_args(argv, {})
    assert info.value.usage.startswith("usage:")


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("ROLLSERVE_PORT", "abc"),
        ("ROLLSERVE_DTYPE", "fp8"),
        ("ROLLSERVE_WAIT_FOR_WEIGHTS", "maybe"),
        ("ROLLSERVE_MAX_MESSAGE_BYTES", "-5"),
        ("ROLLSERVE_SHUTDOWN_GRACE_S", "soon"),
    ],
)
def test_invalid_environment_is_rejected_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=name):
        ServerConfig.from_args([], {name: raw})


def test_invalid_environment_is_ignored_when_a_flag_wins() -> None:
    assert ServerConfig.from_args(["--port", "5"], {"ROLLSERVE_PORT": "abc"}).port == 5


def test_frozen() -> None:
    config = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


def test_direct_construction_is_validated_and_normalised() -> None:
    assert ServerConfig(dtype="bf16", log_level="warning").dtype == "bfloat16"
    assert ServerConfig(log_level="warning").log_level == "WARNING"
    with pytest.raises(ConfigError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=0)


def test_cli_usage_error_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "http"]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--port" in err and "Traceback" not in err


def test_cli_environment_error_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROLLSERVE_MAX_WORKERS", "many")
    assert main(["serve"]) == 2
    assert "ROLLSERVE_MAX_WORKERS" in capsys.readouterr().err


def test_config_and_cli_import_neither_torch_nor_transformers() -> None:
    # `rollserve health` runs as a container HEALTHCHECK every few seconds: it must stay light.
    code = (
        "import sys; import rollserve.server.config, rollserve.server.serving.cli; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_list_fields_repeat_as_flags_and_split_in_environment() -> None:
    config = ServerConfig.from_args(
        ["--reward-fn", "a=m:f", "--reward-fn", "b=m:g"], {"ROLLSERVE_REWARD_ENDPOINT": "x=u1,y=u2"}
    )
    assert config.reward_fn == ("a=m:f", "b=m:g")
    assert config.reward_endpoint == ("x=u1", "y=u2")
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        ServerConfig.from_args(["--reward-fn", "nameless"], {})


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(ConfigError, match="preset must be one of"):
        ServerConfig.from_args(["--default-preset", "trl"], {})


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"ROLLSERVE_TLS_CERT": "/c.pem"}, "tls_cert and tls_key"),
        ({"ROLLSERVE_TLS_KEY": "/k.pem"}, "tls_cert and tls_key"),
        ({"ROLLSERVE_TLS_CLIENT_CA": "/ca.pem"}, "mutual TLS needs tls_cert"),
        ({"ROLLSERVE_DATA_TOKEN": "a1", "ROLLSERVE_DATA_TOKEN_FILE": "/f"}, "give one"),
        ({"ROLLSERVE_ADMIN_TOKEN": "a1", "ROLLSERVE_ADMIN_TOKEN_FILE": "/f"}, "give one"),
        ({"ROLLSERVE_DATA_TOKEN": "same", "ROLLSERVE_ADMIN_TOKEN": "same"}, "must differ"),
        ({"ROLLSERVE_MAX_NEW_TOKENS": "65", "ROLLSERVE_MAX_NEW_TOKENS_LIMIT": "64"}, "above"),
    ],
)
def test_settings_that_conflict_are_rejected(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig.from_args([], environ)


@pytest.mark.parametrize("raw", ["two words", "tab\there", "caf\u00e9", " "])
def test_tokens_must_fit_a_bearer_header(raw: str) -> None:
    with pytest.raises(ConfigError, match="data-token"):
        ServerConfig.from_args(["--data-token", raw], {})


def test_tokens_stay_out_of_the_config_repr() -> None:
    config = ServerConfig(data_token="d4ta-secret", admin_token="adm1n-secret")
    assert "secret" not in repr(config)
    assert config.data_token == "d4ta-secret"


def test_cli_conflicting_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--tls-cert", "/c.pem"]) == 2
    assert "tls_cert and tls_key" in capsys.readouterr().err


def test_flag_table_has_one_row_per_field() -> None:
    from dataclasses import fields

    from rollserve.server.config.flags import FLAGS

    assert list(FLAGS) == [field.name for field in fields(ServerConfig)]
