//! The NATS JetStream [`Sink`] of `pgbus forward`: connecting (`--nats-*`), the stream
//! (`--stream`: created if missing, verified if present), and publishing an event with
//! its envelope as headers and `Nats-Msg-Id` = its id.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, message::PublishMessage};
use futures::future::BoxFuture;
use pgbus::Event;

use super::sink::{Sink, SinkError, Stored};
use super::{Failure, failed, human_duration, usage};

/// The shortest duplicate window of a stream the forwarder creates.
const MIN_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// How often the stream check at start is tried again while NATS cannot answer it.
const START_RETRY: Duration = Duration::from_secs(1);

/// The NATS connection options of `pgbus forward`.
#[derive(Debug, clap::Args)]
pub(crate) struct NatsArgs {
    /// A NATS server (repeatable; or comma-separated): nats://host:4222, tls://host:4222,
    /// nats://user:password@host:4222 or nats://token@host:4222.
    #[arg(
        long = "nats-url",
        env = "NATS_URL",
        value_delimiter = ',',
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    urls: Vec<String>,
    /// A NATS credentials file (a user JWT and its NKey seed, as `nsc` writes it).
    #[arg(long, value_name = "FILE")]
    nats_creds: Option<PathBuf>,
    /// A file holding an NKey seed (SU...) to authenticate with.
    #[arg(long, value_name = "FILE")]
    nats_nkey: Option<PathBuf>,
    /// A PEM file of root certificates to verify the servers' TLS certificates with.
    #[arg(long, value_name = "FILE")]
    nats_ca: Option<PathBuf>,
    /// Require TLS even for nats:// URLs.
    #[arg(long)]
    nats_tls: bool,
    /// How long a publish waits for JetStream's PubAck before it is tried again.
    #[arg(long, default_value = "5s", value_parser = super::parse_duration)]
    publish_timeout: Duration,
}

impl NatsArgs {
    /// The defaults, with the one server `url`.
    #[cfg(feature = "bench")]
    pub(crate) fn url(url: String) -> NatsArgs {
        NatsArgs {
            urls: vec![url],
            nats_creds: None,
            nats_nkey: None,
            nats_ca: None,
            nats_tls: false,
            publish_timeout: Duration::from_secs(5),
        }
    }
}

/// Checks `--subject-prefix`: one or more subject tokens, without wildcards.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), Failure> {
    if valid_subject(prefix) && !prefix.split('.').any(|t| t == "*" || t == ">") {
        Ok(())
    } else {
        Err(usage(format!(
            "error: --subject-prefix {prefix:?} is not a NATS subject (dot-separated, \
             non-empty tokens without white space, * or >)"
        )))
    }
}

/// A subject without empty tokens or white space (wildcard tokens allowed).
fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|t| !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || c.is_control()))
}

/// The subject of event `name`, or why it cannot be one.
fn subject(prefix: &str, name: &str) -> Result<String, String> {
    let subject = format!("{prefix}.{name}");
    if valid_subject(name) && !name.split('.').any(|t| t == "*" || t == ">") {
        Ok(subject)
    } else {
        Err(format!(
            "event name {name:?} makes no valid NATS subject ({subject:?}: an empty token, \
             or a wildcard token)"
        ))
    }
}

