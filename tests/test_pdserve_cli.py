"""The `pdserve` command: one --help with every launcher, engine/node and router flag (derived
from the config dataclasses), flags and model names validated before anything starts, and a
`pip install .` that gives a working `pdserve serve --help`."""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
import site
import subprocess
import sys
import venv

import pytest

from common.protocol import wire_auth
from pdserve.cli import main
from pdserve.flags import LaunchConfig, build_parser, engine_fields, router_fields
from pdserve.launcher import RestartBackoff
from pdserve.plan import configs_from_args, plan
from tests.pd_stack import ROOT

PACKAGES = ("common", "router", "prefill_node", "decode_node", "kv_transfer", "pdserve")


def every_flag() -> list[str]:
    names = [f.name for f in dataclasses.fields(LaunchConfig)]
    names += [f.name for f, _ in engine_fields()] + [f.name for f in router_fields()]
    return ["--" + name.replace("_", "-") for name in names]


def serve_help() -> str:
    parser = build_parser()
    return parser.parse_args(["serve"]).serve_parser.format_help()


def test_serve_help_lists_every_launcher_engine_node_and_router_flag():
    text = serve_help()
    for flag in every_flag():
        assert flag in text, flag
    assert "{auto,float32,bfloat16,float16}" in text and "{zmq,cuda_ipc,nixl,loopback}" in text


