//! The fan-out finds subscriptions through an index of their patterns. It must match
//! exactly what `pgbus.pattern_matches` (and the library's `pattern_matches`) says, for
//! every shape of name and pattern, and follow every change of a subscription.

mod common;

use serde_json::json;

/// Names of depth 1 to 3 over a small alphabet, so that names and patterns collide on
/// purpose: prefixes that are and are not followed by a dot, trailing dots.
fn names() -> Vec<String> {
    let parts = ["a", "b", "ab"];
    let mut out: Vec<String> = Vec::new();
    for x in parts {
        out.push(x.to_string());
        out.push(format!("{x}."));
        for y in parts {
            out.push(format!("{x}.{y}"));
            for z in parts {
                out.push(format!("{x}.{y}.{z}"));
            }
        }
    }
    out
}

fn patterns() -> Vec<String> {
    let mut out = vec!["*".to_string()];
    for n in names() {
        out.push(format!("{n}.*"));
        out.push(n);
    }
    out.retain(|p| pgbus::admin::validate_subscription("s", &[p.as_str()]).is_ok());
    out
}

#[tokio::test]
async fn the_pattern_index_matches_exactly_what_pattern_matches_says() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let patterns = patterns();
    // One subscription per pattern, and one with all of a name's shapes at once.
    for (i, p) in patterns.iter().enumerate() {
        pgbus::admin::register_subscription(&client, &format!("s{i}"), &[p.as_str()], 1)
            .await
            .unwrap();
    }
    pgbus::admin::register_subscription(&client, "many", &["a.*", "a.b", "ab.*"], 1)
        .await
        .unwrap();
    let names = names();
    let rows = client
        .query(
            "SELECT n, m.subscription FROM unnest($1::text[]) AS n,
                    pgbus.subscriptions_matching(n) AS m",
            &[&names],
        )
        .await
        .unwrap();
    let mut indexed: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    indexed.sort();
    let rows = client
        .query(
            "SELECT n, s.name FROM unnest($1::text[]) AS n, pgbus.subscriptions AS s
             WHERE EXISTS (SELECT 1 FROM unnest(s.patterns) AS p
                           WHERE pgbus.pattern_matches(p, n))
             ORDER BY 1, 2",
            &[&names],
        )
        .await
        .unwrap();
    let scanned: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        scanned.len() > names.len() * 3,
        "too few matches to mean anything"
    );
    assert_eq!(indexed, scanned);
    // The library agrees too.
    for (name, sub) in &scanned {
        let i: usize = match sub.strip_prefix('s') {
            Some(i) => i.parse().unwrap(),
            None => continue,
        };
        assert!(
            pgbus::pattern_matches(&patterns[i], name),
            "{} {name}",
            patterns[i]
        );
    }
}

#[tokio::test]
async fn the_index_follows_every_change_of_a_subscription() {
    let db = common::test_db().await;
    let client = db.connect().await;
    // The deliveries of a subscription once the bus has made them.
    let deliveries = |sub: &'static str| {
        let client = &client;
        async move {
            common::fan_out(client).await;
            client
                .query_one(
                    "SELECT count(*) FROM pgbus.deliveries WHERE subscription = $1",
                    &[&sub],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let publish = |name: &'static str| {
        let client = &client;
        async move {
            pgbus::publish(client, &pgbus::Event::new(name, json!({})))
                .await
                .unwrap();
        }
    };
    pgbus::admin::register_subscription(&client, "s", &["order.*"], 1)
        .await
        .unwrap();
    publish("order.placed").await;
    assert_eq!(deliveries("s").await, 1);
    // New patterns replace the old ones.
    let change = pgbus::admin::SubscriptionChange::new().patterns(["invoice.paid"]);
    pgbus::admin::configure_subscription(&client, "s", &change)
        .await
        .unwrap();
    publish("order.placed").await;
    publish("invoice.paid").await;
    assert_eq!(deliveries("s").await, 2);
    // A dropped subscription matches nothing any more.
    pgbus::admin::drop_subscription(&client, "s", true)
        .await
        .unwrap();
    publish("invoice.paid").await;
    assert_eq!(deliveries("s").await, 0);
    assert_eq!(
        client
            .query_one("SELECT count(*) FROM pgbus.subscription_patterns", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0
    );
}
