"""The login environment `swectl serve` captures once per lease: what a login shell sets beside a plain one, and
the shell around each command. Run with a real bash here (no sandbox needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from swectl.serve import login_shell
from swectl.serve.login_shell import CAPTURE, CaptureError, command_script, login_script


def test_the_script_keeps_what_the_login_shell_changed() -> None:
    plain = "HOME=/root\0PATH=/usr/bin\0KEEP=1\0GONE=x\0SHLVL=1\0"
    login = "HOME=/root\0PATH=/opt/venv/bin:/usr/bin\0KEEP=1\0NEW=a b'c\nd\0SHLVL=2\0_=/usr/bin/env\0"
    script = login_script(plain + "\x01" + login + "\x01" + "greet () \n{ \n    echo hi\n}\n")
    assert "export PATH=/opt/venv/bin:/usr/bin" in script and "unset GONE" in script
    assert "KEEP" not in script and "HOME" not in script and "SHLVL" not in script and "export _" not in script
    out = subprocess.run(["bash", "-c", script + "printf '%s|' \"$NEW\" \"$PATH\"; greet"], capture_output=True,
                         text=True, env={"GONE": "x", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert out == "a b'c\nd|/opt/venv/bin:/usr/bin|hi\n"


def test_a_broken_capture_is_an_error() -> None:
    with pytest.raises(CaptureError):
        login_script("bash: env: command not found")


def test_commands_source_the_capture_until_a_profile_file_is_newer(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".profile").write_text("export FROM=profile\n")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    monkeypatch.setattr(login_shell, "LOGIN_ENV", str(tmp_path / "login-env.sh"))

    def run(command: str) -> str:
        script = command_script(command, str(tmp_path))
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env).stdout

    assert run("echo $FROM") == "profile\n"  # no capture yet: the profile files are read
    captured = subprocess.run(["bash", "-c", CAPTURE], capture_output=True, text=True, env=env, check=True).stdout
    Path(login_shell.LOGIN_ENV).write_text(login_script(captured))
    (home / ".profile").write_text("export FROM=changed-but-older\n")
    old = Path(login_shell.LOGIN_ENV).stat().st_mtime - 10
    os.utime(home / ".profile", (old, old))
    assert run("echo $FROM; pwd") == f"profile\n{tmp_path}\n"  # the capture, not the file, while it is current
    (home / ".profile").write_text("export FROM=edited\n")  # newer than the capture: a real login shell again
    assert run("echo $FROM") == "edited\n"
    assert subprocess.run(["bash", "-c", command_script("true", "/no/such/dir")], capture_output=True,
                          env=env).returncode == 1
