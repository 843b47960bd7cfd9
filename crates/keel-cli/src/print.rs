//! What `keel` prints: short lines for people, stable JSON for programs.

use std::io::{self, Write};

use keel_core::budget::BudgetName;
use keel_core::event::EventBody;
use keel_core::run::Run;
use keel_store::{CheckpointRow, StoredEvent};
use serde_json::{Value, json};

pub fn json(out: &mut dyn Write, value: &Value) -> anyhow::Result<()> {
    writeln!(out, "{}", serde_json::to_string_pretty(value)?)?;
    Ok(())
}

pub fn shorten(text: &str, max: usize) -> String {
    let one_line = text.replace('\n', " ⏎ ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

use keel_core::time::rfc3339 as time;

fn phase_label(run: &Run) -> String {
    match run.phases.get(run.cursor as usize) {
        Some(p) => format!("{}/{} {}", run.cursor + 1, run.phases.len(), p.name),
        None => format!("all {} done", run.phases.len()),
    }
}

/// The stable JSON shape of a run (`keel status --json`).
pub fn run_json(run: &Run, checkpoints: usize) -> Value {
    let budgets: serde_json::Map<String, Value> = BudgetName::ALL
        .iter()
        .map(|b| {
            (
                b.as_str().to_string(),
                json!({
                    "used": run.used(*b),
                    "limit": run.limits.get(*b),
                    "unit": match b.unit() {
                        keel_core::budget::Unit::Count => "count",
                        keel_core::budget::Unit::Millis => "ms",
                        keel_core::budget::Unit::MicroUsd => "micro_usd",
                    },
                    "enforced": b.enforced(),
                }),
            )
        })
        .collect();
    json!({
        "id": run.id,
        "state": run.state.as_str(),
        "reason": run.reason,
        "block": run.block,
        "phase": run.phases.get(run.cursor as usize).map(|p| p.name.clone()),
        "phase_index": run.cursor,
        "phases": run.phases.iter().map(|p| json!({
            "name": p.name,
            "verified": p.verified,
            "earlier_steps": p.earlier,
            "steps": p.steps.iter().map(|s| json!({
                "command": s.command,
                "state": s.state.as_str(),
                "attempts": s.attempts,
                "output": s.output,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "budgets": budgets,
        "evidence": run.evidence.values().collect::<Vec<_>>(),
        "checkpoints": checkpoints,
        "plan": run.plan,
        "plan_version": run.plan_version,
        "notes": run.notes,
        "rejected_paths": run.rejected_paths,
        "model_calls": run.model_calls,
        "working_ms": run.used(BudgetName::WallTime),
        "human_wait_ms": run.human_wait_ms,
        "approvals": run.approvals.iter().map(|a| approval_json(run, a)).collect::<Vec<_>>(),
        "questions": run.questions,
        "frozen": run.frozen,
        "violations": run.violations,
        "contract": run.contract_file,
        "contract_hash": run.contract_hash,
        "workspace": run.workspace,
        "created_at": time(run.created_at_ms),
        "updated_at": time(run.updated_at_ms),
        "events": run.seq,
    })
}

pub fn run_list(out: &mut dyn Write, runs: &[Run]) -> io::Result<()> {
    if runs.is_empty() {
        writeln!(out, "no runs yet: start one with `keel run CONTRACT`")?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<32}  {:<17}  {:<16}  {:<20}  reason",
        "id", "state", "phase", "updated"
    )?;
    for run in runs {
        writeln!(
            out,
            "{:<32}  {:<17}  {:<16}  {:<20}  {}",
            run.id,
            run.state.as_str(),
            shorten(&phase_label(run), 16),
            time(run.updated_at_ms),
            shorten(&run.reason, 60)
        )?;
    }
    Ok(())
}

pub fn run_status(out: &mut dyn Write, run: &Run, checkpoints: &[CheckpointRow]) -> io::Result<()> {
    writeln!(out, "run        {}", run.id)?;
    writeln!(out, "state      {}", run.state)?;
    writeln!(out, "reason     {}", run.reason)?;
    writeln!(
        out,
        "contract   {} ({})",
        run.contract_file,
        &run.contract_hash[..12.min(run.contract_hash.len())]
    )?;
    writeln!(out, "workspace  {}", run.workspace)?;
    writeln!(out, "phase      {}", phase_label(run))?;
    for (i, phase) in run.phases.iter().enumerate() {
        let mark = if phase.verified { "verified" } else { "" };
        writeln!(out, "  {} {} {mark}", i + 1, phase.name)?;
        if phase.earlier > 0 {
            writeln!(
                out,
                "    … {} earlier steps, settled (`keel log` has each)",
                phase.earlier
            )?;
        }
        for (j, s) in phase.held_steps() {
            let attempts = if s.attempts > 1 {
                format!(" ({} attempts)", s.attempts)
            } else {
                String::new()
            };
            writeln!(
                out,
                "    {}.{} {:<11} {}{attempts}",
                i + 1,
                j + 1,
                s.state.as_str(),
                shorten(&s.command, 60)
            )?;
        }
    }
    writeln!(out, "budgets    used / limit")?;
    for b in BudgetName::ALL {
        let limit = run.limits.get(b);
        let used = run.used(b);
        if limit.is_none() && used == 0 {
            continue;
        }
        let limit = limit.map_or("unlimited".to_string(), |l| b.format_amount(l));
        let note = if b.enforced() {
            ""
        } else {
            "  (not enforced yet)"
        };
        writeln!(
            out,
            "  {:<18} {} / {limit}{note}",
            b.as_str(),
            b.format_amount(used)
        )?;
    }
    writeln!(
        out,
        "time       {} working, {} waiting for people",
        BudgetName::WallTime.format_amount(run.used(BudgetName::WallTime)),
        BudgetName::WallTime.format_amount(run.human_wait_ms)
    )?;
    if run.model_calls > 0 || run.violations > 0 {
        writeln!(
            out,
            "driver     {} model calls, {} tokens, {}, {} policy violations",
            run.model_calls,
            run.used(BudgetName::Tokens),
            BudgetName::CostUsd.format_amount(run.used(BudgetName::CostUsd)),
            run.violations
        )?;
    }
    if !run.plan.is_empty() {
        writeln!(out, "plan       (version {})", run.plan_version)?;
        for (i, item) in run.plan.iter().enumerate() {
            writeln!(out, "  {}. {}", i + 1, shorten(item, 90))?;
        }
    }
    for q in &run.questions {
        match &q.answer {
            Some(a) => writeln!(
                out,
                "question   #{} {} → {} ({})",
                q.n,
                shorten(&q.question, 60),
                shorten(&a.text, 60),
                a.by
            )?,
            None => writeln!(
                out,
                "question   #{} {} (waiting for an answer)",
                q.n,
                shorten(&q.question, 80)
            )?,
        }
    }
    if run.frozen {
        writeln!(out, "frozen     yes: nothing runs until `keel unfreeze`")?;
    }
    if !run.rejected_paths.is_empty() {
        writeln!(out, "rejected paths")?;
        for r in &run.rejected_paths {
            writeln!(out, "  - {}", shorten(r, 100))?;
        }
    }
    if !run.evidence.is_empty() {
        writeln!(out, "evidence")?;
        for e in run.evidence.values() {
            writeln!(
                out,
                "  #{:<3} {:<12} {:<10} {} {}",
                e.n,
                e.verifier,
                e.tier.to_string(),
                if e.passed { "passed" } else { "FAILED" },
                e.status
            )?;
        }
    }
    match checkpoints.last() {
        Some(c) => writeln!(
            out,
            "checkpoints {} (newest: {} at event {}, {})",
            checkpoints.len(),
            c.snapshot_ref,
            c.seq,
            time(c.at_ms)
        )?,
        None => writeln!(out, "checkpoints none")?,
    }
    Ok(())
}

pub fn event_json(e: &StoredEvent) -> Value {
    let body: Value = serde_json::from_str(&e.body).unwrap_or(Value::String(e.body.clone()));
    json!({
        "seq": e.seq,
        "at": time(e.at_ms),
        "at_ms": e.at_ms,
        "kind": e.kind,
        "body": body,
        "prev_hash": e.prev_hash,
        "hash": e.hash,
    })
}

pub fn timeline(out: &mut dyn Write, events: &[StoredEvent]) -> io::Result<()> {
    let start = events.first().map(|e| e.at_ms).unwrap_or(0);
    for e in events {
        let offset = (e.at_ms - start).max(0) as f64 / 1000.0;
        let summary = match e.decode() {
            Ok(ev) => summarise(&ev.body),
            Err(err) => format!("(undecodable: {err})"),
        };
        writeln!(
            out,
            "{:>5} {:>8.1}s  {:<18} {}",
            e.seq, offset, e.kind, summary
        )?;
    }
    Ok(())
}

fn summarise(body: &EventBody) -> String {
    match body {
        EventBody::RunCreated {
            contract_file,
            phases,
            ..
        } => format!("{} ({} phases)", contract_file, phases.len()),
        EventBody::StateChanged {
            from, to, reason, ..
        } => {
            format!("{from} -> {to}: {}", shorten(reason, 100))
        }
        EventBody::Resumed {
            holder,
            lease,
            checkpoint,
        } => match checkpoint {
            Some(n) => format!("by {holder} (lease {lease}) from checkpoint {n}"),
            None => format!("by {holder} (lease {lease})"),
        },
        EventBody::PhaseStarted { phase, name } => format!("{} {name}", phase + 1),
        EventBody::StepStarted {
            step,
            attempt,
            command,
            ..
        } => format!("{step} attempt {attempt}: {}", shorten(command, 80)),
        EventBody::ModelRequested {
            step,
            prompt_tokens,
            context_tokens,
            ..
        } => format!("{step} prompt of {prompt_tokens} tokens (limit {context_tokens})"),
        EventBody::ModelReplied {
            step,
            reply,
            usage,
            cost_micro_usd,
            retries,
            ..
        } => {
            let calls: Vec<String> = reply
                .calls
                .iter()
                .map(|c| format!("{}({})", c.name, shorten(&c.arguments, 60)))
                .collect();
            let retried = if retries.is_empty() {
                String::new()
            } else {
                format!(", {} retries ({})", retries.len(), retries.join("; "))
            };
            format!(
                "{step} {} in + {} out tokens, {}{retried}: {}",
                usage.input_tokens,
                usage.output_tokens,
                BudgetName::CostUsd.format_amount(*cost_micro_usd),
                if calls.is_empty() {
                    format!(
                        "no tool call: {}",
                        shorten(reply.text.as_deref().unwrap_or(""), 80)
                    )
                } else {
                    calls.join(", ")
                }
            )
        }
        EventBody::PolicyDecision {
            step,
            call,
            tool,
            decision,
            rule,
            reversibility,
            ..
        } => format!(
            "{step}#{call} {tool} [{reversibility}] {}: {}",
            decision.as_str().to_uppercase(),
            shorten(rule, 100)
        ),
        EventBody::ToolCallFinished {
            step,
            call,
            ok,
            observation,
            changed,
            ..
        } => format!(
            "{step}#{call} {}{}: {}",
            if *ok { "ok" } else { "FAILED" },
            if changed.is_empty() {
                String::new()
            } else {
                format!(" (changed {})", changed.join(", "))
            },
            shorten(observation, 90)
        ),
        EventBody::EffectIntended {
            step,
            call,
            key,
            tool,
            class,
            keyed,
            payload,
            ..
        } => format!(
            "{step}#{call} {tool} [{class}{}] key {key}: {}",
            if *keyed { ", keyed" } else { "" },
            shorten(payload.lines().next().unwrap_or(""), 80)
        ),
        EventBody::EffectSettled {
            step,
            call,
            key,
            status,
            detail,
        } => format!(
            "{step}#{call} key {key} {}: {}",
            status.as_str().to_uppercase(),
            shorten(detail, 80)
        ),
        EventBody::PlanUpdated { items, .. } => format!("{} items", items.len()),
        EventBody::NoteAdded { text, .. } => shorten(text, 100),
        EventBody::FinishClaimed { step, summary } => format!("{step}: {}", shorten(summary, 100)),
        EventBody::ScopeReverted { step, paths, .. } => {
            format!("{step}: undone outside the scope: {}", paths.join(", "))
        }
        EventBody::VerificationFailed {
            verifier, evidence, ..
        } => format!("{verifier} failed (evidence #{evidence}): back to the driver"),
        EventBody::LoopDetected {
            pattern,
            rejected_path,
            ..
        } => format!("{pattern}: rejected path: {}", shorten(rejected_path, 100)),
        EventBody::QuestionAsked { n, step, question } => {
            format!("#{n} at {step}: {}", shorten(question, 100))
        }
        EventBody::QuestionAnswered { n, answer, by, via } => {
            format!("#{n} by {by} via {via}: {}", shorten(answer, 100))
        }
        EventBody::Notified { what, status, ok } => format!(
            "{what}: notify command {}{status}",
            if *ok { "" } else { "FAILED, " }
        ),
        EventBody::Frozen { reason, by } => format!("by {by}: {reason}"),
        EventBody::Unfrozen { reason, by } => format!("by {by}: {reason}"),
        EventBody::ApprovalRequested { request } => format!(
            "#{} {} (payload {})",
            request.n,
            shorten(&request.intent, 90),
            &request.payload_hash[..12]
        ),
        EventBody::ApprovalDecided {
            n,
            approve,
            by,
            reason,
            via,
            ..
        } => format!(
            "#{n} {} by {by} via {via}: {}",
            if *approve { "APPROVED" } else { "REJECTED" },
            shorten(reason, 90)
        ),
        EventBody::StepFinished {
            step,
            status,
            duration_ms,
            files_written,
            ..
        } => format!("{step} {status} in {duration_ms}ms, {files_written} files changed"),
        EventBody::EvidenceRecorded { evidence: e } => format!(
            "#{} {} ({}) {} {}",
            e.n,
            e.verifier,
            e.tier,
            if e.passed { "passed" } else { "FAILED" },
            e.status
        ),
        EventBody::StepVerified { step } => format!("{step}"),
        EventBody::StepFailed {
            step,
            reason,
            excerpt,
            ..
        } => {
            format!("{step}: {reason}: {}", shorten(excerpt, 80))
        }
        EventBody::StepRolledBack {
            step,
            restored,
            saved_ref,
        } => format!(
            "{step}: {} paths restored{}",
            restored.len(),
            saved_ref
                .as_ref()
                .map(|r| format!(", interrupted tree kept at {r}"))
                .unwrap_or_default()
        ),
        EventBody::StepInvalidated { step, reason } => format!("{step}: {reason}"),
        EventBody::PhaseVerified { phase } => format!("{}", phase + 1),
        EventBody::CheckpointTaken {
            n, snapshot_ref, ..
        } => format!("{n} at {snapshot_ref}"),
        EventBody::BudgetRaised {
            budget,
            from,
            to,
            reason,
            by,
        } => format!(
            "{budget} {} -> {} by {by}: {reason}",
            from.map_or("unlimited".into(), |f| budget.format_amount(f)),
            budget.format_amount(*to)
        ),
        EventBody::DriftDetected { changes } => keel_engine::describe_changes(changes),
        EventBody::Migrated {
            changes,
            reason,
            by,
            ..
        } => format!(
            "by {by}: {reason} ({})",
            keel_engine::describe_changes(changes)
        ),
        EventBody::TailCut { seq, reason } => format!("from event {seq}: {reason}"),
        EventBody::Cancelled { reason, by } => format!("by {by}: {reason}"),
    }
}

pub fn checkpoint_json(run: &str, row: &CheckpointRow) -> Value {
    let ck = row.decode(run).ok();
    json!({
        "n": row.n,
        "seq": row.seq,
        "at": time(row.at_ms),
        "hash": row.hash,
        "snapshot_ref": row.snapshot_ref,
        "commit": row.commit,
        "phase_index": ck.as_ref().map(|c| c.phase_cursor),
        "fingerprint": ck.as_ref().map(|c| &c.fingerprint),
        "artifacts": ck.as_ref().map(|c| c.artifacts.len()),
    })
}

pub fn effects(
    out: &mut dyn Write,
    run: &str,
    effects: &[keel_core::effect::Effect],
) -> io::Result<()> {
    if effects.is_empty() {
        writeln!(out, "run {run} has no external effects")?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<37}  {:<7}  {:<16}  {:<13}  {:<11}  what",
        "key", "call", "tool", "class", "status"
    )?;
    for e in effects {
        writeln!(
            out,
            "{:<37}  {:<7}  {:<16}  {:<13}  {:<11}  {}{}",
            e.key,
            format!("{}#{}", e.step, e.call),
            shorten(&e.tool, 16),
            format!("{}{}", e.class, if e.keyed { "+key" } else { "" }),
            e.status.as_str(),
            shorten(e.payload.lines().next().unwrap_or(""), 60),
            match &e.compensation {
                Some(c) => format!("\n{:>41}compensation: {}", "", shorten(c, 80)),
                None => String::new(),
            }
        )?;
    }
    let unknown = effects
        .iter()
        .filter(|e| e.status == keel_core::event::EffectStatus::Unknown)
        .count();
    if unknown > 0 {
        writeln!(
            out,
            "{unknown} effect(s) with an unknown outcome: check them, then decide the \
             reconciliation request (`keel approvals {run}`)"
        )?;
    }
    Ok(())
}

pub fn checkpoints(out: &mut dyn Write, run: &str, rows: &[CheckpointRow]) -> io::Result<()> {
    if rows.is_empty() {
        writeln!(out, "run {run} has no checkpoints yet")?;
        return Ok(());
    }
    writeln!(
        out,
        "{:>3}  {:>6}  {:<20}  {:<12}  snapshot",
        "n", "event", "at", "commit"
    )?;
    for row in rows {
        writeln!(
            out,
            "{:>3}  {:>6}  {:<20}  {:<12}  {}",
            row.n,
            row.seq,
            time(row.at_ms),
            &row.commit[..12.min(row.commit.len())],
            row.snapshot_ref
        )?;
    }
    Ok(())
}

/// The stable JSON shape of an approval request (`keel approvals --json`).
pub fn approval_json(run: &Run, a: &keel_core::run::Approval) -> Value {
    json!({
        "run": run.id,
        "n": a.request.n,
        "gate": a.request.gate,
        "intent": a.request.intent,
        "payload": a.request.payload,
        "payload_hash": a.request.payload_hash,
        "checks": a.request.checks,
        "risk": a.request.risk,
        "reversibility": a.request.reversibility,
        "rollback": a.request.rollback,
        "created_at": time(a.request.created_at_ms),
        "expires_at": a.request.expires_at_ms.map(time),
        "decision": a.decision,
    })
}

pub fn approvals(
    out: &mut dyn Write,
    list: &[(&Run, &keel_core::run::Approval)],
) -> io::Result<()> {
    if list.is_empty() {
        writeln!(out, "no approval requests are waiting")?;
        return Ok(());
    }
    for (run, a) in list {
        let r = &a.request;
        writeln!(out, "run {} request #{}: {}", run.id, r.n, r.intent)?;
        writeln!(out, "  payload hash {}", r.payload_hash)?;
        writeln!(out, "  risk        {}", r.risk)?;
        writeln!(out, "  rollback    {}", r.rollback)?;
        for c in &r.checks {
            writeln!(
                out,
                "  check       {} {} ({}, evidence #{})",
                c.verifier,
                if c.passed { "passed" } else { "FAILED" },
                c.status,
                c.evidence
            )?;
        }
        writeln!(out, "  payload:")?;
        for line in r.payload.lines() {
            writeln!(out, "    {line}")?;
        }
        match &a.decision {
            Some(d) => writeln!(
                out,
                "  decided     {} by {} via {}: {}",
                if d.approve { "approved" } else { "rejected" },
                d.by,
                d.via,
                d.reason
            )?,
            None => writeln!(
                out,
                "  decide with: keel approve {} {} --payload-hash {}",
                run.id, r.n, r.payload_hash
            )?,
        }
    }
    Ok(())
}
