#!/bin/bash
# Builds from scratch and checks the tool on inputs the agent never saw.
mkdir -p /logs/verifier
cd /app
fail() { echo "$1"; echo 0 > /logs/verifier/reward.txt; exit 0; }
make clean >/dev/null 2>&1
make > /tmp/build.log 2>&1 || { cat /tmp/build.log; fail "make failed"; }
[ -x build/wc2 ] || fail "no build/wc2 after make"
printf 'one two three\nfour  five\n\n six seven\n' > /tmp/a.txt
printf 'no newline at the end' > /tmp/b.txt
: > /tmp/c.txt
[ "$(./build/wc2 /tmp/a.txt)" = "4 7" ] || fail "a.txt: got '$(./build/wc2 /tmp/a.txt)', expected '4 7'"
[ "$(./build/wc2 /tmp/b.txt)" = "0 5" ] || fail "b.txt: got '$(./build/wc2 /tmp/b.txt)', expected '0 5'"
[ "$(./build/wc2 /tmp/c.txt)" = "0 0" ] || fail "c.txt: got '$(./build/wc2 /tmp/c.txt)', expected '0 0'"
./build/wc2 /nonexistent >/dev/null 2>&1 && fail "a missing file must fail"
grep -q 'count_stream' src/main.c || fail "main.c must use count_stream"
echo 1 > /logs/verifier/reward.txt
echo "all checks passed"
