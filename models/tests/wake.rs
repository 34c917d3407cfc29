//! The cost-aware wake-up model (`pgbus_models::wake`) and its negative controls.

use pgbus_models::check;
use pgbus_models::wake::WakeModel;

const PROPERTY: &str = "no event waits for the poll";

#[test]
fn small_as_built_no_event_waits_for_the_poll() {
    let outcome = check("wake: as built, one bus", WakeModel::small(), false);
    outcome.assert_holds();
    assert!(
        outcome.unreached.is_empty(),
        "unreached: {:?}",
        outcome.unreached
    );
}

#[test]
fn as_built_no_event_waits_for_the_poll() {
    let outcome = check("wake: as built", WakeModel::as_built(), false);
    outcome.assert_holds();
    assert!(
        outcome.unreached.is_empty(),
        "unreached: {:?}",
        outcome.unreached
    );
}

fn control(label: &str, model: WakeModel) {
    let outcome = check(label, model, true);
    assert!(
        outcome.violation(PROPERTY).is_some(),
        "{label}: the checker found no counterexample"
    );
}

#[test]
fn control_without_the_wake_lock_an_event_waits_for_the_poll() {
    control(
        "wake: no wake lock",
        WakeModel {
            wake_lock: false,
            ..WakeModel::small()
        },
    );
}

#[test]
fn control_flags_read_before_the_wake_lock_an_event_waits_for_the_poll() {
    control(
        "wake: flags read before the lock",
        WakeModel {
            read_before_lock: true,
            ..WakeModel::small()
        },
    );
}

#[test]
fn control_no_claim_after_the_sleep_mark_an_event_waits_for_the_poll() {
    control(
        "wake: no claim after the mark",
        WakeModel {
            claim_after_mark: false,
            ..WakeModel::small()
        },
    );
}

#[test]
fn control_no_catch_up_after_a_reconnect_an_event_waits_for_the_poll() {
    control(
        "wake: no catch-up after a reconnect",
        WakeModel {
            catch_up_on_reconnect: false,
            ..WakeModel::small()
        },
    );
}