/// Whether the subject filter `pattern` matches every subject that `subject` (which may
/// end in `>`) matches.
fn covers(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(t)) if t != ">" => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The envelope as NATS headers (see `pgbus forward --help`), and the names of the headers
/// NATS cannot carry: a name with white space, a colon, a control or non-ASCII
/// character, or a value with a line break. The event's own headers are all in
/// `Pgbus-Headers` in any case.
fn headers(event: &Event) -> (HeaderMap, Vec<String>) {
    let mut map = HeaderMap::new();
    let mut skipped = Vec::new();
    let mut put = |name: &str, value: &str| match (
        name.parse::<HeaderName>(),
        value.parse::<HeaderValue>(),
    ) {
        (Ok(name), Ok(value)) => map.insert(name, value),
        _ => skipped.push(name.to_string()),
    };
    put("Nats-Msg-Id", &event.id);
    put("Pgbus-Id", &event.id);
    put("Pgbus-Name", &event.name);
    put("Pgbus-Version", &event.version.to_string());
    // The key an ordered subscription orders the event by: its ordering key, else its
    // aggregate (`type:id`), as the schema's `pgbus.event_key` has it.
    let key = event.ordering_key.clone().or_else(|| {
        Some(format!(
            "{}:{}",
            event.aggregate_type.as_deref()?,
            event.aggregate_id.as_deref()?
        ))
    });
    let optional = [
        ("Pgbus-Source", &event.source),
        ("Pgbus-Aggregate-Type", &event.aggregate_type),
        ("Pgbus-Aggregate-Id", &event.aggregate_id),
        ("Pgbus-Correlation-Id", &event.correlation_id),
        ("Pgbus-Causation-Id", &event.causation_id),
        ("Pgbus-Ordering-Key", &key),
    ];
    for (name, value) in optional {
        if let Some(value) = value {
            put(name, value);
        }
    }
    if let Some(at) = event.occurred_at {
        put(
            "Pgbus-Occurred-At",
            &at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        );
    }
    if let Some(seq) = event.seq {
        put("Pgbus-Seq", &seq.to_string());
    }
    put("Pgbus-Headers", &event.headers.to_string());
    // String headers (traceparent, tracestate, tenant...) also as themselves, so that
    // NATS-side tools and tracing see them; none may pose as NATS's own or pgbus's.
    if let Some(object) = event.headers.as_object() {
        for (name, value) in object {
            let lower = name.to_ascii_lowercase();
            if lower.starts_with("nats-") || lower.starts_with("pgbus-") {
                continue;
            }
            if let Some(value) = value.as_str() {
                put(name, value);
            }
        }
    }
    (map, skipped)
}

/// Why NATS refuses this client itself, if `event` says it does: a wrong or revoked
/// credential, which no retry mends. The client reports a refused connection attempt as
/// a client error with the connect error's text, and a refusal on a live connection as
/// a server error.
fn refusal(event: &async_nats::Event) -> Option<String> {
    use async_nats::{ClientError, ConnectErrorKind, Event, ServerError};
    match event {
        Event::ServerError(ServerError::AuthorizationViolation) => {
            Some(ConnectErrorKind::AuthorizationViolation.to_string())
        }
        Event::ClientError(ClientError::Other(text))
            if *text == ConnectErrorKind::AuthorizationViolation.to_string()
                || *text == ConnectErrorKind::Authentication.to_string() =>
        {
            Some(text.clone())
        }
        _ => None,
    }
}

/// The subjects NATS refused a publish to for want of permission, with the server's
/// words. NATS answers such a publish with an `-ERR` on the connection (reported to the
/// client's event callback), not on the publish, which then waits for a PubAck that never
/// comes; the publish's failure looks here to tell a refusal from an outage.
#[derive(Debug, Clone, Default)]
struct Denied(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>);

impl Denied {
    /// Records the subject of a server error `text` that denies a publish.
    fn note(&self, text: &str) {
        let Some(subject) = denied_subject(text) else {
            return;
        };
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= 1024 {
            map.clear();
        }
        map.insert(subject, text.to_string());
    }

    /// Takes the server's words for `subject`, if a publish to it was denied.
    fn take(&self, subject: &str) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(subject)
    }
}

/// The subject of a NATS "Permissions Violation for Publish to "SUBJECT"" error.
fn denied_subject(text: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let at = lower.find("permissions violation for publish to ")?;
    let rest = &text[at + "permissions violation for publish to ".len()..];
    let rest = rest.trim_start_matches(['"', '\'']);
    let end = rest.find(['"', '\'']).unwrap_or(rest.len());
    Some(rest[..end].trim().to_string()).filter(|s| !s.is_empty())
}

/// Whether JetStream's answer to a publish is a refusal that no retry mends: the message
/// is larger than the stream takes (`max_msg_size`).
fn refused_by_stream(error: &async_nats::jetstream::context::PublishError) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return js.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM;
        }
        source = e.source();
    }
    false
}

