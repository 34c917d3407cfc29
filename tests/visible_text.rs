//! Ids and names an operator reads are refused when they carry control characters or
//! invisible formatting characters (bidirectional overrides, zero-width characters):
//! by the library before anything is sent, and by the schema for raw SQL.

mod common;

use pgbus::{Error, Event};
use proptest::prelude::*;
use serde_json::json;
use tokio_postgres::error::SqlState;

const SPOOFS: &[&str] = &[
    "evil\r",
    "\u{1b}[2Jclear",
    "a\u{85}b",
    "\u{202E}txt.exe",
    "ab\u{200B}cd",
    "x\u{2066}y",
    "\u{FEFF}bom",
    "rl\u{200F}m",
];

#[tokio::test]
async fn spoofing_characters_are_refused_in_ids_and_names_and_nothing_is_written() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for spoof in SPOOFS {
        let cases = [
            Event::new(format!("order.{spoof}"), json!({})),
            Event::new("order.placed", json!({})).id(*spoof),
            Event::new("order.placed", json!({})).correlation_id(*spoof),
            Event::new("order.placed", json!({})).aggregate("order", *spoof),
            Event::new("order.placed", json!({})).ordering_key(*spoof),
        ];
        for event in cases {
            let err = pgbus::publish(&client, &event).await.unwrap_err();
            assert!(matches!(err, Error::Invalid { .. }), "{spoof:?}: {err:?}");
        }
        // Raw SQL meets the schema's constraints.
        for sql in [
            "INSERT INTO pgbus.events (event_name) VALUES ('order.' || $1)",
            "INSERT INTO pgbus.events (event_name, id) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.events (event_name, correlation_id) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.events (event_name, ordering_key) VALUES ('order.placed', $1)",
            "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('s' || $1, '{*}')",
        ] {
            let err = client.execute(sql, &[spoof]).await.unwrap_err();
            assert_eq!(
                err.code(),
                Some(&SqlState::CHECK_VIOLATION),
                "{sql} {spoof:?}"
            );
        }
        let err = pgbus::admin::register_subscription(&client, &format!("s{spoof}"), &["*"], 1)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{spoof:?}: {err:?}");
    }
    let written: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM pgbus.events) + (SELECT count(*) FROM pgbus.subscriptions)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 0);
    // Ordinary text outside ASCII stays welcome.
    pgbus::publish(
        &client,
        &Event::new("commande.passée", json!({}))
            .id("идентификатор-1")
            .aggregate("注文", "42"),
    )
    .await
    .unwrap();
}

/// The report's ten: each makes an id that prints as `order-42` and is another id.
const LOOKALIKES: [char; 10] = [
    '\u{00AD}',
    '\u{034F}',
    '\u{115F}',
    '\u{180B}',
    '\u{2028}',
    '\u{2029}',
    '\u{3164}',
    '\u{FE0F}',
    '\u{FFA0}',
    '\u{E0041}',
];

/// Every column that holds an id or a key, as (the library's name for it, the column).
const ID_COLUMNS: [(&str, &str); 7] = [
    ("event id", "id"),
    ("aggregate type", "aggregate_type"),
    ("aggregate id", "aggregate_id"),
    ("ordering key", "ordering_key"),
    ("correlation id", "correlation_id"),
    ("causation id", "causation_id"),
    ("source", "source"),
];

/// `event` with `text` in the identifier the library calls `what`.
fn with_id(what: &str, text: &str) -> Event {
    let event = Event::new("order.placed", json!({}));
    match what {
        "event id" => event.id(text),
        "aggregate type" => event.aggregate(text, "42"),
        "aggregate id" => event.aggregate("order", text),
        "ordering key" => event.ordering_key(text),
        "correlation id" => event.correlation_id(text),
        "causation id" => event.causation_id(text),
        "source" => event.source(text),
        other => unreachable!("{other}"),
    }
}

/// Checks that `text` in every id column is refused by the library (as bad input) and
/// by the schema (a CHECK violation), and as an event or subscription name when `name`.
async fn assert_refused(client: &tokio_postgres::Client, text: &str, name: bool) {
    for (what, column) in ID_COLUMNS {
        let err = pgbus::publish(client, &with_id(what, text))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Invalid { what: w, .. } if w == what),
            "{what} {text:?}: {err:?}"
        );
        let err = client
            .execute(
                &format!(
                    "INSERT INTO pgbus.events (event_name, {column}) VALUES ('order.placed', $1)"
                ),
                &[&text],
            )
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::CHECK_VIOLATION),
            "{column} {text:?}"
        );
    }
    if name {
        assert_name_refused(client, text).await;
    }
}

