//! The parts of a SentencePiece `tokenizer.model` (a protobuf `ModelProto`) that a GGUF
//! vocabulary carries: each piece with its score and type, and whether a space is prefixed.
//! The file is untrusted: every length is checked against the bytes that remain.

use anyhow::{bail, ensure, Context, Result};

/// A SentencePiece vocabulary.
#[derive(Debug, PartialEq)]
pub struct SpmModel {
    /// (piece, score, type) by id; types are SentencePiece's, which GGUF's `token_type` reuses
    /// (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub pieces: Vec<(String, f32, i32)>,
    /// `normalizer_spec.add_dummy_prefix`: a space goes in front of the text.
    pub add_dummy_prefix: bool,
}

/// One protobuf field: its number and its value (a varint, or the bytes of a fixed-size or
/// length-delimited value).
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

struct Wire<'a> {
    buf: &'a [u8],
}

impl<'a> Wire<'a> {
    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.buf.split_first().context("truncated varint")?;
            self.buf = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint longer than 10 bytes")
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        let n = usize::try_from(n).ok().filter(|&n| n <= self.buf.len()).context("field runs past the end")?;
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next (field number, value), or `None` at the end.
    fn next(&mut self) -> Result<Option<(u64, Field<'a>)>> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => Field::Bytes(self.take(8)?),
            2 => {
                let n = self.varint()?;
                Field::Bytes(self.take(n)?)
            }
            5 => Field::Bytes(self.take(4)?),
            other => bail!("unsupported protobuf wire type {other}"),
        };
        Ok(Some((key >> 3, value)))
    }
}

impl SpmModel {
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut pieces = Vec::new();
        let mut add_dummy_prefix = true;
        let mut top = Wire { buf: bytes };
        while let Some((field, value)) = top.next()? {
            match (field, value) {
                (1, Field::Bytes(b)) => pieces.push(Self::piece(b).with_context(|| format!("piece {}", pieces.len()))?),
                (3, Field::Bytes(b)) => {
                    let mut spec = Wire { buf: b };
                    while let Some((f, v)) = spec.next()? {
                        if let (3, Field::Varint(x)) = (f, v) {
                            add_dummy_prefix = x != 0;
                        }
                    }
                }
                _ => {}
            }
        }
        ensure!(!pieces.is_empty(), "no pieces (not a SentencePiece model?)");
        Ok(SpmModel { pieces, add_dummy_prefix })
    }

    fn piece(b: &[u8]) -> Result<(String, f32, i32)> {
        let (mut text, mut score, mut ty) = (None, 0.0, 1);
        let mut w = Wire { buf: b };
        while let Some((f, v)) = w.next()? {
            match (f, v) {
                (1, Field::Bytes(s)) => text = Some(std::str::from_utf8(s).context("piece is not UTF-8")?.to_owned()),
                (2, Field::Bytes(s)) if s.len() == 4 => score = f32::from_le_bytes(s.try_into()?),
                (3, Field::Varint(t)) => {
                    ty = i32::try_from(t).ok().filter(|t| (1..=6).contains(t)).context("bad type")?
                }
                _ => {}
            }
        }
        Ok((text.context("piece without text")?, score, ty))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(out: &mut Vec<u8>, num: u8, wire: u8, body: &[u8]) {
        out.push(num << 3 | wire);
        if wire == 2 {
            out.push(body.len() as u8);
        }
        out.extend(body);
    }

    fn piece(text: &str, score: f32, ty: u8) -> Vec<u8> {
        let mut p = Vec::new();
        field(&mut p, 1, 2, text.as_bytes());
        field(&mut p, 2, 5, &score.to_le_bytes());
        if ty != 1 {
            field(&mut p, 3, 0, &[ty]);
        }
        p
    }

    #[test]
    fn reads_pieces_and_the_dummy_prefix_and_rejects_truncation() {
        let mut m = Vec::new();
        field(&mut m, 1, 2, &piece("<unk>", 0.0, 2));
        field(&mut m, 1, 2, &piece("\u{2581}a", -1.5, 1));
        field(&mut m, 2, 2, &[8, 1]); // trainer spec: skipped
        field(&mut m, 3, 2, &[3 << 3, 0]); // add_dummy_prefix = false
        let got = SpmModel::parse(&m).unwrap();
        assert_eq!(got.pieces, [("<unk>".to_string(), 0.0, 2), ("\u{2581}a".to_string(), -1.5, 1)]);
        assert!(!got.add_dummy_prefix);
        for cut in 1..m.len() {
            let _ = SpmModel::parse(&m[..cut]); // never panics
        }
        assert!(SpmModel::parse(&m[..m.len() - 1]).is_err());
        assert!(SpmModel::parse(&[]).is_err());
    }
}
