#!/bin/bash
# The expected totals and the input's hash are fixed here (the agent never sees tests/): editing sales.csv
# to make the sums easy scores 0.
mkdir -p /logs/verifier
expected='region,total
north,19231.33
east,18649.84
south,16553.94
west,10511.65'
ok=1
echo "effbe97e7e1677a9aea349816fafb2d5f8da5d7d6a35773aa749ffc891bc8435  /app/sales.csv" | sha256sum -c --quiet || { echo "sales.csv was changed"; ok=0; }
if [ ! -f /app/totals.csv ]; then echo "no /app/totals.csv"; ok=0
elif [ "$(sed -e 's/\r$//' /app/totals.csv | sed -e '${/^$/d}')" != "$expected" ]; then
    echo "totals.csv differs from the expected:"; diff <(echo "$expected") /app/totals.csv; ok=0
fi
echo $ok > /logs/verifier/reward.txt
echo "reward $ok"
