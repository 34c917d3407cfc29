//! W3C Trace Context in event headers: a trace that crosses the bus.
//!
//! An event carries its creation context in two headers, [`TRACEPARENT`] and
//! [`TRACESTATE`], in the format of the W3C Trace Context recommendation (the same text
//! as the HTTP headers of those names, and as the `TRACEPARENT` / `TRACESTATE`
//! environment variables of OpenTelemetry's process carriers).
//!
//! With the `opentelemetry` feature, [`publish`](crate::publish()) and
//! [`publish_batch`](crate::publish_batch()) write the OpenTelemetry context of their
//! `publish` span (a child of the caller's current span) into the headers, unless the
//! event already carries either header; a handler's `process` span is a child of the
//! context an event carries, and links to it (`context` reads it, for a
//! [`Subscription`](crate::Subscription)'s consumer that makes spans of its own). Without
//! the feature, headers are written and read only as the caller gives them; [`TraceParent`]
//! and [`check_tracestate`] still check the text (the command line does, without an
//! OpenTelemetry SDK).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
#[cfg(feature = "opentelemetry")]
use crate::event::Event;

/// The header that carries an event's W3C `traceparent`: version, trace id, parent (span)
/// id and flags, e.g. `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`.
pub const TRACEPARENT: &str = "traceparent";

/// The header that carries an event's W3C `tracestate`: vendors' entries that go with
/// the [`TRACEPARENT`], e.g. `congo=t61rcWkgMzE`.
pub const TRACESTATE: &str = "tracestate";

/// A W3C `traceparent`, checked: a trace id and a parent id that are not all zeros, and
/// the trace flags.
///
/// Parsing follows the recommendation: version `00` is exactly 55 characters of lowercase
/// hex and dashes; a later version (not `ff`) may carry more fields after a dash, which
/// are ignored. [`Display`](fmt::Display) writes version `00`.
///
/// ```
/// use pgbus::trace_context::TraceParent;
///
/// let tp: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse()?;
/// assert!(tp.is_sampled());
/// assert_eq!(tp.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// assert!("00-00000000000000000000000000000000-00f067aa0ba902b7-01".parse::<TraceParent>().is_err());
/// # Ok::<(), pgbus::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