/// Resolves with the reason once `refused` holds one.
async fn refused_with(mut refused: tokio::sync::watch::Receiver<Option<String>>) -> String {
    let reason = match refused.wait_for(Option::is_some).await {
        Ok(reason) => reason.clone(),
        // The client is gone (it keeps the sender): nothing will be refused any more.
        Err(_) => None,
    };
    match reason {
        Some(reason) => reason,
        None => std::future::pending().await,
    }
}

/// The JetStream sink.
pub(crate) struct JetStream {
    context: jetstream::Context,
    prefix: String,
    /// Set by the client's event callback when NATS refuses the credentials.
    refused: tokio::sync::watch::Receiver<Option<String>>,
    /// The subjects NATS denied this client a publish to, with the server's words.
    denied: Denied,
    /// The header names already warned of as ones NATS cannot carry (each once).
    uncarried: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for JetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStream")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl JetStream {
    /// Connects (retrying until NATS answers: the client reconnects by itself after),
    /// then creates or verifies `stream`. Credentials NATS refuses end it with exit 1.
    pub(crate) async fn connect(
        args: &NatsArgs,
        stream: &str,
        prefix: &str,
        lease: Duration,
    ) -> Result<JetStream, Failure> {
        let (refuse, refused) = tokio::sync::watch::channel(None::<String>);
        let denied = Denied::default();
        let mut options = async_nats::ConnectOptions::new()
            .event_callback({
                let denied = denied.clone();
                move |event| {
                    if let Some(reason) = refusal(&event) {
                        refuse.send_replace(Some(reason));
                    }
                    if let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) =
                        &event
                    {
                        denied.note(text);
                    }
                    std::future::ready(())
                }
            })
            .retry_on_initial_connect()
            .max_reconnects(None)
            .require_tls(args.nats_tls)
            .request_timeout(Some(args.publish_timeout));
        if let Some(path) = &args.nats_creds {
            options = options.credentials_file(path).await.map_err(|e| {
                usage(format!(
                    "error: cannot read the credentials file {}: {e}",
                    path.display()
                ))
            })?;
        }
        if let Some(path) = &args.nats_nkey {
            let seed = std::fs::read_to_string(path).map_err(|e| {
                usage(format!(
                    "error: cannot read the NKey seed file {}: {e}",
                    path.display()
                ))
            })?;
            options = options.nkey(seed.trim().to_string());
        }
        if let Some(path) = &args.nats_ca {
            options = options.add_root_certificates(path.clone());
        }
        let mut servers = Vec::new();
        for url in &args.urls {
            let addr: async_nats::ServerAddr = url.parse().map_err(|e| {
                // Its password or token is never shown.
                let secrets = super::secrets::nats_secrets(url);
                usage(super::secrets::redact(
                    &format!("error: --nats-url {url:?} is not valid: {e}"),
                    &secrets,
                ))
            })?;
            servers.push(addr);
        }
        // Credentials in a URL (the first that has any): user and password, or a token.
        if let Some(addr) = servers.iter().find(|a| a.username().is_some()) {
            let user = addr.username().unwrap_or_default().to_string();
            options = match addr.password() {
                Some(password) => options.user_and_password(user, password.to_string()),
                None => options.token(user),
            };
        }
        let client = options.connect(servers).await.map_err(|e| {
            let secrets: Vec<String> = args
                .urls
                .iter()
                .flat_map(|u| super::secrets::nats_secrets(u))
                .collect();
            failed(super::secrets::redact(
                &format!("error: cannot connect to NATS: {e}"),
                &secrets,
            ))
        })?;
        let mut context = jetstream::new(client);
        context.set_timeout(args.publish_timeout);
        tokio::select! {
            checked = ensure_stream(&context, stream, prefix, lease) => checked?,
            reason = refused_with(refused.clone()) => return Err(failed(refused_text(&reason))),
        }
        Ok(JetStream {
            context,
            prefix: prefix.to_string(),
            refused,
            denied,
            uncarried: Default::default(),
        })
    }
}

/// The error that ends the command when NATS refuses the credentials.
pub(crate) fn refused_text(reason: &str) -> String {
    format!(
        "error: NATS refuses the forwarder's credentials ({reason}): check the user and \
         password or token of --nats-url, --nats-creds or --nats-nkey"
    )
}

