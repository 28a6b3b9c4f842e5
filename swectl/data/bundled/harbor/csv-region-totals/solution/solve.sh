#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import csv
totals = {}
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        region = row["region"].strip().lower()
        totals[region] = totals.get(region, 0.0) + float(row["amount"].replace(",", ""))
with open("totals.csv", "w") as out:
    out.write("region,total\n")
    for region, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        out.write(f"{region},{total:.2f}\n")
PY
