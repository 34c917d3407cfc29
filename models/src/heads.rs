//! Per-key heads of an ordered subscription, as built (`docs/ARCHITECTURE.md`, "Ordered
//! subscriptions", "Heads in every isolation level", "Changing a subscription's settings").
//!
//! Each delivery of an ordered subscription carries its key, a position and a head flag;
//! only a pending head can be claimed, so a key's deliveries run one at a time. The model
//! has one subscription and one key; each publisher publishes one event with that key.
//! What each action stands for:
//!
//! - [`Action::Insert`]: the publisher's `INSERT` into `pgbus.events` runs the fan-out
//!   (`pgbus.fan_out`), which takes the configuration lock shared (`pgbus.lock_config`,
//!   held to the end of the transaction) and reads whether the subscription is ordered; a
//!   REPEATABLE READ transaction's snapshot is taken here. Ordering off: the delivery is a
//!   keyless head, decided at once.
//! - [`Action::LockAndDecide`]: the fan-out takes the key lock (`pgbus.lock_keys`, held to
//!   the end of the transaction), draws the position (`nextval('pgbus.key_pos_seq')`) and
//!   decides the head in a statement after the lock: under READ COMMITTED from a fresh
//!   snapshot, under REPEATABLE READ by the immediate one-head check, which reads the
//!   latest committed rows. Both read the key as it is now, under the lock.
//! - [`Action::Commit`]: the deferred one-head exclusion constraint
//!   (`deliveries_one_head`) is checked; a second head makes the commit fail.
//! - [`Action::Claim`]: `pgbus.claim` takes a pending head (no key lock).
//! - [`Action::Fail`]: a settlement (`pgbus.settle`) of a failure with attempts left: the
//!   head backs off and stays the head.
//! - [`Action::SettleLock`] then [`Action::SettleApply`]: `pgbus.settle` (or `pgbus.reap`
//!   for an expired lease) locks the key, then in one statement completes the head
//!   (`Ack`), or dead-letters it (`DieBlock`: it stays the head, its key waits for an
//!   operator; `DieSkip`: it stops being the head), promoting the key's next pending
//!   delivery (lowest position, `pgbus.next_of_key`) when the head left.
//! - [`Action::SkipLock`] / [`Action::SkipApply`]: `pgbus.skip_dead_head`.
//! - [`Action::Redrive`]: `REDRIVE_HEAD` (`ordering::redrive_head`): a dead head is
//!   pending again (one statement, no key lock).
//! - [`Action::RetryDead`], then [`Action::EnsureLock`] / [`Action::EnsureApply`]:
//!   `admin::retry_dead_letters`: `DEAD_RETRY` (one statement, no key lock) puts every
//!   dead letter back to pending, then `pgbus.ensure_heads` (a second statement) gives a
//!   key that has none a head.
//! - [`Action::PurgeRead`], [`Action::PurgeLock`], [`Action::PurgeApply`]:
//!   `pgbus.purge_dead`: reads which keys have dead heads, locks those keys, then in one
//!   statement deletes the dead letters and promotes the next delivery of each key whose
//!   head it deleted.
//! - [`Action::Switch`]: `pgbus.configure_subscription` turning ordering off or on: it
//!   takes the configuration lock exclusively (so it runs between every other
//!   transaction that holds it shared) and converts the backlog.
//!
//! Abstracted away: leases, attempts and timing (a failure may always be retried, a head
//! may always die), several keys and subscriptions (keys are independent: each has its own
//! lock and its own rows), batches (a settlement of many deliveries is many of these
//! steps under the same locks), the repair check (`pgbus.promote_orphans`: the property
//! must hold without it). The key lock and the configuration lock are abstract: any lock
//! held to the end of the transaction fits.
//!
//! Properties: a key never has two heads; a key with pending deliveries always has a head
//! (except between `DEAD_RETRY` and its `ensure_heads`, two statements of one operator
//! call); at most one delivery of the key is processing at a time; and a key's deliveries
//! are first claimed in the order their publishers committed (for events published and
//! claimed while ordering stayed on, and never skipped).

use stateright::{Model, Property};

