//! Server metrics in Prometheus text format. The engine thread updates them; `/metrics` renders them.
//! Speculative counters are summed from each finished request's own acceptance record, so they agree
//! exactly with the per-request stats the responses carry.

use specula_verifier::AcceptanceCounter;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Upper bounds (seconds) of the latency histogram buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, seconds: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if seconds <= *b {
                *c += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug, Clone)]
pub struct Metrics {
    pub model_name: String,
    pub running: usize,
    pub waiting: usize,
    /// Verify steps (each verifies one draft proposal, possibly of zero tokens).
    pub spec_num_drafts: u64,
    pub spec_num_draft_tokens: u64,
    pub spec_num_accepted_tokens: u64,
    /// Index i: verify steps that accepted draft slot i + 1.
    pub spec_accepted_per_position: Vec<u64>,
    pub ttft: Histogram,
    pub inter_token_latency: Histogram,
    pub fallbacks: BTreeMap<String, u64>,
    /// Scheduler steps that ran the `latency_specialized` decode backend.
    pub specialized_steps: u64,
    /// Wall time the scheduler spent drafting and verifying (target forward + acceptance rule), seconds.
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    pub requests_finished: BTreeMap<String, u64>,
    pub requests_cancelled: u64,
    pub requests_rejected_queue_full: u64,
    pub requests_failed: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        Metrics {
            model_name: model_name.to_string(),
            running: 0,
            waiting: 0,
            spec_num_drafts: 0,
            spec_num_draft_tokens: 0,
            spec_num_accepted_tokens: 0,
            spec_accepted_per_position: Vec::new(),
            ttft: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            fallbacks: BTreeMap::new(),
            specialized_steps: 0,
            draft_seconds: 0.0,
            verify_seconds: 0.0,
            requests_finished: BTreeMap::new(),
            requests_cancelled: 0,
            requests_rejected_queue_full: 0,
            requests_failed: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
        }
    }

    pub fn record_acceptance(&mut self, c: &AcceptanceCounter) {
        self.spec_num_drafts += c.steps();
        self.spec_num_draft_tokens += c.drafted_tokens();
        self.spec_num_accepted_tokens += c.accepted_tokens();
        let per_slot = c.accepted_per_slot();
        if self.spec_accepted_per_position.len() < per_slot.len() {
            self.spec_accepted_per_position.resize(per_slot.len(), 0);
        }
        for (total, n) in self.spec_accepted_per_position.iter_mut().zip(per_slot) {
            *total += n;
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let m = &self.model_name;
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model_name=\"{m}\"}} {v}"
            );
        };
        counter(
            "specula_spec_decode_num_drafts_total",
            "Verify steps of finished requests (one draft proposal each).",
            self.spec_num_drafts,
        );
        counter(
            "specula_spec_decode_num_draft_tokens_total",
            "Draft tokens proposed for finished requests.",
            self.spec_num_draft_tokens,
        );
        counter(
            "specula_spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted for finished requests.",
            self.spec_num_accepted_tokens,
        );
        counter(
            "specula_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens,
        );
        counter(
            "specula_generation_tokens_total",
            "Generated tokens of finished requests.",
            self.generation_tokens,
        );
        counter(
            "specula_requests_cancelled_total",
            "Requests cancelled because the client went away.",
            self.requests_cancelled,
        );
        counter(
            "specula_requests_rejected_queue_full_total",
            "Requests answered 429 because the queue was full.",
            self.requests_rejected_queue_full,
        );
        counter(
            "specula_requests_failed_total",
            "Requests ended by an engine error.",
            self.requests_failed,
        );
        let _ = writeln!(
            out,
            "# HELP specula_spec_decode_num_accepted_tokens_per_pos_total Verify steps that accepted each draft position.\n# TYPE specula_spec_decode_num_accepted_tokens_per_pos_total counter"
        );
        for (i, v) in self.spec_accepted_per_position.iter().enumerate() {
            let _ = writeln!(
                out,
                "specula_spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"{m}\",position=\"{i}\"}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP specula_request_success_total Finished requests by finish reason.\n# TYPE specula_request_success_total counter"
        );
        for (reason, v) in &self.requests_finished {
            let _ = writeln!(
                out,
                "specula_request_success_total{{model_name=\"{m}\",finished_reason=\"{reason}\"}} {v}"
            );
        }
        for (name, help, v) in [
            (
                "specula_draft_seconds_total",
                "Wall time spent drafting (all drafter proposals).",
                self.draft_seconds,
            ),
            (
                "specula_verify_seconds_total",
                "Wall time spent verifying (target forward over the draft blocks and the acceptance rule).",
                self.verify_seconds,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{model_name=\"{m}\"}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP specula_decode_backend_fallbacks_total Scheduler steps that fell back to the standard decode backend, by reason.\n# TYPE specula_decode_backend_fallbacks_total counter"
        );
        for (reason, v) in &self.fallbacks {
            let _ = writeln!(
                out,
                "specula_decode_backend_fallbacks_total{{model_name=\"{m}\",reason=\"{reason}\"}} {v}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP specula_decode_backend_specialized_steps_total Scheduler steps that ran the latency_specialized decode backend (the fused kernel).\n# TYPE specula_decode_backend_specialized_steps_total counter\nspecula_decode_backend_specialized_steps_total{{model_name=\"{m}\"}} {}",
            self.specialized_steps
        );
        let _ = writeln!(
            out,
            "# HELP specula_num_requests_running Requests in the decode batch.\n# TYPE specula_num_requests_running gauge\nspecula_num_requests_running{{model_name=\"{m}\"}} {}",
            self.running
        );
        let _ = writeln!(
            out,
            "# HELP specula_num_requests_waiting Requests waiting for a batch slot.\n# TYPE specula_num_requests_waiting gauge\nspecula_num_requests_waiting{{model_name=\"{m}\"}} {}",
            self.waiting
        );
        self.ttft.render(
            &mut out,
            "specula_time_to_first_token_seconds",
            "Time from arrival at the engine to the first token.",
        );
        self.inter_token_latency.render(
            &mut out,
            "specula_inter_token_latency_seconds",
            "Gap between consecutive tokens of a request (tokens of one verify step arrive together).",
        );
        out
    }
}