def parse(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_flags_set_both_pools_and_pool_prefixes_override_one():
    configs = parse(
        "my/model", "--max-num-seqs", "8", "--decode-max-num-seqs", "4",
        "--prefill-no-enable-prefix-caching", "--transport", "cuda_ipc",
        "--request-timeout", "30", "--router-heartbeat-timeout", "2",
    )  # fmt: skip
    assert configs.launch.model == "my/model"
    assert configs.engines["prefill"].scheduler.max_num_seqs == 8
    assert configs.engines["decode"].scheduler.max_num_seqs == 4
    assert not configs.engines["prefill"].cache.enable_prefix_caching
    assert configs.engines["decode"].cache.enable_prefix_caching
    assert configs.nodes["prefill"].transport == configs.nodes["decode"].transport == "cuda_ipc"
    assert configs.router == {"request_timeout_s": 30.0, "heartbeat_timeout": 2.0}


def test_plan_gives_each_node_its_ports_gpu_and_only_non_default_flags():
    configs = parse("--num-prefill", "2", "--zmq-base-port", "7000", "--decode-max-num-seqs", "4")
    p = plan(configs, "/models/m", "m", gpus=4)
    prefill0, prefill1, decode0 = p.nodes
    assert prefill0.argv[1:3] == ["-m", "prefill_node"]
    assert (
        "--device" in prefill1.argv
        and prefill1.argv[prefill1.argv.index("--device") + 1] == "cuda:1"
    )
    assert decode0.argv[decode0.argv.index("--device") + 1] == "cuda:2"
    assert decode0.argv[decode0.argv.index("--kv-address") + 1] == "tcp://127.0.0.1:7201"
    assert "--max-num-seqs" in decode0.argv and "--max-num-seqs" not in prefill0.argv
    router = p.router_argv
    assert router[router.index("--prefill") + 1] == "tcp://127.0.0.1:7001,tcp://127.0.0.1:7002"
    assert router[router.index("--served-model-name") + 1] == "m"
    colocated = plan(parse("--colocated", "--num-decode", "2"), "/m", "m", gpus=0)
    assert [n.role for n in colocated.nodes] == ["colocated", "colocated"]
    assert all("--colocated" in n.argv and "cpu" in n.argv for n in colocated.nodes)


def test_two_host_flags_bind_every_socket_there_and_join_a_remote_router(monkeypatch):
    """Host A: router and prefill pool; host B: only the decode pool, joining A's router."""
    monkeypatch.setattr(wire_auth.SIGNER, "secret", b"s")
    host_a = plan(parse("--num-decode", "0", "--bind-host", "10.0.0.1", "--host", "0.0.0.0"),
                  "/m", "m", gpus=0)  # fmt: skip
    assert [n.address for n in host_a.nodes] == ["tcp://10.0.0.1:5601"]
    router = host_a.router_argv
    assert router[router.index("--events-address") + 1] == "tcp://10.0.0.1:5600"
    assert router[router.index("--mode") + 1] == "pd" and "--decode" not in router
    host_b = plan(parse("--num-prefill", "0", "--bind-host", "10.0.0.2",
                        "--router-url", "http://10.0.0.1:8000/"), "/m", "m", gpus=0)  # fmt: skip
    assert host_b.router_argv is None and host_b.url == "http://10.0.0.1:8000"
    (decode,) = host_b.nodes
    argv = dict(zip(decode.argv, decode.argv[1:], strict=False))
    assert decode.address == argv["--control-address"] == "tcp://10.0.0.2:5701"
    assert argv["--kv-address"] == "tcp://10.0.0.2:5801"
    assert argv["--router-address"] == "tcp://10.0.0.1:5600"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--dtype", "float64"], "invalid choice"),
        (["--transport", "carrier-pigeon"], "invalid choice"),
        (["--max-num-seqs", "many"], "invalid int"),
        (["--num-prefill", "0", "--num-decode", "0"], "num_decode=0"),
        (["--colocated", "--num-decode", "0"], "colocated=True"),
        (["--router-url", "10.0.0.1:8000"], "router_url must be like"),
        (["--bind-host", "10.0.0.2"], "PDSERVE_CLUSTER_SECRET"),
        (["--block-size", "0"], "block_size must be >= 1"),
        (["--decode-kv-memory-fraction", "1.5"], "gpu_memory_fraction"),
        (["--stats-interval", "-1"], "stats_interval"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["a/b", "--model", "c/d"], "two models"),
    ],
)
def test_bad_flags_stop_with_exit_code_2_before_anything_starts(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_model_missing_from_the_hub_cache_is_one_line_and_exit_code_2(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "no-org/no-model"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert str(tmp_path / "hf") in lines[0] and "hf download no-org/no-model" in lines[0]


def test_pip_install_gives_a_pdserve_command_whose_help_lists_every_flag(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    # The new venv sees this one's packages (pip, setuptools; nothing is downloaded), but
    # not its editable pdserve: only the copy installed here can answer.
    (next(env_dir.glob("lib/python*/site-packages")) / "host.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run(
        [*pip, "--no-build-isolation", "--no-index", str(source)], check=True, timeout=300
    )
    run = subprocess.run(
        [str(env_dir / "bin" / "pdserve"), "serve", "--help"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60, check=True,
    )  # fmt: skip
    for flag in every_flag():
        assert flag in run.stdout, flag


def test_restart_backoff_spares_a_node_that_ran_and_slows_a_crash_loop():
    backoff = RestartBackoff(healthy_run_s=20.0, max_delay_s=8.0)
    quick = [backoff.delay("decode-0", ran_s=1.0) for _ in range(7)]
    assert quick == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.delay("prefill-0", ran_s=1.0) == 0.0  # counted per node
    assert backoff.delay("decode-0", ran_s=25.0) == 0.0  # a healthy run resets the count
    assert backoff.delay("decode-0", ran_s=1.0) == 0.0


def device_of(node) -> str:
    return node.argv[node.argv.index("--device") + 1]


def test_tensor_parallel_pools_get_one_gpu_per_rank():
    p = plan(parse("--prefill-tp", "2", "--decode-tp", "1", "--num-decode", "2"), "/m", "m", 4)
    prefill, decode0, decode1 = p.nodes
    assert device_of(prefill) == "cuda:0,1" and prefill.ranks == 2
    assert "--tp" in prefill.argv and "--tp" not in decode0.argv
    assert (device_of(decode0), device_of(decode1)) == ("cuda:2", "cuda:3")
    given = parse("--decode-tp", "2", "--prefill-gpus", "7", "--decode-gpus", "3,5")
    assert device_of(plan(given, "/m", "m", 8).nodes[1]) == "cuda:3,5"
    cpu = plan(parse("--colocated", "--tp", "2"), "/m", "m", gpus=0).nodes[0]
    assert device_of(cpu) == "cpu" and cpu.argv[cpu.argv.index("--tp") + 1] == "2"
    assert "--prefill-tp" in serve_help() and "--decode-tp" in serve_help()


def test_pipelined_pools_get_one_gpu_per_stage_and_rank():
    p = plan(parse("--prefill-pp", "2", "--prefill-tp", "2", "--decode-tp", "1"), "/m", "m", 5)
    prefill, decode = p.nodes
    assert device_of(prefill) == "cuda:0,1,2,3" and prefill.ranks == 4
    assert prefill.argv[prefill.argv.index("--pp") + 1] == "2"
    assert device_of(decode) == "cuda:4" and "--pp" not in decode.argv
    assert "--prefill-pp" in serve_help() and "--decode-pp-layer-partition" in serve_help()


@pytest.mark.parametrize(
    "argv,gpus,needle",
    [
        (["--prefill-tp", "2", "--decode-tp", "2"], 3, r"2 prefill \+ 2 decode GPUs needed"),
        (["--decode-tp", "2", "--decode-gpus", "1"], 4, "need 2"),
        (["--tp", "0"], 4, "tp must be >= 1"),
        (["--prefill-pp", "2", "--prefill-tp", "2"], 4, r"4 prefill \+ 1 decode GPUs needed"),
        (
            ["--prefill-pp", "2", "--prefill-gpus", "0"],
            4,
            r"--prefill-tp 1 x --prefill-pp 2 need 2",
        ),
    ],
)
def test_too_few_gpus_for_the_ranks_is_a_clear_error(argv, gpus, needle):
    with pytest.raises(ValueError, match=needle):
        plan(parse(*argv), "/m", "m", gpus)


def checkout_imports(path) -> list[str]:
    """`file:line what` for each import of a checkout-only folder and each use of sys.path."""
    rel, out = path.relative_to(ROOT), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top not in PACKAGES and (ROOT / top).is_dir():
                out.append(f"{rel}:{node.lineno} imports {name}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            out.append(f"{rel}:{node.lineno} uses sys.path")
    return out


def test_the_packaged_code_imports_nothing_from_the_checkout_and_ships_no_data_files():
    """A wheel holds PACKAGES and nothing else. `pdserve plan` once imported benchmarks/loadgen
    after putting the checkout on sys.path: fine in a checkout, an ImportError installed. A
    non-Python file in a package would be left out of the wheel too (no package-data)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*)\]", pyproject)
    assert {name.strip(' "*') for name in include.group(1).split(",")} == set(PACKAGES)
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "pdserve/planner/main.py" in tracked
    assert [name for name in tracked if not name.endswith(".py")] == []
    found = [line for name in tracked for line in checkout_imports(ROOT / name)]
    assert found == []


def test_a_tp_size_the_model_cannot_split_is_one_line_and_exit_code_2(capsys):
    # the embedded SmolLM2 has 9 query heads and 3 KV heads: TP 3 splits it, TP 2 does not
    assert main(["serve", "--decode-tp", "2", "--health-timeout", "1"]) == 2
    assert "tp=2 does not divide num_heads=9" in capsys.readouterr().err


def test_plan_help_lists_every_planner_flag():
    """`pdserve plan --help` renders (a help text with a bare % once made argparse raise)."""
    from pdserve.planner.config import PlanConfig

    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for f in dataclasses.fields(PlanConfig):
        assert "--" + f.name.replace("_", "-") in result.stdout, f.name
    assert ">85% busy" in result.stdout
