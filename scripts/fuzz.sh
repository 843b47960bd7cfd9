#!/usr/bin/env bash
# Runs keel's coverage-guided fuzz targets (fuzz/, libFuzzer through libfuzzer-sys) on stable
# Rust, each for a bounded time, and fails if any input broke a target's oracle.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS (default 60) is each target's time; the targets default to all of them: contract,
# event_body, log_row, mcp, llm_reply, drivers, api. Each starts from the seeds in the repository
# (the contracts of crates/keel-core/tests/contracts/, the event bodies of the old-log fixtures,
# fuzz/seeds/<target>/) and from what earlier runs found, kept in fuzz/corpus/<target>/ (not
# committed). The `api` target makes a git workspace and a store for its run in a temporary
# directory, removed when the script ends. An input that broke a target is written to fuzz/artifacts/<target>/ and the
# script says how to replay it; make it a regression test named after what it found.
#
# The targets are built with SanitizerCoverage (the `-C passes=sancov-module` flags cargo fuzz
# uses, which stable rustc takes) but without AddressSanitizer, which needs nightly: what is
# looked for is a panic, a hang, an abort or garbage accepted. Of keel's few unsafe blocks (the
# store's VFS, the sandbox, keel-git's spawn) only the `api` target reaches any: the store's VFS
# and, when its run is made, keel-git's spawn. With a nightly toolchain and cargo-fuzz,
# `cd fuzz && cargo fuzz run TARGET` works too.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: SECONDS must be a whole number of seconds above 0, not '$seconds'" >&2
    exit 2
fi
shift || true
all=(contract event_body log_row mcp llm_reply drivers api)
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
    targets=("${all[@]}")
fi
for t in "${targets[@]}"; do
    if [[ ! " ${all[*]} " =~ \ $t\  ]]; then
        echo "$0: no fuzz target '$t'; the targets are: ${all[*]}" >&2
        exit 2
    fi
done

host="$(rustc -vV | sed -n 's/^host: //p')"
# Only the target's code is instrumented: with --target, RUSTFLAGS skip build scripts and
# proc macros, which could not link the coverage callbacks.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
cargo build --release --locked --manifest-path fuzz/Cargo.toml --target "$host" \
    $(printf -- '--bin %s ' "${targets[@]}")
bin="fuzz/target/$host/release"

seeds_of() {
    case "$1" in
        contract) echo crates/keel-core/tests/contracts/good crates/keel-core/tests/contracts/bad ;;
        mcp | llm_reply | api) echo "fuzz/seeds/$1" ;;
        drivers) echo fuzz/seeds/drivers fuzz/seeds/llm_reply ;;
        *) ;;
    esac
}

# What a target makes outside the tree (the `api` target's workspace) goes here, and goes.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch"

failed=()
for t in "${targets[@]}"; do
    corpus="fuzz/corpus/$t"
    artifacts="fuzz/artifacts/$t"
    mkdir -p "$corpus" "$artifacts"
    if [ "$t" = event_body ]; then
        # Every body of the old-log fixtures, one file each (the fixtures are JSON lines whose
        # `body` is the stored text).
        python3 - "$corpus" crates/keel-core/tests/logs/v1/*.events.jsonl <<'PY'
import hashlib, json, os, sys
out = sys.argv[1]
for path in sys.argv[2:]:
    for line in open(path, encoding="utf-8"):
        body = json.loads(line)["body"].encode()
        with open(os.path.join(out, hashlib.sha1(body).hexdigest()), "wb") as f:
            f.write(body)
PY
    fi
    echo "== fuzz target $t: ${seconds}s"
    # shellcheck disable=SC2046
    if ! "$bin/$t" "$corpus" $(seeds_of "$t") -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts/" \
        2> "fuzz/artifacts/$t.log"; then
        tail -40 "fuzz/artifacts/$t.log" >&2
        failed+=("$t")
        echo "fuzz target $t failed: the input is in $artifacts/; replay it with $bin/$t FILE" >&2
    else
        grep -E '^stat::(number_of_executed_units|new_units_added)|^Done ' "fuzz/artifacts/$t.log" || true
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzzing failed in: ${failed[*]}" >&2
    exit 1
fi
echo "fuzzing: ${targets[*]}: ${seconds}s each, nothing broke"
