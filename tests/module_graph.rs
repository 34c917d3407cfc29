//! The library's modules import each other without a circle, only the crate root
//! reaches the bus (each room of the delivery path is handed what it needs instead), and
//! the wings keep their direction: the runtime does not import the operator API, and
//! publishing imports neither. The command line and the test kit have no circle either.
//!
//! The graph is read from the sources: a module depends on another when its code (not
//! its comments, not its unit tests) names `crate::<other>` or, from a folder's file,
//! `super::<other>`; folders (`admin/`, `connect/`) are read file by file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The runtime's modules: what a running bus is made of.
const RUNTIME: &[&str] = &[
    "backoff",
    "bus",
    "claim",
    "conn",
    "context",
    "decode",
    "delivery",
    "dispatch",
    "handler",
    "listen",
    "maintain",
    "retention",
    "settle",
    "shutdown",
    "slot",
    "stats",
    "subscription",
];

/// The publishing wing: what a service that only publishes links.
const PUBLISHING: &[&str] = &["event", "executor", "publish", "trace_context"];

/// Every source file under `dir`, by module path (`admin::status`; a folder's `mod.rs`
/// is the folder's module).
fn sources(dir: &Path, prefix: &str, out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let joined = if prefix.is_empty() {
            stem.clone()
        } else {
            format!("{prefix}::{stem}")
        };
        if path.is_dir() {
            sources(&path, &joined, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = if stem == "mod" {
                prefix.to_string()
            } else {
                joined
            };
            out.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// The longest module of `modules` that `path` (`a::b::item`) lies in.
fn module_of(modules: &BTreeSet<String>, path: &[String]) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// The path segments named after `at` in `line` (`crate::a::b` gives `a`, `b`).
fn segments(rest: &str) -> Vec<String> {
    rest.split("::")
        .map(|s| {
            s.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .take_while(|s| !s.is_empty())
        .collect()
}

/// Each module of the library's `src/` (folders included) and the modules its code
/// names, through `crate::` or `super::` paths.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    graph_of("src")
}

/// [`graph`] for the package whose sources are `dir` (relative to the workspace root).
fn graph_of(dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut texts = BTreeMap::new();
    sources(&src, "", &mut texts);
    path_modules(&mut texts);
    let modules: BTreeSet<String> = texts.keys().cloned().collect();
    texts
        .into_iter()
        .map(|(name, text)| {
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let parent: Vec<String> = {
                let mut p: Vec<String> = name.split("::").map(str::to_owned).collect();
                p.pop();
                p
            };
            let mut deps = BTreeSet::new();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let path = segments(&line[i + "crate::".len()..]);
                    deps.extend(module_of(&modules, &path));
                }
                for (i, _) in line.match_indices("super::") {
                    if line[..i].ends_with("::") {
                        continue;
                    }
                    let mut path = parent.clone();
                    path.extend(segments(&line[i + "super::".len()..]));
                    deps.extend(module_of(&modules, &path));
                }
            }
            deps.remove(&name);
            deps.remove("lib");
            deps.remove("main");
            (name, deps)
        })
        .collect()
}

/// Moves a file that a `#[path = "FILE"] mod NAME;` declaration includes to the module it
/// is there (`sqlx::api` and `sqlx08::api` for `sqlx_api.rs`, once under each): its
/// imports are that module's, and its `super::` is the including module. A file no path
/// attribute names keeps the module its place gives it. The files are found next to the
/// including file, as rustc finds them for a module that is not inline.
fn path_modules(texts: &mut BTreeMap<String, String>) {
    let mut found = Vec::new();
    for (name, text) in texts.iter() {
        let mut lines = text.lines().map(str::trim);
        while let Some(line) = lines.next() {
            let Some(file) = line
                .strip_prefix("#[path = \"")
                .and_then(|rest| rest.strip_suffix("\"]"))
            else {
                continue;
            };
            let declared = lines
                .by_ref()
                .find(|l| !l.starts_with("#[") && !l.starts_with("//"))
                .unwrap_or("");
            let Some(module) = declared
                .trim_start_matches("pub ")
                .strip_prefix("mod ")
                .and_then(|rest| rest.strip_suffix(';'))
            else {
                continue;
            };
            let mut at: Vec<&str> = name.split("::").collect();
            at.pop();
            at.push(file.trim_end_matches(".rs"));
            found.push((at.join("::"), format!("{name}::{module}")));
        }
    }
    for (file, _) in &found {
        assert!(texts.contains_key(file), "#[path] names {file}, not found");
    }
    for (file, module) in &found {
        let text = texts[file].clone();
        texts.insert(module.clone(), text);
    }
    for (file, _) in found {
        texts.remove(&file);
    }
}

/// The modules of `wing` (and their submodules) that import a module of `other`.
fn crossing(
    graph: &BTreeMap<String, BTreeSet<String>>,
    wing: &[&str],
    other: impl Fn(&str) -> bool,
) -> Vec<String> {
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    graph
        .iter()
        .filter(|(name, _)| wing.contains(&top(name).as_str()))
        .flat_map(|(name, deps)| {
            deps.iter()
                .filter(|d| other(d))
                .map(move |d| format!("{name} -> {d}"))
        })
        .collect()
}

/// A circle through `node`, if the graph has one reachable from it.
fn circle(
    graph: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|n| n == node) {
        let mut found = path[at..].to_vec();
        found.push(node.to_string());
        return Some(found);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_string());
    for dep in graph.get(node).into_iter().flatten() {
        if let Some(found) = circle(graph, dep, path, done) {
            return Some(found);
        }
    }
    path.pop();
    done.insert(node.to_string());
    None
}

#[test]
fn the_modules_import_each_other_without_a_circle() {
    let graph = graph();
    assert!(graph.len() > 10, "the sources were not found: {graph:?}");
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(found) = circle(&graph, node, &mut Vec::new(), &mut done) {
            panic!("an import circle: {}", found.join(" -> "));
        }
    }
}

