#!/usr/bin/env bash
# The keel quickstart, offline and without an API key: copies a small project into a fresh git
# repository under target/quickstart/, runs its contract, and shows what keel recorded.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$root/target/quickstart"

echo "== building keel"
cargo build --quiet --manifest-path "$root/Cargo.toml" -p keel-cli
keel="$root/target/debug/keel"

echo "== a fresh workspace at $work"
rm -rf "$work"
mkdir -p "$work"
cp -R "$here/project/." "$work/"
cd "$work"
printf '.keel/\nout/\n' > .gitignore
git init -q -b main
git add -A
git -c user.name=quickstart -c user.email=quickstart@localhost commit -q -m "quickstart project"

echo "== keel run keel.toml"
set +e
"$keel" run keel.toml | tee "$work.out"
code=${PIPESTATUS[0]}
set -e
id="$(head -n 1 "$work.out" | sed -n 's/^run //p')"
rm -f "$work.out"
if [ -z "$id" ]; then
  exit "$code"
fi

echo
echo "== keel status $id"
"$keel" status "$id"
echo
echo "== keel log $id"
"$keel" log "$id"
echo
echo "== keel checkpoints $id"
"$keel" checkpoints "$id"
echo
echo "== keel verify-log $id"
"$keel" verify-log "$id"
echo
echo "The workspace is $work; try \`cd $work && $keel status --json\`."
exit "$code"
