//! The cost-aware wake-up, as built (`docs/ARCHITECTURE.md`, "Cost-aware notify").
//!
//! Publishers notify only when a consumer is asleep. Each consumer (a running bus) has a
//! row in `pgbus.consumers` saying awake or asleep; a publishing transaction checks the
//! rows just before it commits (`pgbus.notify_at_commit`, a deferred constraint trigger)
//! and queues a notification only if some live consumer is asleep. The race: a publisher
//! reads "awake", then the consumer falls asleep, then the publisher commits without a
//! notification. The wake lock closes it: the publisher takes it shared before its read
//! and holds it to the end of its commit; the consumer takes it exclusively for its sleep
//! mark (`pgbus.mark_asleep`) and claims once more right after the mark.
//!
//! What each action stands for:
//!
//! - [`Action::Publish`]: the application's transaction inserts its event (the row
//!   trigger queues the deferred check, `events_notify`);
//! - [`Action::Check`]: `pgbus.notify_at_commit` takes the wake lock shared and, in a new
//!   statement (a fresh snapshot under READ COMMITTED), reads the consumers' flags;
//!   under REPEATABLE READ it always notifies;
//! - [`Action::Commit`] / [`Action::Abort`]: the transaction ends; a commit sends the
//!   queued notification to every connected listener and releases the wake lock;
//! - [`Action::Deliver`]: a listener receives the notification and wakes its claimer
//!   (`listen.rs`, `Wake::by_notification`: a permit the claimer's next wait consumes);
//! - [`Action::DropListener`] / [`Action::Reconnect`]: the listener loses its connection
//!   (notifications in flight are lost) and reconnects, waking the claimer once to catch
//!   up (`listen.rs`, `Listener::caught_up`);
//! - [`Action::Claim`]: one claim statement (`pgbus.claim`) takes every committed,
//!   unclaimed event; a claim of a large batch (`AWAKE_THRESHOLD` deliveries or more)
//!   marks the consumer awake in the same statement; whether a claim was that large is
//!   left to the checker;
//! - [`Action::Linger`]: an awake consumer polls at its short cooldown (`claim.rs`,
//!   `pause`);
//! - [`Action::FallAsleep`]: `claim.rs`'s `fall_asleep`: `pgbus.mark_asleep` takes the wake
//!   lock exclusively and marks the row asleep, then the claimer claims once more;
//! - [`Action::Wake`]: a waiting claimer consumes its wake-up permit and claims;
//! - [`Action::Poll`]: the fallback poll timer fires.
//!
//! Abstracted away: time (the linger period, the poll interval and the re-checks after
//! 10, 50 and 250 ms; the model claims its property with no re-checks at all, the wake
//! lock alone), batch sizes and handler slots, several subscriptions, a consumer row's
//! expiry (a crashed bus) and a sleep mark that fails (the bus then stays awake and
//! polls). The wake lock is abstract: any lock with shared and exclusive modes held to
//! the end of the transaction fits.
//!
//! The property, stated precisely: in every reachable state, every committed event that no
//! consumer has claimed has a consumer that will claim without waiting for the poll:
//! one that is claiming or lingering awake, or holds a wake-up permit, or has a
//! notification in flight, or whose listener is reconnecting (its catch-up wake-up).
//! So no event waits for the poll, except after a fault outside the model (a consumer
//! row that expires while its bus is alive, a mark that fails).

use stateright::{Model, Property};

/// A transaction's isolation level.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Isolation {
    /// READ COMMITTED: each statement sees what committed before it started.
    ReadCommitted,
    /// REPEATABLE READ (or SERIALIZABLE): the check would read an old snapshot, so it
    /// always notifies.
    RepeatableRead,
}

/// Where a publishing transaction is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Publisher {
    /// Not started.
    Idle,
    /// Its event is inserted (not visible to others); the check is queued.
    Open,
    /// Read the flags but has not taken the wake lock yet (only with
    /// [`WakeModel::read_before_lock`]).
    ReadFlags {
        /// Whether it will notify.
        notify: bool,
    },
    /// Holds the wake lock shared and has decided (the check ran).
    Checked {
        /// Whether it will notify.
        notify: bool,
    },
    /// Committed: its event is visible.
    Committed {
        /// Whether its commit sent a notification.
        notified: bool,
    },
    /// Rolled back: its event never existed.
    Aborted,
}

/// Where a consumer's claimer is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Phase {
    /// About to claim.
    Claim,
    /// Awake and lingering: will claim again shortly or fall asleep.
    Linger,
    /// Waiting for a wake-up permit or the poll.
    Wait,
}

