//! How small artifacts and a commit's events are kept: as they are, or compressed when that
//! saves room. A step's request (the whole prompt, stored at every step) is text that compresses
//! two to four times; over a long run the requests are most of the store.
//!
//! Written compressed with LZ4 (`LZ4`: the decompressed length, four bytes little-endian, then
//! one LZ4 block), which on the benchmark's machine compresses a request about three times
//! faster than zstd's fastest level did, for about two thirds of its saving: a step's prompt is
//! compressed on the step's own time, and what it costs there is what matters. zstd frames
//! (`ZSTD`, written by keel before) are still read.
//!
//! A step's request is mostly the request before it (the same instructions, contract and tool
//! list, a window of material that moves a little each step), so a request may be stored
//! against a base (`LZ4_BASED`): one LZ4 block compressed with the bytes of an earlier request
//! of the same series as its dictionary, which costs a few hundred bytes where the request
//! alone costs thousands. The base is always stored alone (never against another), so reading
//! one request reads at most two blobs (see `Store::put_artifact_in`).

use std::borrow::Cow;

use crate::StoreError;

/// The bytes as they are.
pub const RAW: i64 = 0;
/// One zstd frame of the bytes (written before LZ4 was; read only).
pub const ZSTD: i64 = 1;
/// The decompressed length (u32, little-endian) and one LZ4 block.
pub const LZ4: i64 = 2;
/// The decompressed length (u32, little-endian), the name of the base artifact (64 hex
/// digits) and one LZ4 block compressed with the base's bytes as its dictionary.
pub const LZ4_BASED: i64 = 3;

/// The length of an artifact's name (a BLAKE3 hash in hex).
const NAME: usize = 64;

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
        // The block is compressed straight into the frame, after the length.
        let mut frame = vec![0u8; 4 + lz4_flex::block::get_maximum_output_size(bytes.len())];
        frame[..4].copy_from_slice(&len.to_le_bytes());
        if let Ok(n) = lz4_flex::block::compress_into(bytes, &mut frame[4..])
            && 4 + n <= bytes.len() - bytes.len() / 8
        {
            frame.truncate(4 + n);
            return (LZ4, Cow::Owned(frame));
        }
    }
    (RAW, Cow::Borrowed(bytes))
}

/// The `LZ4_BASED` frame of `bytes` against `base` (the bytes of the artifact `base_hash`).
pub(crate) fn encode_based(bytes: &[u8], base_hash: &str, base: &[u8]) -> Option<Vec<u8>> {
    let len = u32::try_from(bytes.len()).ok()?;
    if base_hash.len() != NAME || !base_hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut frame = Vec::with_capacity(4 + NAME + bytes.len() / 4);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(base_hash.as_bytes());
    frame.extend_from_slice(&lz4_flex::block::compress_with_dict(bytes, base));
    Some(frame)
}

/// The name of the base an `LZ4_BASED` frame was compressed against; `None` when the frame is
/// too short to name one or names something that is not an artifact's name.
pub(crate) fn base_of(stored: &[u8]) -> Option<&str> {
    let name = std::str::from_utf8(stored.get(4..4 + NAME)?).ok()?;
    name.bytes().all(|b| b.is_ascii_hexdigit()).then_some(name)
}

/// The bytes an `LZ4_BASED` frame holds, given its base's bytes.
pub(crate) fn decode_based(hash: &str, stored: &[u8], base: &[u8]) -> Result<Vec<u8>, StoreError> {
    let damaged = |reason: String| StoreError::DamagedBlob {
        hash: hash.to_string(),
        reason,
    };
    let (Some(len), Some(block)) = (stored.get(..4), stored.get(4 + NAME..)) else {
        return Err(damaged("its LZ4 frame is shorter than its header".into()));
    };
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len > LARGEST {
        return Err(damaged(format!(
            "its LZ4 frame claims {len} bytes, more than the {LARGEST} it may hold"
        )));
    }
    let mut out = vec![0u8; len];
    match lz4_flex::block::decompress_into_with_dict(block, &mut out, base) {
        Ok(n) if n == len => Ok(out),
        Ok(n) => Err(damaged(format!(
            "its LZ4 frame holds {n} bytes where it claims {len}"
        ))),
        Err(e) => Err(damaged(format!(
            "its LZ4 frame does not decode against its base: {e}"
        ))),
    }
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
        // Read through the store, which finds the base (`Store::decode_stored`).
        LZ4_BASED => Err("it is stored against another artifact, which was not given".into()),
        other => Err(format!(
            "its codec {other} is not one this keel knows (0 = as is, 1 = zstd, 2 = LZ4, 3 = LZ4 \
             against a base); a newer keel wrote it"
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
    #[test]
    fn an_artifact_stored_against_a_base_comes_back_only_with_that_base() {
        let base = "the instructions and the contract, then notes: one two three. ".repeat(60);
        let request = format!("{base} and four.");
        let name = "ab".repeat(32);
        let frame = encode_based(request.as_bytes(), &name, base.as_bytes()).unwrap();
        assert!(frame.len() < 4 + 64 + 64, "{} bytes", frame.len());
        assert_eq!(base_of(&frame), Some(name.as_str()));
        assert_eq!(
            decode_based("h", &frame, base.as_bytes()).unwrap(),
            request.as_bytes()
        );
        // Against other bytes it does not come back as it was.
        let other = base.replace("two", "2wo");
        assert!(
            decode_based("h", &frame, other.as_bytes()).map_or(true, |b| b != request.as_bytes())
        );
        // Without the store to find its base, it is not decoded.
        let err = decode("h", LZ4_BASED, frame.clone())
            .unwrap_err()
            .to_string();
        assert!(err.contains("against another artifact"), "{err}");
        // A name that is not an artifact's is not written or read; a short frame is damage.
        assert_eq!(encode_based(b"x", "not-a-name", b"x"), None);
        assert_eq!(base_of(&frame[..20]), None);
        assert!(decode_based("h", &frame[..10], base.as_bytes()).is_err());
        let mut claims = frame.clone();
        claims[3] = 0xff;
        assert!(decode_based("h", &claims, base.as_bytes()).is_err());
    }
}
