//! The event envelope and its builder, and the validation of what goes into the log.

use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::{Error, Result};

/// The longest event name, subscription name or event id, in bytes; also the longest
/// aggregate type and source.
pub const MAX_NAME_BYTES: usize = 255;

/// The longest aggregate id, ordering key, correlation id or causation id, in bytes: 512.
///
/// Ordered subscriptions keep an event's key (its ordering key, or `"type:id"`) in btree
/// indexes, whose entries hold at most about 2.7 kB: with these bounds a key is at most
/// 768 bytes. Publishing refuses a longer identifier with [`Error::Invalid`]; the schema
/// refuses it for every SQL writer (SQLSTATE 23514, constraint `events_<column>_length`).
pub const MAX_KEY_BYTES: usize = 512;

/// The deepest nesting of arrays and objects accepted in a payload or headers: 127, the
/// most that a reader using serde_json's default recursion limit (tokio-postgres among
/// them) can decode.
pub const MAX_JSON_DEPTH: usize = 127;

/// The longest [`Event::delay`]: 100 years (36,500 days). Longer is refused as bad input.
pub const MAX_DELAY: Duration = Duration::from_secs(36_500 * 24 * 3600);

/// The default limit on an event's payload, in bytes of JSON text as consumers receive it
/// (see [`json_text_bytes`]): 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// The schema's own limit on an event's payload and headers together: 16 MiB of JSON
/// text as consumers receive it, PostgreSQL's text form of the stored jsonb
/// (`octet_length(payload::text) + octet_length(headers::text)`, see [`json_text_bytes`]),
/// whatever the stored, possibly compressed, size. It holds for every writer, SQL
/// included (the CHECK constraint `events_size_limit`, SQLSTATE 23514), whatever
/// [`Publisher::max_payload_bytes`](crate::Publisher::max_payload_bytes) allows; the
/// library checks it before sending.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// An event: the immutable envelope written to `pgbus.events`.
///
/// Build one with [`Event::new`] and the chained setters, then publish it with
/// [`publish`](crate::publish). The id defaults to a fresh UUIDv7, so it is known before
/// the event is published and can be logged or returned to a caller.
///
/// Handlers receive the same type, read back from the log, with the fields PostgreSQL
/// filled in (`seq`, `occurred_at`, `created_at`).
///
/// ```
/// use pgbus::Event;
/// use serde_json::json;
///
/// let event = Event::new("order.placed", json!({"order_id": 42}))
///     .aggregate("order", "42")
///     .correlation_id("req-7f3a")
///     .header("tenant", "acme");
/// assert_eq!(event.name, "order.placed");
/// assert_eq!(event.aggregate_id.as_deref(), Some("42"));
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Event {
    /// The event's position in the log; `None` until it is read back from the log.
    pub seq: Option<i64>,
    /// The idempotency key (default: a fresh UUIDv7).
    pub id: String,
    /// The event's name, e.g. `order.placed`; subscriptions match on it.
    pub name: String,
    /// The payload's schema version (default 1).
    pub version: i32,
    /// The service or component that emitted the event.
    pub source: Option<String>,
    /// The kind of entity the event is about, e.g. `order`.
    pub aggregate_type: Option<String>,
    /// The id of the entity the event is about.
    pub aggregate_id: Option<String>,
    /// Shared by everything one request caused.
    pub correlation_id: Option<String>,
    /// The id of the event or command that caused this one.
    pub causation_id: Option<String>,
    /// When it happened; `None` means the publishing transaction's `now()`.
    pub occurred_at: Option<DateTime<Utc>>,
    /// The payload.
    ///
    /// Numbers are exact: pgbus builds serde_json with `arbitrary_precision`, so a number
    /// is kept as its decimal text (`18446744073709551617`, `0.1000000000000000000001`)
    /// and a handler receives what `jsonb` holds, never a value rounded through `f64`.
    /// jsonb itself writes numbers in its own canonical form (`1e3` comes back as `1000`).
    /// Read them with `as_u64`/`as_i64`/`as_f64` (lossy where they do not fit), or as
    /// text with `Number::as_str`. The feature is on for every crate of the build that uses
    /// serde_json; an object whose key ends in `"$serde_json::private::Number"` is
    /// refused, since serde_json would read it back as a number.
    pub payload: Value,
    /// Headers: a JSON object of metadata (tracing context, tenant, ...).
    pub headers: Value,
    /// Deliver no earlier than this time (set by [`Event::deliver_at`]).
    pub deliver_at: Option<DateTime<Utc>>,
    /// Deliver after this delay, by the database's clock (set by [`Event::delay`]).
    pub delay: Option<Duration>,
    /// When the event was written to the log; `None` until read back from it.
    pub created_at: Option<DateTime<Utc>>,
    /// The key that ordered subscriptions keep this event in order by. `None` means the
    /// aggregate (`"type:id"`) when one is set, else unordered.
    pub ordering_key: Option<String>,
}

