//! What can go wrong talking to a model, with what a user needs to act on it.

/// A failed model call. Messages never contain the API key (it is scrubbed from anything a
/// server sends back) nor credentials or queries from the URL.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The server refused the request for a reason retrying cannot fix: a 4xx other than 408 and
    /// 429 — bad key (401/403), unknown model (404), bad request (400) — or a 429 that says the
    /// account is out of quota. Not retried. `message` is the provider's own message, the
    /// endpoint, and a sentence of advice.
    #[error("the model server refused the request (HTTP {status}): {message}")]
    Rejected { status: u16, message: String },
    /// Every attempt failed with something worth retrying (429, 5xx, timeout, connection error).
    /// `attempts` counts all of them, the first included; `last` says how the last one failed.
    #[error("the model call failed after {attempts} attempt(s); the last: {last}")]
    Exhausted { attempts: u32, last: String },
    /// The client could not be built or the configuration cannot work (a base URL that is not
    /// a URL, an API key that cannot be a header, a zero timeout).
    #[error("cannot call the model: {0}")]
    Transport(String),
    /// A successful (2xx) answer that is not a valid response. `message` says what is missing;
    /// `excerpt` is the start of the body (about 300 bytes).
    #[error(
        "the model server's answer is not a valid response: {message} (body starts: {excerpt})"
    )]
    Malformed { message: String, excerpt: String },
}

/// How much of a body an error shows.
pub(crate) const EXCERPT_BYTES: usize = 300;

/// The first `max` bytes of `body` as text, cut at a character boundary, with `…` if cut.
pub(crate) fn excerpt(body: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(body);
    if text.len() <= max {
        return text.into_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_cut_at_char_boundaries() {
        assert_eq!(excerpt(b"short", 300), "short");
        assert_eq!(excerpt("aé".as_bytes(), 2), "a…");
        assert_eq!(excerpt(b"abcdef", 3), "abc…");
    }
}
