//! What keel's property ("fuzz") tests share: how many cases to run, and the strategies and
//! mutators that turn valid input into bad input. Each test file keeps its own samples, its own
//! hostile values and its own restatement of what the parser under test must accept; this module
//! only changes what it is given.
//!
//! - [`config`]: 256 cases per property, or `KEEL_FUZZ_CASES` (for example
//!   `KEEL_FUZZ_CASES=100000`) when set. `failure_persistence` is off: nothing is written to the
//!   source tree, and a failure prints the smallest input it found instead of saving it.
//!
//! JSON, structure-aware:
//! - [`key`]: an object key, three times in four one of the `known` keys of the format under test
//!   (so that changes hit them often), otherwise any string of up to 8 characters.
//! - [`hostile`] (and [`hostile_sized`]): a value chosen to break assumptions, all equally
//!   likely: null, a boolean, any `i64`, `u64::MAX`, `1e308`, `""`, `"\u{0}"`, any string of up to
//!   16 characters, a long string of `x`, `{}`, `[]`, arrays deep inside each other ([`nested`]),
//!   and the caller's own values and strategies (its wrong types and near misses).
//! - [`any_json`]: arbitrary JSON of modest size, its keys from [`key`], shaped by [`JsonSize`].
//! - [`nested`]: `depth` arrays inside each other, `null` innermost.
//! - [`Edit`], made by [`edit`] (or [`edit_weighted`]) and applied by [`apply`]: one change at a
//!   node picked among all the nodes of a document, the root included: replace it with a hostile
//!   value; remove it from its object or array; add a key (to an object) or an element (to an
//!   array) with a hostile value; or wrap it in 1 to 149 arrays. An edit that does not fit the
//!   node picked (removing the root, adding a key to a number) leaves the document as it is.
//!
//! Bytes, for input that is read as bytes or text:
//! - [`ByteEdit`], applied by [`apply_bytes`]: flip bits of a byte, cut the input short, delete
//!   a run of bytes, insert bytes; or one of three whole-document edits that keep the text
//!   well-formed JSON while giving it a repeated key ([`ByteEdit::RepeatFirstPair`],
//!   [`ByteEdit::DuplicateFirstKey`]) or a second `kind` ([`ByteEdit::KindFirst`]). An edit that
//!   does not fit (flipping a byte of nothing) leaves the input as it is.
//! - [`flip`], [`truncate`], [`delete`], [`insert`]: the four byte-level edits, each with a
//!   position anywhere in the input; [`insert`] picks one of the caller's `tokens` (bytes that
//!   mean something to the format: a quote, an invalid UTF-8 byte, a huge number, deep brackets)
//!   or 1 to 7 random bytes, equally likely.
//! - [`byte_edit`]: the four of them and [`ByteEdit::RepeatFirstPair`], equally likely, with
//!   [`JSON_TOKENS`]; [`byte_edit_with`] for other tokens or other whole-document edits.

use std::borrow::Cow;
use std::ops::Range;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::Union;
use serde_json::{Value, json};

/// The configuration of every fuzz property: 256 cases, or `KEEL_FUZZ_CASES`; nothing saved.
pub fn config() -> ProptestConfig {
    let cases = std::env::var("KEEL_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- JSON ---------------------------------------------------------------------------------------

/// An object key: one of `known` three times in four, otherwise any string of up to 8 characters.
pub fn key(known: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(known).prop_map(str::to_string),
        1 => ".{0,8}",
    ]
}

/// A value chosen to break assumptions (see the module documentation), strings of `x` up to
/// 99,999 characters and arrays up to 199 deep, with the caller's `fixed` values and `other`
/// strategies among the alternatives; every alternative is equally likely.
pub fn hostile(fixed: Vec<Value>, other: Vec<BoxedStrategy<Value>>) -> BoxedStrategy<Value> {
    hostile_sized(100_000, 200, fixed, other)
}

/// [`hostile`], with strings of `x` up to `longest - 1` characters and arrays up to
/// `deepest - 1` deep.
pub fn hostile_sized(
    longest: usize,
    deepest: usize,
    fixed: Vec<Value>,
    other: Vec<BoxedStrategy<Value>>,
) -> BoxedStrategy<Value> {
    let common = vec![
        Just(Value::Null).boxed(),
        any::<bool>().prop_map(Value::from).boxed(),
        any::<i64>().prop_map(Value::from).boxed(),
        Just(json!(u64::MAX)).boxed(),
        Just(json!(1e308)).boxed(),
        Just(json!("")).boxed(),
        Just(json!("\u{0}")).boxed(),
        ".{0,16}".prop_map(Value::from).boxed(),
        (1..longest)
            .prop_map(|n| Value::from("x".repeat(n)))
            .boxed(),
        Just(json!({})).boxed(),
        Just(json!([])).boxed(),
        (1..deepest).prop_map(nested).boxed(),
    ];
    let fixed = fixed.into_iter().map(|v| Just(v).boxed());
    Union::new(common.into_iter().chain(fixed).chain(other)).boxed()
}

/// `depth` arrays inside each other, `null` innermost.
pub fn nested(depth: usize) -> Value {
    let mut v = Value::Null;
    for _ in 0..depth {
        v = Value::Array(vec![v]);
    }
    v
}

/// How large [`any_json`] makes a document.
#[derive(Debug, Clone)]
pub struct JsonSize {
    /// Levels of arrays and objects, at most.
    pub depth: u32,
    /// The number of elements an array or object is expected to hold, for proptest's sizing.
    pub branch: u32,
    /// How many elements an array holds.
    pub items: Range<usize>,
    /// How many keys an object holds (fewer when a key repeats).
    pub keys: Range<usize>,
}

/// Arbitrary JSON of about 64 nodes: null, booleans, `i64`s, the caller's `number`s and strings
/// of up to 12 characters, in arrays and objects (with keys from [`key`] of `known`) as large as
/// `size` says.
pub fn any_json(
    known: &'static [&'static str],
    number: BoxedStrategy<Value>,
    size: JsonSize,
) -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        number,
        ".{0,12}".prop_map(Value::from),
    ];
    let JsonSize {
        depth,
        branch,
        items,
        keys,
    } = size;
    leaf.prop_recursive(depth, 64, branch, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), items.clone()).prop_map(Value::Array),
            proptest::collection::vec((key(known), inner), keys.clone())
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// One structure-aware change to a JSON document, at the node an `Index` picks.
#[derive(Debug, Clone)]
pub enum Edit {
    /// Put this value in place of the node.
    Replace(Index, Value),
    /// Take the node out of its object or array.
    Remove(Index),
    /// Add this key and value to the node if it is an object, or the value if it is an array.
    Insert(Index, String, Value),
    /// Wrap the node in this many arrays.
    Nest(Index, usize),
}

