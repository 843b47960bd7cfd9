//! How a commit's events and small artifacts are kept: one row of the `log` table per commit of
//! a run (schema 6), instead of a row per event and a row per artifact.
//!
//! A step's commit appends one row at the end of the table. With a row per event and per
//! artifact a step's commit touched about 17 pages (each table's and index's B-tree
//! rebalancing as it grew, the artifacts' hash index at random places); a row holds the same in
//! a few (see docs/performance.md).
//!
//! A run's rows are found by their links (schema 7), not by an index: `runs.last_log` is the
//! id of the run's newest row and each row's `prev` the id of the run's row before it (NULL in
//! its first), always smaller than its own (a new row's id is above every id in the table).
//! [`walk_rows`] follows them. The `(run_id, last_seq)` index they replace cost every commit a
//! page of its own (the index's newest leaf, or a leaf at a random place when many runs
//! commit); the links cost none, as the row and the `runs` row are written anyway, and new rows
//! of all runs still go at the table's end.
//!
//! The `events` column is [`encode_events`]: a small header and each event's stored fields
//! (sequence number, time, version, kind, body text, previous hash, hash) with their lengths,
//! compressed with LZ4 when that saves an eighth (`codec`, see `blob`; zstd frames written
//! before are read). The `blobs` column holds the artifacts the
//! commit stored ([`encode_blobs`]: each one's hash, its own codec and bytes), and
//! `blob_hashes` their hashes alone, so a search for an artifact reads no blob. Decoding checks
//! every length against what is there: damaged bytes give an error, never a panic or a read past
//! the end.

use std::borrow::Cow;

use crate::StoredEvent;

/// The first bytes of an encoded event list, and its format version.
const MAGIC: &[u8; 3] = b"KL\x01";
pub use crate::blob::{LZ4, LZ4_BASED, RAW, ZSTD};

/// Shorter event lists are kept as they are.
const SMALLEST: usize = 512;
/// No commit's events come near this: a frame that would decode to more is damage.
const LARGEST: usize = 256 * 1024 * 1024;

/// An artifact stored in a log row: its hash, how its bytes are kept (`blob` codec), the bytes.
pub type InlineBlob = (String, i64, Vec<u8>);

/// The events of one row, as [`StoredEvent`]s of run `run_id`.
pub fn encode_events(events: &[StoredEvent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        8 + events
            .iter()
            .map(|e| 40 + e.kind.len() + e.body.len() + e.prev_hash.len() + e.hash.len())
            .sum::<usize>(),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(events.len() as u32).to_le_bytes());
    for e in events {
        out.extend_from_slice(&e.seq.to_le_bytes());
        out.extend_from_slice(&e.at_ms.to_le_bytes());
        out.extend_from_slice(&e.version.to_le_bytes());
        put(&mut out, e.kind.as_bytes());
        put(&mut out, e.body.as_bytes());
        put(&mut out, e.prev_hash.as_bytes());
        put(&mut out, e.hash.as_bytes());
    }
    out
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The codec and the bytes to store for an encoded event list: compressed (LZ4, see `blob`)
/// when that saves an eighth.
pub fn pack(encoded: Vec<u8>) -> (i64, Vec<u8>) {
    match crate::blob::encode_from(&encoded, SMALLEST) {
        (codec, Cow::Owned(frame)) => (codec, frame),
        (codec, Cow::Borrowed(_)) => (codec, encoded),
    }
}

/// The events a stored `events` column holds. Text that is no longer UTF-8 is read with the
/// damage replaced (U+FFFD), so that the hash check reports the event, as for any other change.
pub fn decode_events(run_id: &str, codec: i64, stored: &[u8]) -> Result<Vec<StoredEvent>, String> {
    let bytes: Cow<'_, [u8]> = match codec {
        RAW => Cow::Borrowed(stored),
        other => Cow::Owned(crate::blob::unpack(other, stored.to_vec(), LARGEST)?),
    };
    let mut r = Reader {
        bytes: &bytes,
        at: 0,
    };
    if r.take(MAGIC.len())? != MAGIC {
        return Err("it does not start as an event list of this keel".into());
    }
    let count = r.u32()? as usize;
    // Each event takes at least 36 bytes: a count beyond what is there is damage.
    if count > bytes.len() / 36 {
        return Err(format!("it claims {count} events in {} bytes", bytes.len()));
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        let seq = r.u64()?;
        let at_ms = r.u64()? as i64;
        let version = r.u32()?;
        let kind = r.text()?;
        let body = r.text()?;
        let prev_hash = r.text()?;
        let hash = r.text()?;
        events.push(StoredEvent {
            run_id: run_id.to_string(),
            seq,
            at_ms,
            version,
            kind,
            body,
            prev_hash,
            hash,
        });
    }
    if r.at != bytes.len() {
        return Err(format!(
            "{} bytes follow its last event",
            bytes.len() - r.at
        ));
    }
    Ok(events)
}

