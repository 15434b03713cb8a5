//! The engine loop: commands in, steps run, events out.

use super::kv_events::Outbox;
use super::shared::{Command, Shared};
use super::speculative::{Ask, Speculator};
use super::stats::RECENT_STEPS;
use super::step_cost::{attended, StepCost};
use super::{Event, FinishReason, Request, StopStrings, Usage};
use crate::grammar::{Constraint, TokenMask};
use crate::kv::KvCache;
use crate::model::{Pooling, SeqStep, StepInput, Workspace};
use crate::sampling::{PromptLogprob, Sampled, Sampler};
use crate::scheduler::{CacheCopy, Scheduled, Scheduler, SchedulerConfig, SeqId, Sequence};
use crate::tokenizer::Detokenizer;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

struct RequestState {
    request: Request,
    events: UnboundedSender<Event>,
    /// Sequences not yet finished.
    seqs: Vec<SeqId>,
    /// Still counted as waiting (not yet admitted).
    waiting: bool,
    /// Samples 1..n have been forked from sample 0.
    forked: bool,
    submitted: Instant,
    first_token: bool,
}

/// What the engine keeps per sequence, inside the scheduler's record of it.
struct SeqState {
    request: u64,
    index: usize,
    /// Tokens of its prompt: longrope chooses the prompt rows' factors by it, also when
    /// they are computed again after a preemption ([`SeqStep::seq_len`]).
    prompt_len: usize,
    sampler: Sampler,
    detok: Detokenizer,
    stop: StopStrings,
    stop_ids: Vec<u32>,
    generated: usize,
    last_token: Option<Instant>,
    /// Structured output: the sequence's place in its grammar, and the tokens it allows at
    /// this step (computed beside the forward pass; an error fails the sequence).
    constraint: Option<Constraint>,
    mask: Option<Result<TokenMask, String>>,
    /// Prompt logprobs: the next prompt position to score (recomputed rows after a
    /// preemption are not scored twice).
    scored: usize,
    /// An embedding request's pooling, as its rows come.
    pool: Option<Pool>,
}

/// An embedding being pooled from the final hidden states of the prompt's rows.
struct Pool {
    kind: Pooling,
    /// Mean: the sum of rows `0..covered` (rows recomputed after a preemption are not
    /// added twice); last: the latest row.
    acc: Vec<f64>,
    covered: usize,
}

impl Pool {
    /// Adds `rows` (of width `d`), which hold positions `first..`.
    fn add(&mut self, rows: &[f32], first: usize, d: usize) {
        if self.acc.is_empty() {
            self.acc = vec![0.0; d];
        }
        for (i, row) in rows.chunks_exact(d).enumerate() {
            match self.kind {
                Pooling::Last => self.acc.iter_mut().zip(row).for_each(|(a, &x)| *a = x as f64),
                Pooling::Mean if first + i == self.covered => {
                    self.acc.iter_mut().zip(row).for_each(|(a, &x)| *a += x as f64);
                    self.covered += 1;
                }
                Pooling::Mean => {}
            }
        }
    }

    /// The pooled vector, L2-normalised.
    fn vector(&self) -> Vec<f32> {
        let n = if self.kind == Pooling::Mean { self.covered.max(1) as f64 } else { 1.0 };
        let v: Vec<f64> = self.acc.iter().map(|a| a / n).collect();
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        v.iter().map(|x| (x / norm) as f32).collect()
    }
}

pub(super) struct EngineLoop {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Command>,
    sched: Scheduler<SeqState>,
    kv: KvCache,
    ws: Workspace,
    requests: HashMap<u64, RequestState>,
    next_seq: SeqId,
    /// Set once every handle is gone: finish what runs, then stop.
    closing: bool,
    /// Prefix-cache counts of schedulers replaced after a failure, so totals never go back.
    prefix_carry: (u64, u64),
    /// The fitted step-time model that sizes prefill beside decodes (and drafts).
    cost: StepCost,
    spec: Option<Speculator>,
    kv_events: Option<Outbox>,
}

impl EngineLoop {
    pub fn new(
        shared: Arc<Shared>,
        kv: KvCache,
        spec: Option<Speculator>,
        rx: mpsc::Receiver<Command>,
        kv_events: Option<Outbox>,
    ) -> Self {
        let sched = Self::scheduler(&shared, &kv);
        let cost = StepCost::new(shared.config.max_step_ms);
        EngineLoop {
            shared,
            rx,
            sched,
            kv,
            ws: Workspace::default(),
            requests: HashMap::new(),
            next_seq: 0,
            closing: false,
            prefix_carry: (0, 0),
            cost,
            spec,
            kv_events,
        }
    }

