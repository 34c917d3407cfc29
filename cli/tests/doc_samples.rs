//! Every command sample in the docs is captured from a real run.
//!
//! A ```console block in README.md or docs/*.md (ARCHITECTURE.md aside) is preceded by a
//! marker comment, `<!-- sample: NAME -->`, naming a scenario: the bash script
//! `cli/tests/samples/NAME.sh`. The test runs each scenario against a fresh database of
//! its own (`DATABASE_URL` exported, the built `pgbus` first on `PATH`), after
//! `samples/prelude.sh`, whose `run` prints `$ command` and then the command's output.
//! The transcript, normalised (ids, times, durations, paths and ports replaced by
//! placeholders, on both sides), must equal the block's, also normalised; a block with no
//! marker fails the test, so a new sample cannot escape capture. A block that cannot be
//! captured says so and why, `<!-- sample: none, reason: WHY -->` (a reason is required).
//! Scenarios run concurrently; the TLS and pooler scenarios also reach a TLS-only server
//! and a PgBouncer of the test's own.
//!
//! `PGBUS_UPDATE_SAMPLES=1` (what `scripts/samples` sets) rewrites each block with its
//! captured transcript instead of comparing.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

const MARKER: &str = "<!-- sample: ";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "md")
                && p.file_name().is_some_and(|n| n != "ARCHITECTURE.md")
        })
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// What a block's marker names.
enum Sample {
    /// `<!-- sample: NAME -->`: the scenario that prints the block.
    Scenario(String),
    /// `<!-- sample: none, reason: WHY -->`: a block that cannot be captured, and why.
    Exempt,
}

/// One console block: its marker (None when unmarked), the line range of its body.
struct Block {
    sample: Option<Sample>,
    body_start: usize,
    body_end: usize,
}

