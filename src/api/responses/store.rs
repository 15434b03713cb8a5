//! Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: each keeps the
//! conversation so far (as chat messages) and the response object. Bounded in count, bytes
//! and age; the oldest go first.

use crate::api::chat::ChatMessage;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    /// The conversation up to and including this response's answer (instructions left out:
    /// they do not carry over).
    pub messages: Vec<ChatMessage>,
    pub response: Value,
    bytes: usize,
    at: Instant,
}

/// The store's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub count: usize,
    pub bytes: usize,
    pub age: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds { count: 4096, bytes: 256 << 20, age: Duration::from_secs(3600) }
    }
}

#[derive(Debug, Default)]
pub struct Store {
    bounds: Bounds,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<String, Arc<Stored>>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

impl Store {
    pub fn new(bounds: Bounds) -> Self {
        Store { bounds, inner: Mutex::default() }
    }

    /// Keeps a response under its `id`, evicting the oldest while over the bounds. One larger
    /// than the whole byte bound is not kept.
    pub fn put(&self, messages: Vec<ChatMessage>, response: Value) {
        let Some(id) = response["id"].as_str().map(str::to_owned) else { return };
        let bytes = serde_json::to_string(&messages).map_or(0, |s| s.len()) + response.to_string().len();
        if bytes > self.bounds.bytes {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.bytes += bytes;
        let stored = Arc::new(Stored { messages, response, bytes, at: Instant::now() });
        if let Some(old) = inner.map.insert(id.clone(), stored) {
            inner.bytes -= old.bytes;
            inner.order.retain(|i| i != &id);
        }
        inner.order.push_back(id);
        while inner.map.len() > self.bounds.count || inner.bytes > self.bounds.bytes {
            inner.pop_oldest();
        }
    }

    /// The response stored as `id`, unless it is unknown or has expired.
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while inner.order.front().and_then(|o| inner.map.get(o)).is_some_and(|s| s.at.elapsed() > self.bounds.age) {
            inner.pop_oldest();
        }
        inner.map.get(id).cloned()
    }

    /// Forgets `id`; whether it was there.
    pub fn delete(&self, id: &str) -> bool {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(old) = inner.map.remove(id) else { return false };
        inner.bytes -= old.bytes;
        inner.order.retain(|i| i != id);
        true
    }
}

impl Inner {
    fn pop_oldest(&mut self) {
        if let Some(id) = self.order.pop_front() {
            if let Some(old) = self.map.remove(&id) {
                self.bytes -= old.bytes;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn put(s: &Store, id: &str, text: &str) {
        s.put(vec![], json!({"id": id, "text": text}));
    }

    #[test]
    fn bounded_in_count_bytes_and_age() {
        let s = Store::new(Bounds { count: 2, bytes: 200, age: Duration::from_secs(60) });
        put(&s, "a", "x");
        put(&s, "b", "x");
        put(&s, "c", "x");
        assert!(s.get("a").is_none() && s.get("b").is_some() && s.get("c").is_some());
        put(&s, "big", &"y".repeat(300));
        assert!(s.get("big").is_none() && s.get("c").is_some());
        put(&s, "d", &"z".repeat(170));
        assert!(s.get("b").is_none() && s.get("c").is_none() && s.get("d").is_some());
        assert!(s.delete("d") && !s.delete("d"));
        assert_eq!(s.inner.lock().unwrap().bytes, 0);
        let quick = Store::new(Bounds { age: Duration::ZERO, ..Bounds::default() });
        put(&quick, "e", "x");
        std::thread::sleep(Duration::from_millis(2));
        assert!(quick.get("e").is_none());
    }
}
