//! `specula serve`: an OpenAI-compatible HTTP server (tokio + axum) over the continuous-batching
//! speculative scheduler. The model runs on one dedicated engine thread (the CPU forward uses
//! rayon); handlers validate requests, submit them over a channel and turn the engine's events into
//! JSON responses or server-sent events.

pub mod api;
pub mod engine;
pub mod metrics;

use api::{check_fields, cut_at_stop, parse_body, ApiError, ChatBody, CompletionBody, Prompt};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::{EngineEvent, Submission};
use futures_util::stream::{self, Stream, StreamExt};
use metrics::Metrics;
use serde_json::{json, Value};
use specula_engine::generate::validate_request_for;
use specula_engine::{
    build_drafter_on, DrafterDevice, GenerationOutput, GenerationRequest, SchedulerConfig,
    SpeculativeConfig, SpeculativeMethod, TargetOptions,
};
pub use specula_engine::{AdditionalConfig, DecodeBackend, Device};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::{load, LoadedModel};
use specula_model::tokenizer::ChatMessage;
use specula_model::WeightDtype;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Request bodies above this are refused with 413.
pub const MAX_BODY_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("loading {path}: {message}")]
    Load { path: String, message: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Target model; None serves the embedded default pair.
    pub model: Option<PathBuf>,
    /// A draft model path, `ngram` or `none`; overrides the speculative config's method.
    pub draft: Option<String>,
    pub speculative_config: Option<String>,
    pub additional_config: Option<String>,
    pub dtype: WeightDtype,
    /// Where the target (and the DSpark drafter or draft model) runs.
    pub device: Device,
    /// `Device::Cuda`: positions per sequence the device KV pools hold (capped at the model's
    /// context); prompts and max_tokens are validated against it.
    pub gpu_max_context: usize,
    pub max_running: usize,
    /// Requests that may wait for a batch slot; beyond it requests get 429.
    pub max_queue: usize,
    pub prefill_chunk_tokens: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            model: None,
            draft: None,
            speculative_config: None,
            additional_config: None,
            dtype: WeightDtype::Auto,
            device: Device::Cpu,
            gpu_max_context: TargetOptions::default().max_positions,
            max_running: 16,
            max_queue: 64,
            prefill_chunk_tokens: 256,
        }
    }
}

/// The embedded default pair: `$SPECULA_DEFAULT_MODELS` or `models/default` of the source tree.
pub fn default_models_dir() -> PathBuf {
    match std::env::var_os("SPECULA_DEFAULT_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/default"),
    }
}

/// The name the embedded default target is served under.
pub const DEFAULT_MODEL_NAME: &str = "specula-default";

struct AppState {
    model: Arc<LoadedModel>,
    /// Positions a sequence may hold (the model's context, or less on the GPU).
    context: usize,
    /// The first is the canonical name; the model path is accepted too.
    served_names: Vec<String>,
    spec: SpeculativeConfig,
    submit: mpsc::UnboundedSender<Submission>,
    metrics: Arc<Mutex<Metrics>>,
    outstanding: AtomicUsize,
    capacity: usize,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
}

