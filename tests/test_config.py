"""Config decoding: valid files, clear errors with paths and hints, cross-field checks, overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swectl.config import (
    LocalNodeConfig,
    SshNodeConfig,
    apply_override,
    decode_config,
    load_config,
)
from swectl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_default_is_one_local_node():
    config = load_config(None)
    assert config.nodes == [LocalNodeConfig(name="local")]
    assert config.sandbox.network is False
    assert [n.name for n in config.sandbox_nodes()] == ["local"]


@pytest.mark.parametrize("name", ["local.toml", "two-nodes.toml"])
def test_examples_decode(name):
    config = load_config(ROOT / "examples" / name)
    assert config.nodes


def test_two_nodes_example_has_ssh_nodes_with_verified_host_keys():
    config = load_config(ROOT / "examples" / "two-nodes.toml")
    assert all(isinstance(n, SshNodeConfig) for n in config.nodes)
    assert all(n.known_hosts != "insecure-accept-any" for n in config.nodes)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_typo_names_path_and_suggests_the_right_key(tmp_path):
    path = write(tmp_path, '[[nodes]]\nkind = "local"\nname = "a"\nmax_runing = 3\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "max_runing" in message
    assert "$.nodes[0]" in message
    assert "did you mean 'max_running'" in message
    assert str(path) in message


def test_wrong_type_names_the_path(tmp_path):
    path = write(tmp_path, '[env_pool]\nwarm = "four"\n')
    with pytest.raises(ConfigError, match=r"Expected `int`, got `str` - at `\$\.env_pool\.warm`"):
        load_config(path)


def test_unknown_node_in_env_pool_names_the_knob(tmp_path):
    path = write(tmp_path, '[[nodes]]\nkind = "local"\nname = "local"\n[env_pool]\nnodes = ["locl"]\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "env_pool.nodes[0]: unknown node 'locl'" in str(err.value)
    assert "did you mean 'local'" in str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[[nodes]]\nkind = "local"\nname = "a"\n[[nodes]]\nkind = "local"\nname = "a"\n', "duplicate node name"),
        ('[[nodes]]\nkind = "ssh"\nname = "b"\n', "missing required field `host`"),
        ('[[nodes]]\nkind = "docker"\nname = "b"\n', 'kind is "local" or "ssh"'),
        ('[[nodes]]\nname = "b"\n', "needs kind"),
        ('[[nodes]]\nkind = "local"\nmax_running = 2\nmax_starting = 4\n', "nodes[0].max_starting (4) exceeds"),
        ('[[nodes]]\nkind = "local"\nmax_running = 0\n', "Expected `int` >= 1"),
        ('[sandbox]\nmemory = "lots"\n', "sandbox.memory"),
        ("nodes = []\n", "at least one [[nodes]]"),
        ('[[nodes]]\nkind = "local"\nname = "bad name!"\n', "$.nodes[0].name"),
        ("[sandbox\n", "invalid TOML"),
    ],
)
def test_broken_configs_give_clear_errors(tmp_path, text, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert expected in str(err.value)


def test_engine_section_defaults_and_checks():
    config = load_config(None)
    assert config.engine.kind == "cpu"
    assert [n.name for n in config.engine_nodes()] == ["local"]
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.nodes=['locl']"])
    assert "engine.nodes[0]: unknown node 'locl'" in str(err.value)
    assert "did you mean 'local'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.port=30000", "engine.replicas=2"])
    assert "set engine.port = 0" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.kind='vlm'"])
    assert "engine.kind" in str(err.value)


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"run_id = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_overrides_parse_as_toml_and_are_validated():
    config = load_config(None, ["env_pool.warm=9", "sandbox.image=foo:bar", "sandbox.network=true"])
    assert config.env_pool.warm == 9
    assert config.sandbox.image == "foo:bar"
    assert config.sandbox.network is True
    with pytest.raises(ConfigError, match=r"\$\.env_pool\.warm"):
        load_config(None, ["env_pool.warm=-1"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_config(None, ["env_pool.warm"])


def test_override_into_a_list_item():
    document = {"nodes": [{"kind": "local", "name": "a"}]}
    apply_override(document, "nodes.0.max_running=64")
    assert decode_config(document).nodes[0].max_running == 64
    with pytest.raises(ConfigError, match="not an index"):
        apply_override(document, "nodes.3.max_running=1")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swectl.cli.main", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_check_config_prints_resolved_json():
    done = run_cli("check-config", "examples/two-nodes.toml", "--set", "env_pool.warm=3")
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    assert resolved["env_pool"]["warm"] == 3
    assert resolved["nodes"][0]["kind"] == "ssh"
    assert resolved["nodes"][1]["max_channels_per_connection"] == 10  # defaults are filled in


def test_check_config_error_exit_code_and_message(tmp_path):
    done = run_cli("check-config", str(write(tmp_path, "[env_pool]\nwarmm = 1\n")))
    assert done.returncode == 2
    assert "config error" in done.stderr
    assert "did you mean 'warm'" in done.stderr


def test_help_explains_commands():
    done = run_cli("--help")
    assert done.returncode == 0
    for word in ("up", "check-config", "nodes", "--set"):
        assert word in done.stdout


def test_an_agent_config_that_does_not_load_stops_the_command(tmp_path):
    """rollout.agent_config is read as a command loads its config, not when the first episode starts."""
    done = run_cli("check-config", "--set", 'rollout.agent_config="compact"')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rollout"]["agent_config"] == "compact"
    done = run_cli("check-config", "--set", 'rollout.agent_config="nope.yaml"')
    assert done.returncode == 2
    assert "rollout.agent_config 'nope.yaml': no such file" in done.stderr
    broken = write(tmp_path, "agent:\n  system_template: [1, 2]\n")
    done = run_cli("eval", "--model", str(tmp_path), "--set", f'rollout.agent_config="{broken}"')
    assert done.returncode == 2
    assert "agent.system_template must be a string" in done.stderr
