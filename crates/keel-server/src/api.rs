//! The JSON API's handlers. Each one opens the store on a blocking thread (a `Store` is one
//! SQLite connection: cheap to open, not shareable between threads) and goes through
//! keel-engine for every write, as the CLI does.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{OriginalUri, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use keel_engine::{Answered, Decided};
use keel_store::Store;
use serde::de::DeserializeOwned;

use crate::AppState;
use crate::error::{ApiError, Earlier};
use crate::views::{
    AllQuery, AnswerBody, ApprovalView, DecisionBody, EventView, EventsPage, EventsQuery,
    QuestionView, ReasonBody, Recorded, RunDetail, RunSummary,
};

/// How often a live timeline looks for new events.
const FOLLOW_EVERY: Duration = Duration::from_millis(300);
/// Events per page of `GET /api/runs/{id}/events`, unless `limit` says otherwise.
const DEFAULT_PAGE: usize = 1000;
const MAX_PAGE: usize = 10_000;

const DECISION_EXAMPLE: &str = r#"{"decision": "approve", "payload_hash": "<payload_hash from GET /api/approvals>", "reason": "why", "by": "your name"}"#;
const ANSWER_EXAMPLE: &str = r#"{"answer": "the answer", "by": "your name"}"#;
const REASON_EXAMPLE: &str = r#"{"reason": "why", "by": "your name"}"#;

/// Runs `f` on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("the request's thread failed: {e}")))?
}

fn open(state: &AppState) -> Result<Store, ApiError> {
    Ok(Store::open(state.store_path())?)
}

fn parse_body<T: DeserializeOwned>(bytes: &[u8], example: &str) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(format!(
            "the request body is empty: send JSON like {example}"
        )));
    }
    // serde also reads a struct from an array, by position: `["because", "me"]` would cancel a
    // run. No client means that, so only an object is read.
    if bytes.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::bad_request(format!(
            "the request body is not the JSON this endpoint takes (it must be an object): send \
             JSON like {example}"
        )));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not the JSON this endpoint takes ({e}): send JSON like {example}"
        ))
    })
}

fn parse_n(text: &str, what: &str) -> Result<u32, ApiError> {
    match text.parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ApiError::bad_request(format!(
            "`{text}` is not a {what} number: they count from 1"
        ))),
    }
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::bad_request(format!("the query string is wrong: {}", e.body_text())))
}

fn required(value: Option<String>, what: &str, example: &str) -> Result<String, ApiError> {
    match value {
        Some(v) if !v.trim().is_empty() => Ok(v),
        _ => Err(ApiError::bad_request(format!(
            "`{what}` is required: send JSON like {example}"
        ))),
    }
}

/// `GET /api/runs`: every run, newest first.
pub async fn list_runs(State(state): State<AppState>) -> Result<Json<Vec<RunSummary>>, ApiError> {
    blocking(move || {
        let store = open(&state)?;
        Ok(store.runs()?.iter().map(RunSummary::of).collect())
    })
    .await
    .map(Json)
}