/// Counts a request against the queue bound until it is dropped (response done or client gone).
struct Permit(Arc<AppState>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A loaded model with its engine thread running, ready to serve.
pub struct Server {
    state: Arc<AppState>,
    pub description: String,
}

fn load_err(path: &std::path::Path, e: impl std::fmt::Display) -> ServerError {
    ServerError::Load {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

impl Server {
    /// Loads the model and drafter and starts the engine thread.
    pub fn start(opts: ServerOptions) -> Result<Server, ServerError> {
        let additional = match &opts.additional_config {
            Some(j) => {
                AdditionalConfig::from_json(j).map_err(|e| ServerError::Config(e.to_string()))?
            }
            None => AdditionalConfig::default(),
        };
        let mut spec = match &opts.speculative_config {
            Some(j) => {
                SpeculativeConfig::from_json(j).map_err(|e| ServerError::Config(e.to_string()))?
            }
            None => SpeculativeConfig::default(),
        };
        let embedded = opts.model.is_none();
        if embedded && opts.draft.is_none() && opts.speculative_config.is_none() {
            spec.method = SpeculativeMethod::DraftModel;
            spec.model = Some(default_models_dir().join("draft").display().to_string());
        }
        match opts.draft.as_deref() {
            None => {}
            Some("none") => spec.method = SpeculativeMethod::None,
            Some("ngram") => spec.method = SpeculativeMethod::Ngram,
            Some("dspark") => {
                spec.method = SpeculativeMethod::Dspark;
                spec.model = None;
            }
            Some(path) => {
                spec.method = SpeculativeMethod::DraftModel;
                spec.model = Some(path.to_string());
            }
        }
        // Method dspark without a path on the embedded target: the DSpark drafter shipped with it.
        if embedded && spec.method == SpeculativeMethod::Dspark && spec.model.is_none() {
            spec.model = Some(default_models_dir().join("dspark").display().to_string());
        }
        spec.rule(0.0)
            .map_err(|e| ServerError::Config(e.to_string()))?;
        let path = opts
            .model
            .clone()
            .unwrap_or_else(|| default_models_dir().join("target"));
        let loaded = load(&path, opts.dtype).map_err(|e| load_err(&path, e))?;
        // The server needs a tokenizer for text prompts; fail at start, not per request.
        loaded.tokenizer().map_err(|e| load_err(&path, e))?;
        let max_running = opts.max_running.max(1);
        let target_opts = TargetOptions {
            max_running,
            prefill_chunk_tokens: opts.prefill_chunk_tokens.max(1),
            max_positions: opts.gpu_max_context,
            specialized_shapes: additional.specialized_shapes,
            ..TargetOptions::default()
        };
        // The target first: on a machine without a usable GPU its error names the problem and the
        // CPU fallback, before a GPU drafter would fail less clearly.
        if opts.device == Device::Cuda {
            specula_engine::target::check_device(Device::Cuda)
                .map_err(|e| ServerError::Config(e.to_string()))?;
        }
        let drafter_device = match opts.device {
            Device::Cpu => DrafterDevice::Cpu,
            Device::Cuda => DrafterDevice::Cuda {
                max_sequences: max_running,
                max_context: opts
                    .gpu_max_context
                    .min(loaded.model.config.max_position_embeddings),
            },
        };
        let drafter =
            build_drafter_on(&spec, &loaded, opts.dtype, drafter_device).map_err(|e| {
                load_err(
                    std::path::Path::new(spec.model.as_deref().unwrap_or("drafter")),
                    e,
                )
            })?;
        let name = if embedded {
            DEFAULT_MODEL_NAME.to_string()
        } else {
            path.file_name()
                .map_or(path.display().to_string(), |f| f.to_string_lossy().into())
        };
        let served_names = vec![name.clone(), path.display().to_string()];
        let drafter_name = drafter.as_ref().map_or("none", |d| d.name()).to_string();
        let model = Arc::new(loaded);
        let metrics = Arc::new(Mutex::new(Metrics::new(&name)));
        let (submit, submissions) = mpsc::unbounded_channel();
        let config = SchedulerConfig {
            max_running,
            prefill_chunk_tokens: opts.prefill_chunk_tokens.max(1),
        };
        // The engine thread builds the target (a GPU target lives on the thread that steps it) and
        // reports how that went before serving starts.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        {
            let model = model.clone();
            let metrics = metrics.clone();
            let setup = engine::EngineSetup {
                device: opts.device,
                target: target_opts,
                decode_backend: additional.decode_backend,
                config,
            };
            std::thread::Builder::new()
                .name("specula-engine".into())
                .spawn(move || {
                    engine::run_engine(model, drafter, setup, submissions, metrics, ready_tx)
                })?;
        }
        let ready = ready_rx
            .recv()
            .map_err(|_| ServerError::Config("the engine thread ended while starting".into()))?
            .map_err(|e| ServerError::Config(e.to_string()))?;
        let description = format!(
            "serving {name} ({}) on {} (acceptance rules on the {}) with drafter {} (k = {}), decode backend {}{}; context {} tokens, max running {}, max queue {}",
            path.display(),
            ready.device,
            ready.verifier,
            drafter_name,
            spec.draft_tokens(),
            additional.decode_backend.name(),
            match ready.fallback_reason {
                Some(reason) => format!(
                    " (not available: every step runs standard and is counted as \
                     specula_decode_backend_fallbacks_total{{reason=\"{reason}\"}})"
                ),
                None => String::new(),
            },
            ready.context,
            opts.max_running,
            opts.max_queue
        );
        Ok(Server {
            state: Arc::new(AppState {
                context: ready.context,
                model,
                served_names,
                spec,
                submit,
                metrics,
                outstanding: AtomicUsize::new(0),
                capacity: opts.max_running.max(1) + opts.max_queue,
                shutting_down: AtomicBool::new(false),
                next_id: AtomicU64::new(0),
            }),
            description,
        })
    }

    pub fn model_name(&self) -> &str {
        &self.state.served_names[0]
    }

    /// Serves until `shutdown` resolves, then stops accepting connections, answers new requests on
    /// open connections with 503 and lets in-flight requests finish before returning.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let state = self.state.clone();
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .fallback(|| async {
                ApiError::invalid("no such endpoint", None)
                    .with_status(StatusCode::NOT_FOUND, "not_found")
            })
            .with_state(self.state);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown.await;
                state.shutting_down.store(true, Ordering::SeqCst);
            })
            .await?;
        Ok(())
    }
}

