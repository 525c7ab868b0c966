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
    assert (config.heartbeat_timeout, config.request_timeout_s) == (3.0, 600.0)
    assert (config.prefill_policy, config.decode_policy) == ("least_load", "least_load")
    assert config.api_key is None and config.max_waiting_requests == 1024


def test_no_nodes_at_all_is_pd_mode_waiting_for_nodes_to_register():
    config = config_from_args([])
    assert not config.colocated and config.prefill == config.decode == ()
    assert config_from_args(["--mode", "colocated"]).colocated


def test_request_timeout_keeps_its_old_flag_name():
    assert config_from_args(["--request-timeout", "5"]).request_timeout_s == 5.0
    assert config_from_args(["--request-timeout-s", "7"]).request_timeout_s == 7.0


def test_policies_are_chosen_per_pool():
    config = config_from_args(["--prefill-policy", "cache_aware", "--decode-policy", "round_robin"])
    assert (config.prefill_policy, config.decode_policy) == ("cache_aware", "round_robin")
    with pytest.raises(ValueError, match="prefill requests only"):
        RouterConfig(decode_policy="cache_aware")
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(prefill_policy="random")


def test_api_key_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    assert config_from_args([]).api_key == "sk-env"
    assert config_from_args(["--api-key", "sk-flag"]).api_key == "sk-flag"
    assert config_from_args(["--auth-all-endpoints"]).auth_all_endpoints is True


def test_model_none_means_the_embedded_model():
    assert config_from_args(["--decode", "x", "--model", "none"]).model is None
    assert config_from_args(["--decode", "x", "--model", "/m"]).model == "/m"


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError, match="no prefill"):
        RouterConfig(prefill=("p",), mode="colocated")
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(prefill=("a",), decode=("a",))
    with pytest.raises(ValueError, match="timeouts"):
        RouterConfig(decode=("d",), request_timeout_s=0)