/// One running bus.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Consumer {
    /// The claimer's phase.
    pub phase: Phase,
    /// Its row in `pgbus.consumers` (and the claimer's own flag): awake, so publishers
    /// do not notify it.
    pub awake: bool,
    /// A pending wake-up (tokio `Notify` permit): the next wait returns at once.
    pub permit: bool,
    /// A notification sent and not yet read by the listener.
    pub in_flight: bool,
    /// The listener is connected (LISTENing).
    pub listening: bool,
}

/// A state of the model.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    /// The publishers, one event each.
    pub publishers: Vec<Publisher>,
    /// Whether each publisher's event has been claimed.
    pub claimed: Vec<bool>,
    /// The consumers.
    pub consumers: Vec<Consumer>,
}

/// A step of one publisher or one consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Publisher inserts its event.
    Publish(usize),
    /// Publisher's deferred check (takes the wake lock shared, reads the flags).
    Check(usize),
    /// Publisher takes the wake lock after reading (control only).
    TakeWakeLock(usize),
    /// Publisher commits.
    Commit(usize),
    /// Publisher rolls back.
    Abort(usize),
    /// Consumer's listener reads a notification.
    Deliver(usize),
    /// Consumer's listener loses its connection.
    DropListener(usize),
    /// Consumer's listener reconnects.
    Reconnect(usize),
    /// Consumer claims; `marks_awake`: the batch was large enough to mark it awake.
    Claim {
        /// The consumer.
        consumer: usize,
        /// The claim marks the consumer awake.
        marks_awake: bool,
    },
    /// Consumer lingers awake and claims again.
    Linger(usize),
    /// Consumer marks itself asleep.
    FallAsleep(usize),
    /// Consumer's wait ends on a wake-up permit.
    Wake(usize),
    /// Consumer's wait ends on the poll timer.
    Poll(usize),
}

/// The wake-up model and its switches. [`WakeModel::as_built`] is pgbus today; each
/// switch off is a negative control.
#[derive(Clone, Debug)]
pub struct WakeModel {
    /// One event per publisher, in this isolation level.
    pub publishers: Vec<Isolation>,
    /// How many consumers (running buses).
    pub consumers: usize,
    /// Publishers take the wake lock shared and the sleep mark takes it exclusively.
    pub wake_lock: bool,
    /// The check reads the flags before taking the wake lock (a stale read; control).
    pub read_before_lock: bool,
    /// The consumer claims once more right after its sleep mark.
    pub claim_after_mark: bool,
    /// A reconnected listener wakes its claimer to catch up.
    pub catch_up_on_reconnect: bool,
}

impl WakeModel {
    /// pgbus as built: two READ COMMITTED publishers and one REPEATABLE READ, two buses.
    pub fn as_built() -> Self {
        WakeModel {
            publishers: vec![
                Isolation::ReadCommitted,
                Isolation::ReadCommitted,
                Isolation::RepeatableRead,
            ],
            consumers: 2,
            wake_lock: true,
            read_before_lock: false,
            claim_after_mark: true,
            catch_up_on_reconnect: true,
        }
    }

    /// The smallest setting that shows each race: one bus, two READ COMMITTED
    /// publishers (the negative controls use it, for short counterexamples).
    pub fn small() -> Self {
        WakeModel {
            publishers: vec![Isolation::ReadCommitted, Isolation::ReadCommitted],
            consumers: 1,
            ..WakeModel::as_built()
        }
    }

    fn lock_held_shared(&self, state: &State) -> bool {
        self.wake_lock
            && state
                .publishers
                .iter()
                .any(|p| matches!(p, Publisher::Checked { .. }))
    }

    fn flags_say_notify(&self, state: &State, isolation: Isolation) -> bool {
        isolation == Isolation::RepeatableRead || state.consumers.iter().any(|c| !c.awake)
    }
}

/// An event waits for the poll: it committed, nobody claimed it, and no consumer will
/// claim before the poll.
pub fn waits_for_the_poll(state: &State) -> bool {
    let unclaimed = state
        .publishers
        .iter()
        .zip(&state.claimed)
        .any(|(p, claimed)| matches!(p, Publisher::Committed { .. }) && !claimed);
    unclaimed
        && state
            .consumers
            .iter()
            .all(|c| c.phase == Phase::Wait && !c.permit && !c.in_flight && c.listening)
}