/// A transaction's isolation level.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Isolation {
    /// READ COMMITTED: each statement has a fresh snapshot.
    ReadCommitted,
    /// REPEATABLE READ (or SERIALIZABLE): one snapshot, taken at the first statement.
    RepeatableRead,
}

/// A delivery's status.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Status {
    /// Waiting to be claimed (when it is the head).
    Pending,
    /// Claimed by a worker.
    Processing,
    /// A dead letter.
    Dead,
    /// Completed and deleted.
    Done,
    /// Purged (deleted as a dead letter).
    Purged,
}

/// A committed delivery of one publisher's event.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Delivery {
    /// Its status.
    pub status: Status,
    /// It is the head of its key (or, keyless, claimable).
    pub head: bool,
    /// It belongs to the key (ordering on when it was filed).
    pub keyed: bool,
    /// Its position in the key (`key_pos`).
    pub pos: u8,
    /// The event's `seq` (insert order).
    pub seq: u8,
    /// Its publisher's place in commit order.
    pub commit: u8,
    /// The ordering epoch it was published in (each switch starts a new one).
    pub epoch: u8,
    /// Its place in the order of first claims, when first claimed as a keyed delivery
    /// in the epoch it was published in.
    pub claim: Option<u8>,
    /// It was dead and skipped at some point (its order is no longer promised).
    pub skipped: bool,
}

impl Delivery {
    fn live(&self) -> bool {
        !matches!(self.status, Status::Done | Status::Purged)
    }
}

/// Where a publishing transaction is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Publisher {
    /// Not started.
    Idle,
    /// Inserted its event; holds the configuration lock shared.
    Inserted {
        /// The subscription was ordered.
        keyed: bool,
        /// The event's seq.
        seq: u8,
        /// Its snapshot (REPEATABLE READ) showed the key with a head.
        snapshot_head: bool,
        /// The position, when drawn before the key lock (control).
        early_pos: Option<u8>,
    },
    /// Decided its delivery (holds the key lock if keyed).
    Decided {
        /// Keyed.
        keyed: bool,
        /// The event's seq.
        seq: u8,
        /// Head.
        head: bool,
        /// Position.
        pos: u8,
    },
    /// Committed.
    Committed,
    /// Rolled back (or failed the one-head check at commit).
    Aborted,
}

/// Who holds the key lock.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Holder {
    /// A publisher.
    Publisher(u8),
    /// The settling worker.
    Settler,
    /// The operator.
    Operator,
}

/// What a settlement does to the head it settles.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Settle {
    /// Completed: deleted, the next promoted.
    Ack,
    /// Dead under `DeadHeadPolicy::Block`: it stays the head.
    DieBlock,
    /// Dead under `DeadHeadPolicy::Skip`: it stops being the head, the next is promoted.
    DieSkip,
}

/// Where the operator's call is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Operator {
    /// No call under way.
    Idle,
    /// `skip_dead_head` holds the key lock.
    SkipLocked,
    /// `DEAD_RETRY` committed; `ensure_heads` not yet run.
    EnsurePending,
    /// `ensure_heads` holds the key lock.
    EnsureLocked,
    /// `purge_dead` read whether the key has a dead head.
    PurgeRead {
        /// It saw a dead head, so it will lock the key.
        lock: bool,
    },
    /// `purge_dead` took the locks it decided to take.
    PurgeLocked {
        /// It holds the key lock.
        locked: bool,
    },
}

/// Which `pgbus.purge_dead` the model runs.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Purge {
    /// Migration 5's: locks the keys of the dead heads its first statement saw, then
    /// deletes every dead letter, including a head that died since, under no lock.
    Migration5,
    /// Migration 15's: deletes a dead head only under its key's lock (a head that died
    /// after the locks were taken stays for the next purge).
    Migration15,
}

/// A state of the model.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    /// The publishers, one event each.
    pub publishers: Vec<Publisher>,
    /// Each publisher's committed delivery.
    pub deliveries: Vec<Option<Delivery>>,
    /// The subscription is ordered.
    pub ordered: bool,
    /// Ordering switches so far (the epoch).
    pub epoch: u8,
    /// The key lock's holder.
    pub key_lock: Option<Holder>,
    /// The worker's settlement under way: the delivery and what it does.
    pub settler: Option<(u8, Settle)>,
    /// The operator's call under way.
    pub operator: Operator,
    /// Counters: next seq, next position, commits, first claims.
    pub next_seq: u8,
    /// Next position (`key_pos_seq`).
    pub next_pos: u8,
    /// Commits so far.
    pub commits: u8,
    /// First claims so far.
    pub claims: u8,
}

