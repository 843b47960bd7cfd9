#!/usr/bin/env bash
# Compares two builds of keel-bench the way docs/performance.md's "How far these moved" does:
# runs of the two alternating (A B, B A, A B, ...), each in a fresh directory at the file
# system's top as TMPDIR (removed after it), then each build's figures side by side.
#
#   scripts/bench-pairs.sh DIR_A DIR_B PAIRS [keel-bench options...]
#
# DIR_A and DIR_B each hold a `keel-bench` and the `keel-sandbox-helper` of the same build
# (copy both from target/release/ after `cargo build --release -p keel-cli -p keel-bench`).
# The options go to every run; the default is `--only concurrent`. Each run's report is kept in
# $BENCH_PAIRS_OUT (default: a new directory under /tmp) as A-1.json, B-1.json, ...
# The fresh directories are made under $BENCH_PAIRS_ROOT (default: /), which must be writable.
# Needs python3 for the summary.
set -euo pipefail

if [ "$#" -lt 3 ]; then
    echo "usage: $0 DIR_A DIR_B PAIRS [keel-bench options...]" >&2
    exit 2
fi
for dir in "$1" "$2"; do
    if [ ! -d "$dir" ]; then
        echo "$0: $dir is not a directory: give two directories, each with a build's keel-bench and keel-sandbox-helper" >&2
        exit 2
    fi
done
a="$(cd "$1" && pwd)"
b="$(cd "$2" && pwd)"
pairs="$3"
shift 3
for dir in "$a" "$b"; do
    for bin in keel-bench keel-sandbox-helper; do
        if [ ! -x "$dir/$bin" ]; then
            echo "$0: $dir/$bin is missing or not executable: copy it from the build's target/release/" >&2
            exit 2
        fi
    done
done
case "$pairs" in
    '' | *[!0-9]* | 0)
        echo "$0: PAIRS must be a whole number above 0, not '$pairs'" >&2
        exit 2
        ;;
esac
if [ "$#" -eq 0 ]; then
    set -- --only concurrent
fi
root="${BENCH_PAIRS_ROOT:-/}"
out="${BENCH_PAIRS_OUT:-$(mktemp -d /tmp/bench-pairs.XXXXXX)}"
mkdir -p "$out"

run() {
    local which="$1" dir="$2" n="$3"
    shift 3
    local tmp
    tmp="$(mktemp -d "${root%/}/bench-pairs-$which-$n.XXXXXX")"
    if ! TMPDIR="$tmp" "$dir/keel-bench" --json "$@" >"$out/$which-$n.json" 2>"$out/$which-$n.err"; then
        rm -rf "$tmp"
        echo "$0: run $which-$n failed; see $out/$which-$n.err" >&2
        exit 1
    fi
    rm -rf "$tmp"
}

for n in $(seq 1 "$pairs"); do
    # The order switches at each pair, so that neither build always runs on a rested machine.
    if [ $((n % 2)) -eq 1 ]; then
        run A "$a" "$n" "$@"
        run B "$b" "$n" "$@"
    else
        run B "$b" "$n" "$@"
        run A "$a" "$n" "$@"
    fi
done

python3 - "$out" "$pairs" <<'PY'
import json, statistics, sys

out, pairs = sys.argv[1], int(sys.argv[2])

def figures(report):
    got = {}
    c = report.get("concurrent_runs")
    if c:
        got["1,000 runs, % of allowed"] = 100 * c["ratio"]
        got["keel's CPU a step, ms"] = c["cpu_ms_per_step"]["process"]
        got["children's CPU a step, ms"] = c["cpu_ms_per_step"]["children"]
    s = report.get("step_overhead_us")
    if s:
        got["no-op step, floors"] = s["ratio_to_floor"]
        got["no-op step, µs"] = s["value"]["median"]
    p = report.get("cpu_us_per_step")
    if p:
        got["no-op step's CPU, µs"] = p["value"]["process"]
    return got

runs = {w: [figures(json.load(open(f"{out}/{w}-{n}.json"))) for n in range(1, pairs + 1)] for w in "AB"}
for name in runs["A"][0]:
    print(name)
    for w in "AB":
        values = [r[name] for r in runs[w]]
        shown = ", ".join(f"{v:.3f}" if v < 10 else f"{v:.1f}" for v in values)
        print(f"  {w}: {shown}  (mean {statistics.mean(values):.3f})")
    ahead = sum(1 for x, y in zip(runs["A"], runs["B"]) if y[name] > x[name])
    print(f"  B above A in {ahead} of {pairs} pairs")
print(f"reports: {out}")
PY