/// `GET /api/runs/{id}`: one run (a unique prefix of the id will do).
pub async fn show_run(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<RunDetail>, ApiError> {
    blocking(move || {
        let store = open(&state)?;
        let id = store.resolve_run(&id)?;
        Ok(RunDetail::of(&store.run(&id)?))
    })
    .await
    .map(Json)
}

/// `GET /api/runs/{id}/events?after=SEQ&limit=N`: the log after `after`.
pub async fn events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Json<EventsPage>, ApiError> {
    let q = query(q)?;
    let limit = q.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    blocking(move || {
        let store = open(&state)?;
        let id = store.resolve_run(&id)?;
        // The state first: every event of a run in that state is in the log already.
        let run_state = store.run(&id)?.state;
        let mut all = store.events_from(&id, q.after.saturating_add(1))?;
        let more = all.len() > limit;
        all.truncate(limit);
        let events: Vec<EventView> = all.iter().map(EventView::of).collect();
        Ok(EventsPage {
            run: id,
            state: run_state.as_str(),
            last_seq: events.last().map_or(q.after, |e| e.seq),
            events,
            more,
        })
    })
    .await
    .map(Json)
}

/// `GET /api/runs/{id}/events/stream?after=SEQ`: server-sent events. Each event of the log is
/// one SSE message (`id` = its sequence number, `data` = the event as JSON); a run that has
/// finished ends the stream with an `end` event. `Last-Event-ID` resumes where a client was.
pub async fn stream(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let q = query(q)?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(q.after);
    let (store, id) = blocking(move || {
        let store = open(&state)?;
        let id = store.resolve_run(&id)?;
        Ok((store, id))
    })
    .await?;
    let follow = Follow {
        store: Some(store),
        id,
        after,
        queue: VecDeque::new(),
        first: true,
        done: false,
    };
    let events = futures_util::stream::unfold(follow, |mut f| async move {
        loop {
            if let Some(event) = f.queue.pop_front() {
                return Some((Ok(event), f));
            }
            if f.done {
                return None;
            }
            if !f.first {
                tokio::time::sleep(FOLLOW_EVERY).await;
            }
            f.first = false;
            f.poll().await;
        }
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// The state of one live timeline.
struct Follow {
    /// Moved onto a blocking thread for each look and back.
    store: Option<Store>,
    id: String,
    after: u64,
    queue: VecDeque<SseEvent>,
    first: bool,
    done: bool,
}

impl Follow {
    async fn poll(&mut self) {
        let Some(store) = self.store.take() else {
            self.done = true;
            return;
        };
        let (id, after) = (self.id.clone(), self.after);
        let looked = tokio::task::spawn_blocking(move || {
            let found = (|| {
                let terminal = store.run(&id)?.state;
                let events = store.events_from(&id, after.saturating_add(1))?;
                Ok::<_, keel_store::StoreError>((terminal, events))
            })();
            (store, found)
        })
        .await;
        match looked {
            Ok((store, Ok((run_state, events)))) => {
                self.store = Some(store);
                for e in &events {
                    self.after = e.seq;
                    let data = serde_json::to_string(&EventView::of(e)).unwrap_or_default();
                    self.queue
                        .push_back(SseEvent::default().id(e.seq.to_string()).data(data));
                }
                if run_state.is_terminal() {
                    let data =
                        serde_json::json!({ "state": run_state.as_str(), "last_seq": self.after });
                    self.queue
                        .push_back(SseEvent::default().event("end").data(data.to_string()));
                    self.done = true;
                }
            }
            Ok((_, Err(e))) => self.fail(&e.to_string()),
            Err(e) => self.fail(&format!("the store could not be read: {e}")),
        }
    }

    fn fail(&mut self, message: &str) {
        let data = serde_json::json!({ "error": message });
        self.queue
            .push_back(SseEvent::default().event("error").data(data.to_string()));
        self.done = true;
    }
}

/// `GET /api/approvals?all=false`: requests waiting for a decision, of every run, oldest first.
pub async fn approvals(
    State(state): State<AppState>,
    q: Result<Query<AllQuery>, QueryRejection>,
) -> Result<Json<Vec<ApprovalView>>, ApiError> {
    let all = query(q)?.all;
    blocking(move || {
        let store = open(&state)?;
        let mut list: Vec<ApprovalView> = store
            .runs()?
            .iter()
            .flat_map(|run| {
                run.approvals
                    .iter()
                    .filter(|a| all || a.decision.is_none())
                    .map(|a| ApprovalView::of(run, a))
            })
            .collect();
        list.sort_by_key(|a| a.created_at_ms);
        Ok(list)
    })
    .await
    .map(Json)
}

/// `GET /api/questions?all=false`: questions waiting for an answer, of every run.
pub async fn questions(
    State(state): State<AppState>,
    q: Result<Query<AllQuery>, QueryRejection>,
) -> Result<Json<Vec<QuestionView>>, ApiError> {
    let all = query(q)?.all;
    blocking(move || {
        let store = open(&state)?;
        Ok(store
            .runs()?
            .iter()
            .rev()
            .flat_map(|run| {
                run.questions
                    .iter()
                    .filter(|q| all || q.answer.is_none())
                    .map(|q| QuestionView::of(run, q))
            })
            .collect())
    })
    .await
    .map(Json)
}

/// `POST /api/runs/{id}/approvals/{n}`: approve or reject request `n`, naming its payload hash.
pub async fn decide(
    State(state): State<AppState>,
    Path((id, n)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Recorded>, ApiError> {
    let n = parse_n(&n, "request")?;
    let body: DecisionBody = parse_body(&body, DECISION_EXAMPLE)?;
    let approve = match required(body.decision, "decision", DECISION_EXAMPLE)?.as_str() {
        "approve" => true,
        "reject" => false,
        other => {
            return Err(ApiError::bad_request(format!(
                "`decision` is \"approve\" or \"reject\", not \"{other}\""
            )));
        }
    };
    let hash = required(body.payload_hash, "payload_hash", DECISION_EXAMPLE)?;
    let actor = state.actor(body.by.as_deref());
    let reason = body.reason;
    blocking(move || {
        let _turn = state.write_turn();
        let mut store = open(&state)?;
        let decided = keel_engine::decide(
            &mut store,
            &id,
            n,
            approve,
            hash.trim(),
            &reason,
            &actor,
            "http",
        )?;
        let word = |approve: bool| if approve { "approve" } else { "reject" };
        match decided {
            Decided::Recorded(run) => Ok(Recorded {
                run: run.id.clone(),
                n,
                decision: word(approve),
                by: actor.by.clone(),
                via: "http",
                state: run.state.as_str(),
                message: if approve {
                    format!(
                        "Request {n} of run {} approved by {}: a worker (or `keel resume {}`) carries the run on.",
                        run.id, actor.by, run.id
                    )
                } else {
                    format!(
                        "Request {n} of run {} rejected by {}: the run stops blocked with your reason.",
                        run.id, actor.by
                    )
                },
            }),
            Decided::Already {
                same,
                approve: earlier,
                by,
            } => {
                let mut err = ApiError::conflict(format!(
                    "request {n} of run {id} was already {} by {by}; this delivery changed nothing",
                    if earlier { "approved" } else { "rejected" }
                ));
                err.body.decided = Some(Earlier {
                    decision: word(earlier),
                    by,
                    same,
                });
                Err(err)
            }
        }
    })
    .await
    .map(Json)
}

/// `POST /api/runs/{id}/questions/{n}`: answer question `n`.
pub async fn answer(
    State(state): State<AppState>,
    Path((id, n)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Recorded>, ApiError> {
    let n = parse_n(&n, "question")?;
    let body: AnswerBody = parse_body(&body, ANSWER_EXAMPLE)?;
    let text = required(body.answer, "answer", ANSWER_EXAMPLE)?;
    let actor = state.actor(body.by.as_deref());
    blocking(move || {
        let _turn = state.write_turn();
        let mut store = open(&state)?;
        let id = store.resolve_run(&id)?;
        if store.run(&id)?.questions.get(n as usize - 1).is_none() {
            return Err(ApiError::not_found(format!(
                "run {id} has no question {n} (GET /api/runs/{id} lists its questions)"
            )));
        }
        match keel_engine::answer(&mut store, &id, n, &text, &actor, "http")? {
            Answered::Recorded(run) => Ok(Recorded {
                run: run.id.clone(),
                n,
                decision: "answer",
                by: actor.by.clone(),
                via: "http",
                state: run.state.as_str(),
                message: format!(
                    "Question {n} of run {} answered by {}: a worker (or `keel resume {}`) carries the run on.",
                    run.id, actor.by, run.id
                ),
            }),
            Answered::Already { by, same } => {
                let mut err = ApiError::conflict(format!(
                    "question {n} of run {id} was already answered by {by}; this delivery changed nothing"
                ));
                err.body.decided = Some(Earlier {
                    decision: "answer",
                    by,
                    same,
                });
                Err(err)
            }
        }
    })
    .await
    .map(Json)
}

async fn hold(
    state: AppState,
    id: String,
    body: Bytes,
    what: Hold,
) -> Result<Json<RunSummary>, ApiError> {
    let body: ReasonBody = parse_body(&body, REASON_EXAMPLE)?;
    let reason = required(body.reason, "reason", REASON_EXAMPLE)?;
    let actor = state.actor(body.by.as_deref());
    blocking(move || {
        let _turn = state.write_turn();
        let mut store = open(&state)?;
        let run = match what {
            Hold::Freeze => keel_engine::freeze(&mut store, &id, true, &reason, &actor)?,
            Hold::Unfreeze => keel_engine::freeze(&mut store, &id, false, &reason, &actor)?,
            Hold::Cancel => keel_engine::cancel(&mut store, &id, &reason, &actor)?,
        };
        Ok(RunSummary::of(&run))
    })
    .await
    .map(Json)
}

#[derive(Debug, Clone, Copy)]
enum Hold {
    Freeze,
    Unfreeze,
    Cancel,
}

/// `POST /api/runs/{id}/freeze`: an incident hold; nothing runs until it is lifted.
pub async fn freeze(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<RunSummary>, ApiError> {
    hold(state, id, body, Hold::Freeze).await
}

/// `POST /api/runs/{id}/unfreeze`.
pub async fn unfreeze(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<RunSummary>, ApiError> {
    hold(state, id, body, Hold::Unfreeze).await
}

/// `POST /api/runs/{id}/cancel`: the run ends `failed`, with who and why.
pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<RunSummary>, ApiError> {
    hold(state, id, body, Hold::Cancel).await
}

const OPENAPI: &str = include_str!("openapi.json");

/// `GET /api/openapi.json`: the description of this API.
pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

pub async fn not_found(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no endpoint {}: GET /api/openapi.json describes the API, and the page is at /",
            uri.path()
        ),
    )
}

pub async fn method_not_allowed(OriginalUri(uri): OriginalUri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not take this method: GET /api/openapi.json says which one it takes",
            uri.path()
        ),
    )
}
