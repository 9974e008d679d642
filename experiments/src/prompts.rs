//! Prompt sets for acceptance experiments: JSONL files whose lines are `{"turns": [...]}` (the first
//! turn is the prompt; an optional `category` groups or filters lines, as in Spec-Bench), or plain
//! text with one prompt per line. Every bad line is reported as `file:line` and either fails the
//! read or is skipped and listed, never silently dropped.

use crate::ExperimentError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// What to do with a malformed line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BadLinePolicy {
    /// Stop with an error naming the first bad line.
    #[default]
    Fail,
    /// Leave the line out and list it in the summary.
    Skip,
}

impl std::str::FromStr for BadLinePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fail" => Ok(BadLinePolicy::Fail),
            "skip" => Ok(BadLinePolicy::Skip),
            other => Err(format!("--on-bad-line must be skip or fail, got {other:?}")),
        }
    }
}

/// One prompt file and how to cut it into datasets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSetSpec {
    pub path: PathBuf,
    /// Dataset name in tables (default: the file stem).
    #[serde(default)]
    pub name: Option<String>,
    /// One dataset per `category` value, named `NAME/CATEGORY`.
    #[serde(default)]
    pub group_by_category: bool,
    /// Keep only lines whose `category` is listed (empty: all lines).
    #[serde(default)]
    pub categories: Vec<String>,
    /// Overrides the experiment's prompts-per-dataset cap for this set.
    #[serde(default)]
    pub num_prompts: Option<usize>,
}

impl PromptSetSpec {
    pub fn from_path(path: impl Into<PathBuf>) -> PromptSetSpec {
        PromptSetSpec {
            path: path.into(),
            name: None,
            group_by_category: false,
            categories: Vec::new(),
            num_prompts: None,
        }
    }

    pub fn dataset_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            self.path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| self.path.display().to_string())
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    pub dataset: String,
    /// Position within its dataset (after filtering), the key used for resuming.
    pub index: usize,
    /// `file:line` of the prompt.
    pub source: String,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BadLine {
    pub file: String,
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for BadLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.reason)
    }
}

/// The prompt text of one JSONL line, its category, or why the line is unusable.
fn parse_jsonl_line(line: &str) -> Result<(String, Option<String>), String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let object = value.as_object().ok_or("not a JSON object")?;
    let turns = object
        .get("turns")
        .ok_or("no \"turns\" field")?
        .as_array()
        .ok_or("\"turns\" is not a list")?;
    let first = turns
        .first()
        .ok_or("\"turns\" is empty")?
        .as_str()
        .ok_or("the first turn is not a string")?;
    if first.trim().is_empty() {
        return Err("the first turn is an empty prompt".into());
    }
    let category = match object.get("category") {
        None => None,
        Some(serde_json::Value::String(c)) => Some(c.clone()),
        Some(_) => return Err("\"category\" is not a string".into()),
    };
    Ok((first.to_string(), category))
}

/// Reads one prompt set into datasets (one, or one per category), each with at most
/// `num_prompts` prompts (the first ones in file order). Bad lines go to `bad_lines` under
/// [`BadLinePolicy::Skip`]; under `Fail` the first one is the error.
pub fn read_prompt_set(
    spec: &PromptSetSpec,
    num_prompts: usize,
    policy: BadLinePolicy,
    bad_lines: &mut Vec<BadLine>,
) -> Result<Vec<(String, Vec<Prompt>)>, ExperimentError> {
    let text = std::fs::read_to_string(&spec.path).map_err(|e| ExperimentError::Io {
        path: spec.path.clone(),
        source: e,
    })?;
    let file = spec.path.display().to_string();
    let is_jsonl = spec.path.extension().is_some_and(|e| e == "jsonl");
    let base = spec.dataset_name();
    let num_prompts = spec.num_prompts.unwrap_or(num_prompts);
    let mut datasets: Vec<(String, Vec<Prompt>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let parsed = if is_jsonl {
            parse_jsonl_line(line)
        } else if line.trim().is_empty() {
            // Plain-text sets separate prompts by newlines; a blank line is spacing, not a prompt.
            continue;
        } else {
            Ok((line.to_string(), None))
        };
        let (prompt, category) = match parsed {
            Ok(p) => p,
            Err(reason) => {
                let bad = BadLine {
                    file: file.clone(),
                    line: line_no,
                    reason,
                };
                match policy {
                    BadLinePolicy::Fail => return Err(ExperimentError::BadLine(bad)),
                    BadLinePolicy::Skip => {
                        bad_lines.push(bad);
                        continue;
                    }
                }
            }
        };
        if !spec.categories.is_empty()
            && !category
                .as_ref()
                .is_some_and(|c| spec.categories.contains(c))
        {
            continue;
        }
        let dataset = match (&category, spec.group_by_category) {
            (Some(c), true) => format!("{base}/{c}"),
            (None, true) => format!("{base}/uncategorised"),
            _ => base.clone(),
        };
        let slot = match datasets.iter().position(|(d, _)| *d == dataset) {
            Some(s) => s,
            None => {
                datasets.push((dataset.clone(), Vec::new()));
                datasets.len() - 1
            }
        };
        let prompts = &mut datasets[slot].1;
        if prompts.len() < num_prompts {
            prompts.push(Prompt {
                dataset,
                index: prompts.len(),
                source: format!("{file}:{line_no}"),
                text: prompt,
            });
        }
    }
    if datasets.iter().all(|(_, p)| p.is_empty()) {
        return Err(ExperimentError::Config(format!(
            "prompt set {file} has no usable prompts{}",
            if spec.categories.is_empty() {
                String::new()
            } else {
                format!(" in categories {:?}", spec.categories)
            }
        )));
    }
    Ok(datasets)
}

/// Reads every set; dataset names must be unique across sets.
pub fn read_prompt_sets(
    specs: &[PromptSetSpec],
    num_prompts: usize,
    policy: BadLinePolicy,
    bad_lines: &mut Vec<BadLine>,
) -> Result<Vec<(String, Vec<Prompt>)>, ExperimentError> {
    let mut all: Vec<(String, Vec<Prompt>)> = Vec::new();
    for spec in specs {
        for (name, prompts) in read_prompt_set(spec, num_prompts, policy, bad_lines)? {
            if all.iter().any(|(n, _)| *n == name) {
                return Err(ExperimentError::Config(format!(
                    "two prompt sets are both named {name:?}; give one a \"name\""
                )));
            }
            all.push((name, prompts));
        }
    }
    Ok(all)
}
