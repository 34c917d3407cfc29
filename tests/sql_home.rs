//! Every statement the library sends lives in `src/sql/` (or is a call of a function
//! its migrations define): no other source file spells one out. One home per
//! statement means one place to review, one corpus for the hostile-neighbour test, and no
//! copy to drift. Transaction control (`BEGIN`, `COMMIT`, `ROLLBACK`) is not counted.

use std::path::Path;

/// The SQL words that start a statement, as they would open a Rust string literal.
const STARTS: &[&str] = &[
    "SELECT", "INSERT", "UPDATE", "DELETE", "WITH", "LISTEN", "NOTIFY", "SHOW", "SET", "LOCK",
    "DO", "CREATE", "DROP", "ALTER", "TRUNCATE", "CALL", "PREPARE", "EXPLAIN", "VACUUM", "ANALYZE",
    "COPY", "GRANT", "REVOKE",
];

/// `(file:line, line)` of every string literal outside `src/sql/` (and outside unit
/// tests and comments) that opens with a statement's first word.
fn statements_outside(src: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if !path.ends_with("src/sql") {
                statements_outside(&path, out);
            }
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for (i, _) in line.match_indices('"') {
                let rest = &line[i + 1..];
                let word: String = rest.chars().take_while(char::is_ascii_uppercase).collect();
                let after = rest[word.len()..].chars().next();
                if STARTS.contains(&word.as_str()) && after.is_none_or(|c| c == ' ' || c == '\\') {
                    out.push((
                        format!("{}:{}", path.display(), n + 1),
                        line.trim().to_string(),
                    ));
                }
            }
        }
    }
}

#[test]
fn every_statement_the_library_sends_is_in_src_sql() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    statements_outside(&src, &mut found);
    assert!(
        found.is_empty(),
        "statements outside src/sql/ (move them there, named and documented): {found:#?}"
    );
}

#[test]
fn the_check_finds_a_statement() {
    let dir = std::env::temp_dir().join(format!("pgbus-sql-home-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("inner")).unwrap();
    std::fs::write(
        dir.join("inner/x.rs"),
        "// \"SELECT in a comment\"\nfn f() { q(\"SELECT 1\"); q(\"Selected\"); }\n",
    )
    .unwrap();
    let mut found = Vec::new();
    statements_outside(&dir, &mut found);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].0.ends_with("inner/x.rs:2"), "{found:?}");
}

/// Every public statement of `src/sql/` is in `sql::ALL`, so that the tests that prepare
/// each against a migrated schema (`tests/delivery.rs`) and read its columns cover it: a
/// new statement left out of the list would go unchecked until it failed in use.
#[test]
fn every_public_statement_is_listed_in_all() {
    // Not prepared: LISTEN is sent as a simple query and has no result to check;
    // LEASE_LOST is a SQLSTATE, not a statement.
    const UNLISTED: &[&str] = &["LISTEN", "LEASE_LOST"];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/sql");
    let listed: Vec<&str> = pgbus_testkit::sql::ALL
        .iter()
        .map(|(name, _)| *name)
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("pub const ") else {
                continue;
            };
            let Some((name, _)) = rest.split_once(": &str") else {
                continue;
            };
            if !listed.contains(&name) && !UNLISTED.contains(&name) {
                missing.push(name.to_owned());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "statements not in sql::ALL: {missing:?}"
    );
}
