//! Locks a stranger cannot take: a role that can merely connect holds every advisory
//! lock key pgbus has ever used, and whatever table and row locks it can get, while the
//! bus publishes, commits, delivers, changes settings and sweeps under a 2 s
//! `statement_timeout`. And a settings change that waits for an open transaction lets
//! the rest of the bus through meanwhile, and gives up naming that transaction's session.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgbus::admin::{self, SubscriptionChange};
use pgbus::{Bus, Error, Event, HandlerError, RunningBus, SubscriptionOptions};
use serde_json::json;
use tokio_postgres::{Client, Config, NoTls};

const WAIT: Duration = Duration::from_secs(30);

/// The statement_timeout every pgbus session of these tests runs with.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every advisory lock key pgbus has used: the configuration gate ("pgbus_cf"), the wake
/// lock, migrations ("pgbus_mg") and the sweep ("pgbus_sw").
const ADVISORY_KEYS: [i64; 4] = [
    8_099_550_711_435_453_286,
    8_099_550_711_435_458_411,
    0x7067_6275_735f_6d67,
    0x7067_6275_735f_7377,
];

/// Every table lock mode.
const MODES: [&str; 8] = [
    "ACCESS SHARE",
    "ROW SHARE",
    "ROW EXCLUSIVE",
    "SHARE UPDATE EXCLUSIVE",
    "SHARE",
    "SHARE ROW EXCLUSIVE",
    "EXCLUSIVE",
    "ACCESS EXCLUSIVE",
];

/// The subscriptions and ordering keys of the first test.
const SUBSCRIPTIONS: [&str; 2] = ["plain", "keyed"];
const KEYS: [&str; 5] = ["k0", "k1", "k2", "k3", "k4"];

/// A role of this test's own (roles are cluster-wide), dropped at the end with its
/// privileges, even when the test fails.
struct Role {
    name: String,
    admin: Config,
}

impl Role {
    /// A role with LOGIN and nothing else (CONNECT on a database is PUBLIC's by default).
    async fn create(admin: Config, kind: &str) -> Role {
        let name = format!("pgbus_{kind}_{:016x}", fastrand::u64(..));
        connect(&admin)
            .await
            .batch_execute(&format!("CREATE ROLE {name} LOGIN"))
            .await
            .unwrap();
        Role { name, admin }
    }

    fn config(&self, db: &common::TestDb) -> Config {
        let mut config = db.config();
        config.user(&self.name);
        config
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let (name, admin) = (self.name.clone(), self.admin.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok((client, connection)) = admin.connect(NoTls).await else {
                    return;
                };
                tokio::spawn(connection);
                let _ = client
                    .batch_execute(&format!(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE usename = '{name}';
                         DROP OWNED BY {name}; DROP ROLE {name}"
                    ))
                    .await;
            });
        })
        .join();
    }
}