impl Event {
    /// A new event named `name` (e.g. `order.placed`) carrying `payload`.
    ///
    /// Its id is a fresh UUIDv7; its version is 1; its headers are an empty object.
    pub fn new(name: impl Into<String>, payload: Value) -> Self {
        Event {
            seq: None,
            id: uuid::Uuid::now_v7().to_string(),
            name: name.into(),
            version: 1,
            source: None,
            aggregate_type: None,
            aggregate_id: None,
            correlation_id: None,
            causation_id: None,
            occurred_at: None,
            payload,
            headers: Value::Object(Default::default()),
            deliver_at: None,
            delay: None,
            created_at: None,
            ordering_key: None,
        }
    }

    /// A new event named `name` whose payload is `payload` serialized with serde, as
    /// [`Event::new`] otherwise.
    ///
    /// ```
    /// #[derive(serde::Serialize)]
    /// struct OrderPlaced {
    ///     order_id: i64,
    /// }
    ///
    /// let event = pgbus::Event::json("order.placed", &OrderPlaced { order_id: 42 })?;
    /// assert_eq!(event.payload, serde_json::json!({"order_id": 42}));
    /// # Ok::<(), pgbus::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] (`payload`) when `payload` cannot be represented as JSON (a map
    /// whose keys are not strings, a `Serialize` implementation that fails); nothing else
    /// happens.
    pub fn json<T: serde::Serialize + ?Sized>(
        name: impl Into<String>,
        payload: &T,
    ) -> Result<Self> {
        let payload = serde_json::to_value(payload)
            .map_err(|e| Error::invalid("payload", format!("cannot be serialized as JSON: {e}")))?;
        Ok(Event::new(name, payload))
    }

    /// Sets the id: the idempotency key. Publishing the same id again with the same
    /// content is a no-op; with different content it fails with [`Error::Conflict`].
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Sets the schema version of the payload (default 1).
    pub fn version(mut self, version: i32) -> Self {
        self.version = version;
        self
    }

    /// Sets the source: the service or component that emitted the event.
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Sets the aggregate (the entity the event is about), e.g. `("order", "42")`.
    pub fn aggregate(mut self, kind: impl Into<String>, id: impl Into<String>) -> Self {
        self.aggregate_type = Some(kind.into());
        self.aggregate_id = Some(id.into());
        self
    }

    /// Sets the ordering key: ordered subscriptions deliver the events of one key one at
    /// a time, in the order their transactions committed, while other keys flow. Default:
    /// the aggregate (`"type:id"`) when one is set.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the correlation id shared by everything one request caused.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Sets the causation id: the id of the event or command that caused this one.
    pub fn causation_id(mut self, id: impl Into<String>) -> Self {
        self.causation_id = Some(id.into());
        self
    }

