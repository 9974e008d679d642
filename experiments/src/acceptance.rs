//! The acceptance experiment runner: drafter x draft length x temperature x acceptance rule x
//! dataset, one JSON line per (setting, prompt) appended to `results.jsonl` so an interrupted run
//! resumes, then `summary.json`, `table.md` and SVG plots rebuilt from every line on disk.

use crate::prompts::{read_prompt_sets, BadLine, BadLinePolicy, Prompt, PromptSetSpec};
use crate::{hash_model_files, sha256_file_cached, ExperimentError, Provenance};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use specula_drafters::Drafter;
use specula_engine::build_drafter;
use specula_engine::{
    generate_batch, GenerationRequest, GoldenAcceptance, SpeculativeConfig, SpeculativeMethod,
    GOLDEN_FORMAT,
};
use specula_kernels::sampling::SamplingParams;
use specula_model::loader::{load, LoadedModel};
use specula_model::tokenizer::{ChatMessage, Tokenizer};
use specula_model::WeightDtype;
use specula_verifier::AcceptanceRule;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const RESULTS_FILE: &str = "results.jsonl";
pub const MANIFEST_FILE: &str = "manifest.json";

/// Whether prompts go through the tokenizer's chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ChatMode {
    /// The template when the tokenizer has one (ChatML for instruct models), raw text otherwise.
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for ChatMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ChatMode::Auto),
            "on" => Ok(ChatMode::On),
            "off" => Ok(ChatMode::Off),
            other => Err(format!("--chat must be auto, on or off, got {other:?}")),
        }
    }
}

fn default_rules() -> Vec<String> {
    vec!["greedy".into(), "standard".into()]
}
fn default_num_prompts() -> usize {
    20
}
fn default_max_new_tokens() -> usize {
    128
}
fn default_batch_size() -> usize {
    1
}
fn default_dtype() -> String {
    "auto".into()
}

/// The whole experiment. Stored in `manifest.json`; a run only resumes into a directory whose
/// stored config equals this one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcceptanceConfig {
    /// Target model path (default: the embedded default target).
    #[serde(default)]
    pub target: Option<PathBuf>,
    /// `embedded` (the embedded draft model), `ngram`, `dspark` (the embedded DSpark drafter),
    /// `draft_model:PATH` or `dspark:PATH`.
    pub drafters: Vec<String>,
    pub draft_lengths: Vec<usize>,
    pub temperatures: Vec<f32>,
    /// greedy (T = 0 only), standard, block (T > 0 only), synthetic (needs
    /// synthetic_acceptance_rates_from).
    #[serde(default = "default_rules")]
    pub rules: Vec<String>,
    pub prompt_sets: Vec<PromptSetSpec>,
    /// Prompts per dataset (the first ones in file order).
    #[serde(default = "default_num_prompts")]
    pub num_prompts: usize,
    #[serde(default = "default_max_new_tokens")]
    pub max_new_tokens: usize,
    #[serde(default)]
    pub chat: ChatMode,
    #[serde(default)]
    pub seed: u64,
    /// Requests per generate_batch call.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default)]
    pub on_bad_line: BadLinePolicy,
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// A golden acceptance file for the synthetic rule.
    #[serde(default)]
    pub synthetic_acceptance_rates_from: Option<PathBuf>,
}

impl AcceptanceConfig {
    /// From a `.json` or `.toml` file.
    pub fn from_file(path: &Path) -> Result<AcceptanceConfig, ExperimentError> {
        let text = std::fs::read_to_string(path).map_err(|e| ExperimentError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let bad = |e: String| ExperimentError::Config(format!("{}: {e}", path.display()));
        if path.extension().is_some_and(|e| e == "toml") {
            toml::from_str(&text).map_err(|e| bad(e.to_string()))
        } else {
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))
        }
    }

    fn validate(&self) -> Result<(), ExperimentError> {
        let bad = |m: &str| Err(ExperimentError::Config(m.into()));
        if self.drafters.is_empty() {
            return bad("no drafters");
        }
        if self.draft_lengths.is_empty() || self.draft_lengths.iter().any(|k| !(1..=16).contains(k))
        {
            return bad("draft lengths must be a non-empty list of values in 1..=16");
        }
        if self.temperatures.is_empty()
            || self.temperatures.iter().any(|t| !t.is_finite() || *t < 0.0)
        {
            return bad("temperatures must be a non-empty list of finite values >= 0");
        }
        if self.rules.is_empty() {
            return bad("no acceptance rules");
        }
        if self.prompt_sets.is_empty() {
            return bad("no prompt sets");
        }
        if self.num_prompts == 0 || self.max_new_tokens == 0 || self.batch_size == 0 {
            return bad("num_prompts, max_new_tokens and batch_size must be at least 1");
        }
        if self.rules.iter().any(|r| r == "synthetic")
            != self.synthetic_acceptance_rates_from.is_some()
        {
            return bad("the synthetic rule and synthetic_acceptance_rates_from go together");
        }
        if self.synthetic_acceptance_rates_from.is_some() && self.rules.len() != 1 {
            return bad("a synthetic run has only the synthetic rule: natural and synthetic results are never mixed");
        }
        self.dtype
            .parse::<WeightDtype>()
            .map_err(|e| ExperimentError::Config(format!("dtype: {e}")))?;
        Ok(())
    }
}

