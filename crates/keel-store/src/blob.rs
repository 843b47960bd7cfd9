//! How a small artifact is kept in the `blobs` table: as it is, or as one zstd frame when that
//! saves room. A step's request (the whole prompt, stored at every step) is text that compresses
//! three to four times; over a long run the requests are most of the store. Compressing costs a
//! step a few tens of microseconds and does not make its commit measurably faster (the fsync
//! costs about the same for fewer pages): it is done for the size of the store.

use std::borrow::Cow;

use crate::StoreError;

/// The bytes as they are.
pub(crate) const RAW: i64 = 0;
/// One zstd frame of the bytes.
pub(crate) const ZSTD: i64 = 1;

/// zstd's fastest level: it takes tens of microseconds for a request and most of the saving.
const LEVEL: i32 = 1;
/// Shorter bytes (most replies and tool outputs) are kept as they are: they fill a fraction of
/// a page, and compressing them costs time for little room.
const SMALLEST: usize = 1024;
/// No blob is near this large (they are at most `INLINE_ARTIFACT_BYTES` before secrets are
/// scrubbed): a frame that would decode to more is damage, and is not decoded into memory.
const LARGEST: usize = 16 * crate::INLINE_ARTIFACT_BYTES;

/// The codec and the bytes to store for `bytes`: compressed when that saves at least an eighth.
pub(crate) fn encode(bytes: &[u8]) -> (i64, Cow<'_, [u8]>) {
    if bytes.len() >= SMALLEST
        && let Some(frame) = compress(bytes)
        && frame.len() <= bytes.len() - bytes.len() / 8
    {
        return (ZSTD, Cow::Owned(frame));
    }
    (RAW, Cow::Borrowed(bytes))
}

fn compress(bytes: &[u8]) -> Option<Vec<u8>> {
    compress_at(bytes, LEVEL)
}

/// One zstd frame of `bytes` at `level`, through this thread's compressor: a new one for each
/// blob would allocate and clear its tables every time, which costs more than compressing a
/// request.
pub(crate) fn compress_at(bytes: &[u8], level: i32) -> Option<Vec<u8>> {
    thread_local! {
        static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
    }
    COMPRESSOR.with_borrow_mut(|slot| {
        if slot.as_ref().is_none_or(|(at, _)| *at != level) {
            *slot = zstd::bulk::Compressor::new(level).ok().map(|c| (level, c));
        }
        slot.as_mut()?.1.compress(bytes).ok()
    })
}

/// The bytes a stored blob holds. A frame that does not decode, or that would grow past
/// [`LARGEST`], is reported as damage to the blob named `hash`.
pub(crate) fn decode(hash: &str, codec: i64, stored: Vec<u8>) -> Result<Vec<u8>, StoreError> {
    decode_within(hash, codec, stored, LARGEST)
}

fn decode_within(
    hash: &str,
    codec: i64,
    stored: Vec<u8>,
    limit: usize,
) -> Result<Vec<u8>, StoreError> {
    let damaged = |reason: String| StoreError::DamagedBlob {
        hash: hash.to_string(),
        reason,
    };
    match codec {
        RAW => Ok(stored),
        ZSTD => zstd::bulk::decompress(&stored, limit)
            .map_err(|e| damaged(format!("its zstd frame does not decode: {e}"))),
        other => Err(damaged(format!(
            "its codec {other} is not one this keel knows (0 = as is, 1 = zstd); a newer keel wrote it"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_compressed_and_comes_back_the_same() {
        let text = "a step's request repeats itself, a step's request repeats itself. ".repeat(40);
        let (codec, stored) = encode(text.as_bytes());
        assert_eq!(codec, ZSTD);
        assert!(
            stored.len() < text.len() / 4,
            "{} of {}",
            stored.len(),
            text.len()
        );
        let back = decode("h", codec, stored.into_owned()).unwrap();
        assert_eq!(back, text.as_bytes());
    }

    #[test]
    fn short_or_incompressible_bytes_are_kept_as_they_are() {
        let short = b"ok";
        assert_eq!(encode(short), (RAW, Cow::Borrowed(&short[..])));
        let mut noise = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            noise.push(x as u8);
        }
        let (codec, stored) = encode(&noise);
        assert_eq!(codec, RAW);
        assert_eq!(&*stored, &noise[..]);
    }

    #[test]
    fn damage_and_unknown_codecs_are_reported_with_the_blob() {
        let text = "x".repeat(10_000);
        let (codec, stored) = encode(text.as_bytes());
        let mut torn = stored.into_owned();
        torn.truncate(torn.len() / 2);
        let err = decode("abc", codec, torn).unwrap_err().to_string();
        assert!(
            err.contains("abc") && err.contains("does not decode"),
            "{err}"
        );
        // A frame that would grow past the limit is refused, not decoded into memory.
        let (codec, stored) = encode(text.as_bytes());
        let err = decode_within("abc", codec, stored.into_owned(), 100)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not decode"), "{err}");
        let err = decode("abc", 7, b"?".to_vec()).unwrap_err().to_string();
        assert!(
            err.contains("codec 7") && err.contains("newer keel"),
            "{err}"
        );
    }
}