    /// Sets when the event happened (default: the publishing transaction's `now()`).
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = Some(at);
        self
    }

    /// Replaces the headers. They must be a JSON object; anything else is refused by
    /// [`publish`](crate::publish) with [`Error::Invalid`].
    pub fn headers(mut self, headers: Value) -> Self {
        self.headers = headers;
        self
    }

    /// Adds one header (replacing headers that were not an object).
    pub fn header(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        if !self.headers.is_object() {
            self.headers = Value::Object(Default::default());
        }
        if let Value::Object(map) = &mut self.headers {
            map.insert(key.into(), value.into());
        }
        self
    }

    /// Delays delivery by `delay`, measured by the database's clock from the publishing
    /// transaction's start. At most [`MAX_DELAY`] (100 years): publishing refuses more
    /// with [`Error::Invalid`].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self.deliver_at = None;
        self
    }

    /// Delivers no earlier than `at`.
    pub fn deliver_at(mut self, at: DateTime<Utc>) -> Self {
        self.deliver_at = Some(at);
        self.delay = None;
        self
    }

    /// The payload deserialized into `T`.
    ///
    /// # Errors
    ///
    /// When the payload does not have the shape of `T`.
    pub fn payload_as<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        T::deserialize(&self.payload)
    }

    /// Checks everything PostgreSQL would refuse, and the size limit, and returns the
    /// payload and headers as JSON text ready to send.
    pub(crate) fn encode(&self, max_payload_bytes: usize) -> Result<Encoded> {
        self.check_identifiers()?;
        self.check_json()?;
        // Measured as consumers will receive it, before anything is serialized: a number
        // like 1e131071 is 8 bytes here and 131,072 digits there.
        let payload_bytes = json_text_bytes(&self.payload);
        if payload_bytes > max_payload_bytes {
            return Err(Error::invalid(
                "payload",
                format!(
                    "{payload_bytes} bytes of JSON exceeds the limit of {max_payload_bytes} \
                     bytes"
                ),
            ));
        }
        let total = payload_bytes.saturating_add(json_text_bytes(&self.headers));
        if total > MAX_EVENT_BYTES {
            return Err(Error::invalid(
                "event",
                format!(
                    "payload and headers are {total} bytes of JSON together, more than the \
                     schema's limit of {MAX_EVENT_BYTES} bytes"
                ),
            ));
        }
        let payload = serde_json::to_string(&self.payload)
            .map_err(|e| Error::invalid("payload", e.to_string()))?;
        let headers = serde_json::to_string(&self.headers)
            .map_err(|e| Error::invalid("headers", e.to_string()))?;
        let delay_ms = match self.delay {
            Some(d) if d > MAX_DELAY => {
                return Err(Error::invalid(
                    "delay",
                    format!("{d:?} is longer than the longest delay, {MAX_DELAY:?} (100 years)"),
                ));
            }
            Some(d) => Some(d.as_millis() as i64),
            None => None,
        };
        Ok(Encoded {
            payload,
            headers,
            delay_ms,
        })
    }

    /// The name, the id and the other identifiers: what PostgreSQL's text and the
    /// schema's checks accept.
    fn check_identifiers(&self) -> Result<()> {
        validate_name("event name", &self.name)?;
        if self.id.is_empty() || self.id.len() > MAX_NAME_BYTES {
            return Err(Error::invalid(
                "event id",
                format!(
                    "must be 1 to {MAX_NAME_BYTES} bytes, got {} bytes",
                    self.id.len()
                ),
            ));
        }
        for (what, text, max) in [
            ("event id", Some(self.id.as_str()), MAX_NAME_BYTES),
            ("source", self.source.as_deref(), MAX_NAME_BYTES),
            (
                "aggregate type",
                self.aggregate_type.as_deref(),
                MAX_NAME_BYTES,
            ),
            ("aggregate id", self.aggregate_id.as_deref(), MAX_KEY_BYTES),
            (
                "correlation id",
                self.correlation_id.as_deref(),
                MAX_KEY_BYTES,
            ),
            ("causation id", self.causation_id.as_deref(), MAX_KEY_BYTES),
            ("ordering key", self.ordering_key.as_deref(), MAX_KEY_BYTES),
        ] {
            if let Some(len) = text.map(str::len).filter(|len| *len > max) {
                return Err(Error::invalid(
                    what,
                    format!("must be at most {max} bytes, got {len} bytes"),
                ));
            }
            if text.is_some_and(|t| t.contains('\0')) {
                return Err(Error::invalid(
                    what,
                    "contains \\u0000, which PostgreSQL text cannot store",
                ));
            }
            if let Some(text) = text {
                validate_visible(what, text)?;
            }
        }
        Ok(())
    }

    /// The payload and headers: headers an object, no `\u0000`, no serde_json number
    /// token, not nested too deep.
    fn check_json(&self) -> Result<()> {
        if !self.headers.is_object() {
            return Err(Error::invalid(
                "headers",
                format!(
                    "must be a JSON object, got {}",
                    json_type_name(&self.headers)
                ),
            ));
        }
        check_no_nul("payload", &self.payload)?;
        check_no_nul("headers", &self.headers)?;
        check_no_number_token("payload", &self.payload)?;
        check_no_number_token("headers", &self.headers)?;
        for (what, value) in [("payload", &self.payload), ("headers", &self.headers)] {
            if too_deep(value, MAX_JSON_DEPTH) {
                return Err(Error::invalid(
                    what,
                    format!("nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"),
                ));
            }
        }
        Ok(())
    }
}

