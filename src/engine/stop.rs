//! Stop strings over streamed text: a stop string split across tokens is caught, and text
//! that might be the start of one is held back until it is known not to be. All stop
//! strings are matched at once by one Aho-Corasick automaton over only the text that could
//! hold a new match, so a token costs the same however many stop strings there are (their
//! number and length are capped by [`super::RequestLimits`]).

use aho_corasick::{AhoCorasick, MatchKind};

#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    matcher: Option<AhoCorasick>,
    /// Length of the longest stop string.
    longest: usize,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    /// The matched stop string is part of the output (vLLM's `include_stop_str_in_output`).
    include: bool,
    /// Which stop string matched, once one has.
    matched: Option<usize>,
}

/// What one delta of text yields.
#[derive(Debug, PartialEq, Eq)]
pub struct StopScan {
    /// Text safe to emit now.
    pub emit: String,
    /// A stop string matched; the output ends before it.
    pub stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>, include: bool) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        // The leftmost match wins: the output must end before the earliest stop string.
        let matcher = (!stops.is_empty()).then(|| {
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostFirst)
                .build(&stops)
                .expect("stop strings are capped in size")
        });
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        StopStrings { stops, matcher, longest, include, ..Default::default() }
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        let Some(matcher) = &self.matcher else {
            return StopScan { emit: delta.to_owned(), stopped: false };
        };
        // A new match must end in the new text, so it starts after `emitted - longest`.
        let mut from = (self.emitted + 1).saturating_sub(self.longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(delta);
        if let Some(m) = matcher.find(&self.text[from..]) {
            self.matched = Some(m.pattern().as_usize());
            let end = if self.include { from + m.end() } else { from + m.start() }.max(self.emitted);
            let emit = self.text[self.emitted..end].to_owned();
            self.emitted = self.text.len();
            return StopScan { emit, stopped: true };
        }
        // Hold back the longest tail that could still grow into a stop string: the first
        // start position (within the last `longest - 1` bytes) whose tail begins a stop.
        let tail_from = self.text.len().saturating_sub(self.longest - 1).max(self.emitted);
        let held_from = (tail_from..self.text.len())
            .filter(|&p| self.text.is_char_boundary(p))
            .find(|&p| {
                let tail = &self.text.as_bytes()[p..];
                self.stops.iter().any(|s| s.as_bytes().starts_with(tail))
            })
            .unwrap_or(self.text.len());
        let emit = self.text[self.emitted..held_from].to_owned();
        self.emitted = held_from;
        StopScan { emit, stopped: false }
    }

    /// The stop string that ended the output, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Everything held back, when the sequence ends for another reason.
    pub fn flush(&mut self) -> String {
        let rest = self.text.get(self.emitted..).unwrap_or("").to_owned();
        self.emitted = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|x| x.to_string()).collect(), false);
        let mut out = String::new();
        for d in deltas {
            let r = s.push(d);
            out += &r.emit;
            if r.stopped {
                return (out, true);
            }
        }
        out += &s.flush();
        (out, false)
    }

    #[test]
    fn stop_string_split_across_tokens() {
        assert_eq!(feed(&["STOP"], &["Hello S", "TO", "P world"]), ("Hello ".into(), true));
        assert_eq!(feed(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn the_stop_string_can_be_kept() {
        let mut s = StopStrings::new(vec!["STOP".into()], true);
        assert_eq!(s.push("Hello S").emit, "Hello ");
        let r = s.push("TOP world");
        assert_eq!((r.emit.as_str(), r.stopped), ("STOP", true));
    }

    #[test]
    fn possible_prefix_is_held_then_released() {
        let mut s = StopStrings::new(vec!["STOP".into()], false);
        assert_eq!(s.push("Hi ST").emit, "Hi ");
        assert_eq!(s.push("AR").emit, "STAR");
        assert_eq!(feed(&["STOP"], &["ST"]), ("ST".into(), false), "flushed at the end");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_no_stops_pass_through() {
        assert_eq!(feed(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(feed(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(feed(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }

    /// The automaton gives what a naive scan of every stop string over the whole text gives.
    #[test]
    fn matches_a_naive_scan() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let alphabet = ['a', 'b', 'c', 'é'];
        let word = |rng: &mut rand::rngs::StdRng, max: usize| -> String {
            (0..rng.random_range(1..=max)).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect()
        };
        for _ in 0..2000 {
            let stops: Vec<String> = (0..rng.random_range(1..4)).map(|_| word(&mut rng, 4)).collect();
            let deltas: Vec<String> = (0..rng.random_range(1..8)).map(|_| word(&mut rng, 3)).collect();
            // Naive: after each delta, the earliest occurrence of any stop in all text so far.
            let mut text = String::new();
            let mut naive = None;
            for d in &deltas {
                text += d;
                naive = stops.iter().filter_map(|s| text.find(s.as_str())).min();
                if naive.is_some() {
                    break;
                }
            }
            let refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let drefs: Vec<&str> = deltas.iter().map(String::as_str).collect();
            let (out, stopped) = feed(&refs, &drefs);
            match naive {
                Some(at) => assert_eq!((out.as_str(), stopped), (&text[..at], true), "{stops:?} {deltas:?}"),
                None => assert_eq!((out.as_str(), stopped), (text.as_str(), false), "{stops:?} {deltas:?}"),
            }
        }
    }
}