    fn scheduler(shared: &Shared, kv: &KvCache) -> Scheduler<SeqState> {
        let cfg = &shared.config;
        let recurrent = kv.states.slot_len() > 0;
        Scheduler::new(SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            block_size: cfg.block_size,
            num_blocks: kv.num_blocks(),
            prefix_caching: cfg.prefix_caching,
            kv_events: cfg.kv_events.is_some(),
            state_snapshots: recurrent.then_some(shared.state_snapshots),
            max_draft: cfg.speculative.as_ref().map_or(0, |s| s.num_speculative_tokens),
            prefill_align: if recurrent { crate::model::RECURRENT_RUN } else { 1 },
        })
    }

    /// The loop, supervised: a panic anywhere in an iteration fails the requests in flight
    /// (each gets an error event) and the loop goes on with fresh books. Restarting in place
    /// costs microseconds and keeps the loaded weights and the listening server; the KV
    /// pools need no clearing because a block is always written before it is read.
    pub fn run(mut self) {
        loop {
            let iteration = std::panic::catch_unwind(AssertUnwindSafe(|| {
                if !self.take_commands() {
                    return false;
                }
                self.drop_abandoned();
                if !self.sched.is_idle() {
                    self.step();
                }
                true
            }));
            match iteration {
                Ok(true) => {}
                Ok(false) => return,
                Err(panic) => self.recover(panic_message(&*panic)),
            }
            if let Some(outbox) = &mut self.kv_events {
                outbox.send(&mut self.sched, &self.shared.stats);
            }
            self.publish_occupancy();
        }
    }

    /// After a panic: every request still known gets an error event and its stream closes;
    /// the scheduler (and with it the block allocator) starts empty.
    fn recover(&mut self, message: String) {
        eprintln!("weft: engine step failed: {message}; failing its requests and restarting the engine");
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).engine_failures += 1;
        let message = format!("the engine failed while running this request ({message}); it has been restarted");
        for (_, req) in self.requests.drain() {
            if req.waiting {
                self.shared.waiting.fetch_sub(req.request.n, Ordering::SeqCst);
            }
            for _ in &req.seqs {
                self.shared.observer.finished(FinishReason::Error, req.submitted.elapsed());
            }
            let _ = req.events.send(Event::Error { message: message.clone() });
        }
        let (q, h) = self.sched.prefix_cache_counts();
        self.prefix_carry = (self.prefix_carry.0 + q, self.prefix_carry.1 + h);
        self.sched = Self::scheduler(&self.shared, &self.kv);
        if let Some(outbox) = &mut self.kv_events {
            outbox.restart();
        }
        self.ws = Workspace::default();
        if let Some(spec) = &mut self.spec {
            spec.reset();
        }
    }

    /// Running, waiting and KV usage as they are now (after steps, aborts and submissions).
    fn publish_occupancy(&self) {
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.running = self.sched.num_running();
        st.waiting = self.shared.waiting.load(Ordering::SeqCst) + self.sched.num_requeued();
        st.kv_blocks_used = self.sched.blocks_used();
        st.kv_blocks_total = self.sched.num_blocks();
        st.kv_blocks_cached = self.sched.num_cached_blocks();
        let per_seq = 4 * self.kv.states.slot_len();
        st.state_bytes_per_seq = per_seq;
        if per_seq > 0 {
            (st.state_slots_used, st.state_slots_total) = (self.sched.num_running(), self.shared.config.max_num_seqs);
            (st.state_snapshots, st.state_snapshots_total) = self.sched.snapshot_counts();
        }
        st.preemptions = self.sched.preemptions();
        let (q, h) = self.sched.prefix_cache_counts();
        st.prefix_cache_queries = self.prefix_carry.0 + q;
        st.prefix_cache_hits = self.prefix_carry.1 + h;
    }

    /// Takes pending commands, blocking while there is nothing to run. False: time to stop.
    fn take_commands(&mut self) -> bool {
        if self.sched.is_idle() {
            if self.closing {
                return false;
            }
            match self.idle_wait() {
                Ok(cmd) => self.command(cmd),
                Err(_) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(cmd) => self.command(cmd),
                Err(mpsc::TryRecvError::Empty) => return true,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.closing = true;
                    return true;
                }
            }
        }
    }

    /// The next command, waited for. A KV-event snapshot that the full queue refused is
    /// retried meanwhile, so an idle engine's subscribers do not stay stale until traffic comes.
    fn idle_wait(&mut self) -> Result<Command, mpsc::RecvError> {
        while let Some(outbox) = self.kv_events.as_mut().filter(|o| o.pending()) {
            match self.rx.recv_timeout(std::time::Duration::from_millis(10)) {
                Ok(cmd) => return Ok(cmd),
                Err(mpsc::RecvTimeoutError::Timeout) => outbox.send(&mut self.sched, &self.shared.stats),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(mpsc::RecvError),
            }
        }
        self.rx.recv()
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, request, events, submitted } => {
                let request = *request;
                let s = self.new_seq(id, 0, &request);
                let seq = s.id;
                self.sched.add(s);
                self.requests.insert(
                    id,
                    RequestState {
                        request,
                        events,
                        seqs: vec![seq],
                        waiting: true,
                        forked: false,
                        submitted,
                        first_token: false,
                    },
                );
            }
            Command::Abort(id) => self.abort(id),
        }
    }

    /// Sample `index` of request `request`: its prompt, sampler and stop state.
    fn new_seq(&mut self, request: u64, index: usize, r: &Request) -> Sequence<SeqState> {
        let id = self.next_seq;
        self.next_seq += 1;
        let mut sampling = r.sampling.clone();
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(index as u64));
        let tok = &self.shared.model.tokenizer;
        let mut stop_ids = r.stop.stop_token_ids.clone();
        if !r.stop.ignore_eos {
            stop_ids.extend(&tok.eos_ids);
        }
        let mut sampler = Sampler::new(sampling, &r.prompt);
        sampler.hold(stop_ids.clone(), r.stop.min_tokens);
        let state = SeqState {
            request,
            index,
            prompt_len: r.prompt.len(),
            sampler,
            detok: Detokenizer::new(tok, &r.prompt, r.skip_special_tokens),
            stop: StopStrings::new(r.stop.stop_strings.clone(), r.stop.include_stop_str_in_output),
            stop_ids,
            generated: 0,
            last_token: None,
            constraint: r.constraint.clone(),
            mask: None,
            scored: 1,
            pool: r.embed.then(|| Pool {
                kind: self.shared.model.model.config.pooling.unwrap_or(Pooling::Last),
                acc: Vec::new(),
                covered: 0,
            }),
        };
        // Arrival is the request id: samples of one request are ordered together.
        let mut seq = Sequence::new(id, r.prompt.clone(), r.priority, request, state);
        seq.cache_salt = r.cache_salt.as_deref().map(Into::into);
        // A prompt past longrope's edge computes every row with the long factors, so its
        // blocks are cached apart from a shorter prompt's (whose first rows take the short).
        if self.shared.model.model.config.length_edge().is_some_and(|edge| r.prompt.len() > edge) {
            let salt = format!("{}\u{0}longrope-long", r.cache_salt.as_deref().unwrap_or(""));
            seq.cache_salt = Some(salt.into());
        }
        // The prompt is scored once, by the first sample (the others fork after it).
        seq.prompt_logits = index == 0 && r.prompt_logprobs.is_some();
        seq.whole_prompt = seq.state.pool.as_ref().is_some_and(|p| p.kind == Pooling::Mean);
        seq
    }

    /// Aborts requests whose client went away (the stream was dropped).
    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self.requests.iter().filter(|(_, r)| r.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.abort(id);
        }
    }

    fn abort(&mut self, id: u64) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        if req.waiting {
            self.shared.waiting.fetch_sub(req.request.n, Ordering::SeqCst);
        }
        for seq in req.seqs {
            if let Some(q) = self.sched.remove(seq) {
                let (s, cached_tokens) = (q.state, q.cached_tokens);
                let usage =
                    Usage { prompt_tokens: req.request.prompt.len(), completion_tokens: s.generated, cached_tokens };
                let _ = req.events.send(Event::Finished {
                    index: s.index,
                    reason: FinishReason::Abort,
                    text: String::new(),
                    usage,
                    stop: None,
                });
                self.shared.observer.finished(FinishReason::Abort, req.submitted.elapsed());
            }
        }
    }

    /// One step: schedule and prepare the batch, run one forward pass over it (the grammar
    /// masks beside it), then hand each sequence its logits.
    fn step(&mut self) {
        let t0 = Instant::now();
        let (decodes, decode_attended) = self.sched.decode_load();
        let max = self.shared.config.max_num_batched_tokens;
        self.sched.set_prefill_limit(self.cost.prefill_budget(decodes, decode_attended, max));
        self.propose(decodes, decode_attended);
        let plan = self.sched.schedule();
        if plan.is_empty() {
            // Nothing fits right now; wait for a command instead of spinning.
            if let Ok(cmd) = self.rx.recv_timeout(std::time::Duration::from_millis(5)) {
                self.command(cmd);
            }
            return;
        }
        self.mark_admitted(&plan);
        #[cfg(feature = "fault-injection")]
        fault::check(&plan, &self.sched);
        // Constrained sequences about to sample: their masks are computed while the forward runs.
        let masking: Vec<(SeqId, Constraint)> = plan
            .iter()
            .filter(|s| s.sample)
            .filter_map(|s| Some((s.id, self.sched.get_mut(s.id)?.state.constraint.take()?)))
            .collect();
        // Sequences resuming after a cached prefix start from its state snapshot.
        for s in &plan {
            if let Some(seq) = self.sched.get_mut(s.id) {
                if let (Some(snap), Some(slot)) = (seq.restore.take(), seq.state_slot) {
                    self.kv.states.restore(snap as usize, slot as usize);
                }
            }
        }
        let (tokens, steps) = batch_input(&self.sched, &plan);
        // Per sequence, the first position and count of its kept hidden rows.
        let kept: Vec<(usize, usize)> =
            steps.iter().map(|st| (st.context_len + st.num_tokens - st.hidden, st.hidden)).collect();
        let t1 = Instant::now();
        let model = self.shared.model.clone();
        // The workspace leaves `self` for the step, so its logits can be read while the
        // sampled tokens update `self`.
        let mut ws = std::mem::take(&mut self.ws);
        let input = StepInput { tokens: &tokens, seqs: &steps };
        let (kv, wsr) = (&mut self.kv, &mut ws);
        let (logits, masked) = if masking.is_empty() {
            (model.model.forward(&input, kv, wsr), Vec::new())
        } else {
            rayon::join(|| model.model.forward(&input, kv, wsr), || compute_masks(masking))
        };
        let t2 = Instant::now();
        // Counted before any request's last events go out, so that whoever reads the
        // stats after a stream ends sees the step that ended it.
        self.record_step(&plan, tokens.len(), [t0, t1, t2]);
        self.store_masks(masked);
        self.sched.step_done(&plan);
        self.dispatch_logits(&plan, logits, model.model.config.vocab_size);
        self.pool_hidden(&kept, &plan, ws.hidden(), model.model.config.hidden_size);
        let moe = ws.take_moe_stats();
        self.ws = ws;
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.overhead_time += t2.elapsed();
        st.moe.add(&moe);
        if tokens.len() == plan.len() {
            st.moe_decode.add(&moe);
        }
    }

    /// Hands embedding sequences their rows of the step's kept hidden states, and answers
    /// those whose prompt is in.
    fn pool_hidden(&mut self, kept: &[(usize, usize)], plan: &[Scheduled], hidden: &[f32], d: usize) {
        let mut row = 0;
        for (&(first, count), s) in kept.iter().zip(plan) {
            let rows = &hidden[row * d..(row + count) * d];
            row += count;
            let Some(q) = self.sched.get_mut(s.id) else { continue };
            let Some(pool) = q.state.pool.as_mut() else { continue };
            pool.add(rows, first, d);
            if s.sample {
                // The prompt is in: an embedding is answered, not continued.
                let vector = pool.vector();
                if let Some(req) = self.requests.get(&q.state.request) {
                    let _ = req.events.send(Event::Embedding { vector });
                }
                self.finish(s.id, FinishReason::Stop, String::new());
            }
        }
    }

    /// Hands each scheduled sequence its rows of the step's logits: prompt rows to be
    /// scored, then the sampled row (or the rows that verify a draft).
    fn dispatch_logits(&mut self, plan: &[Scheduled], logits: &[f32], vocab: usize) {
        let mut drawn = self.presample(plan, logits, vocab);
        let mut row = 0;
        for s in plan {
            let rows = s.logit_rows();
            let logits = &logits[row * vocab..(row + rows) * vocab];
            row += rows;
            let sampled_rows = if s.sample { 1 + s.draft } else { 0 };
            let (prompt_rows, logits) = logits.split_at((rows - sampled_rows) * vocab);
            if !prompt_rows.is_empty() {
                self.score_prompt(s, prompt_rows, vocab);
            }
            if !s.sample {
                continue;
            }
            if self.sched.get(s.id).is_some_and(|q| q.state.pool.is_some()) {
                // An embedding: answered from the hidden states ([`Self::pool_hidden`]).
                continue;
            }
            if s.draft == 0 {
                self.on_logits(s.id, logits, drawn.remove(&s.id));
            } else {
                self.verify(s.id, logits, vocab);
            }
        }
    }

    /// The draw of each sequence that samples one row without a draft, all taken in
    /// parallel before the rows are handed out in order: each sequence has its own sampler
    /// and RNG, so it draws what it would alone, and a large vocabulary's draws do not
    /// wait one after another on this thread. Embeddings, prompts only scored and failed
    /// masks are left to [`Self::on_logits`].
    fn presample(&mut self, plan: &[Scheduled], logits: &[f32], vocab: usize) -> HashMap<SeqId, Sampled> {
        use rayon::prelude::*;
        let mut last_rows = HashMap::new();
        let mut row = 0;
        for s in plan {
            row += s.logit_rows();
            if s.sample && s.draft == 0 {
                last_rows.insert(s.id, row - 1);
            }
        }
        let requests = &self.requests;
        let mut draws: Vec<(SeqId, &mut Sampler, Option<&TokenMask>, &[f32])> = (self.sched.states_mut())
            .filter_map(|(id, st)| {
                let r = *last_rows.get(&id)?;
                let scored_only = requests.get(&st.request).is_none_or(|q| q.request.stop.max_tokens == 0);
                let mask = match &st.mask {
                    Some(Err(_)) => return None,
                    Some(Ok(m)) => Some(m),
                    None => None,
                };
                (!scored_only && st.pool.is_none()).then(|| (id, &mut st.sampler, mask, &logits[r * vocab..][..vocab]))
            })
            .collect();
        draws.par_iter_mut().map(|(id, sampler, mask, row)| (*id, sampler.sample_masked(row, *mask))).collect()
    }

    /// Counts a step of `tokens` rows in the statistics, the step-time model and the
    /// observer; `t`: its start, and the forward's start and end (the time after it, and
    /// the mixture's routing, are added once the step's results are out).
    fn record_step(&mut self, plan: &[Scheduled], tokens: usize, t: [Instant; 3]) {
        let [t0, t1, t2] = t;
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.steps += 1;
        st.last_step_tokens = tokens;
        st.last_step_seqs = plan.len();
        st.forward_time += t2 - t1;
        st.overhead_time += t1 - t0;
        st.step_mix.add(plan.iter().map(|s| (s.num_tokens, s.draft)), t2 - t1);
        let ms = (t2 - t1).as_secs_f64() * 1e3;
        if st.recent_step_ms.len() == RECENT_STEPS {
            st.recent_step_ms.pop_front();
        }
        st.recent_step_ms.push_back(ms as f32);
        drop(st);
        let attended: usize = plan.iter().map(|s| attended(s.context_len, s.num_tokens)).sum();
        self.cost.observe(tokens, attended, ms);
        self.shared.observer.step(tokens, plan.len(), t2 - t1);
    }

    /// Puts the constraints back beside the masks computed for this step.
    fn store_masks(&mut self, masked: Vec<Masked>) {
        if masked.is_empty() {
            return;
        }
        let time: std::time::Duration = masked.iter().map(|m| m.time).sum();
        let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        st.grammar_masks += masked.len() as u64;
        st.grammar_mask_time += time;
        drop(st);
        for m in masked {
            if let Some(q) = self.sched.get_mut(m.seq) {
                q.state.constraint = Some(m.constraint);
                q.state.mask = Some(m.mask.map_err(|e| format!("{e:#}")));
            }
        }
    }

    /// Gives decoding sequences drafts to verify in this step, as many tokens as pay for
    /// their rows (see `speculative::worth`) and fit their `max_tokens` and the context. (The
    /// scheduler gives drafts only the rows prompts leave.)
    fn propose(&mut self, decodes: usize, decode_attended: usize) {
        let Some(spec) = &mut self.spec else {
            return;
        };
        let step_ms = self.cost.predict(decodes, decode_attended);
        let edge = self.shared.model.model.config.length_edge();
        let mut asks = Vec::new();
        for id in self.sched.decoding() {
            let Some(seq) = self.sched.get(id) else { continue };
            let len = seq.tokens.len();
            let s = &seq.state;
            // Not before its first token: the end of a chunked prompt also computes one
            // token, and the first sample is where `n > 1` requests fork.
            // Nor with a grammar: each draft row would need its own mask.
            if s.generated == 0 || s.constraint.is_some() {
                continue;
            }
            let Some(req) = self.requests.get(&s.request) else { continue };
            // The draft plus the token after it stay within max_tokens and the context.
            let mut room = (req.request.stop.max_tokens.saturating_sub(s.generated + 1))
                .min(self.shared.max_model_len.saturating_sub(len));
            // A draft must not carry the step across the length where the model's
            // computation changes, or its rows would be computed otherwise than one at a time.
            if let Some(edge) = edge.filter(|&e| len <= e) {
                room = room.min(edge - len);
            }
            // A draft row attends to the whole context, as the decode row does. Until the
            // step-time model is fitted rows count as free: drafts at the cap.
            let row_ms = self.cost.row_ms(len).unwrap_or(0.0);
            asks.push(Ask { id, room, row_ms });
        }
        spec.propose(&mut self.sched, &asks, step_ms / decodes.max(1) as f64);
    }

    /// Verifies a sequence's draft against the target's logits for the row before it and
    /// each draft row (`1 + draft` rows): each row is sampled by the sequence's own sampler,
    /// and the draft is kept while it equals the draws. The first draw that differs, or the
    /// one after a wholly accepted draft, is the step's own token.
    fn verify(&mut self, seq: SeqId, logits: &[f32], vocab: usize) {
        let Some(q) = self.sched.get_mut(seq) else {
            return;
        };
        let mut out = Vec::with_capacity(q.draft.len() + 1);
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            let t = q.state.sampler.sample(row);
            let hit = q.draft.get(i) == Some(&t.id);
            out.push(t);
            if !hit {
                break;
            }
        }
        let (drafted, accepted) = (q.draft.len(), out.len() - 1);
        self.sched.accept_draft(seq, accepted);
        if let Some(spec) = &mut self.spec {
            spec.verified(seq, drafted, accepted);
        }
        {
            let mut st = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
            st.spec_drafts += 1;
            st.spec_draft_tokens += drafted as u64;
            st.spec_accepted_tokens += accepted as u64;
        }
        for (i, t) in out.into_iter().enumerate() {
            // Accepted draft tokens are in the sequence already; the last one is new.
            if !self.emit(seq, t, i == accepted) {
                break;
            }
        }
    }

    /// Prompt logprobs from a chunk's rows: row `i` predicts the token after position
    /// `context_len + i`; the prompt tokens among those not scored yet are sent.
    fn score_prompt(&mut self, s: &Scheduled, logits: &[f32], vocab: usize) {
        let Some(q) = self.sched.get_mut(s.id) else {
            return;
        };
        let Some(req) = self.requests.get(&q.state.request) else {
            return;
        };
        let (prompt, top) = (&req.request.prompt, req.request.prompt_logprobs.unwrap_or(0));
        let mut scores = Vec::new();
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            let target = s.context_len + i + 1;
            if target >= q.state.scored && target < prompt.len() {
                scores.push(PromptLogprob::score(row, prompt[target], top));
                q.state.scored = target + 1;
            }
        }
        if !scores.is_empty() {
            let _ = req.events.send(Event::PromptLogprobs { logprobs: scores });
        }
    }

    /// Requests entering the batch for the first time stop counting as waiting.
    fn mark_admitted(&mut self, plan: &[Scheduled]) {
        for s in plan {
            let Some(state) = self.sched.get(s.id).map(|q| &q.state) else {
                continue;
            };
            if let Some(req) = self.requests.get_mut(&state.request) {
                if req.waiting {
                    req.waiting = false;
                    self.shared.waiting.fetch_sub(req.request.n, Ordering::SeqCst);
                    self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).prompt_tokens_total +=
                        req.request.prompt.len() as u64;
                }
            }
        }
    }

    /// Samples the sequence's next token, unless [`Self::presample`] drew it (`drawn`), and
    /// for an `n > 1` request's first sample its siblings' first tokens from the same logits.
    fn on_logits(&mut self, seq: SeqId, logits: &[f32], drawn: Option<Sampled>) {
        let Some(state) = self.sched.get_mut(seq).map(|q| &mut q.state) else {
            return;
        };
        let req_id = state.request;
        // max_tokens 0: the prompt was only to be scored.
        if self.requests.get(&req_id).is_some_and(|r| r.request.stop.max_tokens == 0) {
            self.finish(seq, FinishReason::Length, String::new());
            return;
        }
        let mask = match state.mask.take() {
            Some(Err(e)) => {
                eprintln!("weft: structured output failed: {e}");
                self.finish(seq, FinishReason::Error, String::new());
                return;
            }
            Some(Ok(m)) => Some(m),
            None => None,
        };
        let sampled = drawn.unwrap_or_else(|| state.sampler.sample_masked(logits, mask.as_ref()));
        let fork = self.requests.get(&req_id).is_some_and(|r| !r.forked && r.request.n > 1);
        if fork {
            let req = self.requests.get_mut(&req_id).expect("checked");
            req.forked = true;
            let request = req.request.clone();
            for index in 1..request.n {
                let mut child = self.new_seq(req_id, index, &request);
                let child_id = child.id;
                self.requests.get_mut(&req_id).expect("checked").seqs.push(child_id);
                let first = child.state.sampler.sample_masked(logits, mask.as_ref());
                let kv = &mut self.kv;
                self.sched.fork(seq, child, first.id, &mut |copy| match copy {
                    CacheCopy::Block { src, dst } => kv.copy_block(src, dst),
                    CacheCopy::State { src, dst } => kv.states.copy_slot(src as usize, dst as usize),
                });
                self.emit(child_id, first, false);
            }
        }
        self.emit(seq, sampled, true);
    }

    /// Handles a sampled token: stop checks, text, events; finishes the sequence if done.
    /// `append` is false when the token is already in the scheduler's sequence (a fork, an
    /// accepted draft token). Returns whether the sequence goes on.
    fn emit(&mut self, seq: SeqId, sampled: Sampled, append: bool) -> bool {
        if append {
            self.sched.append_token(seq, sampled.id);
        }
        let tok = &self.shared.model.tokenizer;
        let Some((s, cached_tokens)) = self.sched.get_mut(seq).map(|q| (&mut q.state, q.cached_tokens)) else {
            return false;
        };
        let Some(req) = self.requests.get_mut(&s.request) else {
            return false;
        };
        let now = Instant::now();
        let obs = &self.shared.observer;
        match s.last_token {
            Some(prev) => obs.token(now - prev),
            None if !req.first_token => {
                req.first_token = true;
                obs.first_token(now - req.submitted);
            }
            None => {}
        }
        s.last_token = Some(now);
        s.generated += 1;
        // Counted before the token's events go out, so whoever reads the stats after a
        // stream ends sees its tokens.
        self.shared.stats.lock().unwrap_or_else(|p| p.into_inner()).generation_tokens_total += 1;
        let index = s.index;
        // max_tokens, or the context: a sequence never asks the model for a position past it.
        let at_limit = s.generated >= req.request.stop.max_tokens
            || req.request.prompt.len() + s.generated >= self.shared.max_model_len;
        let finish = if s.stop_ids.contains(&sampled.id) {
            let _ = req.events.send(Event::Token {
                index,
                id: sampled.id,
                text: String::new(),
                logprobs: sampled.logprobs,
                cached_tokens,
            });
            Some((FinishReason::Stop, s.stop.flush()))
        } else {
            // The grammar follows the token; once it is complete the output is too.
            let grammar = s.constraint.as_mut().map(|c| c.commit(sampled.id).map(|()| c.is_done()));
            let delta = s.detok.push(tok, sampled.id).unwrap_or_default();
            let scan = s.stop.push(&delta);
            let token =
                Event::Token { index, id: sampled.id, text: scan.emit, logprobs: sampled.logprobs, cached_tokens };
            let _ = req.events.send(token);
            if scan.stopped {
                Some((FinishReason::Stop, String::new()))
            } else if let Some(Err(e)) = grammar {
                eprintln!("weft: structured output failed: {e:#}");
                Some((FinishReason::Error, s.detok.flush(tok).unwrap_or_default() + &s.stop.flush()))
            } else if at_limit || grammar.is_some_and(|g| g.is_ok_and(|done| done)) {
                let tail = s.detok.flush(tok).unwrap_or_default();
                let scan = s.stop.push(&tail);
                let reason = if scan.stopped || !at_limit { FinishReason::Stop } else { FinishReason::Length };
                Some((reason, scan.emit + &s.stop.flush()))
            } else {
                None
            }
        };
        match finish {
            Some((reason, text)) => {
                self.finish(seq, reason, text);
                false
            }
            None => true,
        }
    }

    fn finish(&mut self, seq: SeqId, reason: FinishReason, text: String) {
        let Some(q) = self.sched.remove(seq) else {
            return;
        };
        let (s, cached_tokens) = (q.state, q.cached_tokens);
        let Some(req) = self.requests.get_mut(&s.request) else {
            return;
        };
        let usage = Usage { prompt_tokens: req.request.prompt.len(), completion_tokens: s.generated, cached_tokens };
        let stop = s.stop.matched().map(str::to_owned);
        let _ = req.events.send(Event::Finished { index: s.index, reason, text, usage, stop });
        self.shared.observer.finished(reason, req.submitted.elapsed());
        req.seqs.retain(|&x| x != seq);
        // The last sample of the request: dropping its sender closes the stream. Siblings
        // of an n > 1 request not forked yet are still to come.
        if req.seqs.is_empty() && (req.forked || req.request.n == 1) {
            // Published before the stream closes, so whoever reads the stats after it ends
            // sees this request's totals (the server's metrics baseline after its warm-up).
            self.publish_occupancy();
            self.requests.remove(&s.request);
        }
    }
}

