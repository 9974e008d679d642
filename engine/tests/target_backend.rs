//! The target-backend seam on the CPU: the scheduler over a `TargetBackend` built for `Device::Cpu`
//! gives the tokens of plain generation, `--additional-config` is parsed strictly, and a
//! `latency_specialized` run counts every step as a fallback with the CPU's reason.

use specula_drafters::{Drafter, ModelDrafter, NgramDrafter};
use specula_engine::target::check_device;
use specula_engine::{
    build_target, generate, generate_batch, generate_batch_on, AdditionalConfig, DecodeBackend,
    Device, EngineError, Event, GenerationRequest, Scheduler, SchedulerConfig, TargetOptions,
    FALLBACK_CPU_DEVICE,
};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::load;
use specula_model::WeightDtype;
use specula_verifier::AcceptanceRule;
use std::path::Path;

fn fixture(arch: &str) -> specula_model::Transformer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf_parity")
        .join(arch);
    load(&dir, WeightDtype::Bf16).unwrap().model
}

fn request(prompt_len: usize, seed: u64, k: usize) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: (0..prompt_len)
            .map(|j| ((j * 29 + seed as usize * 7) % 300) as u32)
            .collect(),
        max_new_tokens: 17,
        sampling: SamplingParams::greedy(),
        seed,
        stop_token_ids: vec![],
        vocab_limit: None,
        stop_strings: vec![],
        num_draft_tokens: k,
    }
}

fn cpu_options(max_running: usize) -> TargetOptions {
    TargetOptions {
        max_running,
        ..TargetOptions::default()
    }
}

#[test]
fn cpu_backend_through_the_scheduler_equals_plain_generation() {
    let target = fixture("qwen2");
    let requests: Vec<GenerationRequest> =
        (0..3).map(|i| request(5 + 4 * i, i as u64, 4)).collect();
    let plain: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| generate(&target, r, |_| {}).unwrap().token_ids)
        .collect();

    // Draft model, then n-gram: the backend built for Device::Cpu, a batch of three.
    let mut draft = ModelDrafter::new(fixture("qwen3"));
    let backend = build_target(Device::Cpu, &target, &cpu_options(requests.len())).unwrap();
    assert_eq!(backend.device(), "cpu");
    let out = generate_batch_on(
        backend,
        DecodeBackend::Standard,
        Some(&mut draft as &mut dyn Drafter),
        &AcceptanceRule::Greedy,
        &requests,
        None,
    )
    .unwrap();
    let got: Vec<Vec<u32>> = out.outputs.iter().map(|o| o.token_ids.clone()).collect();
    assert_eq!(got, plain, "draft model on the CPU backend");
    assert_eq!(out.run.device, "cpu");
    assert_eq!(out.run.verifier, "host");
    assert_eq!(out.run.decode_backend, "standard");
    assert!(out.run.decode_backend_fallbacks.is_empty());
    assert!(out.run.num_verify_steps > 0);

    let mut ngram = NgramDrafter::new(1, 3);
    let backend = build_target(Device::Cpu, &target, &cpu_options(requests.len())).unwrap();
    let out = generate_batch_on(
        backend,
        DecodeBackend::Standard,
        Some(&mut ngram as &mut dyn Drafter),
        &AcceptanceRule::Greedy,
        &requests,
        None,
    )
    .unwrap();
    let got: Vec<Vec<u32>> = out.outputs.iter().map(|o| o.token_ids.clone()).collect();
    assert_eq!(got, plain, "n-gram on the CPU backend");

    // The seam is the path generate_batch itself takes: same tokens, same acceptance.
    let mut draft = ModelDrafter::new(fixture("qwen3"));
    let via_wrapper = generate_batch(
        &target,
        Some(&mut draft as &mut dyn Drafter),
        &AcceptanceRule::Greedy,
        &requests,
        None,
    )
    .unwrap();
    let mut draft = ModelDrafter::new(fixture("qwen3"));
    let backend = build_target(Device::Cpu, &target, &cpu_options(requests.len())).unwrap();
    let via_seam = generate_batch_on(
        backend,
        DecodeBackend::Standard,
        Some(&mut draft as &mut dyn Drafter),
        &AcceptanceRule::Greedy,
        &requests,
        None,
    )
    .unwrap();
    assert_eq!(
        via_wrapper.run.acceptance_length,
        via_seam.run.acceptance_length
    );
    assert_eq!(
        via_wrapper.run.num_verify_steps,
        via_seam.run.num_verify_steps
    );
}

