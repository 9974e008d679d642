//! OpenAI-compatible request parsing and validation, and the error shape
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use specula_engine::FinishReason;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    pub fn with_status(mut self, status: StatusCode, code: &'static str) -> Self {
        self.status = status;
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

pub fn finish_reason_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        // The context filling up ends a completion the way max_tokens does.
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

/// `prompt`: a string, a one-element list of strings, or a list of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    TokenIds(Vec<u32>),
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Fields shared by both endpoints. Unknown fields are ignored, as clients send many.
#[derive(Debug, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// Chat clients send this name now.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    /// vLLM extension: do not stop at end-of-sequence tokens (load tests want fixed lengths).
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub fields: SamplingFields,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: MessageContent,
}

#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub fields: SamplingFields,
}

/// Parses a body: invalid UTF-8 and malformed JSON are 400; a well-formed body of the wrong shape
/// (missing fields, wrong types) is 422.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ApiError::invalid(format!("the request body is not valid UTF-8: {e}"), None)
    })?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(
            ApiError::invalid("the request body must be a JSON object", None)
                .with_status(StatusCode::UNPROCESSABLE_ENTITY, "invalid_type"),
        );
    }
    serde_json::from_value(value).map_err(|e| {
        ApiError::invalid(format!("invalid request: {e}"), None)
            .with_status(StatusCode::UNPROCESSABLE_ENTITY, "invalid_type")
    })
}

/// Validated sampling settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: u64,
    pub stops: Vec<String>,
    pub stream: bool,
    pub ignore_eos: bool,
}

pub fn check_fields(f: &SamplingFields, served: &[String]) -> Result<Settings, ApiError> {
    if let Some(m) = &f.model {
        if !served.iter().any(|s| s == m) {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    served[0]
                ),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::invalid(
                format!("n must be 1 (got {n})"),
                Some("n"),
            ));
        }
    }
    let max_tokens = match f.max_tokens.or(f.max_completion_tokens) {
        None => None,
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid(
                format!("max_tokens must be at least 1 (got {m})"),
                Some("max_tokens"),
            ))
        }
        Some(m) => Some(m as usize),
    };
    let temperature = f.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(ApiError::invalid(
            format!("temperature must be a non-negative number (got {temperature})"),
            Some("temperature"),
        ));
    }
    let top_p = f.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("top_p must be in (0, 1] (got {top_p})"),
            Some("top_p"),
        ));
    }
    // -1 and 0 both mean "off" (vLLM uses -1).
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                format!("top_k must be -1 (off) or positive (got {k})"),
                Some("top_k"),
            ))
        }
    };
    let seed = match f.seed {
        Some(s) => s as u64,
        // No seed: a fresh stream per request, as clients expect.
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    let stops = match &f.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop strings must not be empty",
            Some("stop"),
        ));
    }
    Ok(Settings {
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        seed,
        stops,
        stream: f.stream,
        ignore_eos: f.ignore_eos,
    })
}

/// Cuts `text` at the first occurrence of any stop string (the stop string is not returned).
pub fn cut_at_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}