impl Model for WakeModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            publishers: vec![Publisher::Idle; self.publishers.len()],
            claimed: vec![false; self.publishers.len()],
            // A starting bus registers asleep and claims once.
            consumers: vec![
                Consumer {
                    phase: Phase::Claim,
                    awake: false,
                    permit: false,
                    in_flight: false,
                    listening: true,
                };
                self.consumers
            ],
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for (i, p) in state.publishers.iter().enumerate() {
            match p {
                Publisher::Idle => actions.push(Action::Publish(i)),
                Publisher::Open => {
                    actions.push(Action::Check(i));
                    actions.push(Action::Abort(i));
                }
                Publisher::ReadFlags { .. } => {
                    actions.push(Action::TakeWakeLock(i));
                    actions.push(Action::Abort(i));
                }
                Publisher::Checked { .. } => {
                    actions.push(Action::Commit(i));
                    actions.push(Action::Abort(i));
                }
                Publisher::Committed { .. } | Publisher::Aborted => {}
            }
        }
        for (c, consumer) in state.consumers.iter().enumerate() {
            if consumer.in_flight && consumer.listening {
                actions.push(Action::Deliver(c));
            }
            if consumer.listening {
                actions.push(Action::DropListener(c));
            } else {
                actions.push(Action::Reconnect(c));
            }
            match consumer.phase {
                Phase::Claim => {
                    actions.push(Action::Claim {
                        consumer: c,
                        marks_awake: false,
                    });
                    actions.push(Action::Claim {
                        consumer: c,
                        marks_awake: true,
                    });
                }
                Phase::Linger => {
                    actions.push(Action::Linger(c));
                    if !self.lock_held_shared(state) {
                        actions.push(Action::FallAsleep(c));
                    }
                }
                Phase::Wait => {
                    if consumer.permit {
                        actions.push(Action::Wake(c));
                    }
                    actions.push(Action::Poll(c));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Publish(i) => s.publishers[i] = Publisher::Open,
            Action::Check(i) => {
                let notify = self.flags_say_notify(last, self.publishers[i]);
                s.publishers[i] = if self.read_before_lock {
                    Publisher::ReadFlags { notify }
                } else {
                    Publisher::Checked { notify }
                };
            }
            Action::TakeWakeLock(i) => {
                let Publisher::ReadFlags { notify } = last.publishers[i] else {
                    return None;
                };
                // The exclusive holder (a sleep mark) is atomic in this model, so the
                // shared lock is always granted here.
                s.publishers[i] = Publisher::Checked { notify };
            }
            Action::Commit(i) => {
                let Publisher::Checked { notify } = last.publishers[i] else {
                    return None;
                };
                s.publishers[i] = Publisher::Committed { notified: notify };
                if notify {
                    for c in s.consumers.iter_mut().filter(|c| c.listening) {
                        c.in_flight = true;
                    }
                }
            }
            Action::Abort(i) => s.publishers[i] = Publisher::Aborted,
            Action::Deliver(c) => {
                s.consumers[c].in_flight = false;
                s.consumers[c].permit = true;
            }
            Action::DropListener(c) => {
                s.consumers[c].listening = false;
                s.consumers[c].in_flight = false;
            }
            Action::Reconnect(c) => {
                s.consumers[c].listening = true;
                if self.catch_up_on_reconnect {
                    s.consumers[c].permit = true;
                }
            }
            Action::Claim {
                consumer,
                marks_awake,
            } => {
                let mut took = false;
                for (i, p) in last.publishers.iter().enumerate() {
                    if matches!(p, Publisher::Committed { .. }) && !last.claimed[i] {
                        s.claimed[i] = true;
                        took = true;
                    }
                }
                if marks_awake && !took {
                    return None;
                }
                let c = &mut s.consumers[consumer];
                c.awake |= marks_awake;
                c.phase = if c.awake { Phase::Linger } else { Phase::Wait };
            }
            Action::Linger(c) => s.consumers[c].phase = Phase::Claim,
            Action::FallAsleep(c) => {
                let consumer = &mut s.consumers[c];
                consumer.awake = false;
                consumer.phase = if self.claim_after_mark {
                    Phase::Claim
                } else {
                    Phase::Wait
                };
            }
            Action::Wake(c) => {
                s.consumers[c].permit = false;
                s.consumers[c].phase = Phase::Claim;
            }
            Action::Poll(c) => s.consumers[c].phase = Phase::Claim,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no event waits for the poll", |_, s: &State| {
                !waits_for_the_poll(s)
            }),
            Property::sometimes("a commit sends no notification", |_, s: &State| {
                s.publishers
                    .contains(&Publisher::Committed { notified: false })
            }),
            Property::sometimes(
                "a notification wakes a sleeping consumer",
                |_, s: &State| {
                    s.consumers
                        .iter()
                        .any(|c| c.phase == Phase::Wait && c.permit)
                },
            ),
            Property::sometimes("every event is claimed", |_, s: &State| {
                s.claimed.iter().all(|c| *c)
            }),
        ]
    }
}