/// The configuration of a stream the forwarder creates.
fn stream_config(stream: &str, prefix: &str, lease: Duration) -> StreamConfig {
    StreamConfig {
        name: stream.to_string(),
        subjects: vec![format!("{prefix}.>")],
        storage: StorageType::File,
        duplicate_window: MIN_DUPLICATE_WINDOW.max(lease * 2),
        ..Default::default()
    }
}

/// What makes an existing stream unfit, if anything.
fn unfit(config: &StreamConfig, prefix: &str, lease: Duration) -> Vec<String> {
    let wanted = format!("{prefix}.>");
    let mut problems = Vec::new();
    if !config.subjects.iter().any(|s| covers(s, &wanted)) {
        problems.push(format!(
            "its subjects {:?} do not cover {wanted:?}",
            config.subjects
        ));
    }
    if config.duplicate_window < lease {
        problems.push(format!(
            "its duplicate window ({}) is shorter than --lease ({}): an event re-sent after \
             a crash could be stored twice",
            human_duration(config.duplicate_window),
            human_duration(lease)
        ));
    }
    if config.no_ack {
        problems.push("it does not acknowledge publishes (no_ack)".to_string());
    }
    problems
}

/// Creates `stream` if it is missing, or checks that it fits; retries while NATS cannot
/// answer.
async fn ensure_stream(
    context: &jetstream::Context,
    stream: &str,
    prefix: &str,
    lease: Duration,
) -> Result<(), Failure> {
    loop {
        let problem = match context.get_stream(stream).await {
            Ok(mut found) => match found.info().await {
                Ok(info) => {
                    let problems = unfit(&info.config, prefix, lease);
                    if problems.is_empty() {
                        return Ok(());
                    }
                    return Err(usage(format!(
                        "error: the JetStream stream {stream:?} does not fit `pgbus forward`: \
                         {}. Change it (e.g. `nats stream edit {stream}`) or name another \
                         with --stream (a missing one is created).",
                        problems.join("; ")
                    )));
                }
                Err(e) => e.to_string(),
            },
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(js)
                    if js.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    match context
                        .create_stream(stream_config(stream, prefix, lease))
                        .await
                    {
                        Ok(_) => {
                            eprintln!("pgbus: created the JetStream stream {stream:?}");
                            return Ok(());
                        }
                        Err(e) => {
                            let text = e.to_string();
                            if text.contains("subjects overlap") {
                                return Err(usage(format!(
                                    "error: cannot create the JetStream stream {stream:?}: \
                                     {text} (another stream takes {prefix}.>: name it with \
                                     --stream)"
                                )));
                            }
                            text
                        }
                    }
                }
                GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => {
                    return Err(usage(format!(
                        "error: --stream {stream:?} is not a valid stream name"
                    )));
                }
                _ => e.to_string(),
            },
        };
        eprintln!("pgbus: cannot check the JetStream stream {stream:?} yet ({problem}); retrying");
        tokio::time::sleep(START_RETRY).await;
    }
}

impl JetStream {
    /// Warns of header names NATS cannot carry, each name once for the process.
    fn warn_uncarried(&self, event: &Event, names: Vec<String>) {
        let mut warned = self.uncarried.lock().unwrap_or_else(|p| p.into_inner());
        let new: Vec<String> = names
            .into_iter()
            .filter(|name| warned.len() < 1024 && warned.insert(name.clone()))
            .collect();
        if !new.is_empty() {
            eprintln!(
                "pgbus: NATS headers cannot carry {new:?} of event {} (a name with white space, \
                 a colon or a non-ASCII character, or a value with a line break): left out of the \
                 NATS headers (the event's headers are all in Pgbus-Headers); told once per name",
                event.id
            );
        }
    }
}