/// The step's forward input: every scheduled sequence's new tokens (its own, then its
/// draft's) in plan order, and where each sits in its sequence and the KV cache.
fn batch_input<'a>(sched: &'a Scheduler<SeqState>, plan: &[Scheduled]) -> (Vec<u32>, Vec<SeqStep<'a>>) {
    let mut tokens = Vec::with_capacity(plan.iter().map(|s| s.num_tokens).sum());
    let mut steps = Vec::with_capacity(plan.len());
    for s in plan {
        let seq = sched.get(s.id).expect("scheduled sequence exists");
        let own = s.num_tokens - s.draft;
        tokens.extend_from_slice(&seq.tokens[s.context_len..s.context_len + own]);
        tokens.extend_from_slice(&seq.draft[..s.draft]);
        steps.push(SeqStep {
            context_len: s.context_len,
            num_tokens: s.num_tokens,
            seq_len: seq.state.prompt_len,
            block_table: seq.block_table.blocks(),
            state_slot: seq.state_slot.expect("scheduled sequences hold a state slot") as usize,
            captures: &seq.captures,
            logits: s.logit_rows(),
            hidden: match seq.state.pool.as_ref().map(|p| p.kind) {
                Some(Pooling::Mean) => own,
                Some(Pooling::Last) => usize::from(s.sample),
                None => 0,
            },
        });
    }
    (tokens, steps)
}

