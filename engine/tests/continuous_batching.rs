//! Continuous batching keeps each request's tokens: requests that join a running batch late, with
//! their prompts prefilled a few tokens per step, get exactly the tokens they get alone.

use specula_drafters::{Drafter, ModelDrafter};
use specula_engine::{Event, GenerationRequest, Scheduler, SchedulerConfig};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::load;
use specula_model::WeightDtype;
use specula_verifier::AcceptanceRule;
use std::collections::HashMap;
use std::path::Path;

fn fixture(arch: &str) -> specula_model::Transformer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf_parity")
        .join(arch);
    load(&dir, WeightDtype::Bf16).unwrap().model
}

fn request(prompt: Vec<u32>, seed: u64, temperature: f32) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: prompt,
        max_new_tokens: 20,
        sampling: SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
        },
        seed,
        stop_token_ids: vec![],
        vocab_limit: None,
        stop_strings: vec![],
        num_draft_tokens: 4,
    }
}

fn run_alone(req: &GenerationRequest, rule: &AcceptanceRule) -> Vec<u32> {
    let target = fixture("qwen2");
    let mut d = ModelDrafter::new(fixture("qwen3"));
    let mut s = Scheduler::new(
        &target,
        Some(&mut d as &mut dyn Drafter),
        None,
        SchedulerConfig::default(),
    );
    s.add_request(req.clone(), rule.clone()).unwrap();
    loop {
        for e in s.step().unwrap() {
            if let Event::Finished { output, .. } = e {
                return output.token_ids;
            }
        }
    }
}

#[test]
fn late_joiners_with_chunked_prefill_get_their_solo_tokens() {
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| {
            (0..(7 + 9 * i))
                .map(|j| ((j * 37 + i * 11) % 320) as u32)
                .collect()
        })
        .collect();
    let cases: Vec<(GenerationRequest, AcceptanceRule)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            if i % 2 == 0 {
                (request(p.clone(), i as u64, 0.0), AcceptanceRule::Greedy)
            } else {
                (request(p.clone(), i as u64, 0.9), AcceptanceRule::Standard)
            }
        })
        .collect();
    let want: Vec<Vec<u32>> = cases.iter().map(|(r, rule)| run_alone(r, rule)).collect();

    let target = fixture("qwen2");
    let mut d = ModelDrafter::new(fixture("qwen3"));
    let mut s = Scheduler::new(
        &target,
        Some(&mut d as &mut dyn Drafter),
        None,
        SchedulerConfig {
            max_running: 3,
            prefill_chunk_tokens: 5,
        },
    );
    let mut ids = HashMap::new();
    let mut got: HashMap<usize, Vec<u32>> = HashMap::new();
    let mut streamed: HashMap<usize, Vec<u32>> = HashMap::new();
    let mut next = 0;
    let mut step = 0;
    // One request joins every other step; one more is cancelled mid-run.
    let cancelled = s
        .add_request(cases[0].0.clone(), cases[0].1.clone())
        .unwrap();
    while got.len() < cases.len() {
        if step % 2 == 0 && next < cases.len() {
            let id = s
                .add_request(cases[next].0.clone(), cases[next].1.clone())
                .unwrap();
            ids.insert(id, next);
            next += 1;
        }
        if step == 3 {
            assert!(s.cancel(cancelled).unwrap());
        }
        for e in s.step().unwrap() {
            match e {
                Event::Tokens { id, tokens } => {
                    if let Some(&i) = ids.get(&id) {
                        streamed.entry(i).or_default().extend(tokens);
                    }
                }
                Event::Finished { id, output, .. } => {
                    assert_ne!(id, cancelled);
                    got.insert(ids[&id], output.token_ids);
                }
            }
        }
        step += 1;
        assert!(step < 10_000);
    }
    assert!(s.is_idle());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[&i], w, "request {i}");
        assert_eq!(
            &streamed[&i], w,
            "request {i}: streamed tokens == final tokens"
        );
    }
}
