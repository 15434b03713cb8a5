//! Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last
//! n tokens is a free guess at what comes next. It costs nothing to propose, and on
//! input-grounded tasks (rewriting, quoting, code edits) the output copies long spans.

/// Up to `k` tokens that followed the latest earlier occurrence of the last `n` tokens of
/// `tokens`, for the longest `n` in `min..=max` that occurs earlier, with that `n`; `None`
/// if none does.
pub fn propose(tokens: &[u32], min: usize, max: usize, k: usize) -> Option<(usize, Vec<u32>)> {
    let len = tokens.len();
    if k == 0 {
        return None;
    }
    for n in (min.max(1)..=max).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Latest first; the suffix itself (start == len - n) is not an earlier occurrence.
        // Compared from the last token, the likeliest to differ.
        let found = (0..len - n).rev().find(|&start| tokens[start..start + n].iter().rev().eq(suffix.iter().rev()));
        if let Some(start) = found {
            let from = start + n;
            return Some((n, tokens[from..(from + k).min(len)].to_vec()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn continues_the_latest_longest_match() {
        // "1 2 3 4 5 ... 1 2 3" → what followed "1 2 3" last time: 4 5 9.
        let t = [1, 2, 3, 4, 5, 9, 7, 1, 2, 3];
        assert_eq!(propose(&t, 1, 3, 3), Some((3, vec![4, 5, 9])));
        assert_eq!(propose(&t, 1, 3, 10), Some((3, vec![4, 5, 9, 7, 1, 2, 3])), "stops at the end");
        // The latest occurrence wins: "2 8" then "2 6"; after "… 2" comes 6.
        assert_eq!(propose(&[2, 8, 2, 6, 2], 1, 1, 1), Some((1, vec![6])));
        // The longest n wins over a later shorter match: [5 2] matched at 0 gives 8, not 6.
        assert_eq!(propose(&[5, 2, 8, 2, 6, 5, 2], 1, 2, 1), Some((2, vec![8])));
    }

    #[test]
    fn nothing_without_an_earlier_occurrence() {
        assert_eq!(propose(&[1, 2, 3, 4], 1, 3, 4), None);
        assert_eq!(propose(&[1, 2, 1, 2], 3, 3, 4), None, "n below min is not tried");
        assert_eq!(propose(&[1, 1], 2, 2, 4), None, "too short");
        assert_eq!(propose(&[1, 1, 1], 1, 2, 0), None, "k = 0");
        assert_eq!(propose(&[1, 1, 1], 1, 2, 4), Some((2, vec![1])), "overlapping occurrence");
    }
}
