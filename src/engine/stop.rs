//! Stop strings over streamed text: a stop string split across tokens is caught, and text
//! that might be the start of one is held back until it is known not to be.

#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
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
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan { emit: delta.to_owned(), stopped: false };
        }
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = (self.emitted + 1).saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(delta);
        let hit = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min();
        if let Some(end) = hit {
            let end = end.max(self.emitted);
            let emit = self.text[self.emitted..end].to_owned();
            self.emitted = self.text.len();
            return StopScan { emit, stopped: true };
        }
        // Hold back the longest tail that could still grow into a stop string.
        let held = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(move |&k| s.is_char_boundary(k)).map(move |k| &s[..k]))
            .filter(|prefix| self.text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let safe = self.text.len() - held;
        let emit = if safe > self.emitted { self.text[self.emitted..safe].to_owned() } else { String::new() };
        self.emitted = self.emitted.max(safe);
        StopScan { emit, stopped: false }
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
        let mut s = StopStrings::new(stops.iter().map(|x| x.to_string()).collect());
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
    fn possible_prefix_is_held_then_released() {
        let mut s = StopStrings::new(vec!["STOP".into()]);
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
}