/// The `blobs` column for `blobs` (in the order given), and the `blob_hashes` column.
pub fn encode_blobs(blobs: &[InlineBlob]) -> (Vec<u8>, Vec<u8>) {
    let mut out = Vec::new();
    let mut hashes = Vec::with_capacity(blobs.len() * 65);
    for (hash, codec, bytes) in blobs {
        put(&mut out, hash.as_bytes());
        out.push(u8::try_from(*codec).unwrap_or(u8::MAX));
        put(&mut out, bytes);
        hashes.extend_from_slice(hash.as_bytes());
        hashes.push(b'\n');
    }
    (out, hashes)
}

/// The artifacts a stored `blobs` column holds, their bytes as stored (see `blob::decode`).
pub fn decode_blobs(stored: &[u8]) -> Result<Vec<InlineBlob>, String> {
    let mut r = Reader {
        bytes: stored,
        at: 0,
    };
    let mut out = Vec::new();
    while r.at < stored.len() {
        let hash = r.text()?;
        let codec = i64::from(r.take(1)?[0]);
        let len = r.u32()? as usize;
        out.push((hash, codec, r.take(len)?.to_vec()));
    }
    Ok(out)
}

/// Whether a `blob_hashes` column names `hash`.
pub(crate) fn names_blob(hashes: &[u8], hash: &str) -> bool {
    hashes.split(|b| *b == b'\n').any(|h| h == hash.as_bytes())
}

/// Rewrites the stored events of run `run_id` in the `log` row that holds event `seq`, on
/// `conn`: `edit` gets the row's events as stored and changes them as it likes (alters a field,
/// removes one); the row is written back as it is (codec 0), or removed when no event is left.
/// Nothing checks what is written: this is how tests damage a log the way a disk or a hand with
/// a database tool could, and how a repair tool would reach it. Returns whether a row held
/// `seq`.
pub fn rewrite_stored(
    conn: &rusqlite::Connection,
    run_id: &str,
    seq: u64,
    edit: impl FnOnce(&mut Vec<StoredEvent>),
) -> Result<bool, String> {
    let rows = run_rows(conn, run_id, seq).map_err(|e| e.to_string())?;
    if let Some(broken) = &rows.broken {
        return Err(broken.to_string());
    }
    let Some(&id) = rows.ids.first() else {
        return Ok(false);
    };
    let (first, prev, codec, bytes): (u64, Option<i64>, i64, Vec<u8>) = conn
        .query_row(
            "SELECT first_seq, prev, codec, events FROM log WHERE id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .map_err(|e| e.to_string())?;
    if first > seq {
        return Ok(false);
    }
    let mut events = decode_events(run_id, codec, &bytes)?;
    edit(&mut events);
    if events.is_empty() {
        // The row after it (or the run, for its newest) is linked to the one before it.
        match rows.ids.get(1) {
            Some(next) => conn.execute(
                "UPDATE log SET prev = ?2 WHERE id = ?1",
                rusqlite::params![next, prev],
            ),
            None => conn.execute(
                "UPDATE runs SET last_log = ?2 WHERE id = ?1",
                rusqlite::params![run_id, prev],
            ),
        }
        .map_err(|e| e.to_string())?;
        conn.execute("DELETE FROM log WHERE id = ?1", [id])
    } else {
        conn.execute(
            "UPDATE log SET codec = ?2, events = ?3 WHERE id = ?1",
            rusqlite::params![id, RAW, encode_events(&events)],
        )
    }
    .map_err(|e| e.to_string())?;
    Ok(true)
}

/// The rows of a run's log that hold events from some sequence number on, found by following
/// the links back from its newest row (see the module's note).
#[derive(Debug)]
pub(crate) struct RunRows {
    /// Their ids, oldest first.
    pub ids: Vec<i64>,
    /// Where the links stopped before reaching the events asked for, if they did.
    pub broken: Option<BrokenLink>,
}

/// A link of a run's log that leads nowhere: the rows before it cannot be found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BrokenLink {
    /// The events of the oldest row found (none when the run's own link is broken).
    pub after: Option<(u64, u64)>,
    /// The row it names.
    pub names: i64,
    pub why: &'static str,
}