impl TraceParent {
    /// A `traceparent` of these ids and flags; `None` if either id is all zeros (invalid
    /// in W3C Trace Context).
    pub fn new(trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) -> Option<Self> {
        let valid = trace_id != [0; 16] && parent_id != [0; 8];
        valid.then_some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id: 16 bytes, not all zeros.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The parent id (the id of the span that created the event): 8 bytes, not all
    /// zeros.
    pub fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The trace flags; bit 0 is "sampled".
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the caller recorded its span (the "sampled" flag).
    pub fn is_sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// The length of a version-00 `traceparent`.
const TRACEPARENT_LEN: usize = 55;

impl FromStr for TraceParent {
    type Err = Error;

    /// Parses a `traceparent` header value.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] (what: `traceparent`) saying what is wrong.
    fn from_str(text: &str) -> Result<Self> {
        let bad = |reason: &str| {
            Error::invalid(
                "traceparent",
                format!(
                    "{reason} (expected 00-<32 hex digits>-<16 hex digits>-<2 hex digits>, \
                     lowercase, got {text:?})"
                ),
            )
        };
        let bytes = text.as_bytes();
        if bytes.len() < TRACEPARENT_LEN {
            return Err(bad("too short"));
        }
        let [version] = hex::<1>(&bytes[..2]).ok_or_else(|| bad("the version is not hex"))?;
        match version {
            0xff => return Err(bad("version ff is invalid")),
            0 if bytes.len() != TRACEPARENT_LEN => return Err(bad("too long for version 00")),
            _ if bytes.len() > TRACEPARENT_LEN && bytes[TRACEPARENT_LEN] != b'-' => {
                return Err(bad("a field after the flags must follow a dash"));
            }
            _ => {}
        }
        if [2, 35, 52].iter().any(|&i| bytes[i] != b'-') {
            return Err(bad("the fields must be separated by dashes"));
        }
        let trace_id = hex::<16>(&bytes[3..35]).ok_or_else(|| bad("the trace id is not hex"))?;
        let parent_id = hex::<8>(&bytes[36..52]).ok_or_else(|| bad("the parent id is not hex"))?;
        let [flags] = hex::<1>(&bytes[53..55]).ok_or_else(|| bad("the flags are not hex"))?;
        TraceParent::new(trace_id, parent_id, flags)
            .ok_or_else(|| bad("the trace id and the parent id must not be all zeros"))
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

/// `2 * N` lowercase hex digits as `N` bytes.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    let nibble = |d: u8| match d {
        b'0'..=b'9' => Some(d - b'0'),
        b'a'..=b'f' => Some(d - b'a' + 10),
        _ => None,
    };
    let mut out = [0; N];
    if digits.len() != 2 * N {
        return None;
    }
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// The most list members a `tracestate` holds.
const TRACESTATE_MEMBERS: usize = 32;

/// Checks a W3C `tracestate` header value: at most 32 comma-separated `key=value`
/// members with distinct keys, a key of lowercase letters, digits and `_-*/` (with an
/// optional `tenant@system` form) and a value of 1 to 256 printable ASCII characters
/// other than `,` and `=`, not ending with a space.
///
/// # Errors
///
/// [`Error::Invalid`] (what: `tracestate`) saying which member is wrong.
pub fn check_tracestate(text: &str) -> Result<()> {
    let mut keys = Vec::new();
    for member in text.split(',').map(|m| m.trim_matches([' ', '\t'])) {
        if member.is_empty() {
            continue;
        }
        let bad =
            |reason: &str| Error::invalid("tracestate", format!("{reason} in member {member:?}"));
        let (key, value) = member
            .split_once('=')
            .ok_or_else(|| bad("no = between key and value"))?;
        if !valid_key(key) {
            return Err(bad("an invalid key"));
        }
        let printable = |c: char| (' '..='~').contains(&c) && c != ',' && c != '=';
        if value.is_empty() || value.len() > 256 || value.ends_with(' ') {
            return Err(bad(
                "a value must be 1 to 256 characters, not ending with a space",
            ));
        }
        if !value.chars().all(printable) {
            return Err(bad(
                "a value of printable ASCII other than , and = is expected",
            ));
        }
        if keys.contains(&key) {
            return Err(bad("a key seen before"));
        }
        keys.push(key);
    }
    if keys.len() > TRACESTATE_MEMBERS {
        return Err(Error::invalid(
            "tracestate",
            format!("{} members, more than {TRACESTATE_MEMBERS}", keys.len()),
        ));
    }
    Ok(())
}

/// A `tracestate` key: `simple-key` or `tenant-id@system-id`.
fn valid_key(key: &str) -> bool {
    let rest = |s: &str, max: usize| {
        s.len() <= max
            && s.bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/'))
    };
    let first = |s: &str, digit: bool| {
        s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || (digit && b.is_ascii_digit()))
    };
    match key.split_once('@') {
        None => first(key, false) && rest(key, 256),
        Some((tenant, system)) => {
            first(tenant, true) && rest(tenant, 241) && first(system, false) && rest(system, 14)
        }
    }
}

/// The OpenTelemetry context an event was published in: a remote parent made of its
/// [`TRACEPARENT`] header (and [`TRACESTATE`], when it is valid); `None` when the event
/// carries no valid `traceparent`.
///
/// A [`Subscription`](crate::Subscription)'s consumer parents (or links) its own
/// processing span with it; a handler's `process` span already is.
///
/// ```
/// # fn f(delivery: &pgbus::Delivery) {
/// use tracing_opentelemetry::OpenTelemetrySpanExt;
///
/// let span = tracing::info_span!("index the order");
/// if let Some(cx) = pgbus::trace_context::context(delivery.event()) {
///     let _ = span.set_parent(cx);
/// }
/// # }
/// ```
#[cfg(feature = "opentelemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "opentelemetry")))]
pub fn context(event: &Event) -> Option<opentelemetry::Context> {
    use opentelemetry::trace::TraceContextExt;
    let remote = span_context(event)?;
    Some(opentelemetry::Context::new().with_remote_span_context(remote))
}

/// The event's [`TRACEPARENT`] (and [`TRACESTATE`]) as a remote span context.
#[cfg(feature = "opentelemetry")]
fn span_context(event: &Event) -> Option<opentelemetry::trace::SpanContext> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    let header = |name: &str| event.headers.get(name).and_then(serde_json::Value::as_str);
    let parent: TraceParent = header(TRACEPARENT)?.parse().ok()?;
    let state = header(TRACESTATE)
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.parent_id),
        TraceFlags::new(parent.flags),
        true,
        state,
    ))
}