#[test]
fn latency_specialized_on_the_cpu_counts_every_step_as_a_fallback() {
    let target = fixture("qwen2");
    let mut draft = ModelDrafter::new(fixture("qwen3"));
    let backend = build_target(Device::Cpu, &target, &cpu_options(2)).unwrap();
    let mut s = Scheduler::with_target(
        backend,
        Some(&mut draft as &mut dyn Drafter),
        None,
        SchedulerConfig {
            max_running: 2,
            // Small chunks: prefill-only steps must be counted too.
            prefill_chunk_tokens: 3,
        },
    );
    assert_eq!(s.fallback_reason(), None, "standard is the default");
    s.set_decode_backend(DecodeBackend::LatencySpecialized)
        .unwrap();
    assert_eq!(s.fallback_reason(), Some(FALLBACK_CPU_DEVICE));
    s.add_request(request(9, 1, 3), AcceptanceRule::Greedy)
        .unwrap();
    s.add_request(request(4, 2, 3), AcceptanceRule::Greedy)
        .unwrap();
    let mut steps = 0u64;
    let mut finished = 0;
    while !s.is_idle() {
        let events = s.step().unwrap();
        steps += 1;
        finished += events
            .iter()
            .filter(|e| matches!(e, Event::Finished { .. }))
            .count();
    }
    assert_eq!(finished, 2);
    let fallbacks = &s.totals().decode_backend_fallbacks;
    assert_eq!(fallbacks.len(), 1, "{fallbacks:?}");
    assert_eq!(fallbacks.get(FALLBACK_CPU_DEVICE), Some(&steps));
    assert_eq!(s.totals().specialized_steps, 0, "the CPU has no fused path");
    // Verify steps are a subset: prefill-only steps fell back as well.
    assert!(steps > s.totals().steps, "{steps} vs {}", s.totals().steps);

    // Through generate_batch_on the count reaches the run stats.
    let mut draft = ModelDrafter::new(fixture("qwen3"));
    let backend = build_target(Device::Cpu, &target, &cpu_options(1)).unwrap();
    let out = generate_batch_on(
        backend,
        DecodeBackend::LatencySpecialized,
        Some(&mut draft as &mut dyn Drafter),
        &AcceptanceRule::Greedy,
        &[request(6, 3, 4)],
        None,
    )
    .unwrap();
    assert_eq!(out.run.decode_backend, "latency_specialized");
    let counted = out.run.decode_backend_fallbacks[FALLBACK_CPU_DEVICE];
    // One prefill step plus every verify step.
    assert_eq!(counted, out.run.num_verify_steps + 1);
    let json = serde_json::to_value(&out.run).unwrap();
    assert_eq!(
        json["decode_backend_fallbacks"][FALLBACK_CPU_DEVICE],
        serde_json::json!(counted)
    );
    assert_eq!(
        json["decode_backend_specialized_steps"],
        serde_json::json!(0)
    );
}

#[test]
fn additional_config_is_parsed_strictly() {
    let ok = |j: &str| AdditionalConfig::from_json(j).unwrap().decode_backend;
    assert_eq!(
        ok(r#"{"decode_backend": "standard"}"#),
        DecodeBackend::Standard
    );
    assert_eq!(
        ok(r#"{"decode_backend": "latency_specialized"}"#),
        DecodeBackend::LatencySpecialized
    );
    assert_eq!(ok("{}"), DecodeBackend::Standard);
    for (bad, says) in [
        (r#"{"decode_backend": "megakernel"}"#, "megakernel"),
        (r#"{"decode_backend": "Standard"}"#, "Standard"),
        (r#"{"decode_backend": 1}"#, "--additional-config"),
        (r#"{"decode_backend": "standard", "tp": 8}"#, "tp"),
        ("[]", "--additional-config"),
        ("", "--additional-config"),
    ] {
        match AdditionalConfig::from_json(bad) {
            Ok(c) => panic!("{bad:?} parsed as {c:?}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(matches!(e, EngineError::InvalidRequest(_)), "{msg}");
                assert!(msg.contains("--additional-config"), "{msg}");
                assert!(msg.contains(says), "{bad:?}: {msg}");
            }
        }
    }
}

#[test]
fn cuda_device_is_checked_before_anything_is_built() {
    check_device(Device::Cpu).unwrap();
    match check_device(Device::Cuda) {
        // A cuda build on a machine with a GPU, a driver and NVRTC.
        Ok(()) if cfg!(feature = "cuda") => {}
        Ok(()) => panic!("--device cuda accepted by a build without the GPU backend"),
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, EngineError::DeviceUnavailable(_)), "{msg}");
            assert!(msg.starts_with("--device cuda: "), "{msg}");
            assert!(msg.contains("--device cpu"), "{msg}");
        }
    }
}