/// Resolves on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("specula serve: shutting down; finishing in-flight requests");
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.shutting_down.load(Ordering::SeqCst) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.served_names[0],
            "object": "model",
            "created": unix_now(),
            "owned_by": "specula",
            "max_model_len": st.context,
        }]
    }))
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    let text = st
        .metrics
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .render();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            ApiError::invalid(
                format!("the request body is larger than {MAX_BODY_BYTES} bytes"),
                None,
            )
            .with_status(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large")
        })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completion,
    Chat,
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    match handle(st, body, Endpoint::Completion).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    match handle(st, body, Endpoint::Chat).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// A validated request ready for the engine.
struct Prepared {
    request: GenerationRequest,
    settings: api::Settings,
}

fn prepare(st: &AppState, bytes: &[u8], endpoint: Endpoint) -> Result<Prepared, ApiError> {
    let tok = st
        .model
        .tokenizer()
        .map_err(|e| ApiError::invalid(e.to_string(), None))?;
    let context = st.context;
    let (prompt_ids, fields) = match endpoint {
        Endpoint::Completion => {
            let b: CompletionBody = parse_body(bytes)?;
            let ids = match &b.prompt {
                Prompt::Text(t) => tok.encode(t, true),
                Prompt::Texts(v) if v.len() == 1 => tok.encode(&v[0], true),
                Prompt::Texts(v) => {
                    return Err(ApiError::invalid(
                        format!("one prompt per request is supported (got {})", v.len()),
                        Some("prompt"),
                    ))
                }
                Prompt::TokenIds(ids) => Ok(ids.clone()),
            }
            .map_err(|e| ApiError::invalid(format!("prompt: {e}"), Some("prompt")))?;
            (ids, b.fields)
        }
        Endpoint::Chat => {
            let b: ChatBody = parse_body(bytes)?;
            if !tok.has_chat_template() {
                return Err(ApiError::invalid(
                    "this model's tokenizer has no chat template; use /v1/completions",
                    Some("messages"),
                ));
            }
            let mut messages = Vec::with_capacity(b.messages.len());
            for m in &b.messages {
                let content = match &m.content {
                    api::MessageContent::Text(t) => t.clone(),
                    api::MessageContent::Parts(parts) => {
                        let mut s = String::new();
                        for p in parts {
                            match (&*p.kind, &p.text) {
                                ("text", Some(t)) => s.push_str(t),
                                _ => {
                                    return Err(ApiError::invalid(
                                        format!("unsupported content part {:?}", p.kind),
                                        Some("messages"),
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                messages.push(ChatMessage::new(m.role.clone(), content));
            }
            let text = tok
                .apply_chat_template(&messages, true)
                .map_err(|e| ApiError::invalid(format!("chat template: {e}"), Some("messages")))?;
            let ids = tok
                .encode(&text, true)
                .map_err(|e| ApiError::invalid(format!("messages: {e}"), Some("messages")))?;
            (ids, b.fields)
        }
    };
    let settings = check_fields(&fields, &st.served_names)?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    if prompt_ids.len() >= context {
        return Err(ApiError::invalid(
            format!(
                "the prompt has {} tokens; the model's context is {context} tokens and one must remain to generate",
                prompt_ids.len()
            ),
            Some("prompt"),
        )
        .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded"));
    }
    let room = context - prompt_ids.len();
    let max_new_tokens = match settings.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens is {m} but the prompt ({} tokens) leaves room for {room} in the {context}-token context",
                    prompt_ids.len()
                ),
                Some("max_tokens"),
            )
            .with_status(StatusCode::BAD_REQUEST, "context_length_exceeded"))
        }
        Some(m) => m,
        // OpenAI's default for completions is 16; chat runs to the end of the context.
        None if endpoint == Endpoint::Completion => 16.min(room),
        None => room,
    };
    let request = GenerationRequest {
        prompt_ids,
        max_new_tokens,
        sampling: SamplingParams {
            temperature: settings.temperature,
            top_k: settings.top_k,
            top_p: settings.top_p,
        },
        seed: settings.seed,
        stop_token_ids: if settings.ignore_eos {
            Vec::new()
        } else {
            st.model.eos_token_ids()
        },
        vocab_limit: Some(tok.vocab_size()),
        stop_strings: settings.stops.clone(),
        num_draft_tokens: st.spec.draft_tokens(),
    };
    validate_request_for(&st.model.model.config, st.context, &request)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
    Ok(Prepared { request, settings })
}

async fn handle(st: Arc<AppState>, body: Body, endpoint: Endpoint) -> Result<Response, ApiError> {
    if st.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::invalid("the server is shutting down", None)
            .with_status(StatusCode::SERVICE_UNAVAILABLE, "shutting_down"));
    }
    let bytes = read_body(body).await?;
    let prepared = prepare(&st, &bytes, endpoint)?;
    let rule = st
        .spec
        .rule(prepared.settings.temperature)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("temperature")))?;

    // Admission: running plus waiting requests are bounded; beyond that, 429.
    if st.outstanding.fetch_add(1, Ordering::SeqCst) >= st.capacity {
        st.outstanding.fetch_sub(1, Ordering::SeqCst);
        st.metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .requests_rejected_queue_full += 1;
        return Err(ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "the server is at capacity ({} running or queued); retry later",
                st.capacity
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        });
    }
    let permit = Permit(st.clone());
    let (events_tx, events) = mpsc::unbounded_channel();
    let prompt_tokens = prepared.request.prompt_ids.len();
    st.submit
        .send(Submission {
            request: prepared.request,
            rule,
            events: events_tx,
        })
        .map_err(|_| {
            ApiError::invalid("the engine has stopped", None)
                .with_status(StatusCode::INTERNAL_SERVER_ERROR, "engine_stopped")
        })?;
    let n = st.next_id.fetch_add(1, Ordering::SeqCst);
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Completion => format!("cmpl-{n}"),
            Endpoint::Chat => format!("chatcmpl-{n}"),
        },
        created: unix_now(),
        model: st.served_names[0].clone(),
        endpoint,
        prompt_tokens,
        stops: prepared.settings.stops.clone(),
    };
    if prepared.settings.stream {
        Ok(stream_response(st, meta, events, permit))
    } else {
        whole_response(st, meta, events, permit).await
    }
}