/// A step of one publisher, the worker, the operator or the configuration change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Publisher inserts its event (fan-out begins).
    Insert(usize),
    /// Publisher's fan-out locks the key and decides the head.
    LockAndDecide(usize),
    /// Publisher commits.
    Commit(usize),
    /// Publisher rolls back.
    Abort(usize),
    /// Worker claims this pending head.
    Claim(usize),
    /// Worker's failure with attempts left: back to pending, still the head.
    Fail(usize),
    /// Worker's settlement locks the key.
    SettleLock(usize, Settle),
    /// Worker's settlement statement runs and commits.
    SettleApply,
    /// Operator's `skip_dead_head` locks the key.
    SkipLock,
    /// ... and skips a dead head.
    SkipApply,
    /// Operator's `redrive_head`.
    Redrive,
    /// Operator's `DEAD_RETRY`.
    RetryDead,
    /// Operator's `ensure_heads` locks the key.
    EnsureLock,
    /// ... and gives the key a head if it has none.
    EnsureApply,
    /// Operator's `purge_dead`: the first statement.
    PurgeRead,
    /// ... takes the key locks it decided on.
    PurgeLock,
    /// ... deletes the dead letters and promotes.
    PurgeApply,
    /// `configure_subscription` turns ordering on or off.
    Switch,
}

/// The heads model and its switches. [`HeadsModel::as_built`] is pgbus with migration 15;
/// each switch off is a negative control.
#[derive(Clone, Debug)]
pub struct HeadsModel {
    /// One keyed event per publisher, in this isolation level.
    pub publishers: Vec<Isolation>,
    /// How many times the ordering may be switched.
    pub switches: u8,
    /// Publishers take the key lock before deciding heads.
    pub key_lock_on_publish: bool,
    /// A REPEATABLE READ publisher decides its head from its own snapshot (control).
    pub head_from_snapshot: bool,
    /// The deferred one-head exclusion constraint.
    pub one_head_constraint: bool,
    /// The position is drawn at the insert, before the key lock (control).
    pub pos_before_lock: bool,
    /// Which purge.
    pub purge: Purge,
    /// The operator's actions are in the model.
    pub operator: bool,
}

impl HeadsModel {
    /// pgbus with migration 15: two publishers (READ COMMITTED and REPEATABLE READ), the
    /// worker, the operator, and two switches of the ordering (off, then on again).
    pub fn as_built() -> Self {
        HeadsModel {
            publishers: vec![Isolation::ReadCommitted, Isolation::RepeatableRead],
            switches: 2,
            key_lock_on_publish: true,
            head_from_snapshot: false,
            one_head_constraint: true,
            pos_before_lock: false,
            purge: Purge::Migration15,
            operator: true,
        }
    }

    fn config_shared_held(&self, s: &State) -> bool {
        s.settler.is_some()
            || !matches!(s.operator, Operator::Idle | Operator::EnsurePending)
            || s.publishers
                .iter()
                .any(|p| matches!(p, Publisher::Inserted { .. } | Publisher::Decided { .. }))
    }
}

fn key_has_head(s: &State) -> bool {
    s.deliveries
        .iter()
        .flatten()
        .any(|d| d.live() && d.keyed && d.head)
}

/// The key's next pending delivery becomes the head (`pgbus.next_of_key`: lowest
/// position, then seq).
fn promote(s: &mut State) {
    let next = s
        .deliveries
        .iter()
        .enumerate()
        .filter_map(|(i, d)| d.map(|d| (i, d)))
        .filter(|(_, d)| d.keyed && !d.head && d.status == Status::Pending)
        .min_by_key(|(_, d)| (d.pos, d.seq))
        .map(|(i, _)| i);
    if let Some(i) = next
        && let Some(d) = s.deliveries[i].as_mut()
    {
        d.head = true;
    }
}

