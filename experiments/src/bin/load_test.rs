//! Bounded loopback load test of `specula serve` on the embedded default pair: N concurrent
//! streaming clients with mixed prompt lengths, some hanging up mid-stream. Checks that every request
//! completes (usage, finish reason, `[DONE]`) or was the client's own disconnect, and that no text was
//! lost or duplicated (each completed stream equals a non-streamed greedy reference of its prompt).
//! Reports client-side TTFT and inter-chunk latency p50/p90 and aggregate tokens/s as JSON.

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use serde_json::{json, Value};
use specula_experiments::Provenance;
use specula_server::{Server, ServerOptions};
use std::time::{Duration, Instant};

const CLIENTS: usize = 64;
const MAX_TOKENS: usize = 32;
const PROMPT_VARIANTS: usize = 8;

fn prompt(variant: usize) -> String {
    // Mixed lengths: from a few tokens to a few hundred.
    let base = "ROMEO:\nBut soft, what light through yonder window breaks? ";
    let mut p = String::from("Once upon a time ");
    for _ in 0..(variant * variant * 2 / 3) {
        p.push_str(base);
    }
    p
}

struct Outcome {
    variant: usize,
    disconnected: bool,
    text: String,
    completion_tokens: u64,
    ttft: Option<Duration>,
    gaps: Vec<Duration>,
}

async fn client(base: String, i: usize) -> Result<Outcome> {
    let variant = i % PROMPT_VARIANTS;
    // Every ninth client (all prompt lengths in turn) hangs up after its third chunk.
    let hang_up_after = (i % 9 == 4).then_some(3);
    let sent = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"prompt": prompt(variant), "max_tokens": MAX_TOKENS, "temperature": 0,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await?;
    if !r.status().is_success() {
        bail!("client {i}: HTTP {}: {}", r.status(), r.text().await?);
    }
    let mut body = r.bytes_stream();
    let (mut buf, mut text, mut chunks) = (String::new(), String::new(), 0usize);
    let (mut ttft, mut last, mut gaps) = (None, None::<Instant>, Vec::new());
    let mut completion_tokens = 0;
    let mut done = false;
    while let Some(bytes) = body.next().await {
        buf.push_str(std::str::from_utf8(&bytes?)?);
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data = event
                .trim()
                .strip_prefix("data: ")
                .context("SSE data line")?;
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                bail!("client {i}: error event {v}");
            }
            let now = Instant::now();
            match last {
                None => ttft = Some(now - sent),
                Some(t) => gaps.push(now - t),
            }
            last = Some(now);
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                completion_tokens = n;
            }
            chunks += 1;
            if hang_up_after == Some(chunks) {
                return Ok(Outcome {
                    variant,
                    disconnected: true,
                    text,
                    completion_tokens: 0,
                    ttft,
                    gaps,
                });
            }
        }
    }
    if !done {
        bail!("client {i}: stream ended without [DONE]");
    }
    Ok(Outcome {
        variant,
        disconnected: false,
        text,
        completion_tokens,
        ttft,
        gaps,
    })
}

fn pct(mut ms: Vec<f64>, q: f64) -> f64 {
    if ms.is_empty() {
        return f64::NAN;
    }
    ms.sort_by(f64::total_cmp);
    ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let out_path = std::env::args().nth(1);
    let opts = ServerOptions {
        max_running: 16,
        max_queue: 64,
        ..ServerOptions::default()
    };
    let server = Server::start(opts.clone())?;
    let description = server.description.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));

    let start = Instant::now();
    let handles: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client(base.clone(), i)))
        .collect();
    let mut outcomes = Vec::new();
    let mut errors = Vec::new();
    for h in handles {
        match h.await? {
            Ok(o) => outcomes.push(o),
            Err(e) => errors.push(e.to_string()),
        }
    }
    let wall = start.elapsed();

    // References: one non-streamed greedy completion per prompt variant.
    let http = reqwest::Client::new();
    let mut reference = Vec::new();
    for v in 0..PROMPT_VARIANTS {
        let r: Value = http
            .post(format!("{base}/v1/completions"))
            .json(
                &json!({"prompt": prompt(v), "max_tokens": MAX_TOKENS, "temperature": 0,
                          "ignore_eos": true}),
            )
            .send()
            .await?
            .json()
            .await?;
        reference.push((
            r["choices"][0]["text"].as_str().unwrap_or("").to_string(),
            r["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        ));
    }
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let _ = stop.send(());
    served.await??;

    let completed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.disconnected).collect();
    let disconnected = outcomes.len() - completed.len();
    let mismatched = completed
        .iter()
        .filter(|o| o.text != reference[o.variant].0 || o.completion_tokens != MAX_TOKENS as u64)
        .count();
    let prefix_violations = outcomes
        .iter()
        .filter(|o| o.disconnected && !reference[o.variant].0.starts_with(&o.text))
        .count();
    let tokens: u64 = completed.iter().map(|o| o.completion_tokens).sum();
    let ttft_ms: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.ttft.map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let gap_ms: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.gaps.iter().map(|d| d.as_secs_f64() * 1e3))
        .collect();
    let metric = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let report = json!({
        "provenance": Provenance::collect(),
        "server": description,
        "setup": {"clients": CLIENTS, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "prompt_tokens_by_variant": reference.iter().map(|r| r.1).collect::<Vec<_>>(),
                  "hang_up_after_3_chunks": "clients with i % 9 == 4",
                  "max_running": opts.max_running, "max_queue": opts.max_queue,
                  "prefill_chunk_tokens": opts.prefill_chunk_tokens},
        "requests": {"completed": completed.len(), "disconnected_by_client": disconnected,
                     "errors": errors, "completed_text_mismatches": mismatched,
                     "disconnected_prefix_mismatches": prefix_violations},
        "ttft_ms": {"p50": pct(ttft_ms.clone(), 0.5), "p90": pct(ttft_ms, 0.9)},
        "inter_chunk_latency_ms": {"p50": pct(gap_ms.clone(), 0.5), "p90": pct(gap_ms, 0.9),
            "note": "client-side gaps between SSE chunks; one chunk carries every token of a verify step"},
        "aggregate_completion_tokens_per_s": tokens as f64 / wall.as_secs_f64(),
        "wall_s": wall.as_secs_f64(),
        "server_metrics": {
            "cancelled": metric("specula_requests_cancelled_total"),
            "finished": metric("specula_request_success_total"),
            "drafts": metric("specula_spec_decode_num_drafts_total"),
            "draft_tokens": metric("specula_spec_decode_num_draft_tokens_total"),
            "accepted_tokens": metric("specula_spec_decode_num_accepted_tokens_total"),
        },
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(p) = out_path {
        std::fs::write(&p, &text).with_context(|| format!("writing {p}"))?;
    }
    if !errors.is_empty() || mismatched > 0 || prefix_violations > 0 {
        bail!(
            "load test failed: {} errors, {mismatched} mismatched texts",
            errors.len()
        );
    }
    Ok(())
}
