//! The engine thread: owns the scheduler (and through it the target backend — CPU or GPU — and the
//! drafter) and runs steps while there is work. HTTP handlers submit requests over a channel and receive events on a channel
//! of their own; a handler that goes away (client disconnect) drops its receiver, and the engine
//! cancels the request before its next step.

use crate::metrics::Metrics;
use specula_drafters::Drafter;
use specula_engine::{
    build_target, DecodeBackend, Device, EngineError, SchedulerConfig, TargetOptions,
};
use specula_engine::{Event, GenerationOutput, GenerationRequest, RequestId, Scheduler};
use specula_model::loader::LoadedModel;
use specula_verifier::AcceptanceRule;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc;

/// What a handler hears about its request.
#[derive(Debug)]
pub enum EngineEvent {
    Tokens(Vec<u32>),
    Finished(Box<GenerationOutput>),
    /// The request could not be run (engine failure); the message is for the client.
    Failed(String),
}

pub struct Submission {
    pub request: GenerationRequest,
    pub rule: AcceptanceRule,
    pub events: mpsc::UnboundedSender<EngineEvent>,
}

struct Client {
    events: mpsc::UnboundedSender<EngineEvent>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// What the engine thread is to build.
pub struct EngineSetup {
    pub device: Device,
    pub target: TargetOptions,
    pub decode_backend: DecodeBackend,
    pub config: SchedulerConfig,
}

/// What the engine thread reports once its target is built.
#[derive(Debug, Clone)]
pub struct EngineReady {
    pub device: String,
    /// Where acceptance rules run ("host" or "device").
    pub verifier: &'static str,
    /// Positions a sequence may hold.
    pub context: usize,
    /// Why every step will fall back from the configured decode backend, if it will.
    pub fallback_reason: Option<&'static str>,
}

/// Builds the target on this thread, reports on `ready`, then serves submissions until the channel
/// closes. A target that cannot be built (no GPU) is reported and the thread ends.
pub fn run_engine(
    model: Arc<LoadedModel>,
    mut drafter: Option<Box<dyn Drafter>>,
    setup: EngineSetup,
    mut submissions: mpsc::UnboundedReceiver<Submission>,
    metrics: Arc<Mutex<Metrics>>,
    ready: std::sync::mpsc::Sender<Result<EngineReady, EngineError>>,
) {
    let target = match build_target(setup.device, &model.model, &setup.target) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let drafter_ref: Option<&mut dyn Drafter> = match drafter.as_mut() {
        Some(d) => Some(&mut **d),
        None => None,
    };
    let mut scheduler =
        Scheduler::with_target(target, drafter_ref, model.tokenizer.as_ref(), setup.config);
    if let Err(e) = scheduler.set_decode_backend(setup.decode_backend) {
        let _ = ready.send(Err(e));
        return;
    }
    let _ = ready.send(Ok(EngineReady {
        device: scheduler.device(),
        verifier: scheduler.verifier(),
        context: scheduler.max_positions(),
        fallback_reason: scheduler.fallback_reason(),
    }));
    let mut clients: HashMap<RequestId, Client> = HashMap::new();
    loop {
        // Block only when there is nothing to step; otherwise take what has arrived and go on.
        if scheduler.is_idle() {
            match submissions.blocking_recv() {
                Some(s) => admit(&mut scheduler, &mut clients, s),
                None => break,
            }
        }
        while let Ok(s) = submissions.try_recv() {
            admit(&mut scheduler, &mut clients, s);
        }
        // Clients that went away: cancel before spending a step on them.
        let gone: Vec<RequestId> = clients
            .iter()
            .filter(|(_, c)| c.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            clients.remove(&id);
            if let Err(e) = scheduler.cancel(id) {
                eprintln!("specula serve: cancelling request {id}: {e}");
            }
            lock(&metrics).requests_cancelled += 1;
        }
        if scheduler.is_idle() {
            publish_gauges(&scheduler, &metrics);
            continue;
        }
        // Steps that cannot run the configured decode backend run the standard one; the scheduler
        // counts each under its reason, and /metrics shows the counts.
        match scheduler.step() {
            Ok(events) => dispatch(events, &mut clients, &metrics),
            Err(e) => {
                // The scheduler's state after a failed step is not trusted: end every request
                // cleanly and start over with an empty batch.
                eprintln!("specula serve: engine step failed: {e}");
                let ids: Vec<RequestId> = clients.keys().copied().collect();
                for id in ids {
                    let _ = scheduler.cancel(id);
                    if let Some(c) = clients.remove(&id) {
                        let _ = c
                            .events
                            .send(EngineEvent::Failed(format!("engine error: {e}")));
                    }
                    lock(&metrics).requests_failed += 1;
                }
            }
        }
        publish_gauges(&scheduler, &metrics);
    }
}

fn publish_gauges(scheduler: &Scheduler<'_>, metrics: &Arc<Mutex<Metrics>>) {
    let mut m = metrics.lock().unwrap_or_else(|p| p.into_inner());
    m.running = scheduler.num_running();
    m.waiting = scheduler.num_waiting();
    let totals = scheduler.totals();
    m.fallbacks.clone_from(&totals.decode_backend_fallbacks);
    m.specialized_steps = totals.specialized_steps;
    m.draft_seconds = totals.draft_time.as_secs_f64();
    m.verify_seconds = totals.verify_time.as_secs_f64();
}

fn admit(scheduler: &mut Scheduler<'_>, clients: &mut HashMap<RequestId, Client>, s: Submission) {
    match scheduler.add_request(s.request, s.rule) {
        Ok(id) => {
            clients.insert(
                id,
                Client {
                    events: s.events,
                    arrived: Instant::now(),
                    last_token: None,
                },
            );
        }
        Err(e) => {
            // Handlers validate first; this is a request the engine still refused.
            let _ = s.events.send(EngineEvent::Failed(e.to_string()));
        }
    }
}

fn dispatch(
    events: Vec<Event>,
    clients: &mut HashMap<RequestId, Client>,
    metrics: &Arc<Mutex<Metrics>>,
) {
    let now = Instant::now();
    let mut m = metrics.lock().unwrap_or_else(|p| p.into_inner());
    for event in events {
        match event {
            Event::Tokens { id, tokens } => {
                let Some(c) = clients.get_mut(&id) else {
                    continue;
                };
                // Tokens of one verify step arrive together: one gap, then zero gaps.
                for i in 0..tokens.len() {
                    match (c.last_token, i) {
                        (None, 0) => m.ttft.observe((now - c.arrived).as_secs_f64()),
                        (Some(t), 0) => m.inter_token_latency.observe((now - t).as_secs_f64()),
                        _ => m.inter_token_latency.observe(0.0),
                    }
                }
                c.last_token = Some(now);
                let _ = c.events.send(EngineEvent::Tokens(tokens));
            }
            Event::Finished {
                id,
                output,
                acceptance,
            } => {
                m.record_acceptance(&acceptance);
                m.prompt_tokens += output.stats.prompt_tokens as u64;
                m.generation_tokens += output.token_ids.len() as u64;
                let reason = crate::api::finish_reason_name(output.finish_reason);
                *m.requests_finished.entry(reason.to_string()).or_insert(0) += 1;
                if let Some(c) = clients.remove(&id) {
                    let _ = c.events.send(EngineEvent::Finished(Box::new(output)));
                }
            }
        }
    }
}

fn lock(m: &Mutex<Metrics>) -> std::sync::MutexGuard<'_, Metrics> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
