//! The official `openai` Python package against the server (tests/openai_client). The package is
//! installed from the registry with pip when missing; without python3 or pip the test says so and
//! skips.

use specula_server::{Server, ServerOptions};
use std::path::Path;
use std::process::Command;

fn openai_available() -> Result<(), String> {
    let has = |args: &[&str]| {
        Command::new("python3")
            .args(args)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if has(&["-c", "import openai"]) {
        return Ok(());
    }
    let install = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "openai"])
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if !install.status.success() || !has(&["-c", "import openai"]) {
        return Err(format!(
            "pip could not install openai: {}",
            String::from_utf8_lossy(&install.stderr)
        ));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_drives_the_server() {
    if let Err(why) = openai_available() {
        // CI reaches the package registry, so there a missing client is a failure, not a skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must be able to install openai: {why}"
        );
        eprintln!("SKIPPED: official openai client test: {why}");
        return;
    }
    let server = Server::start(ServerOptions::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));
    // A second server on a tiny model whose tokenizer has a ChatML template, for the chat endpoint.
    let chat_server = Server::start(ServerOptions {
        model: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chatml_tiny")),
        draft: Some("ngram".into()),
        ..ServerOptions::default()
    })
    .unwrap();
    let chat_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let chat_base = format!("http://{}/v1", chat_listener.local_addr().unwrap());
    let (chat_stop, chat_stopped) = tokio::sync::oneshot::channel::<()>();
    let chat_served = tokio::spawn(chat_server.serve(chat_listener, async {
        let _ = chat_stopped.await;
    }));
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/openai_client/test_openai_client.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .arg(&base)
        .arg(&chat_base)
        .output()
        .await
        .unwrap();
    let _ = stop.send(());
    let _ = chat_stop.send(());
    served.await.unwrap().unwrap();
    chat_served.await.unwrap().unwrap();
    assert!(
        out.status.success(),
        "python client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
}
