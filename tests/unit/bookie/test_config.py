"""Bookie configuration: precedence defaults < TOML < env < flags, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookie.config import ConfigError, load


def test_precedence_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "bookie.toml"
    toml.write_text(
        'data_dir = "/from/toml"\nport = 4000\nbookie_id = "toml-id"\njournal_group_wait_ms = 2\n'
    )
    env = {"BKAIO_BOOKIE_PORT": "5000", "BKAIO_BOOKIE_FRAME_READ_TIMEOUT_S": "7.5"}
    config, _ = load(["--config", str(toml), "--bookie-id", "flag-id"], env=env)
    assert config.data_dir == "/from/toml"
    assert config.port == 5000
    assert config.bookie_id == "flag-id"
    assert config.journal_group_wait_ms == 2.0
    assert config.frame_read_timeout_s == 7.5


def test_bookie_id_defaults_to_address_but_is_required_with_port_0() -> None:
    config, _ = load(["--data-dir", "/d", "--port", "3181"], env={})
    assert config.bookie_id == "127.0.0.1:3181"
    with pytest.raises(ConfigError, match="bookie_id is required"):
        load(["--data-dir", "/d", "--port", "0"], env={})


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "data_dir is required"),
        (["--data-dir", "/d", "--port", "70000"], {}, "out of range"),
        (["--data-dir", "/d", "--port", "abc"], {}, "port must be int"),
        (["--data-dir", "/d"], {"BKAIO_BOOKIE_NOPE": "1"}, "unknown key 'nope'"),
        (["--data-dir", "/d", "--journal-segment-bytes", "1000"], {}, "segment_bytes"),
        (["--data-dir", "/d", "--in-flight-per-connection-max", "0"], {}, "must be > 0"),
        (["--data-dir", "/d", "--log-level", "loud"], {}, "log_level"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load(argv, env=env)


def test_toml_type_errors_and_unknown_keys(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('data_dir = "/d"\nport = "x"\n')
    with pytest.raises(ConfigError, match=r"config file .*port must be int"):
        load(["--config", str(toml)], env={})
    toml.write_text('data_dir = "/d"\nprot = 1\n')
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load(["--config", str(toml)], env={})
    with pytest.raises(ConfigError, match="config file"):
        load(["--config", str(tmp_path / "missing.toml")], env={})


def test_in_flight_total_max_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="in_flight_total_max"):
        load(["--data-dir", "/d", "--in-flight-total-max", "0"], env={})
