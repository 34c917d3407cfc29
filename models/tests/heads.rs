//! The per-key heads model (`pgbus_models::heads`), the race it found in migration 5's
//! `pgbus.purge_dead`, and its negative controls.

use pgbus_models::check;
use pgbus_models::heads::{HeadsModel, Isolation, Purge};

const ORPHAN: &str = "a key with pending deliveries has a head";
const TWO_HEADS: &str = "no key has two heads";
const ORDER: &str = "per-key delivery order is commit order";

#[test]
fn as_built_keeps_one_head_per_key_in_commit_order() {
    let outcome = check(
        "heads: as built (migration 15)",
        HeadsModel::as_built(),
        false,
    );
    outcome.assert_holds();
    assert!(
        outcome.unreached.is_empty(),
        "unreached: {:?}",
        outcome.unreached
    );
}

#[test]
fn three_publishers_without_switches_keep_one_head_per_key_in_commit_order() {
    let model = HeadsModel {
        publishers: vec![
            Isolation::ReadCommitted,
            Isolation::RepeatableRead,
            Isolation::ReadCommitted,
        ],
        switches: 0,
        operator: false,
        ..HeadsModel::as_built()
    };
    let outcome = check("heads: three publishers, worker only", model, false);
    outcome.assert_holds();
}

/// The race migration 15 fixes: `purge_dead` locks the keys of the dead heads its first
/// statement saw, but its delete, a later statement, also deletes a head that died in
/// between, under no key lock; a publisher holding that key's lock filed its delivery
/// behind the dead head, and the purge, not seeing it, promoted nothing.
#[test]
fn migration_5_purge_strands_a_key() {
    let model = HeadsModel {
        purge: Purge::Migration5,
        switches: 0,
        ..HeadsModel::as_built()
    };
    let outcome = check("heads: migration 5's purge", model, true);
    let trace = outcome
        .violation(ORPHAN)
        .expect("the checker found no counterexample");
    assert!(trace.contains("PurgeApply"), "{trace}");
}

fn control(label: &str, model: HeadsModel, property: &str) {
    let outcome = check(label, model, true);
    assert!(
        outcome.violation(property).is_some(),
        "{label}: no counterexample to \"{property}\" (found: {:?})",
        outcome.violations.iter().map(|v| v.0).collect::<Vec<_>>()
    );
}

#[test]
fn control_head_decided_from_a_stale_snapshot_strands_a_key() {
    control(
        "heads: head from the snapshot",
        HeadsModel {
            head_from_snapshot: true,
            switches: 0,
            operator: false,
            ..HeadsModel::as_built()
        },
        ORPHAN,
    );
}

#[test]
fn control_stale_snapshot_without_the_one_head_constraint_makes_two_heads() {
    control(
        "heads: head from the snapshot, no one-head constraint",
        HeadsModel {
            head_from_snapshot: true,
            one_head_constraint: false,
            switches: 0,
            operator: false,
            ..HeadsModel::as_built()
        },
        TWO_HEADS,
    );
}

#[test]
fn control_publish_without_the_key_lock_strands_a_key() {
    control(
        "heads: no key lock on publish",
        HeadsModel {
            key_lock_on_publish: false,
            switches: 0,
            operator: false,
            ..HeadsModel::as_built()
        },
        ORPHAN,
    );
}

#[test]
fn control_position_drawn_before_the_key_lock_breaks_commit_order() {
    control(
        "heads: position before the key lock",
        HeadsModel {
            publishers: vec![Isolation::ReadCommitted; 3],
            pos_before_lock: true,
            switches: 0,
            operator: false,
            ..HeadsModel::as_built()
        },
        ORDER,
    );
}