/// Makes `span` (not yet entered) a child of the context `event` was published in, and
/// links it to that context; nothing when the event carries none, or without the
/// `opentelemetry` feature.
#[cfg(feature = "opentelemetry")]
pub(crate) fn follow(span: &tracing::Span, event: &Event) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if let (Some(cx), Some(remote)) = (context(event), span_context(event)) {
        // Fails only where the span is not recorded by OpenTelemetry: nothing to parent.
        let _ = span.set_parent(cx);
        span.add_link(remote);
    }
}

#[cfg(not(feature = "opentelemetry"))]
#[inline]
pub(crate) fn follow(_span: &tracing::Span, _event: &crate::event::Event) {}

/// The trace context that publishing writes into events' headers: the `traceparent`
/// and `tracestate` of a publish span (or, where that span is not recorded, of the
/// caller's current span). Empty without the `opentelemetry` feature.
#[derive(Debug, Default)]
pub(crate) struct Outgoing {
    #[cfg(feature = "opentelemetry")]
    headers: Option<(String, Option<String>)>,
}

impl Outgoing {
    /// The context of `span`, or of the current span when `span` has none.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn of(span: &tracing::Span) -> Self {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let valid = |s: &tracing::Span| {
            let cx = s.context();
            let sc = cx.span().span_context().clone();
            sc.is_valid().then_some(sc)
        };
        let headers = valid(span)
            .or_else(|| valid(&tracing::Span::current()))
            .and_then(|sc| {
                let parent = TraceParent::new(
                    sc.trace_id().to_bytes(),
                    sc.span_id().to_bytes(),
                    sc.trace_flags().to_u8(),
                )?;
                let state = sc.trace_state().header();
                Some((parent.to_string(), (!state.is_empty()).then_some(state)))
            });
        Outgoing { headers }
    }

    #[cfg(not(feature = "opentelemetry"))]
    #[inline]
    pub(crate) fn of(_span: &tracing::Span) -> Self {
        Outgoing {}
    }

    /// Rewrites `encoded` (the JSON text of `headers`, an object) with the context added,
    /// unless the caller's headers carry a `traceparent` or a `tracestate` of their own.
    #[cfg(feature = "opentelemetry")]
    pub(crate) fn write(&self, headers: &serde_json::Value, encoded: &mut String) {
        let (Some((parent, state)), Some(map)) = (&self.headers, headers.as_object()) else {
            return;
        };
        if map.contains_key(TRACEPARENT) || map.contains_key(TRACESTATE) {
            return;
        }
        let mut map = map.clone();
        map.insert(TRACEPARENT.into(), parent.clone().into());
        if let Some(state) = state {
            map.insert(TRACESTATE.into(), state.clone().into());
        }
        if let Ok(text) = serde_json::to_string(&map) {
            *encoded = text;
        }
    }

    #[cfg(not(feature = "opentelemetry"))]
    #[inline]
    pub(crate) fn write(&self, _headers: &serde_json::Value, _encoded: &mut String) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let tp: TraceParent = VALID.parse().unwrap();
        assert_eq!(tp.to_string(), VALID);
        assert_eq!(
            tp.parent_id(),
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(tp.trace_id()[0], 0x4b);
        assert!(tp.is_sampled());
        let unsampled: TraceParent = VALID.replace("-01", "-00").parse().unwrap();
        assert!(!unsampled.is_sampled());
    }

    #[test]
    fn a_later_version_may_carry_more_fields() {
        let later = format!("cc{}-what-comes-next", &VALID[2..]);
        let tp: TraceParent = later.parse().unwrap();
        assert_eq!(tp.to_string(), VALID);
        assert!(
            format!("cc{}x", &VALID[2..])
                .parse::<TraceParent>()
                .is_err()
        );
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        for bad in [
            "",
            "garbage",
            &VALID[..54],
            &format!("{VALID}-"),
            &VALID.to_uppercase(),
            &VALID.replace('-', "_"),
            &format!("ff{}", &VALID[2..]),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let e = bad.parse::<TraceParent>().unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid {
                        what: "traceparent",
                        ..
                    }
                ),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn tracestate_follows_the_list_rules() {
        for good in [
            "",
            "congo=t61rcWkgMzE",
            "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE",
            "a1@vendor=x,b=y z",
            ",,congo=1,",
        ] {
            check_tracestate(good).unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        for bad in [
            "congo",
            "Congo=1",
            "1congo=1",
            "congo=",
            "congo=a,congo=b",
            "congo=a=b",
            "congo=a\u{7f}",
            "congo=é",
            &many.join(","),
        ] {
            let e = check_tracestate(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid {
                        what: "tracestate",
                        ..
                    }
                ),
                "{bad:?}: {e}"
            );
        }
    }
}