/// A constraint taken out of its sequence for one step, with the mask it computed.
struct Masked {
    seq: SeqId,
    constraint: Constraint,
    mask: anyhow::Result<TokenMask>,
    time: std::time::Duration,
}

/// Each constraint's mask for this step, computed in parallel (beside the forward pass).
fn compute_masks(masking: Vec<(SeqId, Constraint)>) -> Vec<Masked> {
    use rayon::prelude::*;
    masking
        .into_par_iter()
        .map(|(seq, mut constraint)| {
            let t = Instant::now();
            let mask = constraint.allowed();
            Masked { seq, constraint, mask, time: t.elapsed() }
        })
        .collect()
}

/// The text of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Test builds only: a step with a sequence whose prompt starts with the token id in
/// `WEFT_FAULT_PANIC_TOKEN` three times panics, so supervision can be tested end to end.
#[cfg(feature = "fault-injection")]
mod fault {
    use crate::scheduler::{Scheduled, Scheduler};

    pub fn check<S>(plan: &[Scheduled], sched: &Scheduler<S>) {
        let Some(token) = std::env::var("WEFT_FAULT_PANIC_TOKEN").ok().and_then(|v| v.parse::<u32>().ok()) else {
            return;
        };
        if plan.iter().any(|s| sched.get(s.id).is_some_and(|q| q.tokens.starts_with(&[token; 3]))) {
            panic!("injected fault: token {token} scheduled");
        }
    }
}