struct ResponseMeta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    prompt_tokens: usize,
    stops: Vec<String>,
}

impl ResponseMeta {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    /// One streamed chunk carrying `text` (and the finish reason on the last one).
    fn chunk(&self, text: &str, first: bool, finish: Option<&str>, usage: Option<Value>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut v = json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Completion => "text_completion",
                Endpoint::Chat => "chat.completion.chunk",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn final_text(st: &AppState, ids: &[u32], stops: &[String]) -> String {
    let mut text = match st.model.tokenizer() {
        Ok(t) => t.decode(ids, true).unwrap_or_default(),
        Err(_) => String::new(),
    };
    // Like serving APIs, the stop string itself is not part of the returned text.
    if let Some(cut) = cut_at_stop(&text, stops) {
        text.truncate(cut);
    }
    text
}

async fn whole_response(
    st: Arc<AppState>,
    meta: ResponseMeta,
    mut events: mpsc::UnboundedReceiver<EngineEvent>,
    _permit: Permit,
) -> Result<Response, ApiError> {
    let output: GenerationOutput = loop {
        match events.recv().await {
            Some(EngineEvent::Tokens(_)) => {}
            Some(EngineEvent::Finished(o)) => break *o,
            Some(EngineEvent::Failed(m)) => {
                return Err(ApiError::invalid(m, None)
                    .with_status(StatusCode::INTERNAL_SERVER_ERROR, "engine_error"))
            }
            None => {
                return Err(ApiError::invalid("the engine stopped", None)
                    .with_status(StatusCode::INTERNAL_SERVER_ERROR, "engine_stopped"))
            }
        }
    };
    let text = final_text(&st, &output.token_ids, &meta.stops);
    let finish = api::finish_reason_name(output.finish_reason);
    let choice = match meta.endpoint {
        Endpoint::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        }
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": finish,
        }),
    };
    Ok(Json(json!({
        "id": meta.id,
        "object": match meta.endpoint {
            Endpoint::Completion => "text_completion",
            Endpoint::Chat => "chat.completion",
        },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": meta.usage(output.token_ids.len()),
        // Specula extension: exact token ids and the per-request statistics.
        "specula": {"token_ids": output.token_ids, "stats": output.stats},
    }))
    .into_response())
}

