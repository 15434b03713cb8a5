use super::*;

fn sched(max_seqs: usize, max_tokens: usize, blocks: usize) -> Scheduler {
    sched_with(max_seqs, max_tokens, blocks, false)
}

fn sched_with(max_seqs: usize, max_tokens: usize, blocks: usize, prefix_caching: bool) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        state_snapshots: None,
        max_draft: 0,
        prefill_align: 1,
        max_num_seqs: max_seqs,
        max_num_batched_tokens: max_tokens,
        block_size: 4,
        num_blocks: blocks,
        prefix_caching,
        kv_events: prefix_caching,
    })
}

fn seq_of(id: SeqId, tokens: &[u32]) -> Sequence {
    Sequence::new(id, tokens.to_vec(), 0, id, ())
}

fn seq(id: SeqId, len: usize, priority: i32) -> Sequence {
    Sequence::new(id, (0..len as u32).collect(), priority, id, ())
}

/// Runs a step as the engine would: every sampled sequence gets a token.
fn run(s: &mut Scheduler) -> Vec<Scheduled> {
    let step = s.schedule();
    s.step_done(&step);
    for x in &step {
        if x.sample {
            s.append_token(x.id, 7);
        }
    }
    s.check_invariants().unwrap();
    step
}

#[test]
fn chunked_prefill_within_the_token_budget_then_decode_first() {
    let mut s = sched(8, 8, 100);
    s.add(seq(1, 6, 0));
    s.add(seq(2, 6, 0));
    let step = run(&mut s);
    assert_eq!(
        step,
        vec![
            Scheduled { id: 1, context_len: 0, num_tokens: 6, sample: true, draft: 0, every_row: false },
            Scheduled { id: 2, context_len: 0, num_tokens: 2, sample: false, draft: 0, every_row: false },
        ]
    );
    let step = run(&mut s);
    assert_eq!(
        step[0],
        Scheduled { id: 1, context_len: 6, num_tokens: 1, sample: true, draft: 0, every_row: false },
        "decode goes first"
    );
    assert_eq!(step[1], Scheduled { id: 2, context_len: 2, num_tokens: 4, sample: true, draft: 0, every_row: false });
}

/// With `prefill_align`, a prompt the budget cuts ends its chunk at a multiple of it where
/// one lies within the budget; the next prompt waits where none does and others took part
/// of the budget, and takes what fits where it has the whole; a prompt's last chunk ends
/// with the prompt.
#[test]
fn prompts_cut_by_the_budget_end_at_aligned_positions() {
    let mut s = Scheduler::new(SchedulerConfig { prefill_align: 4, ..sched(8, 10, 100).cfg });
    s.add(seq(1, 13, 0));
    s.add(seq(2, 13, 0));
    let chunks = |step: Vec<Scheduled>| step.iter().map(|x| (x.id, x.context_len, x.num_tokens)).collect::<Vec<_>>();
    assert_eq!(chunks(run(&mut s)), [(1, 0, 8)], "8 of 10; no multiple of 4 within the 2 left");
    assert_eq!(chunks(run(&mut s)), [(1, 8, 5), (2, 0, 4)], "the prompt's end, then up to 4");
    assert_eq!(chunks(run(&mut s)), [(1, 13, 1), (2, 4, 9)]);
    assert_eq!(chunks(run(&mut s)), [(1, 14, 1), (2, 13, 1)]);
    let mut s = Scheduler::new(SchedulerConfig { prefill_align: 4, ..sched(8, 3, 100).cfg });
    s.add(seq(1, 5, 0));
    assert_eq!(chunks(run(&mut s)), [(1, 0, 3)], "a budget under the alignment still moves");
}

#[test]
fn max_num_seqs_and_priority_order() {
    let mut s = sched(2, 100, 100);
    s.add(seq(1, 3, 5));
    s.add(seq(2, 3, 0));
    s.add(seq(3, 3, 0));
    let ids: Vec<SeqId> = run(&mut s).iter().map(|x| x.id).collect();
    assert_eq!(ids, vec![2, 3], "priority 0 before 5, then arrival");
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    s.remove(2);
    let ids: Vec<SeqId> = run(&mut s).iter().map(|x| x.id).collect();
    assert_eq!(ids, vec![3, 1]);
}