fn release(s: &mut State, holder: Holder) {
    if s.key_lock == Some(holder) {
        s.key_lock = None;
    }
}

/// The key has a pending delivery and no head.
pub fn orphaned(s: &State) -> bool {
    let pending = s
        .deliveries
        .iter()
        .flatten()
        .any(|d| d.keyed && d.status == Status::Pending);
    let retry_under_way = matches!(s.operator, Operator::EnsurePending | Operator::EnsureLocked);
    pending && !key_has_head(s) && !retry_under_way
}

/// The key has two heads.
pub fn two_heads(s: &State) -> bool {
    s.deliveries
        .iter()
        .flatten()
        .filter(|d| d.live() && d.keyed && d.head)
        .count()
        > 1
}

/// Two of the key's deliveries are processing at once.
pub fn two_processing(s: &State) -> bool {
    s.deliveries
        .iter()
        .flatten()
        .filter(|d| d.keyed && d.status == Status::Processing)
        .count()
        > 1
}

/// A delivery was first claimed before one of the same epoch whose publisher committed
/// earlier.
pub fn out_of_order(s: &State) -> bool {
    let ordered: Vec<&Delivery> = s
        .deliveries
        .iter()
        .flatten()
        .filter(|d| d.keyed && !d.skipped)
        .collect();
    ordered.iter().any(|b| {
        let Some(b_claim) = b.claim else { return false };
        ordered.iter().any(|a| {
            a.epoch == b.epoch && a.commit < b.commit && a.claim.is_none_or(|c| c > b_claim)
        })
    })
}

