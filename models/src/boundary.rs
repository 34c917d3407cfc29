//! The batch boundary of the log-first publish: designed, not yet built (the shared
//! design, "Where the design goes next: the log-first publish"; `docs/ARCHITECTURE.md`,
//! "Model-checked protocols").
//!
//! In the log-first design a publish writes only its event; a bus process later cuts a
//! batch, the events whose transactions finished since the last batch, and writes their
//! deliveries in one statement. The boundary between batches is a pair of snapshots (as
//! PgQ does): a batch is the events visible in the new snapshot and not in the previous
//! one, whose value (the cursor) the batch records. What each action stands for:
//!
//! - [`Action::Begin`]: a publishing transaction starts; under REPEATABLE READ its
//!   snapshot is taken here.
//! - [`Action::Insert`]: it inserts its event into `pgbus.events`; the event gets its `seq`
//!   and the transaction its xid (the model uses one number for both: either is drawn
//!   at the insert, in an order unrelated to commit order).
//! - [`Action::LockKey`]: the insert's trigger takes the event's key lock (held to the end
//!   of the transaction) and draws the event's position in its key after the lock, from a
//!   sequence, so that positions of one key follow the order in which publishers held the
//!   key, which is their commit order.
//! - [`Action::Commit`] / [`Action::Abort`]: the publisher's transaction ends.
//! - [`Action::CutBegin`]: a cutter's transaction starts (REPEATABLE READ: its snapshot).
//! - [`Action::CutLock`]: it locks the cursor row (`SELECT ... FOR UPDATE`) and reads the
//!   previous boundary; under REPEATABLE READ a cursor changed since the snapshot is a
//!   serialization failure (the cutter starts over).
//! - [`Action::CutSnapshot`]: it takes the new boundary (`pg_current_snapshot()`, which
//!   returns the active snapshot: under REPEATABLE READ the transaction's, the one its
//!   insert reads with; a boundary fresher than that would pass events the insert cannot
//!   see, a control).
//! - [`Action::CutInsert`]: one statement writes the deliveries of the events between the
//!   two boundaries (`pg_visible_in_snapshot`), ordered by key position.
//! - [`Action::CutCommit`]: it writes the new boundary into the cursor row and commits.
//! - [`Action::CutCrash`]: the cutter's process dies between any two steps: its
//!   transaction rolls back, its locks go.
//! - [`Action::Complete`]: a handler completes the event's delivery (deleted).
//! - [`Action::Sweep`]: the retention sweep deletes an event that no delivery refers to
//!   and that the cursor has passed (retention time is abstracted away: it may be 0).
//!
//! The controls replace the boundary by a `seq` high-water mark (which passes events
//! whose transactions are still open: they are skipped) or by the oldest open xid (which
//! holds back every event behind one open transaction), write the cursor in a second
//! transaction, read it without the lock, draw positions without the key lock or from a
//! REPEATABLE READ snapshot, and sweep without looking at the cursor.
//!
//! Abstracted away: subscriptions and patterns (every event matches one subscription),
//! claims (a delivery is written, then completed), the wrap-around of xids, time.
//! Properties, checked in every reachable state: an event becomes deliveries exactly once
//! and only after it committed; no committed event is ever behind the boundary without
//! its deliveries (an event open at a cut is taken by a later batch); a batch takes every
//! event committed before its snapshot, so an open transaction holds back nothing but its
//! own event (the bounded form of the liveness promise); per-key delivery order is commit
//! order; the sweep removes nothing still needed.

use stateright::{Model, Property};

/// A transaction's isolation level.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Isolation {
    /// READ COMMITTED: each statement sees what committed before it.
    ReadCommitted,
    /// REPEATABLE READ: one snapshot, taken at the first statement.
    RepeatableRead,
}

/// How a cut decides which events a batch takes.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Boundary {
    /// The design: events visible in the new snapshot and not in the previous one.
    Snapshots,
    /// Control: events with a `seq` above the last batch's highest and up to the highest
    /// committed one now. Passes transactions still open.
    SeqHighWater,
    /// Control: events whose xid is below the oldest transaction still open. Never
    /// passes an open transaction, but waits for it.
    OldestOpen,
}