/// The key serde_json (with `arbitrary_precision`) reads an object as a number by: an
/// object whose first key it is comes back as a number, or fails to decode.
pub(crate) const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// An event's JSON text, validated and ready for the wire.
#[derive(Debug)]
pub(crate) struct Encoded {
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) delay_ms: Option<i64>,
}

/// Checks an event or subscription name: 1 to 255 bytes, no white space (Unicode's
/// White_Space, U+00A0 included), control, invisible ([`is_invisible`]) characters or `*`.
/// The same rule is a CHECK constraint in the schema.
pub(crate) fn validate_name(what: &'static str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(what, "must not be empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(
            what,
            format!(
                "must be at most {MAX_NAME_BYTES} bytes, got {} bytes",
                name.len()
            ),
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || *c == '*' || is_invisible(*c))
    {
        return Err(Error::invalid(
            what,
            format!(
                "{name:?} contains {c:?}; white space, control characters, invisible \
                 formatting characters and '*' are not allowed"
            ),
        ));
    }
    Ok(())
}

/// Whether `c` is invisible: a code point of Unicode's Default_Ignorable_Code_Point set
/// (bidirectional marks and controls, zero-width characters, the soft hyphen, variation
/// selectors, Hangul fillers, tags, the byte order mark, ...), which renders as nothing
/// or changes how the text around it reads, or the line or paragraph separator (U+2028,
/// U+2029). Two ids that differ only by such characters print alike. pgbus refuses them,
/// with control characters, in ids, keys and names; the schema refuses the same
/// (`pgbus.visible_text` and the events' CHECK constraints).
pub fn is_invisible(c: char) -> bool {
    let c = u32::from(c);
    c >= 0xAD
        && (c == 0x2028
            || c == 0x2029
            || DEFAULT_IGNORABLE
                .iter()
                .any(|&(first, last)| (first..=last).contains(&c)))
}

/// Unicode's Default_Ignorable_Code_Point property (DerivedCoreProperties.txt), as
/// inclusive ranges of code points. Generated from the Unicode data: `tests/visible_text.rs`
/// compares it, and the schema's checks, with that data for every code point, and prints
/// the table anew when a Unicode version changes it.
const DEFAULT_IGNORABLE: [(u32, u32); 17] = [
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
];

/// The bytes of JSON text that PostgreSQL gives back for `value` stored as `jsonb`
/// (`octet_length(value::jsonb::text)`): what a consumer receives, in either wire format,
/// and what pgbus's size limits measure. It differs from `serde_json::to_string`: jsonb
/// writes `", "` and `": "` between items, and numbers in its canonical form (`1e3` as
/// `1000`, `1.50e1` as `15.0`), which can be far longer than the number as written.
///
/// ```
/// use serde_json::json;
///
/// assert_eq!(pgbus::json_text_bytes(&json!({"a": [1, 2]})), r#"{"a": [1, 2]}"#.len());
/// let number: serde_json::Value = serde_json::from_str("1e6").unwrap();
/// assert_eq!(pgbus::json_text_bytes(&number), "1000000".len());
/// ```
pub fn json_text_bytes(value: &Value) -> usize {
    match value {
        Value::Null => 4,
        Value::Bool(true) => 4,
        Value::Bool(false) => 5,
        Value::Number(n) => numeric_text_bytes(n.as_str()),
        Value::String(s) => string_text_bytes(s),
        Value::Array(items) => items
            .iter()
            .map(json_text_bytes)
            .fold(2 + 2 * items.len().saturating_sub(1), usize::saturating_add),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| string_text_bytes(k).saturating_add(json_text_bytes(v).saturating_add(2)))
            .fold(2 + 2 * map.len().saturating_sub(1), usize::saturating_add),
    }
}

/// A string as jsonb writes it: quoted, with `"`, `\`, backspace, form feed, newline,
/// carriage return and tab as two-character escapes and the other control characters
/// below U+0020 as `\u00XX`.
fn string_text_bytes(s: &str) -> usize {
    s.bytes().fold(2usize, |n, b| {
        n.saturating_add(match b {
            b'"' | b'\\' | 0x08 | 0x0C | b'\n' | b'\r' | b'\t' => 2,
            0x00..=0x1F => 6,
            _ => 1,
        })
    })
}

