"""Router command line: flags derived from RouterConfig."""

from __future__ import annotations

import pytest

from router.config import RouterConfig, config_from_args


def test_pd_flags_parse_comma_separated_node_lists():
    config = config_from_args(
        [
            "--prefill", "tcp://127.0.0.1:5601,tcp://127.0.0.1:5602",
            "--decode", "tcp://127.0.0.1:5701",
            "--port", "8100",
            "--heartbeat-timeout", "1.5",
            "--served-model-name", "smol",
        ]
    )  # fmt: skip
    assert config.prefill == ("tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602")
    assert config.decode == ("tcp://127.0.0.1:5701",)
    assert config.port == 8100 and config.heartbeat_timeout == 1.5
    assert config.served_model_name == "smol"
    assert not config.colocated


def test_defaults_and_colocated_mode():
    config = config_from_args(["--decode", "tcp://127.0.0.1:5701", "--prefill", ""])
    assert config.colocated
    assert config.model is None
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.events_address == "tcp://127.0.0.1:5600"
    assert (config.heartbeat_timeout, config.request_timeout) == (3.0, 600.0)


def test_model_none_means_the_embedded_model():
    assert config_from_args(["--decode", "x", "--model", "none"]).model is None
    assert config_from_args(["--decode", "x", "--model", "/m"]).model == "/m"


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError, match="decode"):
        RouterConfig(prefill=("p",))
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(prefill=("a",), decode=("a",))
    with pytest.raises(ValueError, match="timeouts"):
        RouterConfig(decode=("d",), request_timeout=0)
