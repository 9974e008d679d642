//! The server end to end on the embedded default pair, on an ephemeral loopback port: completions,
//! streaming, seeds, equality with `generate_batch`, greedy with and without speculation, every
//! validation error, 429 on a full queue, cancellation on disconnect, `/metrics` against the
//! per-request stats.

use futures_util::StreamExt;
use serde_json::{json, Value};
use specula_drafters::{Drafter, ModelDrafter};
use specula_engine::{generate_batch, GenerationRequest, SpeculativeConfig};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::load;
use specula_model::WeightDtype;
use specula_server::{default_models_dir, Server, ServerOptions};
use std::time::Duration;

struct Running {
    base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(60), &mut self.done).await;
    }
}

async fn start(opts: ServerOptions) -> Running {
    let server = Server::start(opts).expect("server starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        server
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Running {
        base,
        stop: Some(stop),
        done,
    }
}

async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn post_raw(base: &str, body: Vec<u8>) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn ids(v: &Value) -> Vec<u32> {
    v["specula"]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The SSE `data:` payloads of a streamed response, in order.
async fn stream_events(base: &str, path: &str, body: Value) -> Vec<String> {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

async fn metric(base: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const PROMPT: &str = "Once upon a time";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_streaming_seeds_and_equality_with_generate_batch() {
    let s = start(ServerOptions::default()).await;
    let body = json!({"model": "specula-default", "prompt": PROMPT, "max_tokens": 12,
                      "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": true});
    let (st, a) = post(&s.base, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(&s.base, "/v1/completions", body.clone()).await;
    assert_eq!(ids(&a), ids(&b), "same seed, same tokens");
    assert_eq!(ids(&a).len(), 12);
    assert_eq!(a["usage"]["completion_tokens"], 12);
    assert_eq!(
        a["usage"]["total_tokens"],
        a["usage"]["prompt_tokens"].as_u64().unwrap() + 12
    );
    assert_eq!(a["object"], "text_completion");

    // Streaming: the deltas concatenate to the same text, usage on the last chunk, then [DONE].
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = stream_events(&s.base, "/v1/completions", sbody).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, a["choices"][0]["text"].as_str().unwrap());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 12);

    // The same request through generate_batch (embedded pair, default speculative settings).
    let dir = default_models_dir();
    let target = load(&dir.join("target"), WeightDtype::Auto).unwrap();
    let draft = load(&dir.join("draft"), WeightDtype::Auto).unwrap();
    let tok = target.tokenizer().unwrap();
    let spec = SpeculativeConfig {
        method: specula_engine::SpeculativeMethod::DraftModel,
        model: Some(dir.join("draft").display().to_string()),
        ..SpeculativeConfig::default()
    };
    let req = GenerationRequest {
        prompt_ids: tok.encode(PROMPT, true).unwrap(),
        max_new_tokens: 12,
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
        },
        seed: 7,
        stop_token_ids: vec![],
        vocab_limit: Some(tok.vocab_size()),
        stop_strings: vec![],
        num_draft_tokens: spec.draft_tokens(),
    };
    let mut drafter = ModelDrafter::new(draft.model);
    let out = generate_batch(
        &target.model,
        Some(&mut drafter as &mut dyn Drafter),
        &spec.rule(0.8).unwrap(),
        &[req],
        Some(tok),
    )
    .unwrap();
    assert_eq!(
        out.outputs[0].token_ids,
        ids(&a),
        "server == generate_batch"
    );

    // A chat request: the embedded tokenizer has no chat template, which is a clear 400.
    let (st, e) = post(
        &s.base,
        "/v1/chat/completions",
        json!({"model": "specula-default", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(st, 400);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("chat template"));

    let models: Value = reqwest::get(format!("{}/v1/models", s.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "specula-default");
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_is_identical_with_and_without_speculation_and_metrics_match_stats() {
    let spec = start(ServerOptions::default()).await;
    let plain = start(ServerOptions {
        draft: Some("none".into()),
        ..ServerOptions::default()
    })
    .await;
    let prompts = ["Once upon a time", "The king said", "ROMEO:\nWhat light"];
    let mut sums = [0u64; 3];
    for p in prompts {
        let body = json!({"prompt": p, "max_tokens": 16, "temperature": 0});
        let (sa, a) = post(&spec.base, "/v1/completions", body.clone()).await;
        let (sb, b) = post(&plain.base, "/v1/completions", body).await;
        assert_eq!((sa, sb), (200, 200));
        assert_eq!(
            ids(&a),
            ids(&b),
            "greedy speculative == greedy plain for {p:?}"
        );
        assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
        let st = &a["specula"]["stats"];
        sums[0] += st["num_verify_steps"].as_u64().unwrap();
        sums[1] += st["drafted_tokens"].as_u64().unwrap();
        sums[2] += st["accepted_tokens"].as_u64().unwrap();
    }
    assert!(sums[2] > 0, "the distilled draft gets some tokens accepted");
    let m = [
        metric(&spec.base, "specula_spec_decode_num_drafts_total").await,
        metric(&spec.base, "specula_spec_decode_num_draft_tokens_total").await,
        metric(&spec.base, "specula_spec_decode_num_accepted_tokens_total").await,
    ];
    assert_eq!(
        m,
        sums.map(|x| x as f64),
        "/metrics == sum of per-request stats"
    );
    // Drafting and verifying are timed apart (the seed's table separates draft from verify cost).
    let draft_s = metric(&spec.base, "specula_draft_seconds_total").await;
    let verify_s = metric(&spec.base, "specula_verify_seconds_total").await;
    assert!(
        draft_s > 0.0 && verify_s > 0.0,
        "draft {draft_s} s, verify {verify_s} s"
    );
    let per_pos = metric(
        &spec.base,
        "specula_spec_decode_num_accepted_tokens_per_pos_total",
    )
    .await;
    assert_eq!(
        per_pos, sums[2] as f64,
        "per-position counts sum to accepted"
    );
    assert_eq!(
        metric(&spec.base, "specula_time_to_first_token_seconds_count").await,
        3.0
    );
    spec.shutdown().await;
    plain.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_validation_error_is_an_openai_error_and_the_server_survives() {
    let s = start(ServerOptions::default()).await;
    let long_prompt: Vec<u32> = vec![5; 1024];
    let cases: Vec<(&str, Value, u16)> = vec![
        (
            "unknown model",
            json!({"model": "gpt-9", "prompt": "a"}),
            404,
        ),
        (
            "wrong type",
            json!({"prompt": "a", "max_tokens": "ten"}),
            422,
        ),
        ("missing prompt", json!({"max_tokens": 3}), 422),
        ("max_tokens 0", json!({"prompt": "a", "max_tokens": 0}), 400),
        (
            "max_tokens < 0",
            json!({"prompt": "a", "max_tokens": -3}),
            400,
        ),
        (
            "max_tokens > context",
            json!({"prompt": "a", "max_tokens": 5000}),
            400,
        ),
        (
            "negative temperature",
            json!({"prompt": "a", "temperature": -0.5}),
            400,
        ),
        ("top_p 0", json!({"prompt": "a", "top_p": 0.0}), 400),
        ("top_p > 1", json!({"prompt": "a", "top_p": 1.5}), 400),
        ("n = 2", json!({"prompt": "a", "n": 2}), 400),
        ("prompt beyond context", json!({"prompt": long_prompt}), 400),
        ("token out of vocabulary", json!({"prompt": [999999]}), 400),
        ("empty prompt", json!({"prompt": ""}), 400),
    ];
    for (what, body, want) in cases {
        let (st, e) = post(&s.base, "/v1/completions", body).await;
        assert_eq!(st, want, "{what}: {e}");
        assert!(e["error"]["message"].is_string(), "{what}: {e}");
        assert!(e["error"]["type"].is_string(), "{what}: {e}");
        assert!(e["error"].get("param").is_some() && e["error"].get("code").is_some());
    }
    let (st, e) = post_raw(&s.base, b"{\"prompt\": \"a\",".to_vec()).await;
    assert_eq!(st, 400, "malformed JSON: {e}");
    let (st, e) = post_raw(&s.base, b"{\"prompt\": \"\xff\xfe\"}".to_vec()).await;
    assert_eq!(st, 400, "invalid UTF-8: {e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("UTF-8"));
    let mut big = b"{\"prompt\": \"".to_vec();
    big.extend(std::iter::repeat_n(b'a', 2 << 20));
    big.extend(b"\"}");
    let (st, e) = post_raw(&s.base, big).await;
    assert_eq!(st, 413, "oversized body: {e}");
    let (st, e) = post(&s.base, "/v1/nowhere", json!({})).await;
    assert_eq!(st, 404, "{e}");
    // Still serving.
    let (st, _) = post(
        &s.base,
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429_and_a_disconnect_cancels_the_request() {
    let s = start(ServerOptions {
        max_running: 1,
        max_queue: 1,
        ..ServerOptions::default()
    })
    .await;
    let client = reqwest::Client::new();
    let long = json!({"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let first = client
        .post(format!("{}/v1/completions", s.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    let second = client
        .post(format!("{}/v1/completions", s.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let (st, e) = post(&s.base, "/v1/completions", json!({"prompt": "a"})).await;
    assert_eq!(st, 429, "{e}");
    assert_eq!(e["error"]["code"], "queue_full");
    assert_eq!(
        metric(&s.base, "specula_requests_rejected_queue_full_total").await,
        1.0
    );

    // Read a little of the first stream, then hang up on both.
    let mut body = first.bytes_stream();
    let chunk = body.next().await.unwrap().unwrap();
    assert!(chunk.starts_with(b"data: "));
    drop(body);
    drop(second);
    let mut cancelled = 0.0;
    for _ in 0..200 {
        cancelled = metric(&s.base, "specula_requests_cancelled_total").await;
        if cancelled >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cancelled, 2.0, "both hung-up requests were cancelled");
    assert_eq!(metric(&s.base, "specula_num_requests_running").await, 0.0);
    assert_eq!(
        metric(&s.base, "specula_request_success_total").await,
        0.0,
        "neither ran to its 900 tokens"
    );
    // Slots are free again.
    let (st, _) = post(
        &s.base,
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_streams() {
    let mut s = start(ServerOptions {
        additional_config: Some(r#"{"decode_backend": "latency_specialized"}"#.into()),
        ..ServerOptions::default()
    })
    .await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.base))
        .json(
            &json!({"prompt": "Once", "max_tokens": 24, "temperature": 0,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    // Every step falls back (never silently), under the CPU device's reason; the request is
    // running, so steps are being counted while the stream is open.
    let mut fallbacks = 0.0;
    for _ in 0..600 {
        fallbacks = metric(&s.base, "specula_decode_backend_fallbacks_total").await;
        if fallbacks > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(fallbacks > 0.0, "no fallback counted");
    let text = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(&format!(
            "specula_decode_backend_fallbacks_total{{model_name=\"specula-default\",reason=\"{}\"}}",
            specula_engine::FALLBACK_CPU_DEVICE
        )),
        "{text}"
    );
    let _ = s.stop.take().unwrap().send(());
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"finish_reason\":\"length\""));
    tokio::time::timeout(Duration::from_secs(60), &mut s.done)
        .await
        .expect("server stops after the stream ends")
        .unwrap();
}

/// The seed's DL7 configuration: `{"method": "dspark", "num_speculative_tokens": 7}` with no model
/// path serves with the DSpark drafter shipped with the embedded target, greedy output equal to
/// plain decoding; with a synthetic AL of 3.78 the stats say synthetic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dspark_dl7_serves_natural_and_synthetic_acceptance() {
    let dspark = start(ServerOptions {
        speculative_config: Some(r#"{"method": "dspark", "num_speculative_tokens": 7}"#.into()),
        ..ServerOptions::default()
    })
    .await;
    let plain = start(ServerOptions {
        draft: Some("none".into()),
        ..ServerOptions::default()
    })
    .await;
    let synthetic = start(ServerOptions {
        speculative_config: Some(
            r#"{"method": "dspark", "num_speculative_tokens": 7, "synthetic_acceptance_length": 3.78}"#
                .into(),
        ),
        ..ServerOptions::default()
    })
    .await;
    let body = json!({"prompt": "def read_config(path):", "max_tokens": 32, "temperature": 0});
    let (sa, a) = post(&dspark.base, "/v1/completions", body.clone()).await;
    let (sb, b) = post(&plain.base, "/v1/completions", body.clone()).await;
    let (sc, c) = post(&synthetic.base, "/v1/completions", body).await;
    assert_eq!((sa, sb, sc), (200, 200, 200));
    assert_eq!(
        ids(&a),
        ids(&b),
        "greedy DSpark speculation == plain greedy"
    );
    let st = &a["specula"]["stats"];
    assert_eq!(st["acceptance_mode"], "natural");
    assert!(st["accepted_tokens"].as_u64().unwrap() > 0);
    assert_eq!(c["specula"]["stats"]["acceptance_mode"], "synthetic");
    dspark.shutdown().await;
    plain.shutdown().await;
    synthetic.shutdown().await;
}

/// `--device cuda` where it cannot run (no GPU backend in the build, no driver): a start-up error
/// that names the problem and the CPU fallback, never a panic on the engine thread.
#[test]
fn cuda_device_without_a_gpu_is_a_clear_start_error() {
    let started = specula_server::Server::start(ServerOptions {
        device: specula_server::Device::Cuda,
        ..ServerOptions::default()
    });
    match started {
        // A cuda build on a GPU machine.
        Ok(_) => {
            assert!(specula_engine::target::check_device(specula_server::Device::Cuda).is_ok())
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("--device cuda"), "{msg}");
            assert!(msg.contains("--device cpu"), "{msg}");
        }
    }
}
