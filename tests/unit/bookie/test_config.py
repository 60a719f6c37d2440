"""Bookie configuration: precedence defaults < TOML < env < flags, and clear errors."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from bookie.config import (
    BookieConfig,
    ConfigError,
    build_parser,
    effective_toml,
    help_text,
    load,
    reference_table,
)


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


@pytest.mark.parametrize(
    ("argv", "env", "toml", "message"),
    [
        (["--port", "70000"], {}, "", "flag --port: port 70000 is out of range 0..65535"),
        ([], {"BKAIO_BOOKIE_PORT": "70000"}, "", "environment BKAIO_BOOKIE_PORT: port 70000 is out of range"),
        ([], {}, "port = 70000\n", "config file {toml}: port 70000 is out of range"),
        (["--connections-max", "0"], {}, "", "flag --connections-max: connections_max must be > 0"),
        ([], {"BKAIO_LOG_LEVEL": "loud"}, "", "environment BKAIO_LOG_LEVEL: log_level 'loud': use debug,"),
    ],
)
def test_a_range_error_names_where_the_value_came_from(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml: str, message: str
) -> None:
    """docs/configuration.md: a wrong value's message names the key and its source."""
    path = tmp_path / "bookie.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as raised:
        load(["--data-dir", "/d", "--config", str(path), *argv], env=env)
    assert str(raised.value).startswith(message.format(toml=path)), raised.value


def test_bkaio_log_level_sets_the_bookies_level_below_its_own_key_and_flag() -> None:
    """docs/configuration.md: ``$BKAIO_LOG_LEVEL`` holds for every process, the bookie too (it was
    ignored: the bookie passed its own default, info, to the logging set-up)."""
    argv = ["--data-dir", "/d", "--port", "3181"]
    assert load(argv, env={})[0].log_level == "info"
    config, args = load(argv, env={"BKAIO_LOG_LEVEL": "ERROR"})
    assert (config.log_level, args.sources["log_level"]) == ("error", "environment BKAIO_LOG_LEVEL")
    both = {"BKAIO_LOG_LEVEL": "error", "BKAIO_BOOKIE_LOG_LEVEL": "debug"}
    assert load(argv, env=both)[0].log_level == "debug"
    assert load([*argv, "--log-level", "warning"], env=both)[0].log_level == "warning"


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


def test_every_key_has_a_help_text_shown_by_help() -> None:
    usage = " ".join(build_parser().format_help().split())  # argparse wraps lines
    for field in fields(BookieConfig):
        text = help_text(field.name)
        assert len(text) > 10, f"config key {field.name} has no help text (bookie/config.py, _key)"
        flag = "--" + field.name.replace("_", "-")
        shown = " ".join(text.replace("`", "").replace("*", "").split())
        assert f"{flag} " in usage
        assert shown in usage, f"{flag}: its help text is missing from `bookie --help`"
        assert f"BKAIO_BOOKIE_{field.name.upper()}" in usage


def test_docs_reference_table_is_the_generated_one() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    section = doc.split("### BookieConfig (bookie)", 1)[1].split("\n### ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|")) + "\n"
    assert table == reference_table(), (
        "docs/configuration.md's BookieConfig table differs from bookie/config.py: "
        "paste the output of `python -m bookie.config` into it"
    )
    for field in fields(BookieConfig):
        assert f"| `{field.name}` |" in table


def test_the_default_bookie_id_keeps_its_old_spelling() -> None:
    """A bookie id is in its cookie and in ledgers' metadata: an IPv6 host stays unbracketed."""
    config, _ = load(["--data-dir", "/d", "--host", "::1"], env={})
    assert config.bookie_id == "::1:3181"
    assert config.published_address(3181) == "[::1]:3181"


def test_wildcard_host_needs_an_advertised_address() -> None:
    with pytest.raises(ConfigError, match="advertised_address"):
        load(["--data-dir", "/d", "--host", "0.0.0.0"], env={})
    config, _ = load(["--data-dir", "/d", "--host", "::", "--advertised-address", "10.0.0.7"], env={})
    assert config.bookie_id == "10.0.0.7:3181"
    assert config.published_address(3181) == "10.0.0.7:3181"


@pytest.mark.parametrize(
    ("advertised", "bound_port", "published"),
    [
        ("", 4000, "127.0.0.1:4000"),  # the listening address, with the port actually bound
        ("bk-1.example", 4000, "bk-1.example:4000"),
        ("bk-1.example:3181", 4000, "bk-1.example:3181"),  # a forwarded port is published as given
        ("fd00::5", 4000, "[fd00::5]:4000"),
        ("[fd00::5]:3200", 4000, "[fd00::5]:3200"),
    ],
)
def test_published_address(advertised: str, bound_port: int, published: str) -> None:
    config, _ = load(["--data-dir", "/d", "--port", "0", "--bookie-id", "b1"], env={})
    config = BookieConfig(**{**config.__dict__, "advertised_address": advertised})
    assert config.published_address(bound_port) == published


@pytest.mark.parametrize(
    "bad",
    ["0.0.0.0", "::0", "0:0:0:0:0:0:0:0", "host:port", "host:70000", ":3181", "[fe80::1]4000", "[fe80::1"],
)
def test_bad_advertised_address_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="advertised_address"):
        load(["--data-dir", "/d", "--advertised-address", bad], env={})


def test_loopback_address_refused_for_a_remote_cluster() -> None:
    remote = "etcd://10.1.2.3:2379,etcd-2:2379/bk"
    with pytest.raises(ConfigError, match=r"loopback address 127\.0\.0\.1 .* 10\.1\.2\.3:2379, etcd-2:2379"):
        load(["--data-dir", "/d", "--metadata", remote], env={})
    with pytest.raises(ConfigError, match="loopback address localhost"):
        load(["--data-dir", "/d", "--metadata", remote, "--advertised-address", "localhost"], env={})
    with pytest.raises(ConfigError, match=r"loopback address ::ffff:127\.0\.0\.1"):
        load(["--data-dir", "/d", "--metadata", remote, "--advertised-address", "::ffff:127.0.0.1"], env={})
    # a loopback cluster (the sandbox) or a reachable address is fine
    load(["--data-dir", "/d", "--metadata", "etcd://127.0.0.1:2379/bk"], env={})
    config, _ = load(["--data-dir", "/d", "--metadata", remote, "--advertised-address", "10.0.0.7"], env={})
    assert config.bookie_id == "10.0.0.7:3181"


def test_print_config_shows_every_key_with_its_source(tmp_path: Path) -> None:
    toml = tmp_path / "bookie.toml"
    toml.write_text('data_dir = "/d"\nport = 3300\n')
    config, args = load(["--config", str(toml), "--log-level", "debug"], env={"BKAIO_BOOKIE_PORT": "3400"})
    text = effective_toml(config, args.sources)
    assert f'data_dir = "/d"  # config file {toml}' in text
    assert "port = 3400  # environment BKAIO_BOOKIE_PORT" in text
    assert 'log_level = "debug"  # flag --log-level' in text
    assert 'bookie_id = "127.0.0.1:3400"  # derived' in text
    assert "journal_group_wait_ms = 0.0  # default" in text
    # the output is a config file that loads to the same configuration
    toml.write_text(text)
    again, _ = load(["--config", str(toml)], env={})
    assert again == config
