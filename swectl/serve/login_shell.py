"""Commands of `swectl serve` with a login shell's environment, without paying for a login shell on every command.

OpenClaw-RL's exec server runs every command as ``bash -lc CMD``: /etc/profile, /etc/profile.d and root's
~/.profile / ~/.bashrc set PATH and activate environments (the official SWE-bench images activate their conda env
there). A login shell costs two to three process starts on top of the command (``id -u``, ``mesg n``, ...), which
tripled the service's exec round trip. So, per lease, the login environment is captured once: the variables a
login shell sets or changes beside a plain one's, and the functions it defines, written as a script into the
sandbox (``LOGIN_ENV``). Every command then sources that script (shell builtins only) before it runs.

When a profile file is newer than the captured script (an agent edited ~/.bashrc, installed something into
/etc/profile.d) or the script is gone, the shell reads the profile files as a login shell does (/etc/profile, then
the first of ~/.bash_profile, ~/.bash_login, ~/.profile) before the command: the environment is always what a
login shell gives; only its speed changes. (The command text appears once: a command near the kernel's 128 KiB
limit on one argument still runs.)
"""

from __future__ import annotations

import shlex

from swectl.errors import SwectlError

LOGIN_ENV = "/tmp/.swectl-login-env.sh"
# Variables that differ between any two shells and say nothing about the environment.
VOLATILE = frozenset({"_", "SHLVL", "PWD", "OLDPWD"})
SEPARATOR = "\x01"
# One exec: the plain environment, then a login shell's environment and its functions.
CAPTURE = f"env -0; printf '{SEPARATOR}'; bash -lc 'env -0; printf \"{SEPARATOR}\"; declare -f'"
PROFILE_FILES = ('/etc/profile /etc/profile.d /etc/profile.d/*.sh /etc/bash.bashrc "$HOME/.profile" '
                 '"$HOME/.bash_profile" "$HOME/.bash_login" "$HOME/.bashrc"')


class CaptureError(SwectlError):
    """The capture's output is not what CAPTURE prints (a broken image: no ``env`` or no ``bash``)."""


def _variables(block: str) -> dict[str, str]:
    out = {}
    for item in block.split("\0"):
        name, sep, value = item.partition("=")
        if sep and name and name not in VOLATILE:
            out[name] = value
    return out


def login_script(output: str) -> str:
    """The script that turns a plain shell's environment into a login shell's, from CAPTURE's output."""
    parts = output.split(SEPARATOR)
    if len(parts) != 3:
        raise CaptureError(f"unexpected capture output ({len(parts)} parts): {output[-300:]!r}")
    plain, login, functions = _variables(parts[0]), _variables(parts[1]), parts[2]
    lines = [f"unset {shlex.quote(name)}" for name in sorted(plain.keys() - login.keys())]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(login.items())
              if plain.get(name) != value and name.isidentifier()]
    return "\n".join([*lines, functions.strip(), ""])


# What bash reads as a login shell, in a shell that is not one.
READ_PROFILES = ('[[ -r /etc/profile ]] && . /etc/profile; for __swectl_file in "$HOME/.bash_profile" '
                 '"$HOME/.bash_login" "$HOME/.profile"; do [[ -r $__swectl_file ]] && { . "$__swectl_file"; break; }; '
                 'done')


def command_script(command: str, cwd: str) -> str:
    """The shell a command runs in: the captured login environment while it is current, else the profile files
    read as a login shell reads them. A cwd that does not exist fails the command (exit 1), as ``docker exec -w``
    does."""
    return "\n".join([
        "__swectl_stale=0",
        f"[[ -f {LOGIN_ENV} ]] || __swectl_stale=1",
        f"for __swectl_file in {PROFILE_FILES}; do [[ $__swectl_file -nt {LOGIN_ENV} ]] && __swectl_stale=1; done",
        f"if (( __swectl_stale )); then {READ_PROFILES}; else . {LOGIN_ENV}; fi",
        "unset __swectl_stale __swectl_file",
        f"cd -- {shlex.quote(cwd)} || exit 1",
        command,
    ])
