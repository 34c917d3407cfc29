//! The models and the code agree: every `pgbus.<function>` that the code map in
//! `docs/ARCHITECTURE.md` ("Model-checked protocols") names is still created by a migration
//! in `sql/` (and not dropped or renamed by a later one), and every `src/<file>.rs::<name>`
//! is still a function or constant of that file. Rows marked "to be built" name what does
//! not exist yet and are skipped.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("models/ is inside the workspace")
        .to_path_buf()
}

/// The table rows of the "Model-checked protocols" section.
fn map_rows() -> Vec<String> {
    let doc = fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let start = doc
        .find("\n## Model-checked protocols")
        .expect("docs/ARCHITECTURE.md has no \"Model-checked protocols\" section");
    let rest = &doc[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    rest[..end]
        .lines()
        .filter(|line| line.starts_with('|') && !line.contains("to be built"))
        .map(str::to_owned)
        .collect()
}

/// The spans between backticks.
fn code_spans(line: &str) -> impl Iterator<Item = &str> {
    line.split('`').skip(1).step_by(2)
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The functions of schema `pgbus` that the migrations leave in place: created (or
/// replaced), and not dropped or renamed away by a later migration.
fn sql_functions() -> BTreeMap<String, bool> {
    let mut files: Vec<PathBuf> = fs::read_dir(root().join("sql"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    let mut alive = BTreeMap::new();
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        for statement in text.split(';') {
            let normal = statement.split_whitespace().collect::<Vec<_>>().join(" ");
            let upper = normal.to_ascii_uppercase();
            for (verb, lives) in [
                ("CREATE FUNCTION PGBUS.", true),
                ("CREATE OR REPLACE FUNCTION PGBUS.", true),
                ("DROP FUNCTION PGBUS.", false),
                ("DROP FUNCTION IF EXISTS PGBUS.", false),
                ("ALTER FUNCTION PGBUS.", false),
            ] {
                let mut from = 0;
                while let Some(at) = upper[from..].find(verb) {
                    let name_at = from + at + verb.len();
                    let name: String = normal[name_at..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    from = name_at;
                    if verb.starts_with("ALTER") {
                        // Only a rename removes the name (and gives the function another).
                        let Some(to) = upper.find("RENAME TO ") else {
                            continue;
                        };
                        let new: String = normal[to + "RENAME TO ".len()..]
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        alive.insert(name, false);
                        alive.insert(new, true);
                        continue;
                    }
                    alive.insert(name, lives);
                }
            }
        }
    }
    alive
}

fn rust_item_exists(file: &str, name: &str) -> bool {
    let Ok(text) = fs::read_to_string(root().join(file)) else {
        return false;
    };
    [
        format!("fn {name}("),
        format!("fn {name}<"),
        format!("const {name}:"),
    ]
    .iter()
    .any(|needle| text.contains(needle.as_str()))
}

#[test]
fn every_function_the_code_map_names_exists() {
    let rows = map_rows();
    let functions = sql_functions();
    let mut sql_names = 0;
    let mut rust_names = 0;
    let mut missing = Vec::new();
    for row in &rows {
        for span in code_spans(row) {
            if let Some(name) = span.strip_prefix("pgbus.")
                && is_ident(name)
            {
                sql_names += 1;
                if functions.get(name) != Some(&true) {
                    missing.push(format!("{span} (no migration in sql/ leaves it in place)"));
                }
            } else if let Some((file, name)) = span.split_once("::")
                && file.starts_with("src/")
                && file.ends_with(".rs")
                && is_ident(name)
            {
                rust_names += 1;
                if !rust_item_exists(file, name) {
                    missing.push(format!("{span} (no fn or const {name} in {file})"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the code map in docs/ARCHITECTURE.md names what no longer exists:\n  {}",
        missing.join("\n  ")
    );
    // A map that names (almost) nothing checks nothing.
    assert!(
        sql_names >= 15 && rust_names >= 15,
        "the code map names only {sql_names} SQL functions and {rust_names} Rust items"
    );
}

/// The checks above can fail: a name that does not exist is reported.
#[test]
fn a_name_that_does_not_exist_is_found_missing() {
    let functions = sql_functions();
    assert_eq!(functions.get("purge_dead"), Some(&true));
    assert_eq!(functions.get("settle_unlocked"), Some(&true));
    assert_eq!(functions.get("first_event_in_transaction"), Some(&false));
    assert_eq!(functions.get("no_such_function"), None);
    assert!(rust_item_exists("src/claim.rs", "fall_asleep"));
    assert!(!rust_item_exists("src/claim.rs", "no_such_fn"));
}