impl std::fmt::Display for BrokenLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.after {
            Some((first, last)) => write!(
                f,
                "the log's row of events {first}-{last} names row {} as the one before it, \
                 which {}: the events before {first} cannot be found",
                self.names, self.why
            ),
            None => write!(
                f,
                "the run names row {} as its log's newest, which {}: its events cannot be found",
                self.names, self.why
            ),
        }
    }
}

/// The rows of run `run_id`'s log that hold events from `from_seq` on (all of them from 0 or
/// 1), by its links: see [`walk_rows`].
pub(crate) fn run_rows(
    conn: &rusqlite::Connection,
    run_id: &str,
    from_seq: u64,
) -> rusqlite::Result<RunRows> {
    let mut ids = Vec::new();
    let broken = walk_rows(conn, run_id, from_seq, |id| {
        ids.push(id);
        Ok(true)
    })?;
    ids.reverse();
    Ok(RunRows { ids, broken })
}

/// Gives `f` the id of each of run `run_id`'s log rows that hold events from `from_seq` on,
/// newest first, by its links: the newest row, then each one's `prev`, back to the row holding
/// `from_seq`, or until `f` says to stop. A link to a row that is not there, is another run's,
/// or is not older stops the walk and is returned, with the events of the oldest row found
/// before it.
pub(crate) fn walk_rows(
    conn: &rusqlite::Connection,
    run_id: &str,
    from_seq: u64,
    mut f: impl FnMut(i64) -> rusqlite::Result<bool>,
) -> rusqlite::Result<Option<BrokenLink>> {
    let newest: Option<Option<i64>> = conn
        .prepare_cached("SELECT last_log FROM runs WHERE id = ?1")?
        .query_row([run_id], |r| r.get(0))
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })?;
    let mut next = newest.flatten();
    let mut after: Option<(i64, u64, u64)> = None;
    let mut row =
        conn.prepare_cached("SELECT prev, run_id, first_seq, last_seq FROM log WHERE id = ?1")?;
    while let Some(id) = next {
        let found: Option<(Option<i64>, String, u64, u64)> = row
            .query_row([id], |r| {
                Ok((r.get(0)?, crate::text(r, 1)?, r.get(2)?, r.get(3)?))
            })
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                e => Err(e),
            })?;
        let why = match &found {
            None => Some("is not there"),
            Some((_, owner, _, _)) if owner != run_id => Some("is another run's"),
            Some(_) if after.is_some_and(|(later, _, _)| id >= later) => Some("is not older"),
            Some(_) => None,
        };
        if let Some(why) = why {
            return Ok(Some(BrokenLink {
                after: after.map(|(_, first, last)| (first, last)),
                names: id,
                why,
            }));
        }
        let Some((prev, _, first, last)) = found else {
            break;
        };
        if last < from_seq || !f(id)? || first <= from_seq {
            break;
        }
        after = Some((id, first, last));
        next = prev;
    }
    Ok(None)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "it ends after {} bytes, in the middle of a field of {n} at byte {}",
                    self.bytes.len(),
                    self.at
                )
            })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn text(&mut self) -> Result<String, String> {
        let len = self.u32()? as usize;
        Ok(String::from_utf8_lossy(self.take(len)?).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, body: &str) -> StoredEvent {
        StoredEvent {
            run_id: "r".into(),
            seq,
            at_ms: -5 + seq as i64,
            version: 1,
            kind: "note_added".into(),
            body: body.into(),
            prev_hash: format!("{:064}", seq - 1),
            hash: format!("{seq:064}"),
        }
    }

    #[test]
    fn events_come_back_as_they_were_stored_packed_or_not() {
        let events: Vec<StoredEvent> = (1..=20)
            .map(|i| {
                event(
                    i,
                    &format!("{{\"text\":\"{}\"}}", "é".repeat(i as usize * 10)),
                )
            })
            .collect();
        let encoded = encode_events(&events);
        assert_eq!(decode_events("r", RAW, &encoded).unwrap(), events);
        let (codec, packed) = pack(encoded.clone());
        assert_eq!(codec, LZ4, "a long list compresses");
        assert!(packed.len() < encoded.len());
        assert_eq!(decode_events("r", codec, &packed).unwrap(), events);
        let (codec, small) = pack(encode_events(&events[..1]));
        assert_eq!(codec, RAW, "a short list is kept as it is");
        assert_eq!(decode_events("r", codec, &small).unwrap(), events[..1]);
        assert_eq!(decode_events("r", RAW, &encode_events(&[])).unwrap(), []);
    }

    #[test]
    fn every_cut_and_a_flip_of_the_header_is_an_error_not_a_panic() {
        let encoded = encode_events(&[event(1, "{}"), event(2, "{\"a\":1}")]);
        for end in 0..encoded.len() {
            assert!(
                decode_events("r", RAW, &encoded[..end]).is_err(),
                "cut at {end}"
            );
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert!(
            decode_events("r", RAW, &longer)
                .unwrap_err()
                .contains("follow")
        );
        let mut bad = encoded.clone();
        bad[0] ^= 0xff;
        assert!(decode_events("r", RAW, &bad).is_err());
        let mut huge = encoded;
        huge[3..7].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            decode_events("r", RAW, &huge)
                .unwrap_err()
                .contains("claims")
        );
        assert!(decode_events("r", ZSTD, b"not a frame").is_err());
        assert!(decode_events("r", LZ4, b"\x10\0\0\0not a frame").is_err());
        assert!(
            decode_events("r", 7, b"")
                .unwrap_err()
                .contains("newer keel")
        );
    }

    #[test]
    fn text_that_is_no_longer_utf8_reads_with_the_damage_replaced() {
        let mut encoded = encode_events(&[event(1, "{\"t\":\"ab\"}")]);
        let at = encoded.windows(2).position(|w| w == b"ab").unwrap();
        encoded[at] = 0xff;
        let back = decode_events("r", RAW, &encoded).unwrap();
        assert!(back[0].body.contains('\u{fffd}'), "{}", back[0].body);
    }

    #[test]
    fn blobs_come_back_and_their_hashes_are_found() {
        let blobs = vec![
            ("aa".to_string(), 0, b"first".to_vec()),
            ("bb".to_string(), 1, vec![0u8; 3]),
        ];
        let (stored, hashes) = encode_blobs(&blobs);
        assert_eq!(decode_blobs(&stored).unwrap(), blobs);
        assert!(names_blob(&hashes, "bb"));
        assert!(!names_blob(&hashes, "b"));
        assert!(decode_blobs(&stored[..stored.len() - 1]).is_err());
        assert_eq!(decode_blobs(&[]).unwrap(), []);
    }
}
