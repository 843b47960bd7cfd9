//! JSON as written, for the oracles: objects keep every entry in order, a repeated key included
//! (a `serde_json::Value` keeps only the last, and so cannot show what keel's parsers see).

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A JSON value with its objects' entries as written.
#[derive(Debug)]
pub(crate) enum Ordered {
    Object(Vec<(String, Ordered)>),
    Array(Vec<Ordered>),
    /// A string, number, boolean or null.
    Scalar(Value),
}

impl Ordered {
    /// Reads `bytes` as one JSON value; `None` if they are not one.
    pub(crate) fn parse(bytes: &[u8]) -> Option<Ordered> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether this is an object in which a key is written more than once.
    pub(crate) fn repeats_a_key(&self) -> bool {
        let Ordered::Object(entries) = self else {
            return false;
        };
        entries
            .iter()
            .enumerate()
            .any(|(i, (k, _))| entries[..i].iter().any(|(seen, _)| seen == k))
    }
}

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Ordered>()? {
                    out.push(entry);
                }
                Ok(Ordered::Object(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ordered, A::Error> {
                let mut out = Vec::new();
                while let Some(item) = seq.next_element::<Ordered>()? {
                    out.push(item);
                }
                Ok(Ordered::Array(out))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::from(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::from(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::String(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::String(v)))
            }
            fn visit_unit<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::Null))
            }
            fn visit_none<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Scalar(Value::Null))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_key_is_kept_where_a_value_keeps_only_the_last() {
        let body = br#"{"usage": [1, {"a": 1, "a": 2}], "usage": {"input_tokens": 1}, "n": null}"#;
        let v = Ordered::parse(body).unwrap();
        assert!(v.repeats_a_key());
        let Ordered::Object(entries) = &v else {
            panic!("{v:?}")
        };
        assert_eq!(entries.len(), 3);
        let Ordered::Array(items) = &entries[0].1 else {
            panic!("{v:?}")
        };
        assert!(items[1].repeats_a_key());
        assert!(!entries[1].1.repeats_a_key());
        assert!(matches!(entries[2].1, Ordered::Scalar(Value::Null)));
        assert!(Ordered::parse(br#"{"a": "x", "b": "x"}"#).is_some_and(|v| !v.repeats_a_key()));
        assert!(
            matches!(Ordered::parse(br#""s""#), Some(Ordered::Scalar(Value::String(s))) if s == "s")
        );
        assert!(Ordered::parse(b"{").is_none());
    }
}
