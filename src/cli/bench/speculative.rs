//! Speculative decoding on against off: input-grounded tasks and free generation at one
//! stream, then 2 to 32 streams at once.

use super::measure::*;
use crate::engine::{EngineConfig, EngineHandle, Request};
use anyhow::{ensure, Result};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A paragraph for the input-grounded task: most of a faithful rewrite copies it.
const PARAGRAPH: &str = "Alice Morgan opened the bakery on Elm Street at six every morning. Alice \
baked bread while her brother Tom Morgan served coffee to the first customers. On Saturdays Alice \
and Tom sold apple pies at the market, and Tom always kept the best pie for their neighbour, Mrs. \
Green. When the old oven broke in winter, Mrs. Green lent Alice her own oven until the new one came.";

/// The paragraph with five words misspelled, for the proofreading task.
fn misspelled(text: &str) -> String {
    [("bakery", "bakry"), ("morning", "mornign"), ("customers", "custmers"), ("market", "markit"), ("winter", "wintr")]
        .iter()
        .fold(text.to_string(), |t, (right, wrong)| t.replace(right, wrong))
}

/// Code for the code-edit task: a rename leaves the rest as it was.
const CODE: &str = "def total_price(items, tax):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
";

/// Speculative decoding on against off, greedy, through the model's chat template: one
/// stream on grounded tasks and on free generation (each run three times, alternating,
/// the fastest kept: this machine's speed drifts), then 32 streams at once (twice each).
pub(super) fn speculative_run(
    model: &Arc<crate::loaded::LoadedModel>,
    base: &EngineConfig,
    spec: &crate::engine::speculative::SpeculativeConfig,
) -> Result<Value> {
    use crate::tokenizer::ChatContext;
    let tok = &model.tokenizer;
    let template = tok.chat().map_err(|e| anyhow::anyhow!("the speculative run needs a chat template: {e}"))?;
    let chat = |text: &str| -> Result<Vec<u32>> {
        let messages = [json!({"role": "user", "content": text})];
        let text =
            template.render(&ChatContext { messages: &messages, add_generation_prompt: true, ..Default::default() })?;
        tok.encode_with(&text, false)
    };
    let tasks = [
        ("rewrite", chat(&format!("Rewrite this paragraph with the names changed (Alice to Maria, Tom to Ben, Mrs. Green to Mr. Hill):\n\n{PARAGRAPH}"))?),
        ("code edit", chat(&format!("Rename the variable `items` to `products` in this Python code and show the whole code:\n\n```python\n{CODE}```"))?),
        ("proofread", chat(&format!("Correct the spelling mistakes in this paragraph and write it out in full:\n\n{}", misspelled(PARAGRAPH)))?),
        ("free", chat("Write a short story about a dragon who learns to cook.")?),
    ];
    let request = |prompt: &[u32]| Request::new(prompt.to_vec(), 256);
    let off = EngineHandle::start(model.clone(), EngineConfig { speculative: None, ..base.clone() })?;
    let on = EngineHandle::start(model.clone(), EngineConfig { speculative: Some(spec.clone()), ..base.clone() })?;
    println!("\nspeculative decoding ({spec:?}), greedy, chat template; one stream, then many at once");
    println!("(drafted: draft tokens verified per output token; accepted: the share of them kept)");
    println!(
        "{:>10} {:>7} {:>12} {:>12} {:>7} {:>9} {:>8} {:>10}",
        "task", "tokens", "off tok/s", "on tok/s", "ratio", "accepted", "drafted", "identical"
    );
    let accepted = |e: &EngineHandle| {
        let st = e.stats();
        (st.spec_draft_tokens, st.spec_accepted_tokens)
    };
    // Decode speed: tokens after the first over the time since the first.
    let decode_rate = |t: &Timing| {
        (t.tokens.len().saturating_sub(1)) as f64 / (t.tokens[t.tokens.len() - 1] - t.tokens[0]).as_secs_f64().max(1e-9)
    };
    let mut rows = Vec::new();
    for (name, prompt) in &tasks {
        let (mut best_off, mut best_on, mut ids) = (0f64, 0f64, Vec::new());
        let before = accepted(&on);
        for _ in 0..3 {
            for (engine, best) in [(&off, &mut best_off), (&on, &mut best_on)] {
                let t = drive(engine, vec![(Duration::ZERO, request(prompt))])?.remove(0);
                ensure!(t.tokens.len() > 1, "the {name} task produced no output to time");
                *best = best.max(decode_rate(&t));
                ids.push(t.ids);
            }
        }
        let after = accepted(&on);
        let rate = (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64;
        let drafted = (after.0 - before.0) as f64 / 3.0 / ids[0].len() as f64;
        let identical = ids.windows(2).all(|w| w[0] == w[1]);
        println!(
            "{name:>10} {:>7} {best_off:>12.1} {best_on:>12.1} {:>6.2}x {:>8.1}% {drafted:>8.2} {:>10}",
            ids[0].len(),
            best_on / best_off,
            100.0 * rate,
            if identical { "yes" } else { "NO" }
        );
        rows.push(json!({"task": name, "tokens": ids[0].len(), "off_tok_s": best_off, "on_tok_s": best_on,
            "ratio": best_on / best_off, "acceptance": rate, "drafted_per_token": drafted, "identical": identical}));
    }
    // Many streams: the tasks' prompts in turn, all sent at once. As the batch grows the
    // step turns compute-bound and drafts should fade out (the "drafted" column).
    for streams in [2, 4, 8, 16, 32] {
        let many: Vec<(Duration, Request)> =
            (0..streams).map(|i| (Duration::ZERO, request(&tasks[i % tasks.len()].1))).collect();
        // (best tokens/s, outputs) per engine; alternating runs, as above.
        let mut tput: Vec<(f64, Vec<Vec<u32>>)> = vec![(0.0, Vec::new()), (0.0, Vec::new())];
        let before = accepted(&on);
        for _ in 0..2 {
            for (engine, best) in [&off, &on].into_iter().zip(tput.iter_mut()) {
                let t0 = Instant::now();
                let t = drive(engine, many.clone())?;
                let out: usize = t.iter().map(|x| x.tokens.len()).sum();
                best.0 = best.0.max(out as f64 / t0.elapsed().as_secs_f64());
                best.1 = t.into_iter().map(|x| x.ids).collect();
            }
        }
        let after = accepted(&on);
        let tokens: usize = tput[0].1.iter().map(Vec::len).sum();
        let drafted = (after.0 - before.0) as f64 / 2.0 / tokens as f64;
        let rate = (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64;
        let identical = tput[0].1 == tput[1].1;
        let ratio = tput[1].0 / tput[0].0;
        let name = format!("{streams} streams");
        println!(
            "{name:>10} {tokens:>7} {:>12.1} {:>12.1} {ratio:>6.2}x {:>8.1}% {drafted:>8.2} {:>10}",
            tput[0].0,
            tput[1].0,
            100.0 * rate,
            if identical { "yes" } else { "NO" }
        );
        rows.push(
            json!({"task": name, "tokens": tokens, "off_tok_s": tput[0].0, "on_tok_s": tput[1].0, "ratio": ratio,
            "acceptance": rate, "drafted_per_token": drafted, "identical": identical}),
        );
    }
    Ok(json!({"config": format!("{spec:?}"), "runs": rows}))
}
