//! Capacity: the slots of claimed, unsettled deliveries.
//!
//! A bus holds at most its concurrency plus one batch of deliveries it claimed and has not
//! settled in the database, and at most a byte budget of their JSON. Each such delivery
//! holds a [`Slot`] from the moment it is claimed until its settlement is written (or given
//! up); dropping the slot frees it, whichever path the delivery took, and wakes the
//! claimer. The slots also keep the ledger the lease heartbeat extends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::retry::RetryPolicy;

/// A subscription as the claimer and its deliveries see it.
#[derive(Debug)]
pub(crate) struct Sub {
    pub(crate) name: Arc<str>,
    pub(crate) retry: RetryPolicy,
    /// The most deliveries of this subscription held at once, if limited.
    limit: Option<usize>,
    /// Held now (claimed and not settled).
    held: AtomicUsize,
}

impl Sub {
    pub(crate) fn new(name: &str, retry: RetryPolicy, limit: Option<usize>) -> Sub {
        Sub {
            name: Arc::from(name),
            retry,
            limit,
            held: AtomicUsize::new(0),
        }
    }

    /// How many deliveries this subscription may claim now, out of `free`.
    pub(crate) fn quota(&self, free: usize) -> usize {
        match self.limit {
            Some(limit) => limit.saturating_sub(self.held()).min(free),
            None => free,
        }
    }

    /// How many deliveries of this subscription are held now.
    fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }
}

/// A held delivery's key: subscription and event sequence.
pub(crate) type Key = (Arc<str>, i64);

/// The deliveries held, with the attempt each was claimed for and the bytes of JSON it
/// holds.
#[derive(Debug, Default)]
struct Ledger {
    held: HashMap<Key, (i32, usize)>,
    bytes: usize,
}

/// The bus's slots.
#[derive(Debug)]
pub(crate) struct Slots {
    capacity: Arc<Semaphore>,
    /// How many slots there are.
    size: usize,
    /// Signalled whenever a slot is freed.
    freed: Notify,
    ledger: Mutex<Ledger>,
}

impl Slots {
    pub(crate) fn new(capacity: usize) -> Arc<Slots> {
        Arc::new(Slots {
            capacity: Arc::new(Semaphore::new(capacity)),
            size: capacity,
            freed: Notify::new(),
            ledger: Mutex::default(),
        })
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Free slots now.
    pub(crate) fn free(&self) -> usize {
        self.capacity.available_permits()
    }

    /// Slots taken now: deliveries claimed and not yet settled in the database.
    pub(crate) fn taken(&self) -> usize {
        self.size - self.free()
    }

    /// Bytes of JSON held by unsettled deliveries.
    pub(crate) fn bytes(&self) -> usize {
        self.ledger().bytes
    }

    /// Waits until a slot is freed.
    pub(crate) async fn freed(&self) {
        self.freed.notified().await
    }

    /// Takes the slot of a delivery just claimed. The claimer is the only one that takes
    /// slots and claims no more than are free, so a permit is always there; were it not,
    /// the delivery would hold none rather than fail its claim.
    pub(crate) fn take(
        self: &Arc<Self>,
        sub: &Arc<Sub>,
        seq: i64,
        attempt: i32,
        bytes: usize,
    ) -> Slot {
        let permit = self.capacity.clone().try_acquire_owned().ok();
        sub.held.fetch_add(1, Ordering::AcqRel);
        let mut ledger = self.ledger();
        if let Some((_, old)) = ledger
            .held
            .insert((sub.name.clone(), seq), (attempt, bytes))
        {
            ledger.bytes -= old;
        }
        ledger.bytes += bytes;
        drop(ledger);
        Slot {
            slots: self.clone(),
            sub: sub.clone(),
            seq,
            attempt,
            permit,
        }
    }

    /// Every held delivery with its attempt, for the lease heartbeat.
    pub(crate) fn held(&self) -> Vec<(Arc<str>, i64, i32)> {
        self.ledger()
            .held
            .iter()
            .map(|((sub, seq), (attempt, _))| (sub.clone(), *seq, *attempt))
            .collect()
    }
}

/// One claimed, unsettled delivery's place in the bus: freed on drop.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    sub: Arc<Sub>,
    seq: i64,
    attempt: i32,
    permit: Option<OwnedSemaphorePermit>,
}

impl Slot {
    pub(crate) fn sub(&self) -> &Arc<Sub> {
        &self.sub
    }

    pub(crate) fn seq(&self) -> i64 {
        self.seq
    }

    pub(crate) fn attempt(&self) -> i32 {
        self.attempt
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut ledger = self.slots.ledger();
        let key = (self.sub.name.clone(), self.seq);
        // The same delivery claimed again (its lease expired meanwhile) holds the entry
        // now: leave it.
        if let Some(&(attempt, bytes)) = ledger.held.get(&key)
            && attempt == self.attempt
        {
            ledger.held.remove(&key);
            ledger.bytes -= bytes;
        }
        drop(ledger);
        self.sub.held.fetch_sub(1, Ordering::AcqRel);
        // The permit goes back before the claimer is woken, so that it sees the slot.
        drop(self.permit.take());
        self.slots.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_frees_its_capacity_its_quota_and_its_bytes_on_drop() {
        let slots = Slots::new(3);
        let sub = Arc::new(Sub::new("s", RetryPolicy::default(), Some(2)));
        let a = slots.take(&sub, 1, 1, 100);
        let b = slots.take(&sub, 2, 1, 50);
        assert_eq!((slots.free(), sub.quota(3), slots.bytes()), (1, 0, 150));
        assert_eq!((slots.held().len(), slots.taken()), (2, 2));
        drop(a);
        assert_eq!((slots.free(), sub.quota(3), slots.bytes()), (2, 1, 50));
        drop(b);
        assert_eq!((slots.free(), sub.quota(3), slots.bytes()), (3, 2, 0));
        assert!(slots.held().is_empty());
    }

    #[test]
    fn an_older_attempts_slot_leaves_the_newer_claim_in_the_ledger() {
        let slots = Slots::new(4);
        let sub = Arc::new(Sub::new("s", RetryPolicy::default(), None));
        let old = slots.take(&sub, 7, 1, 10);
        let new = slots.take(&sub, 7, 2, 30);
        assert_eq!(slots.bytes(), 30);
        drop(old);
        assert_eq!(slots.held(), vec![(Arc::from("s"), 7, 2)]);
        assert_eq!(slots.bytes(), 30);
        drop(new);
        assert_eq!((slots.bytes(), slots.free()), (0, 4));
    }
}
