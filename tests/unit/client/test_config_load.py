from __future__ import annotations

from pathlib import Path

import pytest

from bookkeeper_aio import BKInterfaceError, ClientConfig


def test_file_then_env_then_arguments(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text("[client]\nadd_timeout_s = 2\nread_window_max = 64\nspeculative_read_delay_ms = 10\n")
    env = {"BKAIO_CLIENT_READ_WINDOW_MAX": "128", "UNRELATED": "x"}
    config = ClientConfig.load(str(path), env=env, speculative_read_delay_ms=0)
    assert config.add_timeout_s == 2.0
    assert config.read_window_max == 128
    assert config.speculative_read_delay_ms == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BKAIO_CLIENT_ADD_TIMEOUT": "1"}, "unknown client setting 'add_timeout'"),
        ({"BKAIO_CLIENT_READ_WINDOW_MAX": "many"}, "read_window_max must be int"),
        ({"BKAIO_CLIENT_ADD_TIMEOUT_S": "-1"}, "add_timeout_s must be >= 0"),
    ],
)
def test_bad_values_name_the_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(BKInterfaceError, match=message):
        ClientConfig.load(env=env)


def test_wrong_type_in_file(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('add_window_max = "lots"\n')
    with pytest.raises(BKInterfaceError, match="add_window_max must be int"):
        ClientConfig.load(str(path), env={})


def test_a_range_error_names_where_the_value_came_from(tmp_path: Path) -> None:
    """docs/configuration.md: a wrong value's message names the key and its source (a range error
    named only the key)."""
    from_env = r"^environment BKAIO_CLIENT_ADD_TIMEOUT_S: .*add_timeout_s must be >= 0"
    with pytest.raises(BKInterfaceError, match=from_env):
        ClientConfig.load(env={"BKAIO_CLIENT_ADD_TIMEOUT_S": "-1"})
    path = tmp_path / "client.toml"
    path.write_text("read_window_max = 0\n")
    with pytest.raises(BKInterfaceError, match=rf"^config file {path}: .*read_window_max must be > 0"):
        ClientConfig.load(str(path), env={})
    with pytest.raises(BKInterfaceError, match=r"^argument: .*read_window_max must be > 0"):
        ClientConfig.load(env={}, read_window_max=0)