/// Where an event's position in its key comes from.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Position {
    /// The design: a sequence read after the key lock.
    SequenceAfterKeyLock,
    /// Control: the event's `seq`, with no key lock.
    Seq,
    /// Control: one more than the key's highest position the publisher's snapshot shows,
    /// after the key lock (right under READ COMMITTED, stale under REPEATABLE READ).
    SnapshotMax,
}

/// A set of publishers (bit `i`: publisher `i`), e.g. those committed in a snapshot.
pub type Mask = u8;

/// Where a publishing transaction is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Phase {
    /// Not started.
    Idle,
    /// Started (a REPEATABLE READ snapshot is taken).
    Open,
    /// Inserted its event.
    Inserted,
    /// Holds its key lock and has its position.
    Locked,
    /// Committed.
    Committed,
    /// Rolled back.
    Aborted,
}

/// One publisher and its event.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Publisher {
    /// Where its transaction is.
    pub phase: Phase,
    /// Its snapshot (REPEATABLE READ): the publishers committed at its first statement.
    pub snapshot: Mask,
    /// The event's seq (and the transaction's xid).
    pub seq: u8,
    /// The event's position in its key.
    pub pos: u8,
    /// Its place in commit order.
    pub commit: u8,
    /// Deliveries committed for the event (2 stands for two or more).
    pub delivered: u8,
    /// Its delivery was completed.
    pub completed: bool,
    /// The sweep deleted the event.
    pub swept: bool,
}

/// Where a cutter is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Cutter {
    /// Not cutting.
    Idle,
    /// Its transaction started.
    Begun {
        /// Its snapshot (REPEATABLE READ) of committed publishers.
        snapshot: Mask,
        /// The cursor its snapshot shows.
        cursor_seen: u8,
        /// The boundary as of its snapshot.
        boundary_then: u8,
    },
    /// Holds the cursor (lock) and read the previous boundary.
    Locked {
        /// Its snapshot.
        snapshot: Mask,
        /// The boundary as of its snapshot.
        boundary_then: u8,
        /// The previous boundary.
        prev: u8,
    },
    /// Took the new boundary.
    Snapped {
        /// Its snapshot.
        snapshot: Mask,
        /// The previous boundary.
        prev: u8,
        /// The new boundary.
        new: u8,
        /// The publishers committed as of the new boundary.
        committed: Mask,
    },
    /// Wrote the batch's deliveries (not committed).
    Inserted {
        /// The new boundary.
        new: u8,
        /// The publishers committed as of the new boundary.
        committed: Mask,
        /// The events the batch takes.
        batch: Mask,
    },
    /// Committed the deliveries in their own transaction; the cursor is still to be
    /// written (only with [`BoundaryModel::cursor_in_same_transaction`] off).
    CursorPending {
        /// The new boundary.
        new: u8,
    },
}

/// A state of the model.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct State {
    /// The publishers, one event each.
    pub publishers: Vec<Publisher>,
    /// The cutters.
    pub cutters: Vec<Cutter>,
    /// Holder of each key's lock.
    pub key_locks: Vec<Option<u8>>,
    /// The cursor lock's holder.
    pub cursor_lock: Option<u8>,
    /// The committed boundary (a [`Mask`], or a `seq` bound for the controls).
    pub cursor: u8,
    /// Next seq and xid.
    pub next_seq: u8,
    /// Next position (the key position sequence).
    pub next_pos: u8,
    /// Commits so far.
    pub commits: u8,
    /// Each key's events in the order their deliveries were written.
    pub delivered_order: Vec<Vec<u8>>,
    /// A batch committed without an event that had committed before its snapshot.
    pub held_back: bool,
}