/// Checks that `text` is refused as an event name and as a subscription name, by the
/// library and by the schema.
async fn assert_name_refused(client: &tokio_postgres::Client, text: &str) {
    let err = pgbus::publish(client, &Event::new(text, json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{text:?}: {err:?}");
    let err = pgbus::admin::register_subscription(client, text, &["*"], 1)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{text:?}: {err:?}");
    for sql in [
        "INSERT INTO pgbus.events (event_name) VALUES ($1)",
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ($1, '{*}')",
        "INSERT INTO pgbus.subscriptions (name, patterns) VALUES ('s', ARRAY[$1 || '.*'])",
    ] {
        let err = client.execute(sql, &[&text]).await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::CHECK_VIOLATION),
            "{sql} {text:?}"
        );
    }
}

async fn written(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT (SELECT count(*) FROM pgbus.events) + (SELECT count(*) FROM pgbus.subscriptions)",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The report's case: ten ids that all render as `order-42`, and a name with a no-break
/// space.
#[tokio::test]
async fn ids_that_render_alike_and_names_with_any_space_are_refused() {
    let db = common::test_db().await;
    let client = db.connect().await;
    for c in LOOKALIKES {
        assert_refused(&client, &format!("order-{c}42"), true).await;
    }
    for c in ['\u{00A0}', '\u{2007}', '\u{3000}', '\u{1680}', '\u{205F}'] {
        assert_name_refused(&client, &format!("order{c}placed")).await;
    }
    assert_eq!(written(&client).await, 0);
    // A space is visible in an id: `order 42` is not `order-42`.
    pgbus::publish(
        &client,
        &Event::new("order.placed", json!({})).aggregate("order", "order\u{00A0}42"),
    )
    .await
    .unwrap();
}

/// Unicode's answer for code point `c`: (refused in ids and keys, refused in names).
struct Truth {
    ignorable: icu_properties::CodePointSetDataBorrowed<'static>,
    white_space: icu_properties::CodePointSetDataBorrowed<'static>,
}

impl Truth {
    fn new() -> Self {
        use icu_properties::CodePointSetData;
        use icu_properties::props::{DefaultIgnorableCodePoint, WhiteSpace};
        Truth {
            ignorable: CodePointSetData::new::<DefaultIgnorableCodePoint>(),
            white_space: CodePointSetData::new::<WhiteSpace>(),
        }
    }

    /// Control characters (general category Cc), Default_Ignorable_Code_Point, and the
    /// line and paragraph separators.
    fn refused_in_ids(&self, c: u32) -> bool {
        c < 0x20
            || (0x7F..=0x9F).contains(&c)
            || c == 0x2028
            || c == 0x2029
            || self.ignorable.contains32(c)
    }

    /// The above, White_Space and `*`.
    fn refused_in_names(&self, c: u32) -> bool {
        self.refused_in_ids(c) || self.white_space.contains32(c) || c == u32::from('*')
    }
}

/// Every Unicode scalar value but NUL (which PostgreSQL's text cannot hold).
fn code_points() -> impl Iterator<Item = char> {
    (1..=0x10FFFF).filter_map(char::from_u32)
}

/// The code points a one-character test refuses, from one query over every code point:
/// `refused` is an SQL condition on the text `t`.
async fn refused_by_schema(client: &tokio_postgres::Client, refused: &str) -> Vec<u32> {
    let rows = client
        .query(
            &format!(
                "SELECT c FROM (SELECT c, chr(c) AS t FROM generate_series(1, 1114111) AS c
                                WHERE c NOT BETWEEN 55296 AND 57343) AS x
                 WHERE {refused} ORDER BY c"
            ),
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<_, i32>(0) as u32).collect()
}

/// The same for a function of one text argument, `f(t)` false for a refused text,
/// evaluated on strings of 60 code points first (a string passes exactly when each of its
/// characters does, and 60 four-byte characters fit a name) and one by one only within
/// the strings that fail: one query, a few thousand calls.
async fn refused_by_function(client: &tokio_postgres::Client, f: &str) -> Vec<u32> {
    let rows = client
        .query(
            &format!(
                "WITH cp AS (SELECT c FROM generate_series(1, 1114111) AS c
                             WHERE c NOT BETWEEN 55296 AND 57343),
                 chunk AS (SELECT c / 60 AS k, string_agg(chr(c), '' ORDER BY c) AS s
                           FROM cp GROUP BY 1),
                 suspect AS (SELECT k FROM chunk WHERE NOT {f}(s))
                 SELECT cp.c FROM cp JOIN suspect ON suspect.k = cp.c / 60
                 WHERE NOT {f}(chr(cp.c)) ORDER BY cp.c"
            ),
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<_, i32>(0) as u32).collect()
}

