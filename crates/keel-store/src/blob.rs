//! How small artifacts and a commit's events are kept: as they are, or compressed when that
//! saves room. A step's request (the whole prompt, stored at every step) is text that compresses
//! two to four times; over a long run the requests are most of the store.
//!
//! Written compressed with LZ4 (`LZ4`: the decompressed length, four bytes little-endian, then
//! one LZ4 block), which on the benchmark's machine compresses a request about three times
//! faster than zstd's fastest level did, for about two thirds of its saving: a step's prompt is
//! compressed on the step's own time, and what it costs there is what matters. zstd frames
//! (`ZSTD`, written by keel before) are still read.

use std::borrow::Cow;

use crate::StoreError;

/// The bytes as they are.
pub const RAW: i64 = 0;
/// One zstd frame of the bytes (written before LZ4 was; read only).
pub const ZSTD: i64 = 1;
/// The decompressed length (u32, little-endian) and one LZ4 block.
pub const LZ4: i64 = 2;

/// Shorter bytes (most replies and tool outputs) are kept as they are: they fill a fraction of
/// a page, and compressing them costs time for little room.
const SMALLEST: usize = 1024;
/// No blob is near this large (they are at most `INLINE_ARTIFACT_BYTES` before secrets are
/// scrubbed): a frame that would decode to more is damage, and is not decoded into memory.
const LARGEST: usize = 16 * crate::INLINE_ARTIFACT_BYTES;

/// The codec and the bytes to store for `bytes`: compressed when that saves at least an eighth.
pub(crate) fn encode(bytes: &[u8]) -> (i64, Cow<'_, [u8]>) {
    encode_from(bytes, SMALLEST)
}

/// [`encode`], compressing from `smallest` bytes up.
pub(crate) fn encode_from(bytes: &[u8], smallest: usize) -> (i64, Cow<'_, [u8]>) {
    if bytes.len() >= smallest
        && let Ok(len) = u32::try_from(bytes.len())
    {
        let mut frame =
            Vec::with_capacity(4 + lz4_flex::block::get_maximum_output_size(bytes.len()));
        frame.extend_from_slice(&len.to_le_bytes());
        frame.extend_from_slice(&lz4_flex::block::compress(bytes));
        if frame.len() <= bytes.len() - bytes.len() / 8 {
            return (LZ4, Cow::Owned(frame));
        }
    }
    (RAW, Cow::Borrowed(bytes))
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
    unpack(codec, stored, limit).map_err(|reason| StoreError::DamagedBlob {
        hash: hash.to_string(),
        reason,
    })
}

/// The bytes `stored` holds under `codec`, at most `limit` of them; why not, when they do not
/// decode.
pub(crate) fn unpack(codec: i64, stored: Vec<u8>, limit: usize) -> Result<Vec<u8>, String> {
    match codec {
        RAW => Ok(stored),
        ZSTD => zstd::bulk::decompress(&stored, limit)
            .map_err(|e| format!("its zstd frame does not decode: {e}")),
        LZ4 => {
            let (Some(len), Some(block)) = (stored.get(..4), stored.get(4..)) else {
                return Err("its LZ4 frame is shorter than its length".into());
            };
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            if len > limit {
                return Err(format!(
                    "its LZ4 frame claims {len} bytes, more than the {limit} it may hold"
                ));
            }
            let mut out = vec![0u8; len];
            match lz4_flex::block::decompress_into(block, &mut out) {
                Ok(n) if n == len => Ok(out),
                Ok(n) => Err(format!(
                    "its LZ4 frame holds {n} bytes where it claims {len}"
                )),
                Err(e) => Err(format!("its LZ4 frame does not decode: {e}")),
            }
        }
        other => Err(format!(
            "its codec {other} is not one this keel knows (0 = as is, 1 = zstd, 2 = LZ4); a newer keel wrote it"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_compressed_and_comes_back_the_same() {
        let text = "a step's request repeats itself, a step's request repeats itself. ".repeat(40);
        let (codec, stored) = encode(text.as_bytes());
        assert_eq!(codec, LZ4);
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
        assert!(err.contains("more than the 100"), "{err}");
        // A frame whose length was changed does not pass for the bytes.
        let (codec, stored) = encode(text.as_bytes());
        let mut longer = stored.into_owned();
        longer[0] ^= 1;
        assert!(decode("abc", codec, longer).is_err());
        // zstd frames keel wrote before are read, and their damage reported.
        let frame = zstd::bulk::compress(text.as_bytes(), 1).unwrap();
        assert_eq!(decode("z", ZSTD, frame.clone()).unwrap(), text.as_bytes());
        assert!(decode("z", ZSTD, frame[..frame.len() / 2].to_vec()).is_err());
        let err = decode("abc", 7, b"?".to_vec()).unwrap_err().to_string();
        assert!(
            err.contains("codec 7") && err.contains("newer keel"),
            "{err}"
        );
    }
}
