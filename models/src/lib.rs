//! Model-checked protocols of pgbus.
//!
//! Each module is a small [`stateright`] model of one concurrency protocol, written in
//! terms of what the protocol's transactions read and write, and of the abstract locks
//! they take (a "key lock", the "wake lock"), so that the models stay valid whatever
//! lock implementation the SQL uses:
//!
//! - [`boundary`]: the batch boundary of the log-first publish (designed, not yet built);
//! - [`heads`]: per-key heads of ordered subscriptions, as built;
//! - [`wake`]: the cost-aware wake-up, as built.
//!
//! Every model has switches that turn one of its safeguards off; with a safeguard off the
//! checker must find a counterexample (the negative controls in `tests/`). The map from
//! each action to the SQL or Rust that implements it is in `docs/ARCHITECTURE.md`,
//! section "Model-checked protocols".

pub mod boundary;
pub mod heads;
pub mod wake;

use std::fmt::Debug;
use std::hash::Hash;
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};

/// What one run of the checker found.
#[derive(Debug)]
pub struct Outcome {
    /// The run's label (model and variant).
    pub label: String,
    /// Distinct states visited.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// The deepest path explored.
    pub max_depth: usize,
    /// Wall-clock time of the run.
    pub elapsed: Duration,
    /// Each violated `always` property, with its counterexample printed one action a line.
    pub violations: Vec<(&'static str, String)>,
    /// The `sometimes` properties (things the model must be able to do) never reached:
    /// a model that cannot reach them checks nothing about them.
    pub unreached: Vec<&'static str>,
}

impl Outcome {
    /// Panics, with every counterexample printed one action a line, unless every
    /// `always` property held and every `sometimes` property was reached.
    pub fn assert_holds(&self) {
        let mut report = String::new();
        for (name, trace) in &self.violations {
            report.push_str(&format!("counterexample to \"{name}\":\n{trace}"));
        }
        for name in &self.unreached {
            report.push_str(&format!("never reached: \"{name}\"\n"));
        }
        assert!(report.is_empty(), "{}:\n{report}", self.label);
    }

    /// The counterexample of a violated property, if the run found one.
    pub fn violation(&self, property: &str) -> Option<&str> {
        self.violations
            .iter()
            .find(|(name, _)| *name == property)
            .map(|(_, trace)| trace.as_str())
    }
}

/// Runs the breadth-first checker over every reachable state of `model` (on one thread:
/// the models are small) and reports the violations it found, printing a summary line
/// and every counterexample. With `stop_at_first_violation` (negative controls) it stops
/// as soon as one `always` property fails.
pub fn check<M>(label: &str, model: M, stop_at_first_violation: bool) -> Outcome
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync,
    M::Action: Clone + Debug + PartialEq,
{
    let started = Instant::now();
    let properties = model.properties();
    let mut builder = model.checker().threads(1);
    if stop_at_first_violation {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let checker = builder.spawn_bfs().join();
    let elapsed = started.elapsed();
    let mut discoveries = checker.discoveries();
    let mut violations = Vec::new();
    let mut unreached = Vec::new();
    for property in &properties {
        match (
            property.expectation.clone(),
            discoveries.remove(property.name),
        ) {
            (Expectation::Sometimes, None) => unreached.push(property.name),
            (Expectation::Sometimes, Some(_)) | (_, None) => {}
            (_, Some(path)) => violations.push((property.name, trace(path))),
        }
    }
    let outcome = Outcome {
        label: label.to_owned(),
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        violations,
        unreached,
    };
    println!(
        "{}: {} states ({} generated), depth {}, {:.2?}",
        outcome.label, outcome.unique_states, outcome.states, outcome.max_depth, outcome.elapsed
    );
    for (name, trace) in &outcome.violations {
        println!("  counterexample to \"{name}\":\n{trace}");
    }
    if stop_at_first_violation && !outcome.violations.is_empty() {
        // The run stopped early: the counts above are not the whole space.
        println!("  (stopped at the first counterexample)");
    }
    outcome
}

/// A path printed one action a line, numbered, ending with the state it reaches.
pub fn trace<S: Debug, A: Debug>(path: Path<S, A>) -> String {
    let steps = path.into_vec();
    let mut out = String::new();
    for (i, (_, action)) in steps.iter().enumerate() {
        if let Some(action) = action {
            out.push_str(&format!("    {:>2}. {action:?}\n", i + 1));
        }
    }
    if let Some((state, _)) = steps.last() {
        out.push_str(&format!("    final state: {state:?}\n"));
    }
    out
}
