//! Reading claimed events back from the log, one column at a time.
//!
//! Anything with the rights to write `pgbus.events` can store values this library cannot
//! represent: an `occurred_at` of `infinity`, JSON nested deeper than serde_json reads,
//! text that is not UTF-8 in a `SQL_ASCII` database. Each column is decoded on its own,
//! and a failure names the column, so that the claimer dead-letters that one delivery
//! with a useful reason and hands out the rest of the claim.

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, Type};

use crate::event::{Event, NUMBER_TOKEN};

/// A column that could not be decoded, and why.
#[derive(Debug)]
pub(crate) struct Undecodable {
    /// The column's name in `pgbus.events`.
    pub(crate) column: &'static str,
    pub(crate) reason: String,
}

impl std::fmt::Display for Undecodable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.column, self.reason)
    }
}

/// Decodes the event of one claimed row. `seq` was read already (the delivery's key).
/// Returns it with the bytes of JSON text its payload and headers arrived as.
pub(crate) fn event(row: &Row, seq: i64) -> Result<(Event, usize), Undecodable> {
    let payload: Jsonb = get(row, "payload")?;
    let headers: Jsonb = get(row, "headers")?;
    if !headers.value.is_object() {
        return Err(Undecodable {
            column: "headers",
            reason: format!(
                "must be a JSON object, got {}",
                crate::event::json_type_name(&headers.value)
            ),
        });
    }
    let occurred_at: Timestamp = get(row, "occurred_at")?;
    let created_at: Timestamp = get(row, "created_at")?;
    let bytes = payload.bytes + headers.bytes;
    let event = Event {
        seq: Some(seq),
        id: get(row, "id")?,
        name: get(row, "event_name")?,
        version: get(row, "event_version")?,
        source: get(row, "source")?,
        aggregate_type: get(row, "aggregate_type")?,
        aggregate_id: get(row, "aggregate_id")?,
        correlation_id: get(row, "correlation_id")?,
        causation_id: get(row, "causation_id")?,
        occurred_at: Some(occurred_at.0),
        payload: payload.value,
        headers: headers.value,
        deliver_at: None,
        delay: None,
        created_at: Some(created_at.0),
        ordering_key: get(row, "ordering_key")?,
    };
    Ok((event, bytes))
}

/// What can be known of an event that could not be decoded: its seq, and its id when
/// that column at least is readable (for the logs).
pub(crate) fn placeholder(row: &Row, seq: i64) -> Event {
    let mut event = Event::new(
        row.try_get::<_, String>("event_name").unwrap_or_default(),
        Value::Null,
    );
    event.id = row.try_get::<_, String>("id").unwrap_or_default();
    event.seq = Some(seq);
    event
}

/// The column `column` of a claimed row (by name: [`CLAIM_CALL`](crate::sql::CLAIM_CALL) returns
/// the event's columns under their names in `pgbus.events`).
fn get<'a, T: FromSql<'a>>(row: &'a Row, column: &'static str) -> Result<T, Undecodable> {
    row.try_get(column).map_err(|e| Undecodable {
        column,
        // tokio-postgres wraps the cause in "error deserializing column N": the cause
        // is what says what is wrong.
        reason: match std::error::Error::source(&e) {
            Some(cause) => cause.to_string(),
            None => e.to_string(),
        },
    })
}

type BoxError = Box<dyn std::error::Error + Sync + Send>;

/// A `timestamptz` that this library can represent, with a reason when it cannot
/// (`infinity`, `-infinity`, or beyond chrono's range of about ±262,000 years).
struct Timestamp(DateTime<Utc>);

impl<'a> FromSql<'a> for Timestamp {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Self, BoxError> {
        let micros = match <[u8; 8]>::try_from(raw) {
            Ok(bytes) => i64::from_be_bytes(bytes),
            Err(_) => return Err(format!("a timestamp of {} bytes", raw.len()).into()),
        };
        match micros {
            i64::MAX => Err("infinity cannot be represented".into()),
            i64::MIN => Err("-infinity cannot be represented".into()),
            _ => DateTime::<Utc>::from_sql(ty, raw)
                .map(Timestamp)
                .map_err(|_| "beyond the range of times that can be represented".into()),
        }
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TIMESTAMPTZ
    }
}

/// A `jsonb` value, and how many bytes of JSON text it arrived as.
struct Jsonb {
    value: Value,
    bytes: usize,
}

impl<'a> FromSql<'a> for Jsonb {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, BoxError> {
        let text = match raw.split_first() {
            Some((1, text)) => text,
            Some((version, _)) => {
                return Err(format!("unsupported jsonb format version {version}").into());
            }
            None => return Err("an empty jsonb value".into()),
        };
        // In jsonb's text form every quote inside a string is escaped, so this sequence
        // appears exactly where an object has a key ending in the token.
        let key = format!("{NUMBER_TOKEN}\": ");
        if memfind(text, key.as_bytes()) {
            return Err(format!(
                "an object has the key {NUMBER_TOKEN:?}, which serde_json reserves for numbers"
            )
            .into());
        }
        let value = serde_json::from_slice(text)?;
        Ok(Jsonb {
            value,
            bytes: text.len(),
        })
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }
}

fn memfind(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_name_what_cannot_be_represented() {
        let ty = Type::TIMESTAMPTZ;
        let err = |micros: i64| {
            Timestamp::from_sql(&ty, &micros.to_be_bytes())
                .err()
                .map(|e| e.to_string())
        };
        assert_eq!(err(i64::MAX).unwrap(), "infinity cannot be represented");
        assert_eq!(err(i64::MIN).unwrap(), "-infinity cannot be represented");
        assert!(err(i64::MAX - 1).unwrap().contains("beyond the range"));
        assert!(err(0).is_none());
    }

    #[test]
    fn jsonb_refuses_objects_that_would_come_back_as_numbers() {
        let raw = |text: &str| [&[1u8][..], text.as_bytes()].concat();
        let ty = Type::JSONB;
        let key = format!("{{\"{NUMBER_TOKEN}\": \"12\"}}");
        assert!(Jsonb::from_sql(&ty, &raw(&key)).is_err());
        // In a string it is harmless: its quote is escaped.
        let string = format!("{{\"a\": \"\\\"{NUMBER_TOKEN}\\\": 1\"}}");
        let ok = Jsonb::from_sql(&ty, &raw(&string)).unwrap();
        assert!(ok.value.is_object());
        assert_eq!(ok.bytes, string.len());
        assert!(Jsonb::from_sql(&ty, &[2, b'1']).is_err());
    }
}
