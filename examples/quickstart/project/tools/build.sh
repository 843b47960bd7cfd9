#!/bin/sh
# Builds out/report.txt from the notes in data/: one line per note, sorted, with a count.
set -eu
mkdir -p out
sort data/*.txt > out/notes.sorted
count=$(wc -l < out/notes.sorted | tr -d ' ')
{
  echo "report: $count notes"
  cat out/notes.sorted
} > out/report.txt
