//! The library's modules import each other without a circle, and only the crate root
//! reaches the bus: each room of the delivery path is handed what it needs instead.
//!
//! The graph is read from the sources: a module depends on another when its code (not
//! its comments, not its unit tests) names `crate::<other>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module of `src/` and the modules its code names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            sources.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .into_iter()
        .map(|(name, text)| {
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let mut deps = BTreeSet::new();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let rest = &line[i + "crate::".len()..];
                    let dep: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if modules.contains(&dep) && dep != name {
                        deps.insert(dep);
                    }
                }
            }
            (name, deps)
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
fn the_check_finds_a_circle() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    graph.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    let found = circle(&graph, "a", &mut Vec::new(), &mut BTreeSet::new());
    assert_eq!(found.unwrap().join(" -> "), "a -> b -> c -> a");
}