fn blocks(lines: &[&str]) -> Vec<Block> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_end() == "```console" {
            let sample = (0..i)
                .rev()
                .find(|&j| !lines[j].trim().is_empty())
                .and_then(|j| lines[j].trim().strip_prefix(MARKER))
                .and_then(|m| m.strip_suffix("-->"))
                .and_then(|m| {
                    let m = m.trim();
                    match m.strip_prefix("none, reason:") {
                        Some(reason) if !reason.trim().is_empty() => Some(Sample::Exempt),
                        Some(_) => None,
                        None => Some(Sample::Scenario(m.to_string())),
                    }
                });
            let start = i + 1;
            let mut end = start;
            while end < lines.len() && lines[end].trim_end() != "```" {
                end += 1;
            }
            out.push(Block {
                sample,
                body_start: start,
                body_end: end,
            });
            i = end + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Replaces what differs from run to run by placeholders, word by word: ids, times,
/// durations and temporary paths.
fn normalise(text: &str) -> String {
    text.lines()
        .map(|line| {
            if is_demo_figure(line) {
                return numbers_hidden(line);
            }
            // A gauge of age: how long the run took to get there.
            if let Some((labels, _age)) = line
                .strip_prefix("pgbus_oldest_due_age_seconds")
                .and_then(|series| series.rsplit_once(' '))
            {
                return format!("pgbus_oldest_due_age_seconds{labels} <seconds>");
            }
            let mut previous = "";
            line.split(' ')
                .map(|word| {
                    // `nats-server -p PORT`: a port picked free at each run.
                    let out = if previous == "-p" && word.chars().all(|c| c.is_ascii_digit()) {
                        "<port>".to_string()
                    } else {
                        normalise_word(word)
                    };
                    previous = word;
                    out
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        // A table's columns are as wide as their values (a duration, a count): runs of
        // spaces compare as one gap.
        .map(|line| {
            let mut gaps = String::new();
            for (i, part) in line.split("  ").enumerate() {
                if i == 0 || !part.is_empty() {
                    if i > 0 {
                        gaps.push_str("  ");
                    }
                    gaps.push_str(part.trim_start());
                }
            }
            gaps
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A line of `pgbus demo`'s summary: its figures (counts, rates, latencies) are the
/// run's, and the columns' widths follow them.
fn is_demo_figure(line: &str) -> bool {
    let text = line.trim_start();
    line.starts_with("  ")
        && [
            "published ",
            "delivered",
            "demo-",
            "retries ",
            "dead letters ",
            "commit -> handler ",
        ]
        .iter()
        .any(|p| text.starts_with(p))
}

/// The line with each number as `<n>` and each run of spaces as one.
fn numbers_hidden(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.trim_start().chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            while chars
                .peek()
                .is_some_and(|c| c.is_ascii_digit() || *c == '.')
            {
                chars.next();
            }
            out.push_str("<n>");
        } else if c == ' ' {
            while chars.peek() == Some(&' ') {
                chars.next();
            }
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

fn normalise_word(word: &str) -> String {
    // A test database's name, `pgbus_t_` and 16 hex digits.
    if let Some(at) = word.find("pgbus_t_") {
        let rest = &word[at + "pgbus_t_".len()..];
        let hex = rest.len()
            - rest
                .trim_start_matches(|c: char| c.is_ascii_hexdigit())
                .len();
        if hex == 16 {
            let named = format!("{}pgbus_t_<id>{}", &word[..at], &rest[hex..]);
            return normalise_word(&named);
        }
    }
    if word.starts_with("PGPORT=") {
        return "PGPORT=<port>".to_string();
    }
    // JSON (one word, no spaces): each string's text apart; `key=value`: the value.
    for separator in ['"', '='] {
        if word.contains(separator) {
            return word
                .split(separator)
                .map(normalise_word)
                .collect::<Vec<_>>()
                .join(&separator.to_string());
        }
    }
    let core = word.trim_matches(|c: char| "()[],;'\"".contains(c));
    let is_uuid = core.len() == 36
        && core.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        && core.matches('-').count() == 4;
    let digits = core.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.');
    let is_duration =
        digits.len() < core.len() && ["ns", "µs", "us", "ms", "s", "m", "h"].contains(&digits);
    let is_time = core.chars().filter(|c| c.is_ascii_digit()).count() >= 6
        && (core.contains(':') || core.matches('-').count() == 2)
        && core
            .chars()
            .all(|c| c.is_ascii_digit() || "-:.TZ+".contains(c));
    let placeholder = if is_uuid {
        "<uuid>"
    } else if is_duration {
        "<duration>"
    } else if is_time {
        "<time>"
    } else if core.starts_with("/tmp/") {
        "<path>"
    } else if let Some((host, at)) = ["127.0.0.1:", "0.0.0.0:"]
        .iter()
        .find_map(|host| core.find(host).map(|at| (host, at)))
    {
        // A port picked free at each run, in an address or a URL (or a list of them).
        let port = &core[at + host.len()..];
        let digits = port.len() - port.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return word.to_string();
        }
        let number = &port[..digits];
        let (done, rest) = word.split_at(word.find(core).unwrap_or(0) + at + host.len() + digits);
        let done = done.replacen(&format!("{host}{number}"), &format!("{host}<port>"), 1);
        return done + &normalise_word(rest);
    } else {
        return word.to_string();
    };
    word.replacen(core, placeholder, 1)
}

async fn capture(scenario: &str) -> String {
    let db = common::test_db().await;
    // The TLS scenario reaches a TLS-only server too: TLS_PORT, TLS_USER, TLS_DATABASE,
    // TLS_CA (its CA's certificate), its password in PGPASSWORD. Its certificate names `localhost` only.
    let mut extra_env = Vec::new();
    if scenario == "tls" {
        let server = common::tls::TlsServer::shared().await;
        extra_env = vec![
            ("TLS_PORT", server.port().to_string()),
            ("TLS_USER", server.user().to_string()),
            ("TLS_DATABASE", server.database().to_string()),
            ("PGPASSWORD", server.password().to_string()),
            ("TLS_CA", server.ca_pem().display().to_string()),
        ];
    }
    // The pooler scenario reaches its database through the shared PgBouncer too:
    // POOLER_USER@127.0.0.1:POOLER_PORT, database DB_NAME.
    if scenario == "pooler" {
        let pooler = common::pgbouncer::shared().await;
        extra_env = vec![
            ("POOLER_PORT", pooler.port().to_string()),
            (
                "POOLER_USER",
                pooler.config().get_user().unwrap_or_default().to_string(),
            ),
            ("DB_NAME", db.name().to_string()),
        ];
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_pgbus")).parent().unwrap();
    let samples = root().join("cli/tests/samples");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let dir = std::env::temp_dir().join(format!("pgbus-sample-{}-{scenario}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let transcript = dir.join("transcript");
    let script = format!(
        ". {}\n. {}\n",
        samples.join("prelude.sh").display(),
        samples.join(format!("{scenario}.sh")).display()
    );
    let name = scenario.to_string();
    let samples = samples.clone();
    // The NATS sample reads the stream with the `nats_tail` example. Only `cargo build`
    // links it as `examples/nats_tail`; `cargo test --all-targets` builds examples as test
    // harnesses. scripts/check and scripts/samples build it first.
    let nats_tail = bin.join("examples/nats_tail");
    if scenario == "forward_nats" {
        assert!(
            nats_tail.is_file(),
            "the forward_nats sample needs the nats_tail example: run \
             `cargo build -p pgbus-cli --examples` first"
        );
    }
    let transcript2 = transcript.clone();
    let status = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(&dir)
            .env("PATH", path)
            .env("DATABASE_URL", db.url())
            .env("TRANSCRIPT", &transcript2)
            .env("SAMPLES", &samples)
            .env("PGBUS_NATS_TAIL", &nats_tail)
            .envs(extra_env)
            .status()
            .unwrap()
    })
    .await
    .unwrap();
    let text = std::fs::read_to_string(&transcript).unwrap_or_default();
    let _ = std::fs::remove_dir_all(transcript.parent().unwrap());
    assert!(
        status.success(),
        "scenario `{name}` failed ({status}):\n{text}"
    );
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn every_console_block_in_the_docs_matches_a_run_of_its_scenario() {
    let update = std::env::var_os("PGBUS_UPDATE_SAMPLES").is_some();
    let mut failures = Vec::new();
    let docs: Vec<(PathBuf, String)> = doc_files()
        .into_iter()
        .map(|file| {
            let text = std::fs::read_to_string(&file).unwrap();
            (file, text)
        })
        .collect();
    // Every scenario runs once, all at once (each has its own database).
    let mut names = std::collections::BTreeSet::new();
    for (_, text) in &docs {
        let lines: Vec<&str> = text.lines().collect();
        for block in blocks(&lines) {
            if let Some(Sample::Scenario(name)) = block.sample {
                names.insert(name);
            }
        }
    }
    let runs = futures::future::join_all(names.iter().map(|name| capture(name))).await;
    let captured: std::collections::BTreeMap<&String, String> = names.iter().zip(runs).collect();
    for (file, text) in &docs {
        let shown_file = file.strip_prefix(root()).unwrap_or(file).display();
        let lines: Vec<&str> = text.lines().collect();
        let mut rewritten: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        for block in blocks(&lines).into_iter().rev() {
            let scenario = match block.sample {
                None => {
                    failures.push(format!(
                        "{shown_file}:{}: a console block with no `{MARKER}NAME -->` marker",
                        block.body_start
                    ));
                    continue;
                }
                Some(Sample::Exempt) => continue,
                Some(Sample::Scenario(name)) => name,
            };
            let captured = &captured[&scenario];
            let shown = lines[block.body_start..block.body_end].join("\n") + "\n";
            if update {
                rewritten.splice(
                    block.body_start..block.body_end,
                    captured.lines().map(str::to_string),
                );
            } else if normalise(captured) != normalise(&shown) {
                failures.push(format!(
                    "{shown_file}:{}: sample `{scenario}` no longer matches its run\n--- doc\n{}--- run\n{}",
                    block.body_start,
                    normalise(&shown),
                    normalise(captured)
                ));
            }
        }
        if update {
            std::fs::write(file, rewritten.join("\n") + "\n").unwrap();
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
