#!/bin/bash
set -euo pipefail
cd /app
# the link recipe is indented with spaces, not a tab; main.c misses a semicolon
sed -i 's/^    /\t/' Makefile
sed -i 's/struct counts c = count_stream(f)$/struct counts c = count_stream(f);/' src/main.c
make clean >/dev/null && make >/dev/null && make clean >/dev/null
