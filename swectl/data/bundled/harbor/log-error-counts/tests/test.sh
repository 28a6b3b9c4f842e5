#!/bin/bash
# The expected counts and the logs' hashes are fixed here (the agent never sees tests/).
mkdir -p /logs/verifier
cd /app/logs && sha256sum -c --quiet <<'SUMS' || { echo "the logs were changed"; echo 0 > /logs/verifier/reward.txt; exit 0; }
f4e14e4a26d44cdb86c38d148e67253903f367e1ff02ca8571e14e3290ab4ed1  access.log
424f46150f01098841971c5c38cf9df46f1c83180b2443bc652531a0fc3cafac  access.log.1
cabda3c799f6087cf50f51ef470da56ae96e98e74172900f7a02989d975d235c  access.log.2.gz
SUMS
python3 - <<'PY'
import json, sys
expected = {"500": 24, "502": 17, "503": 13, "504": 12}
try:
    got = json.load(open("/app/errors.json"))
except (OSError, ValueError) as exc:
    print(f"/app/errors.json: {exc}"); got = None
ok = got == expected
print("errors.json", "matches" if ok else f"is {got!r}, expected {expected!r}")
open("/logs/verifier/reward.txt", "w").write("1\n" if ok else "0\n")
PY