impl Sink for JetStream {
    fn refused(&self) -> BoxFuture<'static, String> {
        Box::pin(refused_with(self.refused.clone()))
    }

    fn publish<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<Stored, SinkError>> {
        Box::pin(async move {
            let subject = subject(&self.prefix, &event.name).map_err(SinkError::Rejected)?;
            let payload = serde_json::to_vec(&event.payload)
                .map_err(|e| SinkError::Rejected(format!("payload: {e}")))?;
            let (headers, skipped) = headers(event);
            if !skipped.is_empty() {
                self.warn_uncarried(event, skipped);
            }
            let message = PublishMessage::build()
                .payload(payload.into())
                .headers(headers);
            let classify = |e: async_nats::jetstream::context::PublishError| {
                if let Some(words) = self.denied.take(&subject) {
                    SinkError::Rejected(format!("NATS denies publishing to {subject:?}: {words}"))
                } else if e.kind() == PublishErrorKind::MaxPayloadExceeded || refused_by_stream(&e)
                {
                    SinkError::Rejected(e.to_string())
                } else {
                    SinkError::Unavailable(e.to_string())
                }
            };
            let ack = self
                .context
                .send_publish(subject.clone(), message)
                .await
                .map_err(classify)?;
            let ack = ack.await.map_err(classify)?;
            Ok(if ack.duplicate {
                Stored::Duplicate
            } else {
                Stored::New
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covers_matches_subject_filters() {
        assert!(covers("pgbus.>", "pgbus.>"));
        assert!(covers(">", "pgbus.>"));
        assert!(covers("*.>", "pgbus.>"));
        assert!(!covers("pgbus.*", "pgbus.>"));
        assert!(!covers("other.>", "pgbus.>"));
        assert!(!covers("pgbus", "pgbus.>"));
        assert!(covers("a.*.>", "a.b.>"));
    }

    #[test]
    fn headers_carry_the_key_of_an_aggregate_and_name_what_nats_cannot_carry() {
        let event = Event::new("order.placed", serde_json::json!({}))
            .aggregate("order", "42")
            .header("traceparent", "00-ab-cd-01")
            .header("bad name", "x")
            .header("a:b", "y")
            .header("na\u{ef}ve", "z")
            .header("multi", "one\ntwo");
        let (map, mut skipped) = headers(&event);
        let get = |name: &str| map.get(name).map(|v| v.to_string());
        assert_eq!(get("Pgbus-Ordering-Key").as_deref(), Some("order:42"));
        assert_eq!(get("traceparent").as_deref(), Some("00-ab-cd-01"));
        skipped.sort();
        assert_eq!(skipped, ["a:b", "bad name", "multi", "na\u{ef}ve"]);
        let all: serde_json::Value = serde_json::from_str(&get("Pgbus-Headers").unwrap()).unwrap();
        assert_eq!(all["multi"], "one\ntwo", "every header is in Pgbus-Headers");

        let keyed = Event::new("x", serde_json::json!({}))
            .aggregate("order", "42")
            .ordering_key("tenant-7");
        let (map, skipped) = headers(&keyed);
        assert_eq!(
            map.get("Pgbus-Ordering-Key").unwrap().to_string(),
            "tenant-7"
        );
        assert!(skipped.is_empty());
        let (map, _) = headers(&Event::new("x", serde_json::json!({})));
        assert!(map.get("Pgbus-Ordering-Key").is_none());
    }

    #[test]
    fn a_denied_publish_names_its_subject() {
        assert_eq!(
            denied_subject("Permissions Violation for Publish to \"pgbus.secret.plans\"")
                .as_deref(),
            Some("pgbus.secret.plans")
        );
        assert_eq!(
            denied_subject("permissions violation for publish to pgbus.a").as_deref(),
            Some("pgbus.a")
        );
        assert_eq!(
            denied_subject("Permissions Violation for Subscription to \"x\""),
            None
        );
        assert_eq!(denied_subject("maximum payload exceeded"), None);
    }

    #[test]
    fn subjects_refuse_wildcards_and_empty_tokens() {
        assert_eq!(
            subject("pgbus", "order.placed").unwrap(),
            "pgbus.order.placed"
        );
        assert!(subject("pgbus", "order..placed").is_err());
        assert!(subject("pgbus", "order.>").is_err());
        assert!(subject("pgbus", "a>b").is_ok());
        assert!(check_prefix("a.*").is_err());
        assert!(check_prefix("").is_err());
        assert!(check_prefix("app.events").is_ok());
    }
}