/// A JSON number as PostgreSQL's `numeric` writes it back: the digits of its integer part
/// (at least one), and as many decimals as the text had after the point less the exponent,
/// with a sign unless it is zero. A number PostgreSQL cannot store is refused by the
/// server; its length here only needs to be large.
fn numeric_text_bytes(n: &str) -> usize {
    let (negative, n) = match n.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, n),
    };
    let (mantissa, exponent) = match n.find(['e', 'E']) {
        Some(i) => (&n[..i], n[i + 1..].parse::<i64>().unwrap_or(i64::MAX)),
        None => (n, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let leading_zeros = int
        .bytes()
        .chain(frac.bytes())
        .take_while(|b| *b == b'0')
        .count();
    let significant = (int.len() + frac.len() - leading_zeros) as i128;
    let (exponent, frac_digits) = (i128::from(exponent), frac.len() as i128);
    let decimals = (frac_digits - exponent).max(0);
    let int_digits = if significant == 0 {
        1
    } else {
        (significant + exponent - frac_digits).max(1)
    };
    let sign = i128::from(negative && significant > 0);
    let point = if decimals > 0 { 1 + decimals } else { 0 };
    usize::try_from(sign + int_digits + point).unwrap_or(usize::MAX)
}

/// Checks an identifier an operator reads (event id, correlation id, ...): no control or
/// invisible formatting characters, which could make one event print as another.
fn validate_visible(what: &'static str, text: &str) -> Result<()> {
    if let Some(c) = text.chars().find(|c| c.is_control() || is_invisible(*c)) {
        return Err(Error::invalid(
            what,
            format!(
                "{text:?} contains {c:?}; control characters and invisible formatting \
                 characters are not allowed"
            ),
        ));
    }
    Ok(())
}

/// Checks a subscription pattern: `*`, an exact event name, or a name prefix followed by
/// `.*` (which matches every name that starts with the prefix and a dot).
pub(crate) fn validate_pattern(pattern: &str) -> Result<()> {
    if pattern == "*" {
        return Ok(());
    }
    let base = pattern.strip_suffix(".*").unwrap_or(pattern);
    validate_name("pattern", base).map_err(|e| match e {
        Error::Invalid { reason, .. } => Error::invalid(
            "pattern",
            format!("{pattern:?}: {reason} (use '*', an event name, or 'prefix.*')"),
        ),
        e => e,
    })
}

/// Whether `pattern` matches `event_name` (the same rule as `pgbus.pattern_matches`).
pub fn pattern_matches(pattern: &str, event_name: &str) -> bool {
    if pattern == "*" || pattern == event_name {
        return true;
    }
    match pattern.strip_suffix('*') {
        Some(prefix) if prefix.ends_with('.') => event_name.starts_with(prefix),
        _ => false,
    }
}

/// PostgreSQL's jsonb cannot store `\u0000`; find it first and name where it is.
fn check_no_nul(what: &'static str, value: &Value) -> Result<()> {
    match locate(value, &|s| s.contains('\0'), &|k| k.contains('\0')) {
        Some(at) => Err(Error::invalid(
            what,
            format!("contains \\u0000 at {at}, which PostgreSQL's jsonb cannot store"),
        )),
        None => Ok(()),
    }
}

/// An object with serde_json's number key would be read back as a number (or not at
/// all): refuse it, as jsonb refuses `\u0000`.
fn check_no_number_token(what: &'static str, value: &Value) -> Result<()> {
    let token = NUMBER_TOKEN;
    match locate(value, &|_| false, &|k| k.ends_with(token)) {
        Some(at) => Err(Error::invalid(
            what,
            format!(
                "has a key ending in {token:?} at {at}, which serde_json reserves for \
                 numbers: the object would not be delivered as it was published"
            ),
        )),
        None => Ok(()),
    }
}

/// The path of the first string matching `string` or object key matching `key`.
fn locate(
    value: &Value,
    string: &dyn Fn(&str) -> bool,
    key: &dyn Fn(&str) -> bool,
) -> Option<String> {
    fn walk(
        value: &Value,
        path: &mut String,
        string: &dyn Fn(&str) -> bool,
        key: &dyn Fn(&str) -> bool,
    ) -> Option<String> {
        match value {
            Value::String(s) if string(s) => Some(path.clone()),
            Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| {
                let len = path.len();
                let _ = write!(path, "[{i}]");
                let found = walk(v, path, string, key);
                path.truncate(len);
                found
            }),
            Value::Object(map) => map.iter().find_map(|(k, v)| {
                let len = path.len();
                if is_plain_key(k) {
                    let _ = write!(path, ".{k}");
                } else {
                    let _ = write!(path, "[{}]", Value::String(k.clone()));
                }
                let found = if key(k) {
                    Some(format!("{path} (in the key)"))
                } else {
                    walk(v, path, string, key)
                };
                path.truncate(len);
                found
            }),
            _ => None,
        }
    }
    let mut path = String::from("$");
    walk(value, &mut path, string, key)
}