/// One point of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setting {
    pub drafter: String,
    pub k: usize,
    pub temperature: f32,
    pub rule: String,
}

impl Setting {
    pub fn key(&self) -> String {
        format!(
            "drafter={}|k={}|T={}|rule={}",
            self.drafter, self.k, self.temperature, self.rule
        )
    }
}

/// One line of `results.jsonl` with `"kind": "result"`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptResult {
    pub kind: String,
    pub session: String,
    pub setting_key: String,
    pub setting: Setting,
    pub acceptance_mode: String,
    pub dataset: String,
    pub prompt_index: usize,
    pub source: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub finish_reason: Value,
    pub acceptance_length: Option<f64>,
    pub num_verify_steps: u64,
    pub accepted_tokens: u64,
    pub drafted_tokens: u64,
    pub accepted_histogram: Vec<u64>,
    pub slot_drafted_steps: Vec<u64>,
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// This request's share of its generate_batch call's wall time.
    pub wall_ms: f64,
}

/// Exactly merged acceptance counts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MergedCounts {
    pub prompts: usize,
    pub generated_tokens: usize,
    pub num_verify_steps: u64,
    pub accepted_tokens: u64,
    pub accepted_histogram: Vec<u64>,
    pub slot_drafted_steps: Vec<u64>,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub wall_ms: f64,
}

fn add_into(into: &mut Vec<u64>, from: &[u64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a += b;
    }
}

impl MergedCounts {
    pub fn add(&mut self, r: &PromptResult) {
        self.prompts += 1;
        self.generated_tokens += r.generated_tokens;
        self.num_verify_steps += r.num_verify_steps;
        self.accepted_tokens += r.accepted_tokens;
        add_into(&mut self.accepted_histogram, &r.accepted_histogram);
        add_into(&mut self.slot_drafted_steps, &r.slot_drafted_steps);
        self.draft_ms += r.draft_ms;
        self.verify_ms += r.verify_ms;
        self.wall_ms += r.wall_ms;
    }

    /// AL = 1 + accepted / verify steps (bonus included).
    pub fn acceptance_length(&self) -> Option<f64> {
        (self.num_verify_steps > 0)
            .then(|| 1.0 + self.accepted_tokens as f64 / self.num_verify_steps as f64)
    }

    /// Unconditional rate at slot i: steps accepting >= i drafts / steps that drafted slot i.
    pub fn unconditional_rates(&self) -> Vec<f64> {
        self.slot_drafted_steps
            .iter()
            .enumerate()
            .map(|(slot, &drafted)| {
                let reached: u64 = self.accepted_histogram.iter().skip(slot + 1).sum();
                if drafted == 0 {
                    0.0
                } else {
                    reached as f64 / drafted as f64
                }
            })
            .collect()
    }
}

/// Where the run writes and how it reports.
pub struct RunOptions {
    pub out_dir: PathBuf,
    /// The embedded pair (`target/`, `draft/`).
    pub default_models_dir: PathBuf,
    pub show_progress: bool,
}

/// A drafter spec from the config: the drafter, and the drafting temperature of an `@draft_t=X`
/// suffix (`dspark@draft_t=0.5`: sampled requests draft at 0.5; see `SpeculativeConfig::draft_temperature`).
struct DrafterSpec {
    method: SpeculativeMethod,
    path: Option<PathBuf>,
    draft_temperature: Option<f32>,
}

fn resolve_drafter(spec: &str, default_models_dir: &Path) -> Result<DrafterSpec, ExperimentError> {
    let (base, draft_temperature) = match spec.split_once("@draft_t=") {
        Some((base, t)) => {
            let t: f32 = t.parse().ok().filter(|t: &f32| t.is_finite() && *t >= 0.0).ok_or_else(|| {
                ExperimentError::Config(format!(
                    "drafter {spec:?}: the drafting temperature after @draft_t= must be a number >= 0"
                ))
            })?;
            (base, Some(t))
        }
        None => (spec, None),
    };
    let path = |p: &str| Some(PathBuf::from(p));
    let (method, path) = match base {
        "ngram" => (SpeculativeMethod::Ngram, None),
        "embedded" => (
            SpeculativeMethod::DraftModel,
            Some(default_models_dir.join("draft")),
        ),
        "dspark" => (
            SpeculativeMethod::Dspark,
            Some(default_models_dir.join("dspark")),
        ),
        other => match (
            other.strip_prefix("draft_model:"),
            other.strip_prefix("dspark:"),
        ) {
            (Some(p), _) if !p.is_empty() => (SpeculativeMethod::DraftModel, path(p)),
            (_, Some(p)) if !p.is_empty() => (SpeculativeMethod::Dspark, path(p)),
            _ => {
                return Err(ExperimentError::Config(format!(
                    "unknown drafter {other:?}: use embedded, ngram, dspark, draft_model:PATH or dspark:PATH, optionally followed by @draft_t=X"
                )))
            }
        },
    };
    Ok(DrafterSpec {
        method,
        path,
        draft_temperature,
    })
}

