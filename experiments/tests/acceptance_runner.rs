//! The acceptance runner on the embedded default pair: bad prompt lines, resuming, refusing a
//! changed config, and golden files (export, import, refusals, synthetic reproduction of AL).

use specula_engine::{GoldenAcceptance, SpeculativeConfig, SpeculativeMethod};
use specula_experiments::acceptance::{
    export_golden, read_results, run_acceptance, AcceptanceConfig, ChatMode, GoldenSelection,
    RunOptions,
};
use specula_experiments::prompts::{read_prompt_set, BadLinePolicy, PromptSetSpec};
use specula_experiments::ExperimentError;
use std::path::{Path, PathBuf};

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/default")
}

fn heldback() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("prompts/heldback.jsonl")
}

fn options(out: &Path) -> RunOptions {
    RunOptions {
        out_dir: out.to_path_buf(),
        default_models_dir: models_dir(),
        show_progress: false,
    }
}

fn small_config(prompts: PathBuf) -> AcceptanceConfig {
    AcceptanceConfig {
        target: None,
        drafters: vec!["ngram".into()],
        draft_lengths: vec![3],
        temperatures: vec![0.0],
        rules: vec!["greedy".into()],
        prompt_sets: vec![PromptSetSpec::from_path(prompts)],
        num_prompts: 2,
        max_new_tokens: 8,
        chat: ChatMode::Auto,
        seed: 0,
        batch_size: 1,
        on_bad_line: BadLinePolicy::Fail,
        dtype: "auto".into(),
        synthetic_acceptance_rates_from: None,
    }
}

#[test]
fn bad_prompt_lines_name_file_and_line_and_are_skipped_or_fail() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("set.jsonl");
    std::fs::write(
        &file,
        concat!(
            "{\"turns\": [\"good one\"]}\n",
            "{not json\n",
            "{\"question\": \"no turns\"}\n",
            "{\"turns\": [\"  \"]}\n",
            "{\"turns\": []}\n",
            "{\"turns\": [\"good two\", \"second turn ignored\"]}\n",
        ),
    )
    .unwrap();
    let spec = PromptSetSpec::from_path(&file);
    let mut bad = Vec::new();
    let err = read_prompt_set(&spec, 10, BadLinePolicy::Fail, &mut bad).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&format!("{}:2:", file.display())),
        "{message}"
    );
    assert!(message.contains("not valid JSON"), "{message}");

    let sets = read_prompt_set(&spec, 10, BadLinePolicy::Skip, &mut bad).unwrap();
    let lines: Vec<usize> = bad.iter().map(|b| b.line).collect();
    assert_eq!(lines, [2, 3, 4, 5]);
    assert!(bad[1].reason.contains("turns"));
    assert!(bad[2].reason.contains("empty"));
    assert_eq!(sets.len(), 1);
    let texts: Vec<&str> = sets[0].1.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(texts, ["good one", "good two"]);
    assert_eq!(sets[0].1[1].source, format!("{}:6", file.display()));

    let missing = PromptSetSpec::from_path(dir.path().join("missing.jsonl"));
    let err = read_prompt_set(&missing, 10, BadLinePolicy::Skip, &mut bad).unwrap_err();
    assert!(matches!(err, ExperimentError::Io { .. }), "{err}");
}

#[test]
fn categories_group_and_filter_spec_bench_lines() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("question.jsonl");
    std::fs::write(
        &file,
        "{\"category\": \"coding\", \"turns\": [\"a\"]}\n{\"category\": \"math\", \"turns\": [\"b\"]}\n{\"category\": \"coding\", \"turns\": [\"c\"]}\n",
    )
    .unwrap();
    let mut spec = PromptSetSpec::from_path(&file);
    spec.group_by_category = true;
    let sets = read_prompt_set(&spec, 10, BadLinePolicy::Fail, &mut Vec::new()).unwrap();
    let names: Vec<(&str, usize)> = sets.iter().map(|(n, p)| (n.as_str(), p.len())).collect();
    assert_eq!(names, [("question/coding", 2), ("question/math", 1)]);
    spec.group_by_category = false;
    spec.categories = vec!["math".into()];
    let sets = read_prompt_set(&spec, 10, BadLinePolicy::Fail, &mut Vec::new()).unwrap();
    assert_eq!(sets[0].1.len(), 1);
    assert_eq!(sets[0].1[0].text, "b");
}

