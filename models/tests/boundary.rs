//! The batch boundary of the log-first publish (`pgbus_models::boundary`, designed, not
//! yet built) and its negative controls.

use pgbus_models::boundary::{Boundary, BoundaryModel, Isolation, Position};
use pgbus_models::check;

const EXACTLY_ONCE: &str = "an event becomes deliveries exactly once, only after it committed";
const SKIPPED: &str = "no committed event is behind the boundary without deliveries";
const HELD_BACK: &str = "an open transaction holds back only its own event";
const ORDER: &str = "per-key delivery order is commit order";
const SWEPT: &str = "nothing swept is still needed";

#[test]
fn the_design_takes_every_event_once_in_commit_order() {
    let outcome = check("boundary: the design", BoundaryModel::design(), false);
    outcome.assert_holds();
    assert!(
        outcome.unreached.is_empty(),
        "unreached: {:?}",
        outcome.unreached
    );
}

fn control(label: &str, model: BoundaryModel, property: &str) {
    let outcome = check(label, model, true);
    assert!(
        outcome.violation(property).is_some(),
        "{label}: no counterexample to \"{property}\" (found: {:?})",
        outcome.violations.iter().map(|v| v.0).collect::<Vec<_>>()
    );
}

#[test]
fn control_a_seq_high_water_mark_skips_open_transactions() {
    control(
        "boundary: seq high-water mark",
        BoundaryModel {
            boundary: Boundary::SeqHighWater,
            ..BoundaryModel::design()
        },
        SKIPPED,
    );
}

#[test]
fn control_the_oldest_open_transaction_holds_back_later_commits() {
    control(
        "boundary: oldest open xid",
        BoundaryModel {
            boundary: Boundary::OldestOpen,
            ..BoundaryModel::design()
        },
        HELD_BACK,
    );
}

#[test]
fn control_a_cursor_written_in_a_second_transaction_takes_events_twice() {
    control(
        "boundary: cursor in a second transaction",
        BoundaryModel {
            cursor_in_same_transaction: false,
            ..BoundaryModel::design()
        },
        EXACTLY_ONCE,
    );
}

#[test]
fn control_cutters_without_the_cursor_lock_take_events_twice() {
    control(
        "boundary: no cursor lock",
        BoundaryModel {
            cursor_lock: false,
            cutters: vec![Isolation::ReadCommitted, Isolation::ReadCommitted],
            ..BoundaryModel::design()
        },
        EXACTLY_ONCE,
    );
}

#[test]
fn control_positions_without_the_key_lock_break_commit_order() {
    control(
        "boundary: position = seq, no key lock",
        BoundaryModel {
            position: Position::Seq,
            ..BoundaryModel::design()
        },
        ORDER,
    );
}

#[test]
fn control_positions_from_a_repeatable_read_snapshot_break_commit_order() {
    control(
        "boundary: position from the snapshot",
        BoundaryModel {
            position: Position::SnapshotMax,
            ..BoundaryModel::design()
        },
        ORDER,
    );
}

#[test]
fn control_a_sweep_that_ignores_the_cursor_removes_events_not_yet_delivered() {
    control(
        "boundary: sweep ignores the cursor",
        BoundaryModel {
            sweep_checks_cursor: false,
            ..BoundaryModel::design()
        },
        SWEPT,
    );
}

#[test]
fn control_a_repeatable_read_cut_with_a_fresher_boundary_than_its_snapshot_skips_events() {
    control(
        "boundary: REPEATABLE READ cutter, fresh boundary",
        BoundaryModel {
            fresh_boundary_in_repeatable_read: true,
            ..BoundaryModel::design()
        },
        SKIPPED,
    );
}
