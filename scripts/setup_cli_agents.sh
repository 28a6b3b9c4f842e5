#!/usr/bin/env bash
# The terminal coding agents swectl runs inside its sandboxes (issue 59), unmodified, pinned, from the npm
# registry, into a tools folder (.tools/cli-agents; $SWECTL_CLI_TOOLS moves it) that every agent sandbox gets
# read-only at /opt/swectl-tools: no task image is rebuilt. Idempotent; about 10 seconds and 660 MiB the first time.
#   - Codex CLI (@openai/codex): a static (musl) binary, so it runs in any image;
#   - Claude Code (@anthropic-ai/claude-code): a Bun-built binary linked against glibc (libc, libm, libdl,
#     libpthread, librt): it runs in glibc images (every SWE-bench image, swectl's base image).
# Both ship their Linux binary as an npm package of their own; npm itself is only needed here, never in a sandbox.
# bin/codex and bin/claude are links into the packages, relative, so they resolve inside the mount too.
# Run by `bash scripts/setup.sh --with-harnesses` (the test command does; CI runs it), or alone.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${SWECTL_CLI_TOOLS:-.tools/cli-agents}
CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.197
say() { printf '\033[1m[setup cli agents]\033[0m %s\n' "$*"; }

if ! command -v npm >/dev/null 2>&1; then
    say "installing npm (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
fi
want="codex $CODEX_VERSION, claude-code $CLAUDE_CODE_VERSION"
if [ -f "$TOOLS/VERSIONS" ] && [ "$(cat "$TOOLS/VERSIONS")" = "$want" ] && [ -x "$TOOLS/bin/codex" ] \
        && [ -x "$TOOLS/bin/claude" ]; then
    say "$want ready in $TOOLS"
    exit 0
fi
mkdir -p "$TOOLS"
say "installing $want into $TOOLS (npm)"
log="$TOOLS/npm-install.log"
# the packages' postinstall scripts are not run (Claude Code's only re-links the binary npm already placed)
if ! npm install --no-audit --no-fund --ignore-scripts --prefix "$TOOLS" \
        "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >"$log" 2>&1; then
    tail -30 "$log" >&2; echo "setup cli agents: npm install failed (full log: $log)" >&2; exit 1
fi
arch=$(uname -m)
case "$arch" in
    x86_64) codex_target=x86_64-unknown-linux-musl; npm_arch=x64 ;;
    aarch64) codex_target=aarch64-unknown-linux-musl; npm_arch=arm64 ;;
    *) echo "setup cli agents: no Codex/Claude Code binaries for $arch" >&2; exit 1 ;;
esac
codex="node_modules/@openai/codex-linux-$npm_arch/vendor/$codex_target/bin/codex"
claude="node_modules/@anthropic-ai/claude-code-linux-$npm_arch/claude"
for f in "$codex" "$claude"; do
    [ -x "$TOOLS/$f" ] || { echo "setup cli agents: $TOOLS/$f is missing after the install (see $log)" >&2; exit 1; }
done
mkdir -p "$TOOLS/bin"
ln -sfn "../$codex" "$TOOLS/bin/codex"
ln -sfn "../$claude" "$TOOLS/bin/claude"
"$TOOLS/bin/codex" --version >>"$log" 2>&1 || { echo "setup cli agents: codex does not run (see $log)" >&2; exit 1; }
"$TOOLS/bin/claude" --version >>"$log" 2>&1 || { echo "setup cli agents: claude does not run (see $log)" >&2; exit 1; }
echo "$want" >"$TOOLS/VERSIONS"
say "$want ready in $TOOLS ($(du -sh "$TOOLS" | cut -f1))"
