//! What the library's and the command line's exact-number tests share
//! (`tests/exact_numbers.rs`, `cli/tests/exact_numbers.rs`).

use serde_json::Value;
use tokio_postgres::Client;

/// JSON texts whose numbers an `f64` cannot hold, or that jsonb writes differently.
pub(crate) const PAYLOADS: &[&str] = &[
    r#"{"big": 18446744073709551617, "dec": 12345678.123456789012, "tiny": 1e-400}"#,
    r#"[9007199254740993, -9007199254740993, 340282366920938463463374607431768211457,
        -170141183460469231731687303715884105729, 123456789012345678901234567890.5]"#,
    r#"{"x": [0.1, 1.0, 1.50, 100, 1e17, 1E+17, 2.5e-10, 1e400, -1e-400]}"#,
    r#"{"zeros": [-0, -0.0, 0.0, 0e10, 0.000]}"#,
    r#"{"money": 0.30000000000000000004, "n": {"deep": [[99999999999999999999.99]]}}"#,
];

/// The stored payload of event `id`: its text form parsed (numbers kept as text), and
/// whether it equals `published` as jsonb (numeric equality, no rounding on the way in).
pub(crate) async fn stored_payload(client: &Client, id: &str, published: &str) -> (Value, bool) {
    let row = client
        .query_one(
            "SELECT payload::text, payload = $2::text::jsonb FROM pgbus.events WHERE id = $1",
            &[&id, &published],
        )
        .await
        .unwrap();
    let text: String = row.get(0);
    (serde_json::from_str(&text).unwrap(), row.get(1))
}

/// `delivered` is `stored` exactly: the same JSON with the same number texts.
pub(crate) fn assert_exact(what: &str, delivered: &Value, stored: &Value) {
    // With arbitrary_precision, numbers compare by their text.
    assert_eq!(delivered, stored, "{what}");
    assert_eq!(
        serde_json::to_string(delivered).unwrap(),
        serde_json::to_string(stored).unwrap(),
        "{what}"
    );
}
