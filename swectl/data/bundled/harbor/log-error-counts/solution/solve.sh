#!/bin/bash
set -euo pipefail
cd /app
{ cat logs/access.log logs/access.log.1; zcat logs/access.log.2.gz; } \
  | awk '$(NF-1) >= 500 && $(NF-1) <= 599 { n[$(NF-1)]++ } END { for (c in n) printf "%s %d\n", c, n[c] }' \
  | sort | python3 -c 'import json, sys; print(json.dumps({c: int(n) for c, n in (l.split() for l in sys.stdin)}))' \
  > errors.json