/// Incremental text for a stream: emits only text that can no longer change (no trailing partial
/// UTF-8 sequence, nothing that might still become a stop string).
struct TextTracker {
    ids: Vec<u32>,
    sent: String,
    hold_back: usize,
}

impl TextTracker {
    fn delta(&mut self, st: &AppState, stops: &[String], finished: bool) -> String {
        let full = final_text(st, &self.ids, stops);
        let mut end = full.len();
        if !finished {
            if full.ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            end = end.saturating_sub(self.hold_back);
            while !full.is_char_boundary(end) {
                end -= 1;
            }
        }
        let ready = &full[..end];
        if ready.len() > self.sent.len() && ready.starts_with(self.sent.as_str()) {
            let d = ready[self.sent.len()..].to_string();
            self.sent = ready.to_string();
            d
        } else {
            String::new()
        }
    }
}

fn stream_response(
    st: Arc<AppState>,
    meta: ResponseMeta,
    events: mpsc::UnboundedReceiver<EngineEvent>,
    permit: Permit,
) -> Response {
    struct StreamState {
        st: Arc<AppState>,
        meta: ResponseMeta,
        events: mpsc::UnboundedReceiver<EngineEvent>,
        tracker: TextTracker,
        first: bool,
        done: bool,
        // Dropped with the stream: a client that disconnects frees its queue slot, and the
        // dropped receiver tells the engine to cancel the request.
        _permit: Permit,
    }
    let hold_back = meta.stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
    let state = StreamState {
        st,
        meta,
        events,
        tracker: TextTracker {
            ids: Vec::new(),
            sent: String::new(),
            hold_back,
        },
        first: true,
        done: false,
        _permit: permit,
    };
    let data = |v: &Value| SseEvent::default().data(v.to_string());
    let s = stream::unfold(state, move |mut s| async move {
        if s.done {
            return None;
        }
        let mut out: VecDeque<SseEvent> = VecDeque::new();
        match s.events.recv().await {
            Some(EngineEvent::Tokens(tokens)) => {
                s.tracker.ids.extend_from_slice(&tokens);
                let d = s.tracker.delta(&s.st, &s.meta.stops, false);
                if !d.is_empty() {
                    out.push_back(data(&s.meta.chunk(&d, s.first, None, None)));
                    s.first = false;
                }
            }
            Some(EngineEvent::Finished(o)) => {
                s.tracker.ids = o.token_ids.clone();
                let d = s.tracker.delta(&s.st, &s.meta.stops, true);
                let finish = api::finish_reason_name(o.finish_reason);
                let usage = s.meta.usage(o.token_ids.len());
                out.push_back(data(&s.meta.chunk(&d, s.first, Some(finish), Some(usage))));
                out.push_back(SseEvent::default().data("[DONE]"));
                s.done = true;
            }
            Some(EngineEvent::Failed(m)) => {
                let e = ApiError::invalid(m, None)
                    .with_status(StatusCode::INTERNAL_SERVER_ERROR, "engine_error");
                out.push_back(data(&e.body()));
                out.push_back(SseEvent::default().data("[DONE]"));
                s.done = true;
            }
            None => {
                let e = ApiError::invalid("the engine stopped", None)
                    .with_status(StatusCode::INTERNAL_SERVER_ERROR, "engine_stopped");
                out.push_back(data(&e.body()));
                out.push_back(SseEvent::default().data("[DONE]"));
                s.done = true;
            }
        }
        Some((stream::iter(out.into_iter().map(Ok::<_, Infallible>)), s))
    })
    .flatten();
    sse(s)
}

fn sse<S>(s: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    Sse::new(s).into_response()
}