#[test]
fn a_run_resumes_without_repeating_prompts_and_refuses_a_changed_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = small_config(heldback());
    let first = run_acceptance(&config, &options(&out)).unwrap();
    assert_eq!(first.results_written, 2);

    // Simulate an interruption: drop the last result and leave half a line behind.
    let path = out.join("results.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let kept: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| !l.contains("\"prompt_index\":1"))
        .filter(|l| !l.contains("session_end"))
        .collect();
    std::fs::write(&path, kept.join("\n") + "\n{\"kind\": \"resu").unwrap();

    let second = run_acceptance(&config, &options(&out)).unwrap();
    assert_eq!(second.results_already_present, 1);
    assert_eq!(
        second.results_written, 1,
        "only the missing prompt runs again"
    );
    let (results, _) = read_results(&out, false).unwrap();
    let mut keys: Vec<usize> = results.iter().map(|r| r.prompt_index).collect();
    keys.sort();
    assert_eq!(keys, [0, 1]);
    for name in ["summary.json", "table.md", "manifest.json"] {
        assert!(out.join(name).exists(), "{name}");
    }
    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert!(table.contains("| heldback |"), "{table}");

    let third = run_acceptance(&config, &options(&out)).unwrap();
    assert_eq!(third.results_written, 0);

    let changed = AcceptanceConfig {
        max_new_tokens: 9,
        ..config
    };
    let err = run_acceptance(&changed, &options(&out)).unwrap_err();
    assert!(
        matches!(err, ExperimentError::ConfigMismatch { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("max_new_tokens"), "{err}");
}

fn write_golden(g: &GoldenAcceptance, path: &Path) {
    std::fs::write(path, serde_json::to_string_pretty(g).unwrap()).unwrap();
}

/// Natural greedy acceptance of the embedded pair exported as a golden file; a synthetic run
/// driven by it, on the same prompts and length (so steps cut short by max_new_tokens weigh the
/// same in both), reproduces its AL. The synthetic AL is a mean of random draws over ~500 verify
/// steps, a standard error of about 0.03.
#[test]
fn golden_round_trip_reproduces_natural_al_and_refuses_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let natural_dir = dir.path().join("natural");
    let mut natural = small_config(heldback());
    natural.drafters = vec!["embedded".into()];
    natural.num_prompts = 20;
    natural.max_new_tokens = 64;
    natural.batch_size = 20;
    run_acceptance(&natural, &options(&natural_dir)).unwrap();
    let selection = GoldenSelection {
        drafter: "embedded".into(),
        k: 3,
        temperature: 0.0,
        rule: None,
        dataset: None,
    };
    let golden = export_golden(&natural_dir, &selection).unwrap();
    assert_eq!(golden.acceptance_mode, "natural");
    assert_eq!(golden.unconditional_rates.len(), 3);
    let golden_path = dir.path().join("golden.json");
    write_golden(&golden, &golden_path);

    // Import: the serving config and the runner accept it for k = 3 only.
    let spec = SpeculativeConfig {
        method: SpeculativeMethod::Ngram,
        num_speculative_tokens: 3,
        synthetic_acceptance_rates_from: Some(golden_path.display().to_string()),
        ..SpeculativeConfig::default()
    };
    assert_eq!(spec.rule(0.0).unwrap().name(), "synthetic");
    let wrong_k = SpeculativeConfig {
        num_speculative_tokens: 5,
        ..spec.clone()
    };
    let err = wrong_k.rule(0.0).unwrap_err().to_string();
    assert!(err.contains("k = 3") && err.contains("drafts 5"), "{err}");
    let mut synthetic_source = golden.clone();
    synthetic_source.acceptance_mode = "synthetic".into();
    let bad_path = dir.path().join("synthetic_golden.json");
    write_golden(&synthetic_source, &bad_path);
    let err = SpeculativeConfig {
        synthetic_acceptance_rates_from: Some(bad_path.display().to_string()),
        ..spec.clone()
    }
    .rule(0.0)
    .unwrap_err()
    .to_string();
    assert!(err.contains("natural"), "{err}");

    let synthetic_dir = dir.path().join("synthetic");
    let mut synthetic = natural.clone();
    synthetic.rules = vec!["synthetic".into()];
    synthetic.synthetic_acceptance_rates_from = Some(golden_path.clone());
    run_acceptance(&synthetic, &options(&synthetic_dir)).unwrap();
    let (results, _) = read_results(&synthetic_dir, false).unwrap();
    assert!(results.iter().all(|r| r.acceptance_mode == "synthetic"));
    let steps: u64 = results.iter().map(|r| r.num_verify_steps).sum();
    let accepted: u64 = results.iter().map(|r| r.accepted_tokens).sum();
    let synthetic_al = 1.0 + accepted as f64 / steps as f64;
    // The synthetic rule reproduces the AL its rates imply (1 + sum of rates). The natural AL of
    // a short run sits below that because its last steps draft fewer than k tokens; in this
    // 64-token run the gap is ~0.08, in the committed 128-token run 0.04 (NOTES.md).
    let from_rates = golden.extra["expected_length_from_rates"].as_f64().unwrap();
    assert!(
        (synthetic_al - from_rates).abs() <= 0.05,
        "synthetic AL {synthetic_al:.3} over {steps} steps vs {from_rates:.3} from the golden rates (natural AL {:.3})",
        golden.acceptance_length
    );

    // A golden file is never made from synthetic results.
    let err = export_golden(
        &synthetic_dir,
        &GoldenSelection {
            rule: Some("synthetic".into()),
            ..selection
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("natural acceptance only"), "{err}");
}

/// `DRAFTER@draft_t=X` drafts sampled requests at X: the draft model at T=1 with draft temperature 0
/// drafts greedily (one-hot q), which changes acceptance but is still a valid natural run; a bad
/// suffix is a config error naming the drafter.
#[test]
fn drafter_specs_take_a_drafting_temperature() {
    let dir = tempfile::tempdir().unwrap();
    let config = AcceptanceConfig {
        drafters: vec!["embedded".into(), "embedded@draft_t=0".into()],
        temperatures: vec![1.0],
        rules: vec!["standard".into()],
        max_new_tokens: 16,
        ..small_config(heldback())
    };
    let report = run_acceptance(&config, &options(&dir.path().join("run"))).unwrap();
    assert_eq!(report.results_written, 4);
    let (results, _) = read_results(&dir.path().join("run"), false).unwrap();
    let drafters: std::collections::BTreeSet<&str> = results
        .iter()
        .map(|r| r.setting_key.split('|').next().unwrap())
        .collect();
    assert_eq!(
        drafters.into_iter().collect::<Vec<_>>(),
        ["drafter=embedded", "drafter=embedded@draft_t=0"]
    );
    for bad in [
        "embedded@draft_t=-1",
        "embedded@draft_t=hot",
        "nope@draft_t=0.5",
    ] {
        let config = AcceptanceConfig {
            drafters: vec![bad.into()],
            ..small_config(heldback())
        };
        let err = run_acceptance(&config, &options(&dir.path().join(bad))).unwrap_err();
        assert!(err.to_string().contains("drafter"), "{bad}: {err}");
    }
}
