//! API errors: a status and a JSON body `{"error": "..."}` that says what to fix.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_engine::{DecisionError, EngineError};
use keel_store::StoreError;
use serde::Serialize;

/// An API error as sent: its status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
}

/// `{"error": "..."}`, with what a program needs to act on a conflict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorBody {
    pub error: String,
    /// For a request decided before: the decision that counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided: Option<Earlier>,
    /// For a stale payload hash: the hash of the payload the request holds now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_hash: Option<String>,
}

/// The decision (or answer) that was recorded first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Earlier {
    /// `approve`, `reject` or `answer`.
    pub decision: &'static str,
    pub by: String,
    /// Whether the refused delivery said the same thing.
    pub same: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorBody {
                error: message.into(),
                decided: None,
                payload_hash: None,
            },
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        let message = e.to_string();
        match e {
            StoreError::NoSuchRun(_) => {
                ApiError::not_found(format!("{message}; GET /api/runs lists the runs it has"))
            }
            StoreError::AmbiguousRun { .. } => ApiError::bad_request(message),
            StoreError::LeaseHeld { .. } => {
                ApiError::conflict(format!("{message}; the run is busy, try again in a moment"))
            }
            StoreError::LeaseLost { .. }
            | StoreError::Conflict { .. }
            | StoreError::HeadMoved { .. } => ApiError::conflict(format!("{message}; try again")),
            StoreError::Sqlite { .. }
            | StoreError::Io { .. }
            | StoreError::Decode { .. }
            | StoreError::Projection { .. }
            | StoreError::NewerSchema { .. }
            | StoreError::DamagedBlob { .. }
            | StoreError::SharedCommit { .. } => ApiError::internal(message),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        match e {
            EngineError::Store(s) => s.into(),
            EngineError::Usage(message) => ApiError::bad_request(message),
            EngineError::Refused { .. }
            | EngineError::Apply { .. }
            | EngineError::TreeMissing { .. } => ApiError::conflict(e.to_string()),
            EngineError::Contract(_)
            | EngineError::Git(_)
            | EngineError::ContractFile { .. }
            | EngineError::Io { .. }
            | EngineError::DamagedLog { .. }
            | EngineError::ContractMissing { .. }
            | EngineError::Stuck { .. } => ApiError::internal(e.to_string()),
        }
    }
}

impl From<DecisionError> for ApiError {
    fn from(e: DecisionError) -> ApiError {
        let message = e.to_string();
        match e {
            DecisionError::NoRequest { run, .. } => ApiError::not_found(format!(
                "{message} (GET /api/runs/{run} lists its requests)"
            )),
            DecisionError::StalePayload { expected, .. } => {
                let mut err = ApiError::conflict(format!(
                    "the payload changed: {message}. Nothing was decided; read the request again \
                     (GET /api/approvals) and decide on what it holds now"
                ));
                err.body.payload_hash = Some(expected);
                err
            }
            DecisionError::NoReason => ApiError::bad_request(
                "a rejection needs a reason: send {\"decision\": \"reject\", \"reason\": \"why\", ...}",
            ),
            DecisionError::Engine(e) => e.into(),
        }
    }
}