#[test]
fn out_of_blocks_preempts_the_newest_and_recomputes_it_later() {
    // 4 blocks of 4 tokens: two sequences of 7 tokens fit (2 blocks each) until they grow.
    let mut s = sched(8, 100, 4);
    s.add(seq(1, 7, 0));
    s.add(seq(2, 7, 0));
    run(&mut s);
    run(&mut s); // both at 8 tokens, 2 blocks each
    let step = run(&mut s); // seq 1 needs a 3rd block: seq 2 is preempted
    assert_eq!(step.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(s.preemptions(), 1);
    assert_eq!(s.get(2).unwrap().num_computed, 0);
    assert_eq!(s.get(2).unwrap().tokens.len(), 9, "generated tokens are kept for recompute");
    assert_eq!(s.num_requeued(), 1, "a preempted sequence counts as waiting again");
    s.remove(1);
    let step = run(&mut s);
    assert_eq!(
        step,
        vec![Scheduled { id: 2, context_len: 0, num_tokens: 9, sample: true, draft: 0, every_row: false }]
    );
    assert_eq!(s.num_requeued(), 0);
}

#[test]
fn fork_shares_full_blocks_and_copies_the_partial_one() {
    let mut s = sched(8, 100, 10);
    s.add(seq(1, 6, 0));
    run(&mut s);
    let mut copies = Vec::new();
    s.fork(1, seq(2, 6, 0), 9, &mut |c| copies.push(c));
    let (p, c) = (s.get(1).unwrap(), s.get(2).unwrap());
    assert_eq!(c.tokens.len(), 7);
    assert_eq!(c.num_computed, 6);
    assert_eq!(p.block_table.blocks()[0], c.block_table.blocks()[0], "full block shared");
    let (src, dst) = (p.block_table.blocks()[1], c.block_table.blocks()[1]);
    let slots = (p.state_slot.unwrap(), c.state_slot.unwrap());
    assert_ne!(slots.0, slots.1);
    assert_eq!(copies, vec![CacheCopy::Block { src, dst }, CacheCopy::State { src: slots.0, dst: slots.1 }]);
    s.check_invariants().unwrap();
    run(&mut s);
    s.remove(1);
    s.remove(2);
    assert_eq!(s.blocks_used(), 0);
}

/// Many sequences, a tiny pool, random aborts: every step respects the budgets, blocks are
/// never double-booked, and at the end every block is free (or cached, held by nobody).
#[test]
fn storm_with_preemption_and_aborts_ends_with_every_block_free() {
    storm(false);
    storm(true);
}

fn storm(prefix_caching: bool) {
    let mut rng = 12345u64;
    let mut rand = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut s = sched_with(16, 64, 24, prefix_caching);
    let mut targets = std::collections::HashMap::new();
    for id in 0..200 {
        let len = 1 + rand(30) as usize;
        targets.insert(id, len + 1 + rand(40) as usize);
        // Prompts share prefixes (0, 1, 2, ...) so that cached blocks are hit.
        s.add(seq(id, len, rand(3) as i32));
    }
    let mut finished = 0;
    let mut steps = 0;
    let mut mirror = std::collections::HashSet::new();
    while !s.is_idle() {
        steps += 1;
        assert!(steps < 100_000, "no progress");
        let step = run(&mut s);
        follow(&mut mirror, s.take_kv_events(), 4);
        assert_eq!(mirror.len(), s.num_cached_blocks(), "the events tell the cache as it is");
        assert!(step.len() <= 16 && step.iter().map(|x| x.num_tokens).sum::<usize>() <= 64);
        for x in step {
            let len = s.get(x.id).map(|q| q.tokens.len()).unwrap();
            if len >= targets[&x.id] || rand(50) == 0 {
                s.remove(x.id);
                finished += 1;
            }
        }
    }
    assert_eq!(finished, 200);
    assert_eq!(s.blocks_used(), 0);
    assert_eq!(s.alloc.num_free(), 24, "every block is free or cached with ref count 0");
    assert!((0..24).all(|b| s.alloc.ref_count(b) == 0));
    assert!(s.preemptions() > 0, "the pool is small enough to force preemption");
    let (queries, hits) = s.prefix_cache_counts();
    assert_eq!(hits > 0, prefix_caching, "{hits} of {queries} prompt tokens hit");
    let mut rebuilt = std::collections::HashSet::from([0]);
    follow(&mut rebuilt, s.kv_snapshot(), 4);
    assert_eq!(rebuilt, mirror, "a snapshot rebuilds what the events built");
    assert_eq!(mirror.is_empty(), !prefix_caching);
}

/// Applies KV events to a set of cached block hashes as a router would, checking that each
/// stored hash is the chained hash of its tokens, that removals name known blocks, and that
/// a stored chain's parent is known.
fn follow(cached: &mut std::collections::HashSet<crate::kv::BlockHash>, events: Vec<KvEvent>, bs: usize) {
    for e in events {
        match e {
            KvEvent::Stored { hashes, parent, tokens } => {
                assert_eq!(tokens.len(), hashes.len() * bs);
                assert!(parent.is_none_or(|p| cached.contains(&p)), "a stored block's parent is cached");
                let mut prev = parent;
                for (h, t) in hashes.iter().zip(tokens.chunks(bs)) {
                    assert_eq!(*h, crate::kv::block_hash(prev, None, t));
                    assert!(cached.insert(*h), "stored twice");
                    prev = Some(*h);
                }
            }
            KvEvent::Removed { hashes } => {
                for h in hashes {
                    assert!(cached.remove(&h), "removal of a block never stored");
                }
            }
            KvEvent::Cleared => cached.clear(),
        }
    }
}

/// Decodes first: a long prefill cannot take the budget from a running stream, even
/// when the prefilling sequence has the higher priority.
#[test]
fn every_decode_is_scheduled_before_any_prefill_chunk() {
    let mut s = sched(8, 4, 100);
    s.add(seq(1, 2, 5));
    run(&mut s);
    s.add(seq(2, 20, 0));
    for _ in 0..5 {
        let step = run(&mut s);
        assert_eq!(step[0].id, 1, "the decode goes first: {step:?}");
        assert_eq!(step[0].num_tokens, 1);
        assert!(step.iter().map(|x| x.num_tokens).sum::<usize>() <= 4);
    }
}

/// A prompt that shares whole blocks with an earlier one reuses them and prefills only
/// the rest; a prompt entirely cached still computes its last token.
#[test]
fn cached_prefix_blocks_are_reused() {
    let mut s = sched_with(8, 100, 16, true);
    let prompt: Vec<u32> = (100..110).collect(); // 2 full blocks + 2 tokens
    s.add(seq_of(1, &prompt));
    run(&mut s);
    let first: Vec<u32> = s.get(1).unwrap().block_table.blocks().to_vec();
    s.remove(1);
    assert_eq!(s.blocks_used(), 0);

    let mut other = prompt[..8].to_vec();
    other.extend([7, 7, 7]);
    s.add(seq_of(2, &other));
    let step = run(&mut s);
    assert_eq!(
        step,
        vec![Scheduled { id: 2, context_len: 8, num_tokens: 3, sample: true, draft: 0, every_row: false }]
    );
    assert_eq!(s.get(2).unwrap().block_table.blocks()[..2], first[..2], "the cached blocks themselves");
    assert_eq!(s.get(2).unwrap().cached_tokens, 8);

    // Exactly the 8 tokens of two cached blocks: one block is reused, the last computed.
    s.add(seq_of(3, &prompt[..8]));
    let step = run(&mut s);
    assert_eq!(step[1], Scheduled { id: 3, context_len: 4, num_tokens: 4, sample: true, draft: 0, every_row: false });
    assert_eq!(s.prefix_cache_counts(), (10 + 11 + 8, 8 + 4));
    s.check_invariants().unwrap();
}

/// Requests with different salts never share blocks; the same salt does.
#[test]
fn cache_salt_isolates_tenants() {
    let mut s = sched_with(8, 100, 16, true);
    let prompt: Vec<u32> = (0..9).collect();
    let salted = |id, salt: &str| {
        let mut q = seq_of(id, &prompt);
        q.cache_salt = Some(salt.into());
        q
    };
    s.add(salted(1, "a"));
    run(&mut s);
    s.add(salted(2, "b"));
    s.add(seq_of(3, &prompt));
    s.add(salted(4, "a"));
    let step = run(&mut s);
    let context: Vec<(SeqId, usize)> = step.iter().filter(|x| x.id != 1).map(|x| (x.id, x.context_len)).collect();
    assert_eq!(context, vec![(2, 0), (3, 0), (4, 8)]);
}

/// Cached blocks nobody holds are evicted least recently released first, and a released
/// sequence gives up its tail before its head.
#[test]
fn eviction_takes_the_least_recently_released_tail_first() {
    let mut s = sched_with(8, 100, 4, true);
    let a: Vec<u32> = (0..9).collect(); // blocks a0 a1 full, a2 partial
    s.add(seq_of(1, &a));
    run(&mut s);
    s.remove(1);
    // Free now: a2 (partial, never cached) and the unused block; a prompt of three blocks
    // must evict one cached block, and it is a1 (the tail), so a's head a0 still hits.
    s.add(seq_of(2, &(50..62).collect::<Vec<u32>>()));
    run(&mut s);
    s.remove(2);
    s.add(seq_of(3, &a));
    let step = run(&mut s);
    assert_eq!(step[0].context_len, 4, "a's head block survived, its tail did not: {step:?}");
}

/// The step-time budget limits prefill only beside decodes; alone, a prompt takes the
/// whole token budget.
#[test]
fn prefill_limit_applies_beside_decodes_only() {
    let mut s = sched(8, 64, 100);
    s.set_prefill_limit(Some(5));
    s.add(seq(1, 40, 0));
    let step = run(&mut s);
    assert_eq!(step[0].num_tokens, 40, "nothing decoding: the full budget");
    s.add(seq(2, 40, 0));
    let step = run(&mut s);
    assert_eq!((step[0].id, step[0].num_tokens), (1, 1));
    assert_eq!((step[1].id, step[1].num_tokens), (2, 5), "beside a decode: the limit");
    assert_eq!(s.decode_load(), (1, 42));
}

/// A draft rides in its sequence's decode; the accepted prefix joins the sequence, the
/// rejected tail's blocks go back, and the books stay balanced.
#[test]
fn drafts_are_verified_in_the_decode_and_rolled_back() {
    let mut s = sched(8, 64, 100);
    s.add(seq(1, 7, 0));
    run(&mut s); // prefill 7, token appended: 8 tokens, 7 computed
    s.get_mut(1).unwrap().draft = vec![10, 11, 12, 13, 14, 15];
    let step = s.schedule();
    assert_eq!(
        step,
        vec![Scheduled { id: 1, context_len: 7, num_tokens: 7, sample: true, draft: 6, every_row: false }]
    );
    assert_eq!(step[0].logit_rows(), 7);
    assert_eq!(s.get(1).unwrap().block_table.blocks().len(), 4, "positions 0..14 in blocks of 4");
    s.step_done(&step);
    assert_eq!(s.get(1).unwrap().num_computed, 8, "drafts count only once accepted");
    s.accept_draft(1, 2);
    let q = s.get(1).unwrap();
    assert_eq!((q.tokens.len(), q.num_computed), (10, 10));
    assert_eq!(&q.tokens[8..], &[10, 11]);
    assert!(q.draft.is_empty());
    assert_eq!(q.block_table.blocks().len(), 3, "room for the next token only");
    s.append_token(1, 7);
    s.check_invariants().unwrap();
    assert_eq!(s.blocks_used(), 3);
    assert_eq!(
        run(&mut s),
        vec![Scheduled { id: 1, context_len: 10, num_tokens: 1, sample: true, draft: 0, every_row: false }]
    );
}

/// Drafts take only the token budget and blocks left once every decode and prefill chunk
/// has its rows: with the pool nearly full, a draft is dropped rather than preempting
/// anyone, and a waiting prompt is admitted before a draft gets a row.
#[test]
fn drafts_never_crowd_out_a_decode_or_a_prompt() {
    let mut s = sched(8, 64, 4);
    s.add(seq(1, 4, 0));
    s.add(seq(2, 4, 0));
    run(&mut s); // each holds one full block and needs a second for its next token
    s.get_mut(1).unwrap().draft = vec![9; 6];
    let step = s.schedule();
    assert_eq!(step.iter().map(|x| (x.id, x.draft)).collect::<Vec<_>>(), vec![(1, 0), (2, 0)]);
    assert_eq!(s.preemptions(), 0);
    s.step_done(&step);

    // A token budget of 3 for two decodes leaves one draft row.
    let mut s = sched(8, 3, 100);
    s.add(seq(1, 2, 0));
    s.add(seq(2, 1, 0));
    run(&mut s);
    for id in [1, 2] {
        s.get_mut(id).unwrap().draft = vec![5, 6];
    }
    let step = s.schedule();
    assert_eq!(step.iter().map(|x| (x.id, x.draft)).collect::<Vec<_>>(), vec![(1, 1), (2, 0)]);
    assert_eq!(step.iter().map(|x| x.num_tokens).sum::<usize>(), 3);

    // A budget of 8: one decode row, a 6-token prompt, and one row left for the draft.
    let mut s = sched(8, 8, 100);
    s.add(seq(1, 3, 0));
    run(&mut s);
    s.add(seq(2, 6, 0));
    s.get_mut(1).unwrap().draft = vec![5; 6];
    let step = s.schedule();
    let got: Vec<_> = step.iter().map(|x| (x.id, x.num_tokens, x.draft)).collect();
    assert_eq!(got, vec![(1, 2, 1), (2, 6, 0)]);
}
