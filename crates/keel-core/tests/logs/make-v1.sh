#!/bin/sh
# Writes the event-log fixtures of event version 1 (run once, with the keel of that version):
#   sh crates/keel-core/tests/logs/make-v1.sh path/to/keel crates/keel-core/tests/logs/v1
# Each scenario leaves NAME.events.jsonl (the stored rows of the run's log, exactly as keel
# wrote them) and NAME.run.json (the projection keel stored when the run ended). The fixtures
# are never regenerated: a later keel must read them and reach the same state (tests/old_logs.rs),
# or carry an explicit migration with its own test.
set -eu
keel=$(readlink -f "$1")
out=$(mkdir -p "$2" && cd "$2" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -n "${KEEP:-}" ] && trap - EXIT && echo "work: $work"
export GIT_AUTHOR_NAME=keel GIT_AUTHOR_EMAIL=keel@localhost GIT_COMMITTER_NAME=keel GIT_COMMITTER_EMAIL=keel@localhost
unset KEEL_STORE KEEL_CRASH_AT KEEL_FAULT_TRACE

repo() { # NAME: a git repository with a README, a lockfile and .keel ignored
  d="$work/$1"; mkdir -p "$d"; cd "$d"
  git init -q -b main .
  printf 'fixture\n' > README.md; printf '# lock v1\n' > Cargo.lock; printf '.keel/\n' > .gitignore
  git add -A; git commit -q -m init
}
id() { sqlite3 .keel/keel.db "SELECT id FROM runs"; }
dump() { # NAME
  sqlite3 .keel/keel.db "SELECT json_object('seq',seq,'at',at,'v',v,'kind',kind,'body',body,'prev_hash',prev_hash,'hash',hash) FROM events ORDER BY seq" > "$out/$1.events.jsonl"
  sqlite3 .keel/keel.db "SELECT projection FROM runs" > "$out/$1.run.json"
}
decide() { # approve|reject N [reason]: the request's payload hash from `keel approvals --json`
  h=$("$keel" approvals "$(id)" --all --json | python3 -c "import json,sys; print([r for r in json.load(sys.stdin) if r['n']==$2][0]['payload_hash'])")
  "$keel" "$1" "$(id)" "$2" --payload-hash "$h" --reason "${3:-fixture}"
}
st() { "$keel" status "$(id)" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['state'])"; }

# 1. agent: command, agent and gated phases; effects with a key; a tool call that needs approval;
#    a question; a crash and its recovery; a budget raise; drift and a migration.
repo agent
cat > script.jsonl <<'JSON'
{"tool": "plan", "args": {"items": ["read notes", "add two and three", "record the release", "finish"]}}
{"tool": "read", "args": {"path": "notes.txt"}}
{"tool": "ask", "args": {"question": "Which item comes third?"}}
{"calls": [{"tool": "write", "args": {"path": "notes.txt", "content": "one\ntwo\nthree\n"}}, {"tool": "note", "args": {"text": "the third item is three"}}]}
{"tool": "record", "args": {"item": "release-1"}}
{"tool": "finish", "args": {"summary": "notes.txt lists three items; release recorded"}}
JSON
cat > keel.toml <<'TOML'
[task]
goal = "notes.txt lists one, two and three; the release is recorded; shipped.txt exists."

[driver]
kind = "script"
script = "script.jsonl"

[scope]
writable = ["notes.txt", "releases.txt", "shipped.txt"]

[budget]
steps = 5

[approvals]
require = ["irreversible"]

[[verify]]
name = "notes"
tier = "acceptance"
run = "grep -qx three notes.txt"

[[verify]]
name = "listed"
tier = "phase"
run = "test -f notes.txt"

[[phase]]
name = "prepare"
kind = "command"
run = ["printf 'one\\n' > notes.txt"]

[[phase]]
name = "work"
kind = "agent"
objective = "Add two and three to notes.txt and record the release."
tools = ["read", "write", "plan", "note", "ask", "record", "finish"]
done_when = []

[[phase]]
name = "ship"
kind = "command"
approval = true
run = ["printf 'shipped\\n' > shipped.txt"]
done_when = []