/// The manifest: everything that must match for results to be comparable.
fn build_manifest(
    config: &AcceptanceConfig,
    target_path: &Path,
    default_models_dir: &Path,
) -> Result<Value, ExperimentError> {
    let mut models = serde_json::Map::new();
    models.insert(
        "target".into(),
        json!({"path": target_path.display().to_string(), "sha256": hash_model_files(target_path)?}),
    );
    for d in &config.drafters {
        if let Some(path) = resolve_drafter(d, default_models_dir)?.path {
            models.insert(
                d.clone(),
                json!({"path": path.display().to_string(), "sha256": hash_model_files(&path)?}),
            );
        }
    }
    let mut prompt_files = serde_json::Map::new();
    for s in &config.prompt_sets {
        let sha = sha256_file_cached(&s.path).map_err(|e| ExperimentError::Io {
            path: s.path.clone(),
            source: e,
        })?;
        prompt_files.insert(s.path.display().to_string(), json!(sha));
    }
    if let Some(g) = &config.synthetic_acceptance_rates_from {
        let sha = sha256_file_cached(g).map_err(|e| ExperimentError::Io {
            path: g.clone(),
            source: e,
        })?;
        prompt_files.insert(format!("golden:{}", g.display()), json!(sha));
    }
    Ok(json!({
        "config": config,
        "models_sha256": models,
        "input_files_sha256": prompt_files,
    }))
}

/// Names the first differing top-level field of two JSON objects (for the refusal message).
fn first_difference(old: &Value, new: &Value, prefix: &str) -> String {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys().chain(b.keys()) {
                if a.get(key) != b.get(key) {
                    let path = format!("{prefix}{key}");
                    return match (a.get(key), b.get(key)) {
                        (Some(x), Some(y)) => first_difference(x, y, &format!("{path}.")),
                        (x, y) => format!("{path}: {x:?} vs {y:?}"),
                    };
                }
            }
            String::new()
        }
        _ => format!("{}: stored {old}, now {new}", prefix.trim_end_matches('.')),
    }
}

/// Writes the manifest into a fresh directory, or checks it against the stored one.
fn check_or_write_manifest(dir: &Path, manifest: &Value) -> Result<(), ExperimentError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e| ExperimentError::Io { path, source: e }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(MANIFEST_FILE);
    if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let stored: Value = serde_json::from_str(&text).map_err(|e| {
            ExperimentError::Config(format!("{}: unreadable manifest: {e}", path.display()))
        })?;
        if stored != *manifest {
            return Err(ExperimentError::ConfigMismatch {
                dir: dir.to_path_buf(),
                difference: first_difference(&stored, manifest, ""),
            });
        }
        return Ok(());
    }
    if dir.join(RESULTS_FILE).exists() {
        return Err(ExperimentError::Config(format!(
            "{} has results but no {MANIFEST_FILE}: refusing to resume into it",
            dir.display()
        )));
    }
    let text = serde_json::to_string_pretty(manifest).expect("JSON values serialise");
    std::fs::write(&path, text + "\n").map_err(io(&path))
}

