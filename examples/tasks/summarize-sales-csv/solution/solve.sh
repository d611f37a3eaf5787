#!/bin/sh
set -eu
python3 - <<'PY'
import csv
import json

totals = {}
with open("sales.csv", newline="") as fh:
    for row in csv.DictReader(fh):
        totals[row["region"]] = totals.get(row["region"], 0) + float(row["amount"])
with open("summary.json", "w") as fh:
    json.dump(totals, fh, indent=2)
PY
