"""symphony.config_secrets: config files owner-only and whole, secrets never printed, children's
environments without them, tokens from a file or stdin."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import tomllib
from pathlib import Path

import pytest

from node_manager.engine import engine_launch
from symphony.cli import main
from symphony.config import ConfigError, SymphonyConfig, load_config
from symphony.config_secrets import (
    REDACTED,
    SECRET_FILE,
    read_token_file,
    redacted,
    scrubbed_env,
    with_cluster_secret,
    write_private,
)
from symphony.launcher import LocalCluster
from symphony.models import ModelInfo
from symphony.process import ManagedProcess

CONFIG = """
[scheduler]
api_keys = ["acme:sk-acme-123", "globex:sk-globex-456"]
admin_token = "root-789"
"""


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("SYMPHONY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SYMPHONY_HOME", str(tmp_path / "home"))


def test_config_show_names_tenants_and_never_prints_a_key_or_the_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "symphony.toml"
    path.write_text(CONFIG)
    assert main(["config", "show", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sk-acme-123" not in out and "sk-globex-456" not in out and "root-789" not in out
    shown = tomllib.loads(out)["scheduler"]
    assert shown["api_keys"] == [f"acme:{REDACTED}", f"globex:{REDACTED}"] and shown["admin_token"] == REDACTED
    # Set through the environment: the same.
    monkeypatch.setenv("SYMPHONY_SCHEDULER_ADMIN_TOKEN", "env-token-1")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "env-token-1" not in out and tomllib.loads(out)["scheduler"]["admin_token"] == REDACTED
    # No token set: shown empty, so whether one is set shows.
    monkeypatch.delenv("SYMPHONY_SCHEDULER_ADMIN_TOKEN")
    assert main(["config", "show"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["scheduler"]["admin_token"] == ""


def test_a_cluster_secret_is_checked_and_a_given_one_kept() -> None:
    for bad, fragment in [("short", "16 characters or more"), (REDACTED, "not config show's")]:
        with pytest.raises(ConfigError, match=f"cluster.secret: .*{fragment}"):
            load_config(env={}, overrides={"cluster": {"secret": bad}})
    given = load_config(env={}, overrides={"cluster": {"secret": "s" * 16}})
    assert with_cluster_secret(given) is given


def _at(home: Path) -> SymphonyConfig:
    return dataclasses.replace(load_config(env={}), home=str(home))


def test_a_home_keeps_the_secret_it_made(tmp_path: Path) -> None:
    """With none configured, the secret is made once per home, owner-only, and read back at every
    later start: SSD pages' MACs made under it must still verify after a restart."""
    homes = [tmp_path / "a", tmp_path / "b"]
    made = [with_cluster_secret(_at(home)).cluster.secret for home in homes]
    assert made[0] != made[1] and all(len(secret) == 64 for secret in made)  # random per home
    path = homes[0] / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == made[0]
    again = with_cluster_secret(_at(homes[0])).cluster.secret
    assert again == made[0]
    assert sorted(p.name for p in homes[0].iterdir()) == [SECRET_FILE]  # no temporary file left