async fn connect(config: &Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// `config` with a 2 s statement_timeout and an application_name.
fn bounded(config: &Config, application_name: &str) -> Config {
    let mut config = config.clone();
    config.options(format!(
        "-c statement_timeout={}",
        STATEMENT_TIMEOUT.as_millis()
    ));
    config.application_name(application_name);
    config
}

/// What a session of `config` holds: every advisory key pgbus has used and the key-lock
/// hashes of `subs` x `keys` (session locks, exclusive), and, in a transaction left
/// open, every table lock mode and row lock it can get on every relation of the pgbus
/// schema. Returns the session, its pid, and what it got.
async fn hold_everything(
    admin: &Client,
    config: &Config,
    subs: &[&str],
    keys: &[&str],
) -> (Client, i32, Vec<String>) {
    let s = connect(config).await;
    let pid: i32 = s
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    s.execute(
        "SELECT pg_advisory_lock(k) FROM unnest($1::int8[]) AS k",
        &[&ADVISORY_KEYS.to_vec()],
    )
    .await
    .unwrap();
    let subs: Vec<String> = subs.iter().map(|s| s.to_string()).collect();
    let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    let held: i64 = s
        .query_one(
            "SELECT count(pg_advisory_lock(hashtextextended(s || chr(31) || k, 7305)))
             FROM unnest($1::text[]) AS s, unnest($2::text[]) AS k",
            &[&subs, &keys],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held as usize, subs.len() * keys.len());

    let relations: Vec<String> = admin
        .query(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class AS c
             JOIN pg_namespace AS n ON n.oid = c.relnamespace
             WHERE n.nspname = 'pgbus' AND c.relkind IN ('r', 'p', 'S', 'v', 'm')
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(relations.iter().any(|r| r == "pgbus.events"));
    // A lock it would have to wait for is a lock it may queue for: give it a moment.
    s.batch_execute("SET lock_timeout = '500ms'; BEGIN")
        .await
        .unwrap();
    let mut got = Vec::new();
    for rel in &relations {
        let mut tries: Vec<String> = MODES
            .iter()
            .map(|m| format!("LOCK TABLE {rel} IN {m} MODE"))
            .collect();
        for lock in [
            "FOR UPDATE",
            "FOR NO KEY UPDATE",
            "FOR SHARE",
            "FOR KEY SHARE",
        ] {
            tries.push(format!("SELECT 1 FROM {rel} LIMIT 1 {lock}"));
        }
        tries.push(format!("PREPARE p_{} AS SELECT 1 FROM {rel}", got.len()));
        for attempt in tries {
            s.batch_execute("SAVEPOINT t").await.unwrap();
            match s.batch_execute(&attempt).await {
                Ok(()) => {
                    s.batch_execute("RELEASE SAVEPOINT t").await.unwrap();
                    got.push(attempt);
                }
                Err(_) => s.batch_execute("ROLLBACK TO SAVEPOINT t").await.unwrap(),
            }
        }
    }
    (s, pid, got)
}

/// The modes `pid` holds on relations of the pgbus schema, beyond ACCESS SHARE.
async fn strong_locks(admin: &Client, pid: i32) -> Vec<String> {
    admin
        .query(
            "SELECT l.relation::regclass::text || ' ' || l.mode FROM pg_locks AS l
             JOIN pg_class AS c ON c.oid = l.relation
             WHERE l.pid = $1 AND l.locktype = 'relation'
               AND c.relnamespace = 'pgbus'::regnamespace AND l.mode <> 'AccessShareLock'
             ORDER BY 1",
            &[&pid],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// (subscription, event id) of every handled delivery, in handling order.
type Handled = Arc<Mutex<Vec<(String, String)>>>;

async fn start_bus(config: Config, handled: &Handled) -> RunningBus {
    let (h1, h2) = (handled.clone(), handled.clone());
    Bus::builder(config)
        .statement_timeout(STATEMENT_TIMEOUT)
        .poll_interval(Duration::from_secs(5))
        .handler_fn("plain", ["t.*"], move |e: Event| {
            h1.lock().unwrap().push(("plain".into(), e.id.clone()));
            async { Ok::<(), HandlerError>(()) }
        })
        .handler_fn_with(
            "keyed",
            ["t.*"],
            SubscriptionOptions::new().ordered(true),
            move |e: Event| {
                h2.lock().unwrap().push(("keyed".into(), e.id.clone()));
                async { Ok::<(), HandlerError>(()) }
            },
        )
        .build()
        .unwrap()
        .start()
        .await
        .unwrap()
}

/// Waits until both subscriptions handled every one of `ids`.
async fn handled_all(handled: &Handled, ids: &[String]) {
    common::wait_for("every event handled by both subscriptions", WAIT, || {
        let done = {
            let h = handled.lock().unwrap();
            SUBSCRIPTIONS.iter().all(|sub| {
                ids.iter()
                    .all(|id| h.iter().any(|(s, i)| s == sub && i == id))
            })
        };
        async move { done }
    })
    .await;
}

#[tokio::test]
async fn a_role_that_can_only_connect_cannot_stop_the_bus() {
    let db = common::test_db().await;
    let admin = connect(&bounded(&db.config(), "pgbus-test-admin")).await;
    let stranger = Role::create(db.config(), "stranger").await;
    let (held, stranger_pid, got) =
        hold_everything(&admin, &stranger.config(&db), &SUBSCRIPTIONS, &KEYS).await;
    println!("the stranger got: {got:?}");
    assert_eq!(
        strong_locks(&admin, stranger_pid).await,
        Vec::<String>::new(),
        "a role outside pgbus holds a lock that conflicts with the bus's"
    );

    let handled: Handled = Default::default();
    let running = start_bus(bounded(&db.config(), "pgbus-test-bus"), &handled).await;
    let mut ids = Vec::new();

    // The library, on its own statement.
    let e = Event::new("t.lib", json!({"n": 0})).ordering_key("k0");
    ids.push(e.id.clone());
    common::within("a publish", WAIT, pgbus::publish(&admin, &e))
        .await
        .expect("a publish under the stranger's locks");

    // The library in a transaction, and its commit.
    let mut publisher = connect(&bounded(&db.config(), "pgbus-test-publisher")).await;
    let events: Vec<Event> = ["k1", "k2", "k1"]
        .iter()
        .enumerate()
        .map(|(n, k)| Event::new("t.tx", json!({"n": n})).ordering_key(*k))
        .collect();
    ids.extend(events.iter().map(|e| e.id.clone()));
    common::within("a publish in a transaction and its commit", WAIT, async {
        let tx = publisher.transaction().await.unwrap();
        pgbus::publish_batch(&tx, &events)
            .await
            .expect("a batch under the stranger's locks");
        tx.commit()
            .await
            .expect("a commit under the stranger's locks");
    })
    .await;

    // SQL: the function, and a plain INSERT, each committed.
    let by_sql: String = common::within(
        "a publish through SQL",
        WAIT,
        admin.query_one(
            "SELECT pgbus.publish('t.sql', '{}'::jsonb, ordering_key => 'k3')",
            &[],
        ),
    )
    .await
    .expect("pgbus.publish under the stranger's locks")
    .get(0);
    ids.push(by_sql);
    let inserted: String = common::within(
        "an INSERT into the log",
        WAIT,
        admin.query_one(
            "INSERT INTO pgbus.events (event_name, payload, ordering_key)
             VALUES ('t.insert', '{}', 'k4') RETURNING id",
            &[],
        ),
    )
    .await
    .expect("an INSERT under the stranger's locks")
    .get(0);
    ids.push(inserted);

    // Delivery, ordered and unordered, and its settlement.
    handled_all(&handled, &ids).await;
    let k1: Vec<String> = {
        let h = handled.lock().unwrap();
        h.iter()
            .filter(|(s, i)| s == "keyed" && (*i == ids[1] || *i == ids[3]))
            .map(|(_, i)| i.clone())
            .collect()
    };
    assert_eq!(
        k1,
        vec![ids[1].clone(), ids[3].clone()],
        "key k1 out of order"
    );

    // A settings change, both ways, and the sweep.
    for ordered in [true, false] {
        let converted = common::within(
            "a settings change",
            WAIT,
            admin::configure_subscription(
                &admin,
                "plain",
                &SubscriptionChange::new().ordered(ordered).max_attempts(9),
            ),
        )
        .await
        .expect("a settings change under the stranger's locks");
        assert!(converted.is_some());
    }
    let swept = common::within(
        "a sweep",
        WAIT,
        admin::sweep_batch(&admin, Duration::from_millis(1), 100),
    )
    .await
    .expect("a sweep under the stranger's locks");
    assert!(!swept.busy, "the sweep thought another one was running");

    // Idle, the bus tries to fall asleep, which needs the wake lock the stranger holds:
    // it waits for it (at most 200 ms a try), stays awake, and still finds events.
    common::wait_for("the bus to wait for the wake lock", WAIT, || async {
        common::count(
            &admin,
            "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
             WHERE l.locktype = 'advisory' AND NOT l.granted
               AND a.application_name = 'pgbus worker'",
        )
        .await
            > 0
    })
    .await;
    let late: Vec<Event> = (0..3)
        .map(|n| Event::new("t.late", json!({"n": n})).ordering_key(KEYS[n]))
        .collect();
    common::within("a late publish", WAIT, pgbus::publish_batch(&admin, &late))
        .await
        .expect("a late publish under the stranger's locks");
    let late_ids: Vec<String> = late.iter().map(|e| e.id.clone()).collect();
    handled_all(&handled, &late_ids).await;
    common::wait_for("every delivery settled", WAIT, || async {
        common::count(&admin, common::WORK_LEFT).await == 0
    })
    .await;

    // The stranger held everything throughout.
    let advisory: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND granted",
            &[&stranger_pid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        advisory as usize,
        ADVISORY_KEYS.len() + SUBSCRIPTIONS.len() * KEYS.len()
    );
    running.shutdown().await.unwrap();
    drop(held);
}

/// pgbus's own roles can take the locks the bus coordinates with only as far as their
/// work needs: none, except through pgbus's owner-rights functions (a publisher's
/// fan-out; a consumer's settling; an operator's settings change, since migration 17).
#[tokio::test]
async fn publishers_and_consumers_take_the_bus_locks_only_as_far_as_they_need() {
    let db = common::test_db().await;
    let admin = connect(&db.config()).await;
    let publisher = Role::create(db.config(), "publisher").await;
    let consumer = Role::create(db.config(), "consumer").await;
    admin
        .execute(
            "SELECT pgbus.grant_publisher($1::text::regrole)",
            &[&publisher.name],
        )
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pgbus.grant_consumer($1::text::regrole)",
            &[&consumer.name],
        )
        .await
        .unwrap();
    let gates = ["pgbus.config_gate", "pgbus.key_stripes", "pgbus.duties"];
    let (held, pid, got) = hold_everything(&admin, &publisher.config(&db), &[], &[]).await;
    let strong: Vec<String> = strong_locks(&admin, pid)
        .await
        .into_iter()
        .filter(|l| gates.iter().any(|g| l.starts_with(&format!("{g} "))))
        .collect();
    assert_eq!(strong, Vec::<String>::new(), "a publisher got {got:?}");
    drop(held);
    let (held, pid, got) = hold_everything(&admin, &consumer.config(&db), &[], &[]).await;
    let strong: Vec<String> = strong_locks(&admin, pid)
        .await
        .into_iter()
        .filter(|l| gates.iter().any(|g| l.starts_with(&format!("{g} "))))
        .collect();
    assert_eq!(strong, Vec::<String>::new(), "a consumer got {got:?}");
    drop(held);
}

#[tokio::test]
async fn a_settings_change_waiting_for_an_open_transaction_stalls_nobody() {
    let db = common::test_db().await;
    let admin = connect(&bounded(&db.config(), "pgbus-test-admin")).await;
    let handled: Handled = Default::default();
    let running = start_bus(bounded(&db.config(), "pgbus-test-bus"), &handled).await;

    // A publisher's transaction, left open: it holds the configuration gate shared.
    let mut open = connect(&bounded(&db.config(), "pgbus-test-open")).await;
    let open_tx = open.transaction().await.unwrap();
    let first = Event::new("t.open", json!({})).ordering_key("k0");
    pgbus::publish(&open_tx, &first).await.unwrap();
    let open_pid: i32 = open_tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    // A change of the unordered subscription to ordered, waiting at most 3 s.
    let bound = Duration::from_secs(3);
    let operator = connect(&bounded(&db.config(), "pgbus-test-operator")).await;
    let change = tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let result = admin::configure_subscription_within(
            &operator,
            "plain",
            &SubscriptionChange::new().ordered(true),
            bound,
        )
        .await;
        (result, started.elapsed(), operator)
    });

    // Meanwhile publishes and their deliveries' settlements complete, each under the
    // 2 s statement_timeout.
    let mut through = BTreeMap::new();
    while !change.is_finished() {
        let e = Event::new("t.meanwhile", json!({"n": through.len()}));
        common::within(
            "a publish while the change waits",
            WAIT,
            pgbus::publish(&admin, &e),
        )
        .await
        .expect("a publish while a settings change waits");
        handled_all(&handled, std::slice::from_ref(&e.id)).await;
        through.insert(e.id.clone(), ());
    }
    let (result, waited, operator) = common::within("the change", WAIT, change).await.unwrap();
    assert!(
        through.len() >= 2,
        "only {} publishes went through",
        through.len()
    );
    let err = result.expect_err("the change should have given up");
    let message = err.to_string();
    match err {
        Error::LockWait { sessions, .. } => {
            assert!(
                sessions.iter().any(|s| s.pid == Some(open_pid)
                    && s.application_name.as_deref() == Some("pgbus-test-open")),
                "{sessions:?} does not name pid {open_pid}"
            );
        }
        other => panic!("expected a LockWait, got {other:?}"),
    }
    assert!(
        message.contains(&format!("pid {open_pid} ")),
        "the error does not name pid {open_pid}: {message}"
    );
    assert!(waited >= bound, "gave up after {waited:?}");
    assert!(waited < bound + WAIT, "gave up only after {waited:?}");
    let settings = admin::subscription_settings(&admin, "plain")
        .await
        .unwrap()
        .unwrap();
    assert!(!settings.ordered, "the change was made after all");

    // Once the transaction ends, the change goes through.
    open_tx.commit().await.unwrap();
    let converted = admin::configure_subscription_within(
        &operator,
        "plain",
        &SubscriptionChange::new().ordered(true),
        bound,
    )
    .await
    .expect("the change once the transaction ended");
    assert!(converted.is_some());
    assert!(
        admin::subscription_settings(&admin, "plain")
            .await
            .unwrap()
            .unwrap()
            .ordered
    );
    handled_all(&handled, std::slice::from_ref(&first.id)).await;
    running.shutdown().await.unwrap();
}