impl Model for HeadsModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            publishers: vec![Publisher::Idle; self.publishers.len()],
            deliveries: vec![None; self.publishers.len()],
            ordered: true,
            epoch: 0,
            key_lock: None,
            settler: None,
            operator: Operator::Idle,
            next_seq: 0,
            next_pos: 0,
            commits: 0,
            claims: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let lock_free = s.key_lock.is_none();
        for (i, p) in s.publishers.iter().enumerate() {
            match p {
                Publisher::Idle => actions.push(Action::Insert(i)),
                Publisher::Inserted { .. } => {
                    if lock_free || !self.key_lock_on_publish {
                        actions.push(Action::LockAndDecide(i));
                    }
                    actions.push(Action::Abort(i));
                }
                Publisher::Decided { .. } => {
                    actions.push(Action::Commit(i));
                    actions.push(Action::Abort(i));
                }
                Publisher::Committed | Publisher::Aborted => {}
            }
        }
        for (i, d) in s.deliveries.iter().enumerate() {
            let Some(d) = d else { continue };
            if d.status == Status::Pending && d.head {
                actions.push(Action::Claim(i));
            }
            if d.status == Status::Processing && s.settler.is_none() && (lock_free || !d.keyed) {
                actions.push(Action::Fail(i));
                actions.push(Action::SettleLock(i, Settle::Ack));
                actions.push(Action::SettleLock(i, Settle::DieBlock));
                actions.push(Action::SettleLock(i, Settle::DieSkip));
            }
        }
        if s.settler.is_some() {
            actions.push(Action::SettleApply);
        }
        if self.operator {
            match s.operator {
                Operator::Idle => {
                    if lock_free {
                        actions.push(Action::SkipLock);
                    }
                    actions.push(Action::Redrive);
                    actions.push(Action::RetryDead);
                    actions.push(Action::PurgeRead);
                }
                Operator::SkipLocked => actions.push(Action::SkipApply),
                Operator::EnsurePending => {
                    if lock_free {
                        actions.push(Action::EnsureLock);
                    }
                }
                Operator::EnsureLocked => actions.push(Action::EnsureApply),
                Operator::PurgeRead { lock } => {
                    if lock_free || !lock {
                        actions.push(Action::PurgeLock);
                    }
                }
                Operator::PurgeLocked { .. } => actions.push(Action::PurgeApply),
            }
        }
        if s.epoch < self.switches && !self.config_shared_held(s) {
            actions.push(Action::Switch);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Insert(i) => {
                let seq = s.next_seq;
                s.next_seq += 1;
                s.publishers[i] = if s.ordered {
                    let early_pos = self.pos_before_lock.then(|| {
                        s.next_pos += 1;
                        s.next_pos - 1
                    });
                    Publisher::Inserted {
                        keyed: true,
                        seq,
                        snapshot_head: key_has_head(last),
                        early_pos,
                    }
                } else {
                    Publisher::Decided {
                        keyed: false,
                        seq,
                        head: true,
                        pos: 0,
                    }
                };
            }
            Action::LockAndDecide(i) => {
                let Publisher::Inserted {
                    keyed,
                    seq,
                    snapshot_head,
                    early_pos,
                } = last.publishers[i]
                else {
                    return None;
                };
                if self.key_lock_on_publish {
                    s.key_lock = Some(Holder::Publisher(i as u8));
                }
                let sees_head =
                    if self.head_from_snapshot && self.publishers[i] == Isolation::RepeatableRead {
                        snapshot_head
                    } else {
                        key_has_head(last)
                    };
                let pos = early_pos.unwrap_or_else(|| {
                    s.next_pos += 1;
                    s.next_pos - 1
                });
                s.publishers[i] = Publisher::Decided {
                    keyed,
                    seq,
                    head: !sees_head,
                    pos,
                };
            }
            Action::Commit(i) => {
                let Publisher::Decided {
                    keyed,
                    seq,
                    head,
                    pos,
                } = last.publishers[i]
                else {
                    return None;
                };
                release(&mut s, Holder::Publisher(i as u8));
                if self.one_head_constraint && keyed && head && key_has_head(last) {
                    s.publishers[i] = Publisher::Aborted;
                    return Some(s);
                }
                s.publishers[i] = Publisher::Committed;
                s.deliveries[i] = Some(Delivery {
                    status: Status::Pending,
                    head,
                    keyed,
                    pos,
                    seq,
                    commit: s.commits,
                    epoch: s.epoch,
                    claim: None,
                    skipped: false,
                });
                s.commits += 1;
            }
            Action::Abort(i) => {
                release(&mut s, Holder::Publisher(i as u8));
                s.publishers[i] = Publisher::Aborted;
            }
            Action::Claim(i) => {
                let epoch = s.epoch;
                let claims = s.claims;
                let d = s.deliveries[i].as_mut()?;
                d.status = Status::Processing;
                if d.keyed && d.epoch == epoch && d.claim.is_none() {
                    d.claim = Some(claims);
                    s.claims += 1;
                }
            }
            Action::Fail(i) => s.deliveries[i].as_mut()?.status = Status::Pending,
            Action::SettleLock(i, kind) => {
                if last.deliveries[i]?.keyed {
                    s.key_lock = Some(Holder::Settler);
                }
                s.settler = Some((i as u8, kind));
            }
            Action::SettleApply => {
                let (i, kind) = last.settler?;
                let d = s.deliveries[i as usize].as_mut()?;
                let vacated = d.keyed && d.head && kind != Settle::DieBlock;
                match kind {
                    Settle::Ack => d.status = Status::Done,
                    Settle::DieBlock => d.status = Status::Dead,
                    Settle::DieSkip => {
                        d.status = Status::Dead;
                        if d.keyed {
                            d.head = false;
                            d.skipped = true;
                        }
                    }
                }
                if vacated {
                    promote(&mut s);
                }
                s.settler = None;
                release(&mut s, Holder::Settler);
            }
            Action::SkipLock => {
                s.key_lock = Some(Holder::Operator);
                s.operator = Operator::SkipLocked;
            }
            Action::SkipApply => {
                let dead_head = s
                    .deliveries
                    .iter_mut()
                    .flatten()
                    .find(|d| d.keyed && d.head && d.status == Status::Dead);
                if let Some(d) = dead_head {
                    d.head = false;
                    d.skipped = true;
                    promote(&mut s);
                }
                s.operator = Operator::Idle;
                release(&mut s, Holder::Operator);
            }
            Action::Redrive => {
                let d = s
                    .deliveries
                    .iter_mut()
                    .flatten()
                    .find(|d| d.keyed && d.head && d.status == Status::Dead)?;
                d.status = Status::Pending;
            }
            Action::RetryDead => {
                let mut any = false;
                let mut skipped_keyed = false;
                for d in s.deliveries.iter_mut().flatten() {
                    if d.status == Status::Dead {
                        any = true;
                        skipped_keyed |= d.keyed && !d.head;
                        d.status = Status::Pending;
                    }
                }
                if !any {
                    return None;
                }
                if skipped_keyed {
                    s.operator = Operator::EnsurePending;
                }
            }
            Action::EnsureLock => {
                s.key_lock = Some(Holder::Operator);
                s.operator = Operator::EnsureLocked;
            }
            Action::EnsureApply => {
                if !key_has_head(&s) {
                    promote(&mut s);
                }
                s.operator = Operator::Idle;
                release(&mut s, Holder::Operator);
            }
            Action::PurgeRead => {
                let lock = s
                    .deliveries
                    .iter()
                    .flatten()
                    .any(|d| d.keyed && d.head && d.status == Status::Dead);
                s.operator = Operator::PurgeRead { lock };
            }
            Action::PurgeLock => {
                let Operator::PurgeRead { lock } = last.operator else {
                    return None;
                };
                if lock {
                    s.key_lock = Some(Holder::Operator);
                }
                s.operator = Operator::PurgeLocked { locked: lock };
            }
            Action::PurgeApply => {
                let Operator::PurgeLocked { locked } = last.operator else {
                    return None;
                };
                let mut vacated = false;
                for d in s.deliveries.iter_mut().flatten() {
                    if d.status != Status::Dead {
                        continue;
                    }
                    let keyed_head = d.keyed && d.head;
                    if keyed_head && !locked && self.purge == Purge::Migration15 {
                        continue; // a head that died after the locks: left for the next purge
                    }
                    d.status = Status::Purged;
                    vacated |= keyed_head;
                }
                if vacated {
                    promote(&mut s);
                }
                s.operator = Operator::Idle;
                release(&mut s, Holder::Operator);
            }
            Action::Switch => {
                s.epoch += 1;
                s.ordered = !s.ordered;
                if s.ordered {
                    // Ordering on: waiting deliveries join the key at position 0 in event
                    // order, the oldest pending is the head, dead letters are skipped;
                    // processing ones stay outside the key.
                    let oldest = s
                        .deliveries
                        .iter()
                        .flatten()
                        .filter(|d| d.status == Status::Pending)
                        .map(|d| d.seq)
                        .min();
                    for d in s.deliveries.iter_mut().flatten() {
                        if !d.live() || d.status == Status::Processing {
                            continue;
                        }
                        d.keyed = true;
                        d.pos = 0;
                        d.head = d.status == Status::Pending && Some(d.seq) == oldest;
                        d.skipped |= d.status == Status::Dead;
                    }
                } else {
                    for d in s.deliveries.iter_mut().flatten() {
                        if d.live() {
                            d.keyed = false;
                            d.head = true;
                        }
                    }
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("no key has two heads", |_, s: &State| !two_heads(s)),
            Property::always(
                "a key with pending deliveries has a head",
                |_, s: &State| !orphaned(s),
            ),
            Property::always("a key's deliveries run one at a time", |_, s: &State| {
                !two_processing(s)
            }),
            Property::always("per-key delivery order is commit order", |_, s: &State| {
                !out_of_order(s)
            }),
            Property::sometimes("every event is delivered in order", |_, s: &State| {
                s.deliveries
                    .iter()
                    .all(|d| d.is_some_and(|d| d.status == Status::Done && d.claim.is_some()))
            }),
        ];
        if self.operator {
            properties.push(Property::sometimes(
                "a purge hands the head on",
                |_, s: &State| {
                    s.operator == Operator::Idle
                        && s.deliveries
                            .iter()
                            .flatten()
                            .any(|d| d.status == Status::Purged)
                        && s.deliveries
                            .iter()
                            .flatten()
                            .any(|d| d.keyed && d.head && d.status == Status::Pending)
                },
            ));
        }
        if self.switches >= 2 {
            properties.push(Property::sometimes(
                "ordering switched off and on again",
                |_, s: &State| s.epoch >= 2 && s.deliveries.iter().flatten().any(|d| d.keyed),
            ));
        }
        properties
    }
}