def test_a_short_or_readable_home_secret_is_refused(tmp_path: Path) -> None:
    path = tmp_path / SECRET_FILE
    path.write_text("short\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=f"{SECRET_FILE} holds a secret of 5 characters"):
        with_cluster_secret(_at(tmp_path))
    path.write_text("x" * 64 + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="may be read by others"):
        with_cluster_secret(_at(tmp_path))


def test_redacting_leaves_the_configuration_itself_alone(tmp_path: Path) -> None:
    path = tmp_path / "symphony.toml"
    path.write_text(CONFIG)
    config = load_config(path, env={})
    shown = redacted(config)
    assert config.scheduler.admin_token == "root-789" and shown.scheduler.port == config.scheduler.port
    assert config.scheduler.api_keys[0] == "acme:sk-acme-123"


def test_a_private_file_is_owner_only_and_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "run" / "cluster.toml"
    write_private(path, "first\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "first\n"
    path.chmod(0o644)  # an older file, world-readable: replaced by an owner-only one
    write_private(path, "second\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "second\n"
    assert [p.name for p in path.parent.iterdir()] == ["cluster.toml"]  # no temporary file left


async def test_the_launcher_writes_the_cluster_file_owner_only_and_scrubs_its_childrens_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`symphony up --regions` (every kind of child), its processes not started."""
    monkeypatch.setattr(ManagedProcess, "start", lambda self: None)
    monkeypatch.setenv("SYMPHONY_SCHEDULER_ADMIN_TOKEN", "env-token-2")
    monkeypatch.setenv("SYMPHONY_SCHEDULER_API_KEYS", "acme:sk-env")
    monkeypatch.setenv("SYMPHONY_ADMIN_TOKEN", "cli-token")
    monkeypatch.setenv("SYMPHONY_NODE_HOST", "127.0.0.1")  # not a secret: kept
    layout = {"regions": {"layout": ["us-east:1", "eu-west:1"]}, "kv": {"data_plane": "grpc"}}
    config = dataclasses.replace(load_config(None, overrides=layout), home=str(tmp_path / "home"))
    cluster = LocalCluster(config, ModelInfo(tmp_path / "model", "m"), io.StringIO())
    cluster.spawn()
    assert stat.S_IMODE(cluster.config_path.stat().st_mode) == 0o600
    effective = load_config(cluster.config_path, env={})
    assert effective.scheduler.admin_token == "env-token-2"  # children read it there
    # A cluster secret of its own, shared by every child through that file, never printed.
    assert len(effective.cluster.secret) == 64 and config.cluster.secret == ""
    assert (tmp_path / "home" / SECRET_FILE).read_text().strip() == effective.cluster.secret  # kept for restarts
    assert redacted(effective).cluster.secret == REDACTED
    children = [*cluster.nodes, *cluster.schedulers, *cluster.services]
    assert len(cluster.nodes) == 2 and len(cluster.schedulers) == 2 and len(cluster.services) == 2
    for child in children:
        assert child.env is not None, child.name
        assert not {"SYMPHONY_SCHEDULER_ADMIN_TOKEN", "SYMPHONY_SCHEDULER_API_KEYS", "SYMPHONY_ADMIN_TOKEN"} & set(
            child.env
        )
        assert child.env.get("SYMPHONY_NODE_HOST") == "127.0.0.1"
    await cluster.shutdown()


def test_an_engine_inherits_no_secret(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "SYMPHONY_SCHEDULER_API_KEYS": "a:b", "SYMPHONY_ADMIN_TOKEN": "t"}
    assert scrubbed_env(base) == {"PATH": "/bin"}
    launch = engine_launch(load_config(None).engine, ModelInfo(tmp_path, "m"), "127.0.0.1", 8100, base_env=base)
    assert launch.env["PATH"] == "/bin"
    assert not {"SYMPHONY_SCHEDULER_API_KEYS", "SYMPHONY_ADMIN_TOKEN"} & set(launch.env)


def test_a_token_file_gives_its_first_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "token"
    path.write_text("  s3cret \nignored\n")
    assert read_token_file(str(path)) == "s3cret"
    monkeypatch.setattr("sys.stdin", io.StringIO("from-stdin\n"))
    assert read_token_file("-") == "from-stdin"


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("\n  \n", "holds no token"), ("x" * 5000, "longer than 4096 bytes")],
)
def test_a_bad_token_file_is_named(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_token_file(str(path))


def test_the_admin_cli_names_a_bad_token_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    absent = str(tmp_path / "absent")
    assert main(["admin", "priority", "list", "--url", "http://127.0.0.1:9", "--token-file", absent]) == 2
    assert "--token-file: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one way of giving the token at a time
        main(["admin", "priority", "list", "--token", "a", "--token-file", absent])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ('admin_token = "<redacted>"', "scheduler.admin_token"),
        ('api_keys = ["acme:<redacted>"]', "scheduler.api_keys"),
    ],
)
def test_config_shows_output_is_no_config_with_a_known_secret(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, section: str, message: str
) -> None:
    """A file copied from `config show` does not load: its placeholder would be a token anyone knows."""
    path = tmp_path / "copied.toml"
    path.write_text(f"[scheduler]\n{section}\n")
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "<redacted>" in err