/// Every result line in a results file. A last line cut short by an interruption is dropped (and
/// cut from the file when `repair` is set, so appending continues on a line boundary).
pub fn read_results(
    dir: &Path,
    repair: bool,
) -> Result<(Vec<PromptResult>, Vec<Value>), ExperimentError> {
    let path = dir.join(RESULTS_FILE);
    if !path.exists() {
        return Ok((Vec::new(), Vec::new()));
    }
    let io = |e| ExperimentError::Io {
        path: path.clone(),
        source: e,
    };
    let mut text = std::fs::read_to_string(&path).map_err(io)?;
    if !text.is_empty() && !text.ends_with('\n') {
        let keep = text.rfind('\n').map_or(0, |i| i + 1);
        eprintln!(
            "{}: dropping an incomplete last line (an interrupted write)",
            path.display()
        );
        text.truncate(keep);
        if repair {
            std::fs::write(&path, &text).map_err(io)?;
        }
    }
    let mut results = Vec::new();
    let mut sessions = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let value: Value = serde_json::from_str(line).map_err(|e| {
            ExperimentError::Config(format!(
                "{}:{}: corrupt result line: {e}",
                path.display(),
                i + 1
            ))
        })?;
        match value.get("kind").and_then(Value::as_str) {
            Some("result") => results.push(serde_json::from_value(value).map_err(|e| {
                ExperimentError::Config(format!(
                    "{}:{}: corrupt result line: {e}",
                    path.display(),
                    i + 1
                ))
            })?),
            Some("session") | Some("session_end") => sessions.push(value),
            _ => {
                return Err(ExperimentError::Config(format!(
                    "{}:{}: line without a known \"kind\"",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    Ok((results, sessions))
}

fn encode_prompt(tok: &Tokenizer, chat: ChatMode, p: &Prompt) -> Result<Vec<u32>, ExperimentError> {
    let use_template = match chat {
        ChatMode::Off => false,
        ChatMode::Auto => tok.has_chat_template(),
        ChatMode::On if tok.has_chat_template() => true,
        ChatMode::On => {
            return Err(ExperimentError::Config(
                "--chat on, but the target's tokenizer has no chat template".into(),
            ))
        }
    };
    let text = if use_template {
        tok.apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: p.text.clone(),
            }],
            true,
        )
        .map_err(|e| ExperimentError::Model(e.into()))?
    } else {
        p.text.clone()
    };
    let ids = tok
        .encode(&text, true)
        .map_err(|e| ExperimentError::Model(e.into()))?;
    if ids.is_empty() {
        return Err(ExperimentError::Config(format!(
            "{}: the prompt encodes to no tokens",
            p.source
        )));
    }
    Ok(ids)
}

/// The seed of one prompt: fixed by the run seed and the prompt's key, so a resumed run draws
/// exactly what an uninterrupted one would.
fn prompt_seed(seed: u64, dataset: &str, index: usize) -> u64 {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    for b in dataset.bytes().chain(index.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub results_written: usize,
    pub results_already_present: usize,
    pub skipped_settings: Vec<String>,
    pub bad_lines: Vec<BadLine>,
    pub wall_s: f64,
}

/// Runs (or resumes) the sweep and rewrites summary, table and plots.
pub fn run_acceptance(
    config: &AcceptanceConfig,
    opts: &RunOptions,
) -> Result<RunReport, ExperimentError> {
    let started = Instant::now();
    config.validate()?;
    let mut bad_lines = Vec::new();
    let datasets = read_prompt_sets(
        &config.prompt_sets,
        config.num_prompts,
        config.on_bad_line,
        &mut bad_lines,
    )?;
    for b in &bad_lines {
        eprintln!("skipping bad prompt line {b}");
    }
    let target_path = config
        .target
        .clone()
        .unwrap_or_else(|| opts.default_models_dir.join("target"));
    let manifest = build_manifest(config, &target_path, &opts.default_models_dir)?;
    check_or_write_manifest(&opts.out_dir, &manifest)?;
    let (existing, _) = read_results(&opts.out_dir, true)?;
    let done: HashSet<(String, String, usize)> = existing
        .iter()
        .map(|r| (r.setting_key.clone(), r.dataset.clone(), r.prompt_index))
        .collect();

    // The settings that are valid, and why the others are left out.
    let dtype: WeightDtype = config
        .dtype
        .parse()
        .map_err(|e| ExperimentError::Config(format!("dtype: {e}")))?;
    let mut settings: Vec<(Setting, AcceptanceRule)> = Vec::new();
    let mut skipped_settings = Vec::new();
    for drafter in &config.drafters {
        let DrafterSpec {
            method,
            path: draft_path,
            draft_temperature,
        } = resolve_drafter(drafter, &opts.default_models_dir)?;
        for &k in &config.draft_lengths {
            for &temperature in &config.temperatures {
                for rule_name in &config.rules {
                    let setting = Setting {
                        drafter: drafter.clone(),
                        k,
                        temperature,
                        rule: rule_name.clone(),
                    };
                    let reason = match (rule_name.as_str(), temperature == 0.0) {
                        ("greedy", false) => Some("greedy needs temperature 0"),
                        ("standard" | "block", true) => {
                            Some("at temperature 0 standard and block reduce to greedy; run greedy")
                        }
                        _ => None,
                    };
                    if let Some(reason) = reason {
                        skipped_settings.push(format!("{}: {reason}", setting.key()));
                        continue;
                    }
                    let spec = SpeculativeConfig {
                        method,
                        model: draft_path.as_ref().map(|p| p.display().to_string()),
                        num_speculative_tokens: k,
                        rejection_sample_method: Some(rule_name.clone()),
                        synthetic_acceptance_rates_from: config
                            .synthetic_acceptance_rates_from
                            .as_ref()
                            .map(|p| p.display().to_string()),
                        draft_temperature,
                        ..SpeculativeConfig::default()
                    };
                    match spec.rule(temperature) {
                        Ok(rule) => settings.push((setting, rule)),
                        Err(e) if rule_name == "synthetic" => return Err(e.into()),
                        Err(e) => skipped_settings.push(format!("{}: {e}", setting.key())),
                    }
                }
            }
        }
    }
    for s in &skipped_settings {
        eprintln!("skipping setting {s}");
    }

    let pending: usize = settings
        .iter()
        .map(|(s, _)| {
            datasets
                .iter()
                .flat_map(|(_, ps)| ps)
                .filter(|p| !done.contains(&(s.key(), p.dataset.clone(), p.index)))
                .count()
        })
        .sum();
    let results_path = opts.out_dir.join(RESULTS_FILE);
    let io = |e| ExperimentError::Io {
        path: results_path.clone(),
        source: e,
    };
    let mut results_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&results_path)
        .map_err(io)?;
    let provenance = Provenance::collect();
    let session = provenance.date_utc.clone();
    let header = json!({"kind": "session", "session": session, "provenance": provenance,
                        "pending_results": pending, "manifest": manifest});
    writeln!(results_file, "{header}").map_err(io)?;

    let bar = if opts.show_progress {
        ProgressBar::new(pending as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} prompts, {elapsed} elapsed, ETA {eta} {msg}",
        )
        .expect("the template is valid"),
    );
    let mut written = 0;
    if pending > 0 {
        let target = load(&target_path, dtype).map_err(|e| ExperimentError::Load {
            path: target_path.clone(),
            source: e,
        })?;
        let tok = target.tokenizer()?;
        let encoded: Vec<Vec<Vec<u32>>> = datasets
            .iter()
            .map(|(_, ps)| {
                ps.iter()
                    .map(|p| encode_prompt(tok, config.chat, p))
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        for drafter_spec in &config.drafters {
            let max_k = config.draft_lengths.iter().copied().max().unwrap_or(1);
            let mut drafter = make_drafter(
                drafter_spec,
                &opts.default_models_dir,
                dtype,
                &target,
                max_k,
            )?;
            for (setting, rule) in settings.iter().filter(|(s, _)| s.drafter == *drafter_spec) {
                bar.set_message(setting.key());
                for ((_, prompts), ids) in datasets.iter().zip(&encoded) {
                    let todo: Vec<usize> = (0..prompts.len())
                        .filter(|&i| {
                            !done.contains(&(setting.key(), prompts[i].dataset.clone(), i))
                        })
                        .collect();
                    for chunk in todo.chunks(config.batch_size) {
                        let requests: Vec<GenerationRequest> = chunk
                            .iter()
                            .map(|&i| GenerationRequest {
                                prompt_ids: ids[i].clone(),
                                max_new_tokens: config.max_new_tokens,
                                sampling: SamplingParams {
                                    temperature: setting.temperature,
                                    top_k: 0,
                                    top_p: 1.0,
                                },
                                seed: prompt_seed(config.seed, &prompts[i].dataset, i),
                                stop_token_ids: target.eos_token_ids(),
                                vocab_limit: Some(tok.vocab_size()),
                                stop_strings: Vec::new(),
                                num_draft_tokens: setting.k,
                            })
                            .collect();
                        let out = generate_batch(
                            &target.model,
                            Some(drafter.as_mut()),
                            rule,
                            &requests,
                            Some(tok),
                        )?;
                        let share = out.run.wall_ms / chunk.len() as f64;
                        for (&i, o) in chunk.iter().zip(&out.outputs) {
                            let sp = o.stats.speculative.as_ref().ok_or_else(|| {
                                ExperimentError::Config(
                                    "a speculative run returned no speculative stats".into(),
                                )
                            })?;
                            let line = PromptResult {
                                kind: "result".into(),
                                session: session.clone(),
                                setting_key: setting.key(),
                                setting: setting.clone(),
                                acceptance_mode: sp.acceptance_mode.clone(),
                                dataset: prompts[i].dataset.clone(),
                                prompt_index: i,
                                source: prompts[i].source.clone(),
                                prompt_tokens: o.stats.prompt_tokens,
                                generated_tokens: o.stats.generated_tokens,
                                finish_reason: serde_json::to_value(o.finish_reason)
                                    .unwrap_or(Value::Null),
                                acceptance_length: sp.acceptance_length,
                                num_verify_steps: sp.num_verify_steps,
                                accepted_tokens: sp.accepted_tokens,
                                drafted_tokens: sp.drafted_tokens,
                                accepted_histogram: sp.accepted_histogram.clone(),
                                slot_drafted_steps: sp.slot_drafted_steps.clone(),
                                draft_ms: sp.draft_ms,
                                verify_ms: sp.verify_ms,
                                wall_ms: share,
                            };
                            let text = serde_json::to_string(&line).expect("results serialise");
                            writeln!(results_file, "{text}").map_err(io)?;
                            written += 1;
                        }
                        results_file.flush().map_err(io)?;
                        bar.inc(chunk.len() as u64);
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    let wall_s = started.elapsed().as_secs_f64();
    let end = json!({"kind": "session_end", "session": session, "wall_s": wall_s, "results_written": written});
    writeln!(results_file, "{end}").map_err(io)?;
    drop(results_file);
    let report = RunReport {
        results_written: written,
        results_already_present: existing.len(),
        skipped_settings,
        bad_lines,
        wall_s,
    };
    write_reports(&opts.out_dir, Some(&report))?;
    Ok(report)
}

fn make_drafter(
    spec: &str,
    default_models_dir: &Path,
    dtype: WeightDtype,
    target: &LoadedModel,
    max_k: usize,
) -> Result<Box<dyn Drafter>, ExperimentError> {
    let d = resolve_drafter(spec, default_models_dir)?;
    let config = SpeculativeConfig {
        method: d.method,
        model: d.path.as_ref().map(|p| p.display().to_string()),
        num_speculative_tokens: max_k,
        draft_temperature: d.draft_temperature,
        ..SpeculativeConfig::default()
    };
    build_drafter(&config, target, dtype)
        .map_err(|e| ExperimentError::Config(format!("drafter {spec}: {e}")))?
        .ok_or_else(|| ExperimentError::Config(format!("drafter {spec} builds no drafter")))
}

/// A table group: one drafter x temperature x rule x acceptance mode.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Group {
    drafter: String,
    temperature_bits: String,
    rule: String,
    mode: String,
}

impl Group {
    fn of(r: &PromptResult) -> Group {
        Group {
            drafter: r.setting.drafter.clone(),
            temperature_bits: format!("{}", r.setting.temperature),
            rule: r.setting.rule.clone(),
            mode: r.acceptance_mode.clone(),
        }
    }
    fn title(&self) -> String {
        format!(
            "drafter {}, temperature {}, {} rule, {} acceptance",
            self.drafter, self.temperature_bits, self.rule, self.mode
        )
    }
    fn slug(&self) -> String {
        format!(
            "{}_T{}_{}_{}",
            self.drafter, self.temperature_bits, self.rule, self.mode
        )
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect()
    }
}

pub const POOLED: &str = "all (pooled)";

/// Merges results into counts per group -> k -> dataset (plus the pooled row).
fn merge(
    results: &[PromptResult],
) -> BTreeMap<Group, BTreeMap<usize, BTreeMap<String, MergedCounts>>> {
    let mut out: BTreeMap<Group, BTreeMap<usize, BTreeMap<String, MergedCounts>>> = BTreeMap::new();
    for r in results {
        let by_dataset = out
            .entry(Group::of(r))
            .or_default()
            .entry(r.setting.k)
            .or_default();
        by_dataset.entry(r.dataset.clone()).or_default().add(r);
        by_dataset.entry(POOLED.into()).or_default().add(r);
    }
    out
}

/// Rebuilds `summary.json`, `table.md` and `plots/*.svg` from everything in `results.jsonl`.
pub fn write_reports(dir: &Path, report: Option<&RunReport>) -> Result<(), ExperimentError> {
    let (results, sessions) = read_results(dir, false)?;
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest: Value = std::fs::read_to_string(&manifest_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    let merged = merge(&results);
    let modes: HashSet<&str> = results.iter().map(|r| r.acceptance_mode.as_str()).collect();
    let mut dataset_order: Vec<String> = Vec::new();
    for r in &results {
        if !dataset_order.contains(&r.dataset) {
            dataset_order.push(r.dataset.clone());
        }
    }

    let mut groups_json = Vec::new();
    for (group, by_k) in &merged {
        let mut rows = Vec::new();
        for (k, by_dataset) in by_k {
            for (dataset, c) in by_dataset {
                rows.push(json!({
                    "k": k, "dataset": dataset, "prompts": c.prompts,
                    "acceptance_length": c.acceptance_length(),
                    "unconditional_rates": c.unconditional_rates(),
                    "num_verify_steps": c.num_verify_steps, "accepted_tokens": c.accepted_tokens,
                    "generated_tokens": c.generated_tokens,
                    "accepted_histogram": c.accepted_histogram, "slot_drafted_steps": c.slot_drafted_steps,
                    "draft_ms": c.draft_ms, "verify_ms": c.verify_ms, "wall_s": c.wall_ms / 1e3,
                }));
            }
        }
        groups_json.push(json!({
            "drafter": group.drafter, "temperature": group.temperature_bits, "rule": group.rule,
            "acceptance_mode": group.mode, "rows": rows,
        }));
    }
    let sessions_wall_s: f64 = sessions
        .iter()
        .filter(|s| s["kind"] == "session_end")
        .filter_map(|s| s["wall_s"].as_f64())
        .sum();
    let summary = json!({
        "metric": "AL = tokens emitted per target verify step, bonus token included (1 + accepted / steps); unconditional rate at slot i = verify steps accepting >= i drafts / steps that drafted slot i (reference.md section 3); merged exactly from per-prompt histograms",
        "acceptance_modes": modes.iter().collect::<Vec<_>>(),
        "results": results.len(),
        "wall_s_all_sessions": sessions_wall_s,
        "generation_wall_s": results.iter().map(|r| r.wall_ms).sum::<f64>() / 1e3,
        "this_session": report,
        "manifest": manifest,
        "sessions": sessions.iter().filter(|s| s["kind"] == "session").map(|s| json!({"session": s["session"], "provenance": s["provenance"]})).collect::<Vec<_>>(),
        "session_ends": sessions.iter().filter(|s| s["kind"] == "session_end").collect::<Vec<_>>(),
        "groups": groups_json,
    });
    let write = |name: &str, text: String| -> Result<(), ExperimentError> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| ExperimentError::Io { path, source: e })
    };
    write(
        "summary.json",
        serde_json::to_string_pretty(&summary).expect("JSON") + "\n",
    )?;
    write(
        "table.md",
        markdown_tables(
            &merged,
            &dataset_order,
            &manifest,
            &sessions,
            sessions_wall_s,
            report,
        ),
    )?;
    let plots = dir.join("plots");
    std::fs::create_dir_all(&plots).map_err(|e| ExperimentError::Io {
        path: plots.clone(),
        source: e,
    })?;
    for (group, by_k) in &merged {
        crate::plots::per_position(
            &plots.join(format!("per_position_{}.svg", group.slug())),
            &group.title(),
            by_k,
        )?;
        crate::plots::al_vs_k(
            &plots.join(format!("al_vs_k_{}.svg", group.slug())),
            &group.title(),
            by_k,
            &dataset_order,
        )?;
    }
    Ok(())
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.2}"))
}

fn markdown_tables(
    merged: &BTreeMap<Group, BTreeMap<usize, BTreeMap<String, MergedCounts>>>,
    datasets: &[String],
    manifest: &Value,
    sessions: &[Value],
    sessions_wall_s: f64,
    report: Option<&RunReport>,
) -> String {
    let mut s = String::from("# Acceptance length per dataset and draft length\n\n");
    s.push_str("AL = tokens emitted per target verify step, bonus token included (1 + accepted drafts / verify steps). ");
    s.push_str("Per-position rates are unconditional (fraction of verify steps whose accepted prefix reaches the slot). ");
    s.push_str(
        "Counts are merged exactly over prompts (pooled, not a mean of per-prompt ALs).\n\n",
    );
    let config = &manifest["config"];
    s.push_str(&format!(
        "Config: max_new_tokens {}, {} prompts per dataset, chat {}, seed {}, batch size {}. Target `{}`.\n\n",
        config["max_new_tokens"], config["num_prompts"], config["chat"], config["seed"], config["batch_size"],
        manifest["models_sha256"]["target"]["path"].as_str().unwrap_or("?")
    ));
    for (i, (group, by_k)) in merged.iter().enumerate() {
        let ks: Vec<usize> = by_k.keys().copied().collect();
        s.push_str(&format!("## {}. {}\n\n| dataset |", i + 1, group.title()));
        for k in &ks {
            s.push_str(&format!(" k={k} |"));
        }
        s.push_str("\n|---|");
        s.push_str(&"---:|".repeat(ks.len()));
        s.push('\n');
        for d in datasets.iter().map(String::as_str).chain([POOLED]) {
            if !by_k.values().any(|m| m.contains_key(d)) {
                continue;
            }
            s.push_str(&format!("| {d} |"));
            for k in &ks {
                s.push_str(&format!(
                    " {} |",
                    fmt_opt(by_k[k].get(d).and_then(MergedCounts::acceptance_length))
                ));
            }
            s.push('\n');
        }
        s.push_str("\nPer-position unconditional acceptance (slot 1 first), all datasets pooled:\n\n| k | AL | rates | verify steps | wall s |\n|---:|---:|---|---:|---:|\n");
        for k in &ks {
            let c = &by_k[k][POOLED];
            let rates: Vec<String> = c
                .unconditional_rates()
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect();
            s.push_str(&format!(
                "| {k} | {} | {} | {} | {:.1} |\n",
                fmt_opt(c.acceptance_length()),
                rates.join(", "),
                c.num_verify_steps,
                c.wall_ms / 1e3
            ));
        }
        s.push_str(&format!(
            "\nPlots: `plots/per_position_{0}.svg`, `plots/al_vs_k_{0}.svg`.\n\n",
            group.slug()
        ));
    }
    s.push_str("## Provenance\n\n");
    for sess in sessions.iter().filter(|x| x["kind"] == "session") {
        let p = &sess["provenance"];
        s.push_str(&format!(
            "- session {}: git {}{}, {}, {} ({} cores, CPU kernel {})\n",
            sess["session"].as_str().unwrap_or("?"),
            p["git_revision"].as_str().unwrap_or("?"),
            if p["git_dirty"] == true {
                " (dirty)"
            } else {
                ""
            },
            p["machine"].as_str().unwrap_or("?"),
            p["cpu"].as_str().unwrap_or("?"),
            p["cores"],
            p["cpu_kernel"].as_str().unwrap_or("unrecorded")
        ));
    }
    s.push_str(&format!(
        "\nWall time over all sessions: {sessions_wall_s:.1} s.\n"
    ));
    if let Some(r) = report {
        if !r.skipped_settings.is_empty() {
            s.push_str("\nSettings left out:\n\n");
            for x in &r.skipped_settings {
                s.push_str(&format!("- {x}\n"));
            }
        }
        if !r.bad_lines.is_empty() {
            s.push_str(&format!(
                "\n{} bad prompt lines skipped:\n\n",
                r.bad_lines.len()
            ));
            for b in &r.bad_lines {
                s.push_str(&format!("- {b}\n"));
            }
        }
    }
    s.push_str("\nModel and input sha256 are in `manifest.json` (and `summary.json`).\n");
    s
}

/// Which results a golden file is made from.
#[derive(Debug, Clone)]
pub struct GoldenSelection {
    pub drafter: String,
    pub k: usize,
    pub temperature: f32,
    /// Default: the only rule present for this drafter/k/temperature.
    pub rule: Option<String>,
    /// Default: all datasets pooled.
    pub dataset: Option<String>,
}

/// Natural per-position rates of the selected results, exactly merged, as a golden file.
pub fn export_golden(
    dir: &Path,
    sel: &GoldenSelection,
) -> Result<GoldenAcceptance, ExperimentError> {
    let (results, sessions) = read_results(dir, false)?;
    if results.is_empty() {
        return Err(ExperimentError::Golden(format!(
            "{} has no results",
            dir.display()
        )));
    }
    let chosen: Vec<&PromptResult> = results
        .iter()
        .filter(|r| {
            r.setting.drafter == sel.drafter
                && r.setting.k == sel.k
                && r.setting.temperature == sel.temperature
                && sel.rule.as_ref().is_none_or(|x| *x == r.setting.rule)
                && sel.dataset.as_ref().is_none_or(|d| *d == r.dataset)
        })
        .collect();
    if chosen.is_empty() {
        let available: HashSet<String> = results
            .iter()
            .map(|r| format!("{} [{}]", r.setting_key, r.dataset))
            .collect();
        let mut available: Vec<_> = available.into_iter().collect();
        available.sort();
        return Err(ExperimentError::Golden(format!(
            "no results for drafter {} k={} T={} rule {:?} dataset {:?}; available: {}",
            sel.drafter,
            sel.k,
            sel.temperature,
            sel.rule,
            sel.dataset,
            available.join(", ")
        )));
    }
    let rules: HashSet<&str> = chosen.iter().map(|r| r.setting.rule.as_str()).collect();
    if rules.len() > 1 {
        return Err(ExperimentError::Golden(format!(
            "results from several rules {rules:?}: choose one with --rule"
        )));
    }
    if let Some(r) = chosen.iter().find(|r| r.acceptance_mode != "natural") {
        return Err(ExperimentError::Golden(format!(
            "the selected results are {} ({}): a golden file records natural acceptance only",
            r.acceptance_mode, r.source
        )));
    }
    let mut counts = MergedCounts::default();
    for r in &chosen {
        counts.add(r);
    }
    let mut rates = counts.unconditional_rates();
    rates.resize(sel.k, 0.0);
    if let Some(i) = (1..rates.len()).find(|&i| rates[i] > rates[i - 1]) {
        return Err(ExperimentError::Golden(format!(
            "unconditional rates increase at slot {} ({:.4} > {:.4}): many steps drafted fewer than k tokens (an n-gram drafter missing?), so the rates do not describe k-token steps",
            i + 1, rates[i], rates[i - 1]
        )));
    }
    let manifest: Value = std::fs::read_to_string(dir.join(MANIFEST_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    let mut extra = serde_json::Map::new();
    extra.insert(
        "expected_length_from_rates".into(),
        json!(1.0 + rates.iter().sum::<f64>()),
    );
    extra.insert("prompts".into(), json!(counts.prompts));
    extra.insert(
        "accepted_histogram".into(),
        json!(counts.accepted_histogram),
    );
    extra.insert(
        "slot_drafted_steps".into(),
        json!(counts.slot_drafted_steps),
    );
    extra.insert("source_results".into(), json!(dir.display().to_string()));
    extra.insert("source_manifest".into(), manifest);
    extra.insert(
        "source_sessions".into(),
        json!(sessions
            .iter()
            .filter(|s| s["kind"] == "session")
            .map(|s| &s["provenance"])
            .collect::<Vec<_>>()),
    );
    extra.insert("export_provenance".into(), json!(Provenance::collect()));
    Ok(GoldenAcceptance {
        format: GOLDEN_FORMAT.into(),
        acceptance_mode: "natural".into(),
        num_speculative_tokens: sel.k,
        unconditional_rates: rates,
        acceptance_length: counts.acceptance_length().unwrap_or(1.0),
        num_verify_steps: counts.num_verify_steps,
        drafter: sel.drafter.clone(),
        acceptance_rule: rules.into_iter().next().unwrap_or_default().to_string(),
        temperature: sel.temperature,
        dataset: sel.dataset.clone().unwrap_or_else(|| POOLED.into()),
        extra,
    })
}