/// An [`Edit`]: replace, remove, insert and nest in the proportions 3:2:2:1, with keys from `key`
/// and values from `hostile`.
pub fn edit(
    key: impl Strategy<Value = String>,
    hostile: BoxedStrategy<Value>,
) -> impl Strategy<Value = Edit> {
    edit_weighted([3, 2, 2, 1], key, hostile)
}

/// An [`Edit`], with replace, remove, insert and nest in the proportions `weights`.
pub fn edit_weighted(
    weights: [u32; 4],
    key: impl Strategy<Value = String>,
    hostile: BoxedStrategy<Value>,
) -> impl Strategy<Value = Edit> {
    let [replace, remove, insert, nest] = weights;
    prop_oneof![
        replace => (any::<Index>(), hostile.clone()).prop_map(|(i, v)| Edit::Replace(i, v)),
        remove => any::<Index>().prop_map(Edit::Remove),
        insert => (any::<Index>(), key, hostile).prop_map(|(i, k, v)| Edit::Insert(i, k, v)),
        nest => (any::<Index>(), 1usize..150).prop_map(|(i, d)| Edit::Nest(i, d)),
    ]
}

/// JSON pointers to every node of `v`, the root first.
fn pointers(v: &Value) -> Vec<String> {
    fn walk(v: &Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, format!("{at}/{i}"), out);
                }
            }
            Value::Object(map) => {
                for (k, item) in map {
                    let k = k.replace('~', "~0").replace('/', "~1");
                    walk(item, format!("{at}/{k}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

/// `doc` with `edit` made; an edit that does not fit the node it picks changes nothing.
pub fn apply(mut doc: Value, edit: &Edit) -> Value {
    let paths = pointers(&doc);
    let at = |i: &Index| paths[i.index(paths.len())].clone();
    match edit {
        Edit::Replace(i, v) => {
            if let Some(node) = doc.pointer_mut(&at(i)) {
                *node = v.clone();
            }
        }
        Edit::Remove(i) => {
            let p = at(i);
            if let Some((parent, last)) = p.rsplit_once('/') {
                let last = last.replace("~1", "/").replace("~0", "~");
                match doc.pointer_mut(parent) {
                    Some(Value::Object(map)) => {
                        map.remove(&last);
                    }
                    Some(Value::Array(items)) => {
                        if let Ok(n) = last.parse::<usize>() {
                            items.remove(n);
                        }
                    }
                    _ => {}
                }
            }
        }
        Edit::Insert(i, k, v) => match doc.pointer_mut(&at(i)) {
            Some(Value::Object(map)) => {
                map.insert(k.clone(), v.clone());
            }
            Some(Value::Array(items)) => items.push(v.clone()),
            _ => {}
        },
        Edit::Nest(i, depth) => {
            if let Some(node) = doc.pointer_mut(&at(i)) {
                let mut wrapped = node.take();
                for _ in 0..*depth {
                    wrapped = Value::Array(vec![wrapped]);
                }
                *node = wrapped;
            }
        }
    }
    doc
}

// ---- bytes --------------------------------------------------------------------------------------

/// One change to the bytes of an input.
#[derive(Debug, Clone)]
pub enum ByteEdit {
    /// XOR the byte an `Index` picks with this mask.
    Flip(Index, u8),
    /// Keep only the bytes before the position an `Index` picks.
    Truncate(Index),
    /// Delete up to this many bytes from the position an `Index` picks.
    Delete(Index, usize),
    /// Insert these bytes at the position an `Index` picks.
    Insert(Index, Vec<u8>),
    /// For text that starts with `{`: repeat everything up to its first `,` right after it, so
    /// that the first `"key":value` pair is there twice: `{"id":"a","id":"a",…`.
    RepeatFirstPair,
    /// For text with a `{` anywhere: repeat the pair that follows the first `{` (up to the next
    /// `,` or `}`, if it holds a `:`) right after it: `{"a":1}` becomes `{"a":1,"a":1}`.
    DuplicateFirstKey,
    /// For text that starts with `{`: put `"kind":"<this>",` first, ahead of the kind it names.
    KindFirst(&'static str),
}

/// Bytes that mean something to a JSON reader: invalid UTF-8, NUL, a lone surrogate, numbers too
/// large for any type, brackets deeper than serde_json reads, and the punctuation of JSON.
pub const JSON_TOKENS: &[&[u8]] = &[
    b"\xff",
    b"\xc3",
    b"\x00",
    b"\"\\ud800\"",
    b"1e99999",
    b"18446744073709551616",
    b"-1",
    b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    b",",
    b"}",
    b"\"",
];

/// A [`ByteEdit::Flip`] of any byte with any non-zero mask.
pub fn flip() -> impl Strategy<Value = ByteEdit> {
    (any::<Index>(), 1u8..=255).prop_map(|(i, m)| ByteEdit::Flip(i, m))
}

/// A [`ByteEdit::Truncate`] anywhere, the very end included.
pub fn truncate() -> impl Strategy<Value = ByteEdit> {
    any::<Index>().prop_map(ByteEdit::Truncate)
}

/// A [`ByteEdit::Delete`] of 1 to `most - 1` bytes.
pub fn delete(most: usize) -> impl Strategy<Value = ByteEdit> {
    (any::<Index>(), 1usize..most).prop_map(|(i, n)| ByteEdit::Delete(i, n))
}

/// A [`ByteEdit::Insert`] of one of `tokens` or of 1 to 7 random bytes, equally likely.
pub fn insert(tokens: impl Into<Cow<'static, [&'static [u8]]>>) -> impl Strategy<Value = ByteEdit> {
    (
        any::<Index>(),
        prop_oneof![
            proptest::sample::select(tokens).prop_map(<[u8]>::to_vec),
            proptest::collection::vec(any::<u8>(), 1..8),
        ],
    )
        .prop_map(|(i, b)| ByteEdit::Insert(i, b))
}

/// A [`ByteEdit`] for JSON: flip, truncate, delete (up to 63 bytes), insert (of
/// [`JSON_TOKENS`]) and [`ByteEdit::RepeatFirstPair`], equally likely.
pub fn byte_edit() -> BoxedStrategy<ByteEdit> {
    byte_edit_with(JSON_TOKENS, vec![Just(ByteEdit::RepeatFirstPair).boxed()])
}

/// A [`ByteEdit`]: flip, truncate, delete (up to 63 bytes), insert (of `tokens`) and each of the
/// `whole` document edits, equally likely.
pub fn byte_edit_with(
    tokens: &'static [&'static [u8]],
    whole: Vec<BoxedStrategy<ByteEdit>>,
) -> BoxedStrategy<ByteEdit> {
    let bytes = vec![
        flip().boxed(),
        truncate().boxed(),
        delete(64).boxed(),
        insert(tokens).boxed(),
    ];
    Union::new(bytes.into_iter().chain(whole)).boxed()
}

/// `bytes` with `edit` made; an edit that does not fit the input changes nothing.
pub fn apply_bytes(mut bytes: Vec<u8>, edit: &ByteEdit) -> Vec<u8> {
    let len = bytes.len();
    match edit {
        ByteEdit::Flip(i, mask) if len > 0 => bytes[i.index(len)] ^= mask,
        ByteEdit::Truncate(i) => bytes.truncate(i.index(len + 1)),
        ByteEdit::Delete(i, n) if len > 0 => {
            let from = i.index(len);
            bytes.drain(from..(from + n).min(len));
        }
        ByteEdit::Insert(i, b) => {
            let at = i.index(len + 1);
            bytes.splice(at..at, b.iter().copied());
        }
        ByteEdit::RepeatFirstPair => {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if let Some(rest) = text.strip_prefix('{')
                && let Some(end) = rest.find(',')
            {
                return format!("{{{},{rest}", &rest[..end]).into_bytes();
            }
        }
        ByteEdit::DuplicateFirstKey => {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if let Some(open) = text.find('{') {
                let rest = &text[open + 1..];
                if let Some(end) = rest.find([',', '}']) {
                    let pair = &rest[..end];
                    if pair.contains(':') {
                        let mut out = text[..=open].to_string();
                        out.push_str(pair);
                        out.push(',');
                        out.push_str(rest);
                        return out.into_bytes();
                    }
                }
            }
        }
        ByteEdit::KindFirst(kind) => {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if let Some(rest) = text.strip_prefix('{') {
                return format!("{{\"kind\":\"{kind}\",{rest}").into_bytes();
            }
        }
        _ => {}
    }
    bytes
}
