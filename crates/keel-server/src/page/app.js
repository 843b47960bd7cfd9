// keel serve: the page. Plain JavaScript, no build step, no external resource.
//
// The token: taken once from `?token=` (then removed from the address bar), kept in this tab's
// sessionStorage, sent as `Authorization: Bearer` on every API call; asked for when missing or
// refused. Live timelines read the server-sent event stream with fetch(), because EventSource
// cannot send that header.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const S = {
    token: "",
    runs: [],
    approvals: [],
    questions: [],
    route: { view: "inbox" },
    follow: null,
    inboxKey: null,
    runKey: null,
    detail: null,
    timer: null,
    tools: new Map(),
    showRoutine: true,
  };

  // ---------------------------------------------------------------- helpers

  const $ = (sel, root = document) => root.querySelector(sel);

  function el(tag, attrs, ...kids) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      // Through the CSSOM: the page's content security policy refuses style attributes.
      else if (k === "style") node.style.cssText = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat()) {
      if (kid === undefined || kid === null || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return node;
  }

  const enc = encodeURIComponent;
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const shortId = (id) => (id.length > 16 ? `${id.slice(0, 8)}…${id.slice(-6)}` : id);
  const sid = (s) => (s ? `${s.phase + 1}.${s.index + 1}` : "");
  const cut = (text, n) => {
    const t = String(text ?? "");
    return t.length > n ? `${t.slice(0, n - 1)}…` : t;
  };

  function fmtMs(ms) {
    ms = Math.max(0, Math.round(ms || 0));
    if (ms < 1000) return `${ms} ms`;
    const s = ms / 1000;
    if (s < 60) return `${s.toFixed(1)} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m ${Math.floor(s % 60)}s`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h}h ${m % 60}m`;
    return `${Math.floor(h / 24)}d ${h % 24}h`;
  }

  function fmtAmount(unit, v) {
    if (v === null || v === undefined) return "no limit";
    if (unit === "ms") return fmtMs(v);
    if (unit === "micro_usd") return `$${(v / 1e6).toFixed(2)}`;
    return Number(v).toLocaleString();
  }

  const BUDGET_UNITS = { wall_time: "ms", compute_time: "ms", cost_usd: "micro_usd" };
  const budgetAmount = (name, v) => fmtAmount(BUDGET_UNITS[name] || "count", v);

  function clock(ms) {
    const d = new Date(ms);
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
  }

  function ago(ms) {
    const s = Math.max(0, (Date.now() - ms) / 1000);
    if (s < 60) return "just now";
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    return `${Math.floor(s / 86400)} d ago`;
  }

  function toast(text, bad) {
    const t = el("div", { class: bad ? "toast bad" : "toast", role: "status", text });
    $("#toasts").append(t);
    setTimeout(() => t.remove(), bad ? 9000 : 5000);
  }

  function setConn(ok, text) {
    const c = $("#conn");
    c.className = ok ? "conn ok" : "conn bad";
    c.textContent = text;
  }

  function by() {
    return ($("#by").value || "").trim();
  }

  // ---------------------------------------------------------------- API

  class HttpError extends Error {
    constructor(status, body) {
      super((body && body.error) || `HTTP ${status}`);
      this.status = status;
      this.body = body || {};
    }
  }

  async function api(method, path, body) {
    const opts = { method, headers: { Authorization: `Bearer ${S.token}` } };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const res = await fetch(`/api${path}`, opts);
    let data = null;
    try {
      data = await res.json();
    } catch (_) {
      data = null;
    }
    if (res.status === 401) {
      needToken((data && data.error) || "The token was refused.");
      throw new HttpError(401, data);
    }
    if (!res.ok) throw new HttpError(res.status, data);
    return data;
  }

  // ---------------------------------------------------------------- token

  function takeToken() {
    const url = new URL(location.href);
    const t = url.searchParams.get("token");
    if (t) {
      sessionStorage.setItem("keel.token", t);
      url.searchParams.delete("token");
      history.replaceState(null, "", url.pathname + url.search + url.hash);
    }
    return sessionStorage.getItem("keel.token") || "";
  }

  function needToken(message) {
    stopFollow();
    clearInterval(S.timer);
    S.timer = null;
    sessionStorage.removeItem("keel.token");
    S.token = "";
    setConn(false, "no token");
    const main = $("#main");
    main.replaceChildren($("#token-form").content.cloneNode(true));
    if (message) {
      const e = $("#login-error");
      e.textContent = message;
      e.hidden = false;
    }
    $("#login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      S.token = $("#token").value.trim();
      sessionStorage.setItem("keel.token", S.token);
      S.inboxKey = null;
      S.runKey = null;
      start();
    });
    $("#token").focus();
  }

  // ---------------------------------------------------------------- refresh

  async function refresh() {
    try {
      const [runs, approvals, questions] = await Promise.all([
        api("GET", "/runs"),
        api("GET", "/approvals"),
        api("GET", "/questions"),
      ]);
      S.runs = runs;
      S.approvals = approvals;
      S.questions = questions;
      setConn(true, "connected");
    } catch (e) {
      if (e.status === 401) return;
      setConn(false, "server unreachable: retrying");
      return;
    }
    renderNav();
    renderSidebar();
    if (S.route.view === "inbox") renderInbox();
    else if (S.route.view === "run") await refreshRun();
  }

  function start() {
    if (!S.token) {
      needToken();
      return;
    }
    clearInterval(S.timer);
    S.timer = setInterval(refresh, REFRESH_MS);
    route();
  }

  function route() {
    const m = location.hash.match(/^#\/runs\/([^/]+)/);
    S.route = m ? { view: "run", id: decodeURIComponent(m[1]) } : { view: "inbox" };
    S.inboxKey = null;
    S.runKey = null;
    S.detail = null;
    stopFollow();
    if (S.route.view === "run") showRun(S.route.id);
    else $("#main").replaceChildren(el("p", { class: "muted", text: "Loading…" }));
    refresh();
  }

  // ---------------------------------------------------------------- nav and sidebar

  function renderNav() {
    const n = S.approvals.length + S.questions.length;
    const c = $("#inbox-count");
    c.textContent = String(n);
    c.hidden = n === 0;
    $("#nav-inbox").classList.toggle("active", S.route.view === "inbox");
    document.title = n ? `(${n}) keel` : "keel";
  }

  function waitedMs(run) {
    const live = run.waiting_since_ms ? Math.max(0, Date.now() - run.waiting_since_ms) : 0;
    return (run.human_wait_ms || 0) + live;
  }

  function timeBlock(run, compact) {
    const work = run.working_ms || 0;
    const wait = waitedMs(run);
    const total = Math.max(1, work + wait);
    return el(
      "div",
      { class: "timeblock" },
      el(
        "div",
        { class: "timebar", title: "working vs waiting for people" },
        el("div", { class: "work", style: `width:${(100 * work) / total}%` }),
        el("div", { class: "wait", style: `width:${(100 * wait) / total}%` }),
      ),
      el(
        "div",
        { class: "times" },
        el("span", {}, el("span", { class: "dot work" }), "working ", el("b", { class: "working", text: fmtMs(work) })),
        el(
          "span",
          {},
          el("span", { class: "dot wait" }),
          "waiting for people ",
          el("b", { class: "waiting", text: fmtMs(wait) }),
          run.waiting_since_ms && !compact ? " (waiting now)" : "",
        ),
      ),
    );
  }

  function budgetBar(name, b) {
    if (b.limit === null || b.limit === undefined) {
      return el(
        "div",
        { class: "bar unlimited", title: `${name}: ${fmtAmount(b.unit, b.used)} used, no limit` },
        el("span", { class: "name", text: name.replace(/_/g, " ") }),
        el("span", { class: "value", text: `${fmtAmount(b.unit, b.used)} · no limit` }),
      );
    }
    const frac = b.limit ? Math.min(1, b.used / b.limit) : 0;
    const level = frac >= 0.9 ? " high" : frac >= 0.7 ? " mid" : "";
    return el(
      "div",
      { class: "bar", title: `${name}: ${fmtAmount(b.unit, b.used)} of ${fmtAmount(b.unit, b.limit)}${b.enforced ? "" : " (not enforced yet)"}` },
      el("span", { class: "name", text: name.replace(/_/g, " ") }),
      el("div", { class: "track" }, el("div", { class: `fill${level}`, style: `width:${(100 * frac).toFixed(1)}%` })),
      el("span", { class: "value", text: `${fmtAmount(b.unit, b.used)} / ${fmtAmount(b.unit, b.limit)}` }),
    );
  }

  function limitedBudgets(run) {
    return Object.entries(run.budgets || {})
      .filter(([, b]) => b.limit !== null && b.limit !== undefined)
      .sort(([, a], [, b]) => b.used / b.limit - a.used / a.limit);
  }

  function phaseLabel(run) {
    if (!run.phase) return run.phase_count ? `all ${run.phase_count} phases done` : "";
    return `${run.phase_index + 1}/${run.phase_count} ${run.phase}`;
  }

  function statePill(state, frozen) {
    return [
      el("span", { class: `pill state ${state}`, "data-state": state, text: state.replace(/_/g, " ") }),
      frozen ? el("span", { class: "pill frozen", text: "frozen" }) : null,
    ];
  }

  function renderSidebar() {
    $("#run-count").textContent = S.runs.length ? `(${S.runs.length})` : "";
    const list = $("#run-list");
    if (!S.runs.length) {
      list.replaceChildren(el("li", { class: "empty", text: "No runs yet: start one with keel run." }));
      return;
    }
    const selected = S.route.view === "run" ? S.route.id : null;
    list.replaceChildren(
      ...S.runs.map((run) =>
        el(
          "li",
          { "data-run": run.id, class: selected && run.id.startsWith(selected) ? "selected" : "" },
          el(
            "a",
            { href: `#/runs/${enc(run.id)}`, title: run.id },
            el("div", { class: "run-head" }, statePill(run.state, run.frozen), el("span", { class: "run-id", text: shortId(run.id) })),
            el("div", { class: "run-sub", text: `${phaseLabel(run)} · updated ${ago(run.updated_at_ms)}` }),
            el("div", { class: "run-reason", title: run.reason, text: run.reason }),
            el("div", { class: "bars" }, limitedBudgets(run).slice(0, 3).map(([name, b]) => budgetBar(name, b))),
            timeBlock(run, true),
            run.pending_approvals || run.pending_questions
              ? el("div", { class: "tag", text: `${run.pending_approvals + run.pending_questions} waiting for you` })
              : null,
          ),
        ),
      ),
    );
  }

  // ---------------------------------------------------------------- payload and diff

  function renderPayload(text) {
    const box = el("div", { class: "payload", "data-testid": "payload" });
    const stats = { add: 0, del: 0, files: 0 };
    let inDiff = false;
    let file = null;
    let oldLn = 0;
    let newLn = 0;
    const line = (cls, a, b, code) =>
      el("div", { class: `dl ${cls}` }, el("span", { class: "ln", text: a }), el("span", { class: "ln", text: b }), el("span", { class: "code", text: code }));
    for (const raw of String(text).split("\n")) {
      if (raw.startsWith("diff --git ")) {
        inDiff = true;
        const m = raw.match(/^diff --git a\/(.*) b\/(.*)$/);
        file = { add: 0, del: 0, count: el("span", {}) };
        stats.files += 1;
        box.append(el("div", { class: "diff-file" }, el("span", { class: "path", text: m ? m[2] : raw.slice(11) }), file.count));
        continue;
      }
      if (!inDiff) {
        if (raw === "" && !box.lastChild) continue;
        box.append(el("div", { class: raw.trimStart().startsWith("$ ") ? "prose cmd" : "prose", text: raw || " " }));
        continue;
      }
      if (raw.startsWith("@@")) {
        const m = raw.match(/^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@/);
        if (m) {
          oldLn = Number(m[1]);
          newLn = Number(m[2]);
        }
        box.append(line("hunk", "", "", raw));
      } else if (raw.startsWith("+++ ") || raw.startsWith("--- ")) {
        box.append(line("meta", "", "", raw));
      } else if (raw.startsWith("+")) {
        stats.add += 1;
        if (file) file.add += 1;
        box.append(line("add", "", newLn++, raw));
      } else if (raw.startsWith("-")) {
        stats.del += 1;
        if (file) file.del += 1;
        box.append(line("del", oldLn++, "", raw));
      } else if (raw.startsWith(" ")) {
        box.append(line("ctx", oldLn++, newLn++, raw));
      } else if (/^(index |new file|deleted file|old mode|new mode|similarity|rename |Binary|\\)/.test(raw)) {
        box.append(line("meta", "", "", raw));
      } else {
        // Text after the diff: keel's own words again.
        inDiff = false;
        if (raw !== "") box.append(el("div", { class: "prose", text: raw }));
      }
      if (file) {
        file.count.replaceChildren(el("span", { class: "stat-add", text: `+${file.add}` }), " ", el("span", { class: "stat-del", text: `−${file.del}` }));
      }
    }
    return { box, stats };
  }

  // ---------------------------------------------------------------- approval and question cards

  function approvalCard(a) {
    const { box, stats } = renderPayload(a.payload);
    const reason = el("input", {
      class: "reason",
      type: "text",
      placeholder: "Reason (optional to approve, required to reject)",
      "aria-label": "reason",
    });
    const note = el("span", { class: "note" });
    const approve = el("button", { class: "approve", type: "button", "data-testid": "approve", text: "Approve" });
    const reject = el("button", { class: "reject", type: "button", "data-testid": "reject", text: "Reject…" });
    const card = el(
      "article",
      { class: a.decision ? "card approval decided" : "card approval", "data-testid": "approval", "data-run": a.run, "data-n": a.n },
      el(
        "div",
        { class: "approval-head" },
        el(
          "div",
          { class: "what" },
          el("span", { class: "tag", text: `Approval request #${a.n}` }),
          el("h3", { text: a.intent }),
          el(
            "div",
            { class: "meta" },
            "run ",
            el("a", { href: `#/runs/${enc(a.run)}`, class: "mono", title: a.run, text: shortId(a.run) }),
            a.phase ? ` · phase ${a.phase}` : "",
            ` · requested ${clock(a.created_at_ms)} (${ago(a.created_at_ms)}) · run is `,
            statePill(a.run_state),
          ),
        ),
      ),
      el(
        "div",
        { class: "facts" },
        el("div", { class: "fact risk" }, el("h4", { text: "Risk" }), el("p", {}, el("span", { class: `rev ${a.reversibility}`, text: a.reversibility.replace(/_/g, " ") }), " ", a.risk.startsWith(`${a.reversibility}: `) ? a.risk.slice(a.reversibility.length + 2) : a.risk)),
        el("div", { class: "fact rollback" }, el("h4", { text: "Rollback plan" }), el("p", {}, el("code", { text: a.rollback }))),
        el(
          "div",
          { class: "fact checks-box" },
          el("h4", { text: "Checks so far" }),
          a.checks.length
            ? el(
                "ul",
                { class: "checks" },
                a.checks.map((c) =>
                  el("li", {}, el("span", { class: c.passed ? "ok" : "no", text: c.passed ? "✓ " : "✗ " }), el("b", { text: c.verifier }), ` ${c.status} · evidence #${c.evidence}`),
                ),
              )
            : el("p", { class: "muted", text: "No verifier has run yet." }),
        ),
      ),
      el(
        "div",
        { class: "payload-head" },
        el("h4", { text: "Exact payload" }),
        stats.files ? el("span", {}, el("span", { class: "stat-add", text: `+${stats.add}` }), " ", el("span", { class: "stat-del", text: `−${stats.del}` }), ` in ${stats.files} file${stats.files === 1 ? "" : "s"}`) : el("span", { class: "muted", text: "no change to files so far" }),
        el("span", { class: "hash", title: a.payload_hash, text: `blake3 ${a.payload_hash.slice(0, 16)}…` }),
      ),
      box,
    );
    if (a.decision) {
      const d = a.decision;
      card.append(
        el("div", {
          class: `decided-line ${d.approve ? "approved" : "rejected"}`,
          text: `${d.approve ? "✓ Approved" : "✗ Rejected"} by ${d.by} via ${d.via} at ${clock(d.at_ms)}${d.reason ? `: ${d.reason}` : ""}`,
        }),
      );
      return card;
    }
    const send = async (approveIt) => {
      const why = reason.value.trim();
      if (!approveIt && !why) {
        reason.classList.add("needed");
        note.className = "error";
        note.textContent = "Say why you reject it: the reason goes back to the run and its log.";
        reject.textContent = "Reject";
        reason.focus();
        return;
      }
      approve.disabled = true;
      reject.disabled = true;
      note.className = "note";
      note.textContent = approveIt ? "Approving…" : "Rejecting…";
      try {
        const r = await api("POST", `/runs/${enc(a.run)}/approvals/${a.n}`, {
          decision: approveIt ? "approve" : "reject",
          payload_hash: a.payload_hash,
          reason: why,
          by: by() || undefined,
        });
        toast(r.message);
        note.textContent = approveIt ? "Approved." : "Rejected.";
      } catch (e) {
        note.className = "error";
        note.textContent = e.message;
        if (e.status !== 409) {
          approve.disabled = false;
          reject.disabled = false;
        }
        toast(e.message, true);
      }
      S.inboxKey = null;
      S.runKey = null;
      refresh();
    };
    approve.addEventListener("click", () => send(true));
    reject.addEventListener("click", () => send(false));
    reason.addEventListener("input", () => reason.classList.remove("needed"));
    card.append(el("div", { class: "actions" }, reason, approve, reject, note));
    return card;
  }

  function questionCard(q) {
    const text = el("input", { class: "reason", type: "text", placeholder: "Your answer", "aria-label": "answer" });
    const note = el("span", { class: "note" });
    const send = el("button", { class: "primary", type: "button", text: "Send answer" });
    send.addEventListener("click", async () => {
      if (!text.value.trim()) {
        text.classList.add("needed");
        text.focus();
        return;
      }
      send.disabled = true;
      try {
        const r = await api("POST", `/runs/${enc(q.run)}/questions/${q.n}`, { answer: text.value.trim(), by: by() || undefined });
        toast(r.message);
      } catch (e) {
        note.className = "error";
        note.textContent = e.message;
        send.disabled = false;
      }
      S.inboxKey = null;
      S.runKey = null;
      refresh();
    });
    return el(
      "article",
      { class: "card question", "data-testid": "question" },
      el("span", { class: "tag", text: `Question #${q.n}` }),
      el("div", { class: "meta" }, "run ", el("a", { href: `#/runs/${enc(q.run)}`, class: "mono", title: q.run, text: shortId(q.run) }), ` · asked at step ${q.step}`),
      el("blockquote", { text: q.question }),
      q.answer
        ? el("div", { class: "decided-line approved", text: `Answered by ${q.answer.by}: ${q.answer.text}` })
        : el("div", { class: "actions" }, text, send, note),
    );
  }

  // ---------------------------------------------------------------- inbox

  function renderInbox() {
    const key = JSON.stringify([S.approvals.map((a) => [a.run, a.n, a.payload_hash, a.run_state]), S.questions.map((q) => [q.run, q.n])]);
    if (key === S.inboxKey) return;
    S.inboxKey = key;
    const n = S.approvals.length + S.questions.length;
    $("#main").replaceChildren(
      el(
        "div",
        { class: "page-head" },
        el("h1", { text: "Inbox" }),
        el("p", { text: n ? `${n} waiting for a person, oldest first. A decision applies to the exact payload shown.` : "" }),
      ),
      ...(n ? [] : [el("div", { class: "empty", text: "Nothing is waiting for you. Approval requests and questions from runs appear here as they are made." })]),
      ...S.approvals.map(approvalCard),
      ...S.questions.map(questionCard),
    );
  }

  // ---------------------------------------------------------------- one run

  function showRun(id) {
    const holdReason = el("input", { type: "text", placeholder: "reason for a hold or cancel", "aria-label": "reason" });
    const freezeBtn = el("button", { type: "button", id: "freeze-btn", text: "Freeze" });
    const cancelBtn = el("button", { type: "button", class: "danger", text: "Cancel run" });
    const hold = async (what) => {
      const reason = holdReason.value.trim();
      if (!reason) {
        holdReason.focus();
        toast(`Give a reason to ${what}: it is recorded with who and why.`, true);
        return;
      }
      try {
        await api("POST", `/runs/${enc(S.detail ? S.detail.id : id)}/${what}`, { reason, by: by() || undefined });
        toast(`${what}: done`);
        holdReason.value = "";
      } catch (e) {
        toast(e.message, true);
      }
      S.runKey = null;
      refresh();
    };
    freezeBtn.addEventListener("click", () => hold(S.detail && S.detail.frozen ? "unfreeze" : "freeze"));
    cancelBtn.addEventListener("click", () => hold("cancel"));
    const routine = el("input", { type: "checkbox", checked: S.showRoutine });
    routine.addEventListener("change", () => {
      S.showRoutine = routine.checked;
      for (const li of document.querySelectorAll("#timeline .ev.minor")) li.hidden = !S.showRoutine;
    });
    S.tools = new Map();
    $("#main").replaceChildren(
      el(
        "div",
        { class: "run-layout" },
        el(
          "div",
          { class: "run-main" },
          el(
            "section",
            { class: "card" },
            el("div", { id: "run-title", class: "run-title" }, el("h1", { text: id })),
            el("div", { id: "run-facts" }),
            el("div", { class: "holdbox" }, holdReason, freezeBtn, cancelBtn),
          ),
          el("div", { id: "run-requests" }),
          el(
            "section",
            { class: "card" },
            el(
              "div",
              { class: "timeline-head" },
              el("h4", { text: "Timeline" }),
              el("span", { id: "live", class: "live", text: "connecting…" }),
              el("span", { class: "spacer" }),
              el("label", { class: "meta" }, routine, " routine events"),
            ),
            el("ul", { id: "timeline", class: "timeline", "data-testid": "timeline" }),
          ),
        ),
        el(
          "aside",
          { class: "run-side" },
          el("section", { class: "card" }, el("h4", { text: "Budgets" }), el("div", { id: "run-budgets", class: "bars" })),
          el("section", { class: "card" }, el("h4", { text: "Phases" }), el("div", { id: "run-phases" })),
          el("section", { class: "card" }, el("h4", { text: "Details" }), el("div", { id: "run-details" })),
        ),
      ),
    );
    follow(id);
  }

  async function refreshRun() {
    let run;
    try {
      run = await api("GET", `/runs/${enc(S.route.id)}`);
    } catch (e) {
      if (e.status === 404) $("#main").replaceChildren(el("div", { class: "empty", text: e.message }));
      return;
    }
    if (S.route.view !== "run" || !$("#run-title")) return;
    S.detail = run;
    $("#run-title").replaceChildren(
      el("h1", { title: run.id, text: run.id }),
      ...statePill(run.state, run.frozen).filter(Boolean),
      el("span", { class: "spacer" }),
      el("span", { class: "meta", text: `updated ${ago(run.updated_at_ms)}` }),
    );
    $("#freeze-btn").textContent = run.frozen ? "Unfreeze" : "Freeze";
    // A finished run takes no hold and no cancel.
    $(".holdbox").hidden = run.state === "completed" || run.state === "failed";
    $("#run-facts").replaceChildren(
      el("p", { class: "run-reason-full", id: "run-reason", text: run.reason }),
      el("div", { class: "run-time" }, timeBlock(run)),
    );
    $("#run-details").replaceChildren(
      el(
        "dl",
        { class: "kv" },
        el("dt", { text: "phase" }),
        el("dd", { text: phaseLabel(run) || "—" }),
        el("dt", { text: "contract" }),
        el("dd", { class: "mono", text: run.contract }),
        el("dt", { text: "workspace" }),
        el("dd", { class: "mono", text: run.workspace }),
        el("dt", { text: "started" }),
        el("dd", { text: `${new Date(run.created_at_ms).toLocaleString()} (${ago(run.created_at_ms)})` }),
        el("dt", { text: "evidence" }),
        el(
          "dd",
          {},
          run.evidence.length
            ? run.evidence.map((e) => el("div", { title: `${e.verifier}: ${e.status}, evidence #${e.n}` }, el("span", { class: e.passed ? "mark ok" : "mark no", text: e.passed ? "✓" : "✗" }, ""), `${e.verifier} (${e.status})`))
            : "none yet",
        ),
        el("dt", { text: "log" }),
        el("dd", { text: `${run.events} events · ${run.checkpoints} checkpoints · ${run.model_calls} model calls · ${run.violations} policy violations` }),
      ),
    );
    const budgets = Object.entries(run.budgets).filter(([, b]) => b.limit !== null || b.used > 0);
    $("#run-budgets").replaceChildren(...(budgets.length ? budgets.map(([n, b]) => budgetBar(n, b)) : [el("p", { class: "muted", text: "No budget is set." })]));
    $("#run-phases").replaceChildren(
      el(
        "ul",
        { class: "phases" },
        run.phases.map((p, i) =>
          el(
            "li",
            { class: i === run.phase_index ? "current" : "" },
            el("span", { class: p.verified ? "mark ok" : i === run.phase_index ? "mark now" : "mark", text: p.verified ? "✓" : i === run.phase_index ? "▸" : "·" }),
            `${i + 1}. ${p.name}`,
            p.gated ? el("span", { class: "meta", text: p.approved ? "  · approved" : "  · needs approval" }) : "",
            p.agent ? el("span", { class: "meta", text: "  · agent" }) : "",
            p.steps.length
              ? el(
                  "ul",
                  { class: "steps" },
                  p.earlier_steps ? el("li", { class: "meta", text: `… ${p.earlier_steps} earlier steps, settled` }) : null,
                  p.steps.map((s) => el("li", { title: s.command }, el("span", { class: s.state === "verified" ? "mark ok" : s.state === "failed" ? "mark no" : "mark", text: s.state === "verified" ? "✓" : s.state === "failed" ? "✗" : s.state === "in_progress" ? "▸" : "·" }), s.command)),
                )
              : null,
          ),
        ),
      ),
    );
    const key = JSON.stringify([run.approvals.map((a) => [a.n, a.payload_hash, !!a.decision, a.run_state]), run.questions.map((q) => [q.n, !!q.answer])]);
    if (key !== S.runKey) {
      S.runKey = key;
      const pendingA = run.approvals.filter((a) => !a.decision);
      const pendingQ = run.questions.filter((q) => !q.answer);
      $("#run-requests").replaceChildren(...pendingA.map(approvalCard), ...pendingQ.map(questionCard));
    }
  }

  // ---------------------------------------------------------------- timeline

  function describe(ev) {
    const b = ev.body || {};
    const tool = (step, call) => S.tools.get(`${sid(step)}#${call}`) || "tool";
    switch (ev.kind) {
      case "run_created":
        return { icon: "✦", title: "Run created", text: `${b.contract_file} · ${(b.phases || []).length} phases · workspace ${b.workspace}` };
      case "state_changed": {
        const cls = { completed: "good", failed: "bad", blocked: "bad", awaiting_approval: "human", waiting: "human" }[b.to] || "state";
        return { icon: "→", cls, title: `${b.from.replace(/_/g, " ")} → ${b.to.replace(/_/g, " ")}`, text: b.reason };
      }
      case "resumed":
        return { icon: "↻", cls: "minor", title: "Picked up", text: `by ${b.holder} (lease ${b.lease})${b.checkpoint !== undefined ? `, from checkpoint ${b.checkpoint}` : ""}` };
      case "phase_started":
        return { icon: "▸", title: `Phase ${b.phase + 1}: ${b.name}` };
      case "step_started":
        return { icon: "▶", cls: "minor", title: `Step ${sid(b.step)} started${b.attempt > 1 ? ` (attempt ${b.attempt})` : ""}`, text: b.agent ? "agent step" : `$ ${b.command}` };
      case "model_requested":
        return { icon: "…", cls: "minor", title: `Asked the model (step ${sid(b.step)})`, text: `${b.prompt_tokens} prompt tokens, context limit ${b.context_tokens}` };
      case "model_replied": {
        const calls = ((b.reply && b.reply.calls) || []).map((c) => `${c.name}(${cut(c.arguments, 80)})`);
        const u = b.usage || {};
        return {
          icon: "◆",
          cls: "minor",
          title: `Model replied (step ${sid(b.step)})`,
          text: `${calls.length ? calls.join(", ") : `no tool call: ${cut(b.reply && b.reply.text, 160)}`}\n${u.input_tokens ?? 0} in + ${u.output_tokens ?? 0} out tokens, ${budgetAmount("cost_usd", b.cost_micro_usd || 0)}${(b.retries || []).length ? `, ${b.retries.length} retries` : ""}`,
        };
      }
      case "policy_decision": {
        S.tools.set(`${sid(b.step)}#${b.call}`, b.tool);
        if (b.decision === "deny") return { icon: "⊘", cls: "bad", title: `Policy denied ${b.tool}`, text: `${b.rule}\n${cut(b.arguments, 240)}` };
        if (b.decision === "needs_approval") return { icon: "⚑", cls: "human", title: `${b.tool} needs approval`, text: `${b.rule}\n${cut(b.arguments, 240)}` };
        return { icon: "⚙", title: `Tool call ${b.tool} [${b.reversibility}]`, text: cut(b.arguments, 240) };
      }
      case "tool_call_finished":
        return {
          icon: b.ok ? "✓" : "✗",
          cls: b.ok ? "minor" : "warn",
          title: `${tool(b.step, b.call)} ${b.ok ? "done" : "failed"}`,
          text: `${cut(b.observation, 300)}${(b.changed || []).length ? `\nchanged: ${b.changed.join(", ")}` : ""}`,
        };
      case "plan_updated":
        return { icon: "☰", title: `Plan updated (${(b.items || []).length} items)`, text: (b.items || []).map((x, i) => `${i + 1}. ${x}`).join("\n") };
      case "note_added":
        return { icon: "✎", cls: "minor", title: "Note", text: b.text };
      case "finish_claimed":
        return { icon: "⚑", title: "The driver says the phase is done; the verifiers decide", text: b.summary };
      case "scope_reverted":
        return { icon: "⚠", cls: "warn", title: "Changes outside the scope were undone", text: (b.paths || []).join(", ") };
      case "verification_failed":
        return { icon: "✗", cls: "bad", title: `Verifier ${b.verifier} failed`, text: `evidence #${b.evidence}: back to the driver` };
      case "loop_detected":
        return { icon: "⚠", cls: "bad", title: `Loop detected (${b.pattern})`, text: `rejected path: ${b.rejected_path}` };
      case "approval_requested": {
        const r = b.request || {};
        return { icon: "⚑", cls: "human", title: `Approval #${r.n} requested`, text: `${r.intent}\npayload ${String(r.payload_hash || "").slice(0, 16)}… · ${r.reversibility}` };
      }
      case "approval_decided":
        return b.approve
          ? { icon: "✓", cls: "good", title: `Approval #${b.n} approved by ${b.by}`, text: `via ${b.via}${b.reason ? `: ${b.reason}` : ""}` }
          : { icon: "✗", cls: "bad", title: `Approval #${b.n} rejected by ${b.by}`, text: `via ${b.via}: ${b.reason}` };
      case "question_asked":
        return { icon: "?", cls: "human", title: `Question #${b.n} (step ${sid(b.step)})`, text: b.question };
      case "question_answered":
        return { icon: "✓", cls: "good", title: `Question #${b.n} answered by ${b.by}`, text: `via ${b.via}: ${b.answer}` };
      case "frozen":
        return { icon: "■", cls: "bad", title: `Frozen by ${b.by}`, text: b.reason };
      case "unfrozen":
        return { icon: "▶", cls: "good", title: `Hold lifted by ${b.by}`, text: b.reason };
      case "step_finished":
        return {
          icon: b.success ? "■" : "✗",
          cls: b.success ? "minor" : "warn",
          title: `Step ${sid(b.step)} finished: ${b.status}`,
          text: `${fmtMs(b.duration_ms)} · ${b.files_written} files changed · run diff ${b.diff_files} files, ${b.diff_lines} lines`,
        };
      case "evidence_recorded": {
        const e = b.evidence || {};
        return {
          icon: e.passed ? "✓" : "✗",
          cls: e.passed ? "good" : "bad",
          title: `Verifier ${e.verifier} (${e.tier}) ${e.passed ? "passed" : "FAILED"}`,
          text: `${e.status} in ${fmtMs(e.duration_ms)} · evidence #${e.n} · $ ${e.command}${!e.passed && e.excerpt ? `\n${cut(e.excerpt, 600)}` : ""}`,
        };
      }
      case "step_verified":
        return { icon: "✓", cls: "minor", title: `Step ${sid(b.step)} verified` };
      case "step_failed":
        return { icon: "✗", cls: "bad", title: `Step ${sid(b.step)} failed`, text: `${b.reason}${b.excerpt ? `\n${cut(b.excerpt, 400)}` : ""}` };
      case "step_rolled_back":
        return { icon: "↺", cls: "warn", title: `Step ${sid(b.step)} rolled back`, text: `${(b.restored || []).length} paths restored${b.saved_ref ? `; the interrupted tree is kept at ${b.saved_ref}` : ""}` };
      case "step_invalidated":
        return { icon: "↺", cls: "warn", title: `Step ${sid(b.step)} invalidated`, text: b.reason };
      case "phase_verified":
        return { icon: "✓", cls: "good", title: `Phase ${b.phase + 1} verified` };
      case "checkpoint_taken":
        return { icon: "◉", title: `Checkpoint ${b.n}`, text: `${b.snapshot_ref} · commit ${String(b.commit || "").slice(0, 12)}` };
      case "budget_raised":
        return { icon: "↑", cls: "human", title: `Budget ${b.budget} raised by ${b.by}`, text: `${b.from === null || b.from === undefined ? "unlimited" : budgetAmount(b.budget, b.from)} → ${budgetAmount(b.budget, b.to)}: ${b.reason}` };
      case "drift_detected":
        return { icon: "⚠", cls: "warn", title: "The environment changed since the checkpoint", text: cut(JSON.stringify(b.changes), 400) };
      case "migrated":
        return { icon: "→", cls: "human", title: `Migrated by ${b.by}`, text: b.reason };
      case "tail_cut":
        return { icon: "✂", cls: "warn", title: `A torn last write was cut (from event ${b.seq})`, text: b.reason };
      case "cancelled":
        return { icon: "✗", cls: "bad", title: `Cancelled by ${b.by}`, text: b.reason };
      default:
        return { icon: "·", title: ev.kind, text: cut(JSON.stringify(b), 300) };
    }
  }

  function addEvent(ev) {
    const list = $("#timeline");
    if (!list) return;
    const d = describe(ev);
    const raw = el("details", {}, el("summary", { text: `#${ev.seq} ${ev.kind}` }), el("pre", { text: JSON.stringify(ev.body, null, 2) }));
    const li = el(
      "li",
      { class: `ev ${d.cls || ""}`, "data-kind": ev.kind, "data-seq": ev.seq },
      el("span", { class: "t", title: ev.at, text: clock(ev.at_ms) }),
      el("span", { class: "icon", text: d.icon }),
      el("div", { class: "what" }, el("div", { class: "title", text: d.title }), d.text ? el("div", { class: "text", text: d.text }) : null, raw),
    );
    if ((d.cls || "") === "minor" && !S.showRoutine) li.hidden = true;
    list.append(li);
  }

  function setLive(on, text) {
    const l = $("#live");
    if (!l) return;
    l.className = on ? "live on" : "live";
    l.textContent = text;
  }

  function stopFollow() {
    if (S.follow) S.follow.abort();
    S.follow = null;
  }

  function parseSse(block) {
    const msg = { event: "message", data: [], id: null };
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      let value = i < 0 ? "" : line.slice(i + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") msg.event = value;
      else if (field === "data") msg.data.push(value);
      else if (field === "id") msg.id = value;
    }
    return msg.data.length ? { event: msg.event, data: msg.data.join("\n"), id: msg.id } : null;
  }

  async function follow(id) {
    stopFollow();
    const ctl = new AbortController();
    S.follow = ctl;
    let after = 0;
    while (!ctl.signal.aborted) {
      let ended = null;
      try {
        const res = await fetch(`/api/runs/${enc(id)}/events/stream?after=${after}`, {
          headers: { Authorization: `Bearer ${S.token}` },
          signal: ctl.signal,
        });
        if (res.status === 401) {
          needToken("The token was refused.");
          return;
        }
        if (res.status === 404) {
          setLive(false, "no such run");
          return;
        }
        if (!res.ok) throw new Error(`HTTP ${res.status}`);
        setLive(true, "live");
        const reader = res.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const msg = parseSse(buf.slice(0, i));
            buf = buf.slice(i + 2);
            if (!msg) continue;
            if (msg.event === "end") ended = JSON.parse(msg.data);
            else if (msg.event === "error") setLive(false, JSON.parse(msg.data).error);
            else {
              const ev = JSON.parse(msg.data);
              after = ev.seq;
              addEvent(ev);
            }
          }
        }
      } catch (e) {
        if (ctl.signal.aborted) return;
      }
      if (ended) {
        setLive(false, `run ${ended.state.replace(/_/g, " ")}: the log is complete`);
        return;
      }
      setLive(false, "reconnecting…");
      await sleep(1500);
    }
  }

  // ---------------------------------------------------------------- boot

  window.addEventListener("hashchange", () => {
    if (S.token) route();
  });
  const who = $("#by");
  who.value = localStorage.getItem("keel.by") || "";
  who.addEventListener("change", () => localStorage.setItem("keel.by", who.value.trim()));
  if (!location.hash) history.replaceState(null, "", `${location.pathname}${location.search}#/inbox`);
  S.token = takeToken();
  start();
})();
