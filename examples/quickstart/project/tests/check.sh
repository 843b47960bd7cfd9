#!/bin/sh
# Acceptance: the report exists, counts every note, and lists them sorted.
set -eu
test -f out/report.txt || { echo "out/report.txt is missing"; exit 1; }
expected=$(cat data/*.txt | wc -l | tr -d ' ')
head -n 1 out/report.txt | grep -qx "report: $expected notes" || {
  echo "the first line should be 'report: $expected notes', it is '$(head -n 1 out/report.txt)'"; exit 1; }
tail -n +2 out/report.txt | sort -c || { echo "notes are not sorted"; exit 1; }
echo "report ok: $expected notes"