/// A CHECK constraint of pgbus.events as an SQL condition.
async fn check_of(client: &tokio_postgres::Client, constraint: &str) -> String {
    client
        .query_one(
            "SELECT pg_get_expr(conbin, conrelid) FROM pg_constraint
             WHERE conrelid = 'pgbus.events'::regclass AND conname = $1",
            &[&constraint],
        )
        .await
        .unwrap()
        .get(0)
}

/// `ranges` as the library's table, to paste when a Unicode version changes it.
fn as_table(ranges: impl Iterator<Item = std::ops::RangeInclusive<u32>>) -> String {
    ranges
        .map(|r| format!("    (0x{:04X}, 0x{:04X}),\n", r.start(), r.end()))
        .collect()
}

/// For every code point, the library and every check of the schema refuse exactly what
/// Unicode's data says: control characters, Default_Ignorable_Code_Point, U+2028 and
/// U+2029 in ids and keys, and White_Space and `*` as well in names.
#[tokio::test]
async fn every_code_point_is_judged_as_the_unicode_data_says() {
    let truth = Truth::new();
    let ids: Vec<u32> = code_points()
        .map(u32::from)
        .filter(|c| truth.refused_in_ids(*c))
        .collect();
    let names: Vec<u32> = code_points()
        .map(u32::from)
        .filter(|c| truth.refused_in_names(*c))
        .collect();

    // The library.
    let library_ids: Vec<u32> = code_points()
        .filter(|c| c.is_control() || pgbus::is_invisible(*c))
        .map(u32::from)
        .collect();
    assert!(
        library_ids == ids,
        "pgbus::is_invisible differs from Unicode's Default_Ignorable_Code_Point; the table \
         from the Unicode data:\n{}",
        as_table(truth.ignorable.iter_ranges())
    );
    let library_names: Vec<u32> = code_points()
        .filter(|c| pgbus::admin::validate_subscription(&c.to_string(), &["*"]).is_err())
        .map(u32::from)
        .collect();
    assert_eq!(library_names, names);
    // Through publishing, every refused code point in an id.
    for c in ids.iter().filter_map(|c| char::from_u32(*c)) {
        let event = Event::new("order.placed", json!({})).aggregate("order", format!("a{c}"));
        assert!(pgbus::__private::encode(&event).is_err(), "{c:?}");
    }

    // The schema: the events' constraints, and the functions the subscriptions' use.
    let db = common::test_db().await;
    let client = db.connect().await;
    let id_check = check_of(&client, "events_ids_visible").await;
    let id_check = id_check
        .replace("COALESCE(correlation_id, ''::text)", "''")
        .replace("COALESCE(causation_id, ''::text)", "''")
        .replace("COALESCE(aggregate_type, ''::text)", "''")
        .replace("COALESCE(aggregate_id, ''::text)", "''")
        .replace("COALESCE(ordering_key, ''::text)", "''")
        .replace("COALESCE(source, ''::text)", "''")
        .replace("id", "t");
    assert!(!id_check.contains("COALESCE"), "{id_check}");
    assert_eq!(
        refused_by_schema(&client, &format!("NOT ({id_check})")).await,
        ids
    );
    let name_check = check_of(&client, "events_event_name_check")
        .await
        .replace("event_name", "t");
    assert_eq!(
        refused_by_schema(&client, &format!("NOT ({name_check})")).await,
        names
    );
    assert_eq!(
        refused_by_function(&client, "pgbus.visible_text").await,
        ids
    );
    assert_eq!(
        refused_by_function(&client, "pgbus.valid_name").await,
        names
    );
}

/// Text of visible characters.
fn visible() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9._:-é注文]{0,8}"
}

/// Any code point of `set`.
fn one_of(set: Vec<char>) -> impl Strategy<Value = char> {
    proptest::sample::select(set)
}

/// Anywhere in an id, key or name, any code point of the refused ranges is refused by
/// the library and by the schema, and nothing is written; and White_Space anywhere in a
/// name.
#[test]
fn refused_code_points_anywhere_are_refused_by_library_and_schema() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = runtime.block_on(common::test_db());
    let client = runtime.block_on(db.connect());
    let truth = Truth::new();
    let in_ids: Vec<char> = code_points()
        .filter(|c| truth.refused_in_ids(u32::from(*c)))
        .collect();
    let in_names: Vec<char> = code_points()
        .filter(|c| truth.refused_in_names(u32::from(*c)) && !truth.refused_in_ids(u32::from(*c)))
        .collect();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(visible(), one_of(in_ids), one_of(in_names), visible()),
            |(before, id_char, name_char, after)| {
                runtime.block_on(async {
                    assert_refused(&client, &format!("{before}{id_char}{after}"), true).await;
                    assert_name_refused(&client, &format!("n{before}{name_char}{after}")).await;
                });
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(runtime.block_on(written(&client)), 0);
}
