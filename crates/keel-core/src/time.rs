//! Times as people read them. keel keeps every time as milliseconds since the Unix epoch (the
//! clock is the caller's, see `keel_engine::now_ms`); this only formats one.

/// `ms` milliseconds since the epoch as RFC 3339 in UTC, to the second:
/// `2026-12-06T21:32:19Z`. A time before the epoch is shown as the epoch.
pub fn rfc3339(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_reads_as_utc_to_the_second() {
        assert_eq!(rfc3339(1_796_592_739_102), "2026-12-06T21:32:19Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00Z");
    }
}