/// Whether `value` nests containers deeper than `levels`.
fn too_deep(value: &Value, levels: usize) -> bool {
    match value {
        Value::Array(items) => levels == 0 || items.iter().any(|v| too_deep(v, levels - 1)),
        Value::Object(map) => levels == 0 || map.values().any(|v| too_deep(v, levels - 1)),
        _ => false,
    }
}

fn is_plain_key(k: &str) -> bool {
    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(crate) fn json_type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_is_found_with_its_path() {
        let e = Event::new("a.b", json!({"x": [1, {"y z": "a\u{0}b"}]}));
        let err = e.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid payload: contains \\u0000 at $.x[1][\"y z\"], which PostgreSQL's jsonb cannot store"
        );
    }

    #[test]
    fn serde_jsons_number_key_is_refused() {
        let key = NUMBER_TOKEN;
        let e = Event::new("a.b", json!({"x": [{ key: "12" }]}));
        let err = e.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap_err();
        assert!(err.to_string().contains("at $.x[0]"), "{err}");
        let e = Event::new("a.b", json!({})).header(format!("x{key}"), 1);
        assert!(e.encode(DEFAULT_MAX_PAYLOAD_BYTES).is_err());
        // As a string it is harmless.
        let e = Event::new("a.b", json!({ "x": key }));
        assert!(e.encode(DEFAULT_MAX_PAYLOAD_BYTES).is_ok());
    }

    #[test]
    fn numbers_are_encoded_exactly() {
        let text = r#"{"big":18446744073709551617,"dec":12345678.123456789012,"tiny":1e-400}"#;
        let e = Event::new("a.b", serde_json::from_str(text).unwrap());
        assert_eq!(e.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap().payload, text);
    }

    #[test]
    fn nul_in_a_key_is_found() {
        let e = Event::new("a.b", json!({"k\u{0}": 1}));
        let err = e.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap_err();
        assert!(err.to_string().contains("(in the key)"), "{err}");
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("event name", "order.placed").is_ok());
        assert!(validate_name("event name", "").is_err());
        assert!(validate_name("event name", "a b").is_err());
        assert!(validate_name("event name", "a*").is_err());
        assert!(validate_name("event name", &"x".repeat(256)).is_err());
        assert!(validate_name("event name", &"x".repeat(255)).is_ok());
    }

    #[test]
    fn patterns_match_like_the_schema() {
        assert!(validate_pattern("*").is_ok());
        assert!(validate_pattern("order.*").is_ok());
        assert!(validate_pattern("order.placed").is_ok());
        assert!(validate_pattern("order*").is_err());
        assert!(validate_pattern("*.placed").is_err());
        assert!(validate_pattern("").is_err());
        assert!(pattern_matches("*", "x"));
        assert!(pattern_matches("order.*", "order.placed"));
        assert!(pattern_matches("order.*", "order.line.added"));
        assert!(!pattern_matches("order.*", "order"));
        assert!(!pattern_matches("order.*", "orders.placed"));
        assert!(pattern_matches("order.placed", "order.placed"));
        assert!(!pattern_matches("order.placed", "order.placed.v2"));
    }

    #[test]
    fn nesting_is_limited_to_what_readers_can_decode() {
        let nest = |n: usize| {
            let mut v = json!(1);
            for _ in 0..n {
                v = Value::Array(vec![v]);
            }
            v
        };
        assert!(
            Event::new("a", nest(127))
                .encode(DEFAULT_MAX_PAYLOAD_BYTES)
                .is_ok()
        );
        let err = Event::new("a", nest(128))
            .encode(DEFAULT_MAX_PAYLOAD_BYTES)
            .unwrap_err();
        assert!(err.to_string().contains("deeper than 127"), "{err}");
        let text = serde_json::to_string(&nest(127)).unwrap();
        assert!(serde_json::from_str::<Value>(&text).is_ok());
    }

    #[test]
    fn headers_must_be_an_object() {
        let e = Event::new("a", json!(1)).headers(json!([1]));
        let err = e.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid headers: must be a JSON object, got an array"
        );
    }

    #[test]
    fn payload_limit_is_enforced() {
        let e = Event::new("a", json!("x".repeat(100)));
        assert!(e.encode(50).is_err());
        assert!(e.encode(200).is_ok());
    }

    #[test]
    fn json_is_measured_as_jsonb_writes_it() {
        let bytes = |text: &str| json_text_bytes(&serde_json::from_str(text).unwrap());
        assert_eq!(
            bytes(r#"{"a":[1,2],"b":{}}"#),
            r#"{"a": [1, 2], "b": {}}"#.len()
        );
        assert_eq!(
            bytes(r#""a\"b\\c\n\u0001é""#),
            r#""a\"b\\c\n\u0001é""#.len()
        );
        for (number, as_jsonb) in [
            ("1.50e1", "15.0"),
            ("100e-2", "1.00"),
            ("-0.0", "0.0"),
            ("-0", "0"),
            ("0e5", "0"),
            ("1e-3", "0.001"),
            ("-12.5E+2", "-1250"),
            ("0.00", "0.00"),
            (
                "123456789012345678901234567890",
                "123456789012345678901234567890",
            ),
            ("1e3", "1000"),
        ] {
            assert_eq!(bytes(number), as_jsonb.len(), "{number}");
        }
        assert_eq!(bytes("1e131071"), 131_072);
        // An exponent PostgreSQL cannot take makes a number too long for any limit.
        assert!(bytes("1e99999999999999999999999") > MAX_EVENT_BYTES);
        assert!(bytes("1e-99999999999999999999999") > MAX_EVENT_BYTES);
    }

    #[test]
    fn the_payload_limit_counts_what_is_delivered() {
        // Seven bytes as serde_json writes it, nine as delivered: "[1, 2, 3]".
        let e = Event::new("a", json!([1, 2, 3]));
        assert!(e.encode(8).is_err());
        assert!(e.encode(9).is_ok());
        let bomb: Value =
            serde_json::from_str(&format!("[{}]", ["1e131071"; 130].join(","))).unwrap();
        let err = Event::new("a", bomb).encode(usize::MAX).unwrap_err();
        assert!(matches!(err, Error::Invalid { what: "event", .. }), "{err}");
    }

    #[test]
    fn keys_are_bounded() {
        let at = |n: usize| "k".repeat(n);
        type Set = fn(Event, String) -> Event;
        let cases: [(&str, Set, usize); 6] = [
            ("aggregate type", |e, s| e.aggregate(s, "1"), MAX_NAME_BYTES),
            ("source", |e, s| e.source(s), MAX_NAME_BYTES),
            ("aggregate id", |e, s| e.aggregate("t", s), MAX_KEY_BYTES),
            ("ordering key", |e, s| e.ordering_key(s), MAX_KEY_BYTES),
            ("correlation id", |e, s| e.correlation_id(s), MAX_KEY_BYTES),
            ("causation id", |e, s| e.causation_id(s), MAX_KEY_BYTES),
        ];
        for (what, set, max) in cases {
            let ok = set(Event::new("a", json!({})), at(max));
            assert!(ok.encode(DEFAULT_MAX_PAYLOAD_BYTES).is_ok(), "{what}");
            let long = set(Event::new("a", json!({})), at(max + 1));
            let err = long.encode(DEFAULT_MAX_PAYLOAD_BYTES).unwrap_err();
            assert!(
                matches!(err, Error::Invalid { what: w, .. } if w == what),
                "{err}"
            );
        }
    }

    #[test]
    fn lookalikes_are_invisible() {
        for c in [
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
        ] {
            assert!(is_invisible(c), "{c:?}");
            let e = Event::new("a", json!({})).aggregate("order", format!("order-{c}42"));
            assert!(e.encode(DEFAULT_MAX_PAYLOAD_BYTES).is_err(), "{c:?}");
        }
        assert!(!is_invisible('a') && !is_invisible('\u{00A0}') && !is_invisible('注'));
        assert!(validate_name("event name", "a\u{00A0}b").is_err());
        assert!(validate_name("event name", "a\u{3000}b").is_err());
    }
}