[[tool]]
name = "record"
description = "Record a release, with the call's idempotency key."
run = ["sh", "-c", "printf '%s %s\\n' \"$0\" \"$KEY\" >> releases.txt", "{item}"]
parameters = { item = { type = "string" } }
idempotency_key = "env:KEY"
reversibility = "irreversible"
TOML
git add -A; git commit -q -m contract
KEEL_CRASH_AT=12 "$keel" run keel.toml >/dev/null 2>&1 || true
for i in 1 2 3 4 5 6 7 8 9 10; do
  code=0; "$keel" resume "$(id)" >/dev/null 2>&1 || code=$?
  [ "$code" = 0 ] && break
  s=$(st)
  case "$s" in
    waiting) "$keel" answer "$(id)" 1 "three" ;;
    awaiting_approval)
      n=$("$keel" approvals "$(id)" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[0]['n'])")
      decide approve "$n" ;;
    blocked)
      if "$keel" status "$(id)" --json | grep -q "environment changed"; then
        "$keel" resume "$(id)" --migrate --reason "fixture: the lockfile changed on purpose" >/dev/null 2>&1 || true
      else
        printf '# lock v2\n' > Cargo.lock; git commit -qam "lock v2"
        "$keel" unblock "$(id)" --budget steps=+5 --reason "fixture: more steps" >/dev/null 2>&1 || true
      fi ;;
    *) echo "unexpected state $s" >&2; exit 1 ;;
  esac
done
[ "$(st)" = completed ] || { echo "agent: ended $(st)" >&2; exit 1; }
dump agent

# 2. refused: an out-of-scope write undone, a finish claim the verifier refuses, a freeze and
#    an unfreeze, and a cancel.
repo refused
cat > script.jsonl <<'JSON'
{"tool": "write", "args": {"path": "README.md", "content": "changed\n"}}
{"tool": "run", "args": {"command": "printf 'x\\n' > other.txt"}}
{"tool": "finish", "args": {"summary": "done"}}
{"tool": "finish", "args": {"summary": "done"}}
{"tool": "finish", "args": {"summary": "done"}}
JSON
cat > keel.toml <<'TOML'
[task]
goal = "answer.txt says 42."

[driver]
kind = "script"
script = "script.jsonl"

[scope]
writable = ["answer.txt"]

[budget]
same_error = 2

[[verify]]
name = "answer"
tier = "acceptance"
run = "grep -qx 42 answer.txt"

[[phase]]
name = "answer"
kind = "agent"
objective = "Write 42 to answer.txt."
tools = ["write", "run", "finish"]
done_when = []
TOML
git add -A; git commit -q -m contract
"$keel" run keel.toml >/dev/null 2>&1 || true
"$keel" freeze "$(id)" --reason "fixture: incident hold" >/dev/null
"$keel" unfreeze "$(id)" --reason "fixture: hold lifted" >/dev/null
"$keel" cancel "$(id)" --reason "fixture: cancelled" >/dev/null || true  # exit 5: failed
[ "$(st)" = failed ] || { echo "refused: ended $(st)" >&2; exit 1; }
dump refused
# 3. failures: a step that fails once and runs again, a notification for an approval request,
#    and a torn last event cut back on resume.
repo failures
mkdir -p "$work/marks"
cat > keel.toml <<TOML
[task]
goal = "out.txt says ok; shipped.txt exists."

[approvals]
notify = "true"

[[verify]]
name = "ok"
tier = "acceptance"
run = "grep -qx ok out.txt && test -f shipped.txt"

[[phase]]
name = "flaky"
kind = "command"
run = ["if [ -f $work/marks/once ]; then echo ok > out.txt; else touch $work/marks/once; exit 1; fi"]

[[phase]]
name = "ship"
kind = "command"
approval = true
run = ["echo shipped > shipped.txt"]
done_when = []

[sandbox]
writable = ["$work/marks"]
TOML
git add -A; git commit -q -m contract
"$keel" run keel.toml >/dev/null 2>&1 || true
decide approve 1
"$keel" resume "$(id)" >/dev/null 2>&1 || true
[ "$(st)" = completed ] || { echo "failures: ended $(st)" >&2; exit 1; }
# A torn last write: the completion event's body cut short; resume cuts it and completes again.
sqlite3 .keel/keel.db "UPDATE events SET body = substr(body, 1, 20) WHERE seq = (SELECT max(seq) FROM events)"
"$keel" resume "$(id)" >/dev/null 2>&1 || true
[ "$(st)" = completed ] || { echo "failures: after the cut, ended $(st)" >&2; exit 1; }
dump failures
echo "wrote $(ls "$out" | wc -l) files to $out"
