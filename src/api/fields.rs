//! The JSON keys a `#[derive(Deserialize)]` struct reads, asked of serde itself, so that no
//! list of field names is written again beside the struct.

use serde::de::{self, Deserialize, Deserializer, Visitor};
use std::fmt;

/// The keys `T` reads: its fields as serde names them (renames applied, skipped fields left
/// out); none for a type that is not a struct (a map, `Value`).
pub fn keys<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    // The probe always fails: it only records what the derived code asks for.
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// A deserializer that hands nothing to the visitor and remembers the struct's fields.
struct Probe<'a>(&'a mut &'static [&'static str]);

#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field probe")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for Probe<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = fields;
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::keys;
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Example {
        plain: u32,
        #[serde(rename = "renamed")]
        inner: Option<String>,
        #[serde(skip)]
        skipped: bool,
    }

    #[test]
    fn keys_are_the_fields_serde_reads() {
        assert_eq!(keys::<Example>(), ["plain", "renamed"]);
        assert!(keys::<serde_json::Value>().is_empty());
        assert!(keys::<std::collections::HashMap<String, u32>>().is_empty());
    }
}