/// A step of a publisher, a cutter, a handler or the sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Publisher begins.
    Begin(usize),
    /// Publisher inserts its event.
    Insert(usize),
    /// Publisher takes its key lock and position.
    LockKey(usize),
    /// Publisher commits.
    Commit(usize),
    /// Publisher rolls back.
    Abort(usize),
    /// Cutter begins.
    CutBegin(usize),
    /// Cutter locks the cursor and reads the previous boundary.
    CutLock(usize),
    /// Cutter takes the new boundary.
    CutSnapshot(usize),
    /// Cutter writes the batch's deliveries.
    CutInsert(usize),
    /// Cutter writes the cursor and commits (or, controls, commits the deliveries).
    CutCommit(usize),
    /// Cutter writes the cursor in a second transaction (control).
    CutWriteCursor(usize),
    /// Cutter crashes: its transaction rolls back.
    CutCrash(usize),
    /// A handler completes the event's delivery.
    Complete(usize),
    /// The sweep deletes the event.
    Sweep(usize),
}

/// The boundary model and its switches. [`BoundaryModel::design`] is the design; each
/// switch off is a negative control.
#[derive(Clone, Debug)]
pub struct BoundaryModel {
    /// One event per publisher: its key and the publisher's isolation level.
    pub publishers: Vec<(u8, Isolation)>,
    /// The cutters' isolation levels.
    pub cutters: Vec<Isolation>,
    /// How a batch is bounded.
    pub boundary: Boundary,
    /// Where positions come from.
    pub position: Position,
    /// The cursor is written in the batch's transaction.
    pub cursor_in_same_transaction: bool,
    /// Cutters lock the cursor row.
    pub cursor_lock: bool,
    /// The sweep keeps events the cursor has not passed.
    pub sweep_checks_cursor: bool,
    /// A REPEATABLE READ cutter takes its new boundary from a fresh snapshot rather than
    /// its transaction's (control): its insert cannot see what the boundary passes.
    pub fresh_boundary_in_repeatable_read: bool,
}

impl BoundaryModel {
    /// The design, with three publishers (two on one key, READ COMMITTED and REPEATABLE
    /// READ; one on another key) and two cutters (READ COMMITTED and REPEATABLE READ).
    pub fn design() -> Self {
        BoundaryModel {
            publishers: vec![
                (0, Isolation::ReadCommitted),
                (0, Isolation::RepeatableRead),
                (1, Isolation::ReadCommitted),
            ],
            cutters: vec![Isolation::ReadCommitted, Isolation::RepeatableRead],
            boundary: Boundary::Snapshots,
            position: Position::SequenceAfterKeyLock,
            cursor_in_same_transaction: true,
            cursor_lock: true,
            sweep_checks_cursor: true,
            fresh_boundary_in_repeatable_read: false,
        }
    }

    fn keys(&self) -> usize {
        self.publishers
            .iter()
            .map(|(k, _)| *k as usize + 1)
            .max()
            .unwrap_or(0)
    }

    fn key_locked(&self) -> bool {
        self.position != Position::Seq
    }

    /// The boundary a cut taking its snapshot now would record.
    fn boundary_now(&self, s: &State) -> u8 {
        match self.boundary {
            Boundary::Snapshots => committed(s),
            Boundary::SeqHighWater => s
                .publishers
                .iter()
                .filter(|p| p.phase == Phase::Committed)
                .map(|p| p.seq + 1)
                .max()
                .unwrap_or(0),
            Boundary::OldestOpen => s
                .publishers
                .iter()
                .filter(|p| matches!(p.phase, Phase::Inserted | Phase::Locked))
                .map(|p| p.seq)
                .min()
                .unwrap_or(s.next_seq),
        }
    }

    /// Whether a boundary has passed publisher `i`'s event.
    fn passed(&self, boundary: u8, s: &State, i: usize) -> bool {
        let p = &s.publishers[i];
        match self.boundary {
            Boundary::Snapshots => boundary & (1 << i) != 0,
            Boundary::SeqHighWater | Boundary::OldestOpen => {
                p.phase != Phase::Idle && p.phase != Phase::Open && p.seq < boundary
            }
        }
    }
}

/// The publishers committed now.
pub fn committed(s: &State) -> Mask {
    s.publishers
        .iter()
        .enumerate()
        .filter(|(_, p)| p.phase == Phase::Committed)
        .fold(0, |m, (i, _)| m | 1 << i)
}