#[test]
fn the_command_line_and_the_test_kit_import_without_a_circle() {
    for dir in ["cli/src", "testkit/src"] {
        let graph = graph_of(dir);
        assert!(
            graph.len() > 5,
            "{dir}: the sources were not found: {graph:?}"
        );
        let mut done = BTreeSet::new();
        for node in graph.keys() {
            if let Some(found) = circle(&graph, node, &mut Vec::new(), &mut done) {
                panic!("{dir}: an import circle: {}", found.join(" -> "));
            }
        }
    }
}

#[test]
fn only_the_crate_root_reaches_the_bus() {
    let graph = graph();
    let reaching: Vec<&String> = graph
        .iter()
        .filter(|(name, deps)| *name != "lib" && deps.contains("bus"))
        .map(|(name, _)| name)
        .collect();
    assert!(
        reaching.is_empty(),
        "modules that import the bus: {reaching:?}"
    );
}

#[test]
fn the_runtime_does_not_import_the_operator_api() {
    let graph = graph();
    assert!(
        graph.contains_key("admin::status"),
        "admin's files were not read"
    );
    let found = crossing(&graph, RUNTIME, |d| {
        d == "admin" || d.starts_with("admin::")
    });
    assert!(found.is_empty(), "the runtime imports admin: {found:?}");
}

#[test]
fn publishing_imports_neither_the_runtime_nor_the_operator_api() {
    let graph = graph();
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let found = crossing(&graph, PUBLISHING, |d| {
        RUNTIME.contains(&top(d).as_str()) || top(d) == "admin"
    });
    assert!(found.is_empty(), "publishing imports: {found:?}");
}

#[test]
fn every_module_belongs_to_a_named_wing() {
    // A new module is placed on purpose: in the runtime, in publishing, or among the
    // operating and shared modules listed here.
    let others = [
        "admin", "connect", "error", "metrics", "retry", "schema", "sql", "sqlx", "sqlx08",
    ];
    let graph = graph();
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let unplaced: Vec<&String> = graph
        .keys()
        .filter(|m| *m != "lib")
        .filter(|m| {
            let t = top(m);
            !RUNTIME.contains(&t.as_str())
                && !PUBLISHING.contains(&t.as_str())
                && !others.contains(&t.as_str())
        })
        .collect();
    assert!(unplaced.is_empty(), "modules in no wing: {unplaced:?}");
}

#[test]
fn the_reader_sees_folders_and_super_paths() {
    let graph = graph();
    // connect::tls names its parent through `super::`; maintain::sweep its sibling crate::retention.
    assert!(
        graph["connect::tls"].contains("connect"),
        "{:?}",
        graph["connect::tls"]
    );
    assert!(
        graph["maintain::sweep"].contains("retention"),
        "{:?}",
        graph["maintain::sweep"]
    );
    // sqlx_api.rs is `#[path]`-included as `sqlx::api` and `sqlx08::api`: read as those.
    assert!(!graph.contains_key("sqlx_api"), "{:?}", graph.keys());
    for module in ["sqlx::api", "sqlx08::api"] {
        assert!(graph.contains_key(module), "{module}: {:?}", graph.keys());
    }
}

#[test]
fn the_check_finds_a_circle() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    graph.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    let found = circle(&graph, "a", &mut Vec::new(), &mut BTreeSet::new());
    assert_eq!(found.unwrap().join(" -> "), "a -> b -> c -> a");
}