impl Model for BoundaryModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            publishers: vec![
                Publisher {
                    phase: Phase::Idle,
                    snapshot: 0,
                    seq: 0,
                    pos: 0,
                    commit: 0,
                    delivered: 0,
                    completed: false,
                    swept: false,
                };
                self.publishers.len()
            ],
            cutters: vec![Cutter::Idle; self.cutters.len()],
            key_locks: vec![None; self.keys()],
            cursor_lock: None,
            cursor: 0,
            next_seq: 0,
            next_pos: 0,
            commits: 0,
            delivered_order: vec![Vec::new(); self.keys()],
            held_back: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (i, p) in s.publishers.iter().enumerate() {
            let key = self.publishers[i].0 as usize;
            match p.phase {
                Phase::Idle => {
                    // Under READ COMMITTED the start reads nothing: it is folded into the
                    // insert (fewer interleavings, the same behaviours).
                    if self.publishers[i].1 == Isolation::RepeatableRead {
                        actions.push(Action::Begin(i));
                    } else {
                        actions.push(Action::Insert(i));
                    }
                }
                Phase::Open => {
                    actions.push(Action::Insert(i));
                    actions.push(Action::Abort(i));
                }
                Phase::Inserted => {
                    if !self.key_locked() || s.key_locks[key].is_none() {
                        actions.push(Action::LockKey(i));
                    }
                    actions.push(Action::Abort(i));
                }
                Phase::Locked => {
                    actions.push(Action::Commit(i));
                    actions.push(Action::Abort(i));
                }
                Phase::Committed => {
                    if p.delivered > 0 && !p.completed {
                        actions.push(Action::Complete(i));
                    }
                    if !p.swept {
                        actions.push(Action::Sweep(i));
                    }
                }
                Phase::Aborted => {}
            }
        }
        for (c, cutter) in s.cutters.iter().enumerate() {
            match cutter {
                Cutter::Idle => {
                    // Under READ COMMITTED the start reads nothing: folded into the lock.
                    if self.cutters[c] == Isolation::RepeatableRead {
                        actions.push(Action::CutBegin(c));
                    } else if !self.cursor_lock || s.cursor_lock.is_none() {
                        actions.push(Action::CutLock(c));
                    }
                }
                Cutter::Begun { .. } => {
                    if !self.cursor_lock || s.cursor_lock.is_none() {
                        actions.push(Action::CutLock(c));
                    }
                }
                Cutter::Locked { .. } => actions.push(Action::CutSnapshot(c)),
                Cutter::Snapped { .. } => actions.push(Action::CutInsert(c)),
                Cutter::Inserted { .. } => actions.push(Action::CutCommit(c)),
                Cutter::CursorPending { .. } => actions.push(Action::CutWriteCursor(c)),
            }
            if *cutter != Cutter::Idle {
                actions.push(Action::CutCrash(c));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Begin(i) => {
                let p = &mut s.publishers[i];
                p.phase = Phase::Open;
                if self.publishers[i].1 == Isolation::RepeatableRead {
                    p.snapshot = committed(last);
                }
            }
            Action::Insert(i) => {
                let p = &mut s.publishers[i];
                p.phase = Phase::Inserted;
                p.seq = s.next_seq;
                s.next_seq += 1;
            }
            Action::LockKey(i) => {
                let key = self.publishers[i].0;
                if self.key_locked() {
                    s.key_locks[key as usize] = Some(i as u8);
                }
                let visible = match self.publishers[i].1 {
                    Isolation::ReadCommitted => committed(last),
                    Isolation::RepeatableRead => last.publishers[i].snapshot,
                };
                let pos = match self.position {
                    Position::SequenceAfterKeyLock => {
                        s.next_pos += 1;
                        s.next_pos - 1
                    }
                    Position::Seq => last.publishers[i].seq,
                    Position::SnapshotMax => last
                        .publishers
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| visible & (1 << j) != 0 && self.publishers[*j].0 == key)
                        .map(|(_, p)| p.pos + 1)
                        .max()
                        .unwrap_or(0),
                };
                let p = &mut s.publishers[i];
                p.phase = Phase::Locked;
                p.pos = pos;
            }
            Action::Commit(i) => {
                let key = self.publishers[i].0 as usize;
                if s.key_locks[key] == Some(i as u8) {
                    s.key_locks[key] = None;
                }
                let p = &mut s.publishers[i];
                p.phase = Phase::Committed;
                p.commit = s.commits;
                s.commits += 1;
            }
            Action::Abort(i) => {
                let key = self.publishers[i].0 as usize;
                if s.key_locks[key] == Some(i as u8) {
                    s.key_locks[key] = None;
                }
                s.publishers[i].phase = Phase::Aborted;
            }
            Action::CutBegin(c) => {
                s.cutters[c] = Cutter::Begun {
                    snapshot: committed(last),
                    cursor_seen: last.cursor,
                    boundary_then: self.boundary_now(last),
                };
            }
            Action::CutLock(c) => {
                let (snapshot, cursor_seen, boundary_then) = match last.cutters[c] {
                    Cutter::Begun {
                        snapshot,
                        cursor_seen,
                        boundary_then,
                    } => (snapshot, cursor_seen, boundary_then),
                    Cutter::Idle => (0, last.cursor, 0),
                    _ => return None,
                };
                if self.cutters[c] == Isolation::RepeatableRead && cursor_seen != last.cursor {
                    // The cursor changed since this snapshot: a serialization failure.
                    s.cutters[c] = Cutter::Idle;
                    return Some(s);
                }
                if self.cursor_lock {
                    s.cursor_lock = Some(c as u8);
                }
                s.cutters[c] = Cutter::Locked {
                    snapshot,
                    boundary_then,
                    prev: last.cursor,
                };
            }
            Action::CutSnapshot(c) => {
                let Cutter::Locked {
                    snapshot,
                    boundary_then,
                    prev,
                } = last.cutters[c]
                else {
                    return None;
                };
                let fresh = self.cutters[c] == Isolation::ReadCommitted
                    || self.fresh_boundary_in_repeatable_read;
                let (new, committed_then) = if fresh {
                    (self.boundary_now(last), committed(last))
                } else {
                    (boundary_then, snapshot)
                };
                let snapshot = match self.cutters[c] {
                    Isolation::ReadCommitted => committed(last),
                    Isolation::RepeatableRead => snapshot,
                };
                s.cutters[c] = Cutter::Snapped {
                    snapshot,
                    prev,
                    new,
                    committed: committed_then,
                };
            }
            Action::CutInsert(c) => {
                let Cutter::Snapped {
                    snapshot,
                    prev,
                    new,
                    committed: committed_then,
                } = last.cutters[c]
                else {
                    return None;
                };
                // What this statement sees: READ COMMITTED a fresh snapshot, REPEATABLE
                // READ the transaction's.
                let visible = match self.cutters[c] {
                    Isolation::ReadCommitted => committed(last),
                    Isolation::RepeatableRead => snapshot,
                };
                let mut batch = 0;
                for i in 0..last.publishers.len() {
                    let taken = match self.boundary {
                        Boundary::Snapshots => new & (1 << i) != 0 && prev & (1 << i) == 0,
                        Boundary::SeqHighWater | Boundary::OldestOpen => {
                            visible & (1 << i) != 0
                                && self.passed(new, last, i)
                                && !self.passed(prev, last, i)
                        }
                    };
                    if taken && visible & (1 << i) != 0 && !last.publishers[i].swept {
                        batch |= 1 << i;
                    }
                }
                s.cutters[c] = Cutter::Inserted {
                    new,
                    committed: committed_then,
                    batch,
                };
            }
            Action::CutCommit(c) => {
                let Cutter::Inserted {
                    new,
                    committed: committed_then,
                    batch,
                } = last.cutters[c]
                else {
                    return None;
                };
                // The batch's deliveries, each key's in position order.
                let mut taken: Vec<usize> = (0..s.publishers.len())
                    .filter(|i| batch & (1 << i) != 0)
                    .collect();
                taken.sort_by_key(|&i| (s.publishers[i].pos, s.publishers[i].seq));
                for i in taken {
                    let p = &mut s.publishers[i];
                    p.delivered = (p.delivered + 1).min(2);
                    s.delivered_order[self.publishers[i].0 as usize].push(i as u8);
                }
                // An event committed before the snapshot and still without deliveries
                // was held back by this batch.
                s.held_back |= (0..s.publishers.len())
                    .any(|i| committed_then & (1 << i) != 0 && s.publishers[i].delivered == 0);
                if self.cursor_in_same_transaction {
                    s.cursor = new;
                    s.cutters[c] = Cutter::Idle;
                } else {
                    s.cutters[c] = Cutter::CursorPending { new };
                }
                if s.cursor_lock == Some(c as u8) {
                    s.cursor_lock = None;
                }
            }
            Action::CutWriteCursor(c) => {
                let Cutter::CursorPending { new } = last.cutters[c] else {
                    return None;
                };
                s.cursor = new;
                s.cutters[c] = Cutter::Idle;
            }
            Action::CutCrash(c) => {
                s.cutters[c] = Cutter::Idle;
                if s.cursor_lock == Some(c as u8) {
                    s.cursor_lock = None;
                }
            }
            Action::Complete(i) => s.publishers[i].completed = true,
            Action::Sweep(i) => {
                let p = last.publishers[i];
                let no_delivery = p.delivered == 0 || p.completed;
                if !no_delivery || (self.sweep_checks_cursor && !self.passed(last.cursor, last, i))
                {
                    return None;
                }
                s.publishers[i].swept = true;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "an event becomes deliveries exactly once, only after it committed",
                |_, s: &State| {
                    s.publishers.iter().all(|p| {
                        p.delivered <= 1 && (p.delivered == 0 || p.phase == Phase::Committed)
                    })
                },
            ),
            Property::always(
                "no committed event is behind the boundary without deliveries",
                |m: &BoundaryModel, s: &State| {
                    (0..s.publishers.len()).all(|i| {
                        let p = &s.publishers[i];
                        p.phase != Phase::Committed || p.delivered > 0 || !m.passed(s.cursor, s, i)
                    })
                },
            ),
            Property::always(
                "an open transaction holds back only its own event",
                |_, s: &State| !s.held_back,
            ),
            Property::always(
                "per-key delivery order is commit order",
                |m: &BoundaryModel, s: &State| {
                    s.delivered_order.iter().enumerate().all(|(key, order)| {
                        let commits: Vec<u8> = order
                            .iter()
                            .map(|&i| s.publishers[i as usize].commit)
                            .collect();
                        let increasing = commits.windows(2).all(|w| w[0] < w[1]);
                        let last = commits.last().copied();
                        // No event of the key that committed before the last one
                        // delivered is still without deliveries.
                        let none_left_behind = s.publishers.iter().enumerate().all(|(i, p)| {
                            m.publishers[i].0 as usize != key
                                || p.phase != Phase::Committed
                                || order.contains(&(i as u8))
                                || last.is_none_or(|l| p.commit > l)
                        });
                        increasing && none_left_behind
                    })
                },
            ),
            Property::always("nothing swept is still needed", |_, s: &State| {
                s.publishers
                    .iter()
                    .all(|p| !p.swept || (p.delivered > 0 && p.completed))
            }),
            Property::sometimes("every event is delivered and swept", |_, s: &State| {
                s.publishers
                    .iter()
                    .all(|p| p.phase == Phase::Committed && p.swept)
            }),
            Property::sometimes("a batch skips an open transaction", |_, s: &State| {
                // A later-committed event was delivered while an earlier-inserted one was
                // still open.
                s.publishers.iter().any(|p| p.delivered > 0)
                    && s.publishers
                        .iter()
                        .any(|p| matches!(p.phase, Phase::Inserted | Phase::Locked))
            }),
        ]
    }
}
