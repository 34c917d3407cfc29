//! The dashboard's defences that are not HTTP plumbing: the host names it answers to, the
//! back-off of wrong passwords, the one-time outcomes of actions, and the marking of
//! characters that hide or reorder text.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// Both ends of a connection, attached to each of its requests.
#[derive(Debug, Clone, Copy)]
pub(super) struct Conn {
    /// The address the client reached: one of this machine's, with the port.
    pub(super) local: SocketAddr,
    /// The client's address.
    pub(super) peer: SocketAddr,
}

/// A name given with `--allowed-host`: lowercase, with its port if one was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AllowedHost {
    name: String,
    port: Option<u16>,
}

/// Parses `--allowed-host`: `NAME` or `NAME:PORT`, a DNS name or an IP address (an IPv6
/// one in brackets).
pub(crate) fn parse_allowed_host(text: &str) -> Result<AllowedHost, String> {
    let bad = |why: &str| format!("--allowed-host {text:?}: {why}; give NAME or NAME:PORT");
    let (name, port) = split_host_port(text).ok_or_else(|| bad("not a host name"))?;
    let valid = if let Some(inner) = name.strip_prefix('[') {
        inner
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<Ipv6Addr>().is_ok())
    } else {
        name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    };
    if !valid {
        return Err(bad(
            "a host name has only letters, digits, '-', '.' and '_'",
        ));
    }
    Ok(AllowedHost {
        name: name.to_ascii_lowercase(),
        port,
    })
}

/// Splits `host[:port]` (an IPv6 address in brackets) into the host and the port. `None`:
/// not of that form (an empty host, a port that is not a number of 16 bits, a bare
/// IPv6 address).
pub(super) fn split_host_port(text: &str) -> Option<(&str, Option<u16>)> {
    let (name, port) = if text.starts_with('[') {
        let end = text.find(']')?;
        let (name, after) = text.split_at(end + 1);
        if after.is_empty() {
            (name, None)
        } else {
            (name, Some(after.strip_prefix(':')?))
        }
    } else {
        match text.split_once(':') {
            None => (text, None),
            Some((name, port)) => (name, Some(port)),
        }
    };
    if name.is_empty() {
        return None;
    }
    let port = match port {
        None => None,
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
    };
    Some((name, port))
}

/// The IP address a host name writes literally (`127.0.0.1`, `[::1]`), if it does.
fn literal_ip(name: &str) -> Option<IpAddr> {
    match name.strip_prefix('[') {
        Some(inner) => inner
            .strip_suffix(']')?
            .parse::<Ipv6Addr>()
            .ok()
            .map(IpAddr::V6),
        None => name.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
    }
}

/// The names the dashboard answers to.
#[derive(Debug)]
pub(super) struct Hosts {
    allowed: Vec<AllowedHost>,
}

impl Hosts {
    pub(super) fn new(allowed: Vec<AllowedHost>) -> Hosts {
        Hosts { allowed }
    }

    /// Whether `authority` (a `Host` header's value, or the host and port of an origin
    /// whose scheme's port is `default_port`) names the dashboard on the connection
    /// `conn`: the address the connection reached, with its port; on a loopback
    /// connection, `localhost`, `127.0.0.1` or `[::1]` with its port; or a name given
    /// with `--allowed-host` (with its port, when one was given).
    pub(super) fn serves(&self, conn: &Conn, authority: &str, default_port: u16) -> bool {
        let Some((name, port)) = split_host_port(authority) else {
            return false;
        };
        let port = port.unwrap_or(default_port);
        let local = conn.local.ip().to_canonical();
        if port == conn.local.port() {
            let loopback = local.is_loopback();
            match literal_ip(name).map(|ip| ip.to_canonical()) {
                Some(ip) => {
                    if ip == local
                        || (loopback
                            && (ip == IpAddr::V4(Ipv4Addr::LOCALHOST)
                                || ip == IpAddr::V6(Ipv6Addr::LOCALHOST)))
                    {
                        return true;
                    }
                }
                None => {
                    if loopback && name.eq_ignore_ascii_case("localhost") {
                        return true;
                    }
                }
            }
        }
        self.allowed.iter().any(|a| {
            a.name.eq_ignore_ascii_case(name) && a.port.is_none_or(|allowed| allowed == port)
        })
    }

    /// Checks an unsafe request's `Origin` (or, without one, its `Referer`), when sent:
    /// its host must be one the dashboard answers to on this connection (never merely the
    /// request's own `Host`, which the page of a rebound name sets to its own).
    pub(super) fn same_origin(
        &self,
        conn: &Conn,
        origin: Option<&[u8]>,
        referer: Option<&[u8]>,
    ) -> Result<(), String> {
        let (what, url) = match (origin, referer) {
            (Some(origin), _) => ("origin", origin),
            (None, Some(referer)) => ("referer", referer),
            (None, None) => return Ok(()),
        };
        let url = String::from_utf8_lossy(url);
        let refused = || {
            Err(format!(
                "cross-site request refused: the {what} {url:?} is not this dashboard"
            ))
        };
        let Some((scheme, rest)) = url.split_once("://") else {
            return refused();
        };
        let default_port = if scheme.eq_ignore_ascii_case("http") {
            80
        } else if scheme.eq_ignore_ascii_case("https") {
            443
        } else {
            return refused();
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        if authority.contains('@') || !self.serves(conn, authority, default_port) {
            return refused();
        }
        Ok(())
    }
}

/// Wrong passwords a client may send before it must wait.
const FREE_FAILURES: u32 = 4;

/// The first wait; each further failure doubles it.
const FIRST_WAIT: Duration = Duration::from_secs(5);

/// The longest wait.
const LONGEST_WAIT: Duration = Duration::from_secs(15 * 60);

/// A client's failures are forgotten this long after its last one.
const FORGET_AFTER: Duration = Duration::from_secs(60 * 60);

/// The clients whose failures are remembered at most (beyond, the oldest are forgotten).
const CLIENTS_TRACKED: usize = 10_000;

/// One client's wrong passwords.
#[derive(Debug)]
struct Failures {
    count: u32,
    last: Instant,
    until: Option<Instant>,
}

/// The wrong passwords of each client address (an IPv6 client by its /64): after
/// [`FREE_FAILURES`], each one makes the client wait, twice as long as the last time.
#[derive(Debug, Default)]
pub(super) struct Guesses {
    clients: HashMap<IpAddr, Failures>,
}

/// The address whose failures and connections are counted together: an IPv4 address,
/// or the /64 network of an IPv6 one (a single host usually has all of one).
pub(super) fn client_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

impl Guesses {
    /// How long `client` must still wait, if it must.
    pub(super) fn waiting(&self, client: IpAddr, now: Instant) -> Option<Duration> {
        let until = self.clients.get(&client)?.until?;
        (until > now).then(|| until - now)
    }

    /// Counts a wrong password of `client`; how long it must now wait, if it must.
    pub(super) fn failed(&mut self, client: IpAddr, now: Instant) -> Option<Duration> {
        if self.clients.len() >= CLIENTS_TRACKED && !self.clients.contains_key(&client) {
            self.clients
                .retain(|_, f| now.duration_since(f.last) < FORGET_AFTER);
            if self.clients.len() >= CLIENTS_TRACKED
                && let Some(oldest) = self
                    .clients
                    .iter()
                    .min_by_key(|(_, f)| f.last)
                    .map(|(ip, _)| *ip)
            {
                self.clients.remove(&oldest);
            }
        }
        let failures = self.clients.entry(client).or_insert(Failures {
            count: 0,
            last: now,
            until: None,
        });
        if now.duration_since(failures.last) >= FORGET_AFTER {
            failures.count = 0;
        }
        failures.count += 1;
        failures.last = now;
        let over = failures.count.checked_sub(FREE_FAILURES + 1)?;
        let wait = FIRST_WAIT
            .saturating_mul(1u32.checked_shl(over).unwrap_or(u32::MAX))
            .min(LONGEST_WAIT);
        failures.until = Some(now + wait);
        Some(wait)
    }

    /// Forgets `client`'s failures: it gave the password.
    pub(super) fn succeeded(&mut self, client: IpAddr) {
        self.clients.remove(&client);
    }
}

/// How long an action's outcome waits for its page.
const OUTCOME_KEPT: Duration = Duration::from_secs(10 * 60);

/// The outcomes kept at most.
const OUTCOMES_KEPT: usize = 1000;

/// One action's outcome.
#[derive(Debug)]
struct Outcome {
    id: String,
    subscription: String,
    text: String,
    at: Instant,
}

/// What the actions did, each behind a random one-time id: the page an action sends the
/// browser to carries only the id, so a link cannot make a page claim anything.
#[derive(Debug, Default)]
pub(super) struct Outcomes {
    recent: VecDeque<Outcome>,
}

impl Outcomes {
    /// Keeps `text`, what an action on `subscription` did, under `id`.
    pub(super) fn put(&mut self, id: String, subscription: &str, text: String) {
        self.expire(Instant::now());
        if self.recent.len() >= OUTCOMES_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Outcome {
            id,
            subscription: subscription.to_string(),
            text,
            at: Instant::now(),
        });
    }

    /// The outcome kept under `id` for `subscription`'s page, once.
    pub(super) fn take(&mut self, id: &str, subscription: &str) -> Option<String> {
        self.expire(Instant::now());
        let at = self.recent.iter().position(|o| {
            super::constant_time_eq(o.id.as_bytes(), id.as_bytes())
                && o.subscription == subscription
        })?;
        self.recent.remove(at).map(|o| o.text)
    }

    fn expire(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|o| now.duration_since(o.at) > OUTCOME_KEPT)
        {
            self.recent.pop_front();
        }
    }
}

/// Whether `c` is shown as a marked code rather than as itself: a control character
/// (but newline and tab), a bidirectional control, a zero-width or otherwise invisible
/// character (Unicode's default-ignorable code points), a line or paragraph separator,
/// or a space other than U+0020 (each looks like another character, or like nothing).
/// The same set as `HIDDEN` in `app.js`.
pub(super) fn hidden(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || pgbus::is_invisible(c)
        || matches!(
            c,
            '\u{00A0}'
                | '\u{00AD}'
                | '\u{034F}'
                | '\u{061C}'
                | '\u{115F}'
                | '\u{1160}'
                | '\u{1680}'
                | '\u{17B4}'
                | '\u{17B5}'
                | '\u{180B}'..='\u{180F}'
                | '\u{2000}'..='\u{200F}'
                | '\u{2028}'..='\u{202F}'
                | '\u{205F}'..='\u{206F}'
                | '\u{2800}'
                | '\u{3000}'
                | '\u{3164}'
                | '\u{FE00}'..='\u{FE0F}'
                | '\u{FEFF}'
                | '\u{FFA0}'
                | '\u{FFF0}'..='\u{FFFB}'
                | '\u{1BCA0}'..='\u{1BCA3}'
                | '\u{1D173}'..='\u{1D17A}'
                | '\u{E0000}'..='\u{E0FFF}'
        )
}

/// The code a hidden character shows as: `<U+202E>`.
pub(super) fn code(c: char) -> String {
    format!("<U+{:04X}>", u32::from(c))
}

/// `text` with every hidden character written as its code, for where no markup can go
/// (a page's title, a confirmation dialog).
pub(super) fn plain(text: &str) -> Cow<'_, str> {
    if !text.chars().any(hidden) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(
        text.chars()
            .map(|c| if hidden(c) { code(c) } else { c.to_string() })
            .collect(),
    )
}

/// Text for a page: escaped, every hidden character a marked code
/// (`<span class="cc">&lt;U+202E&gt;</span>`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Shown<'a>(pub(super) &'a str);

impl maud::Render for Shown<'_> {
    fn render_to(&self, out: &mut String) {
        let mut rest = self.0;
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| hidden(*c)) {
            maud::Render::render_to(&rest[..at], out);
            out.push_str("<span class=\"cc\" title=\"an invisible or control character\">");
            maud::Render::render_to(&code(c), out);
            out.push_str("</span>");
            rest = &rest[at + c.len_utf8()..];
        }
        maud::Render::render_to(rest, out);
    }
}

/// JSON text with every hidden character escaped (`\u202e`): the same data for a
/// program, and nothing that reorders or hides text where a person reads it raw. JSON
/// writes every character of the set outside strings as itself never, so only strings
/// change.
pub(super) fn escape_json(json: String) -> String {
    if !json.chars().any(hidden) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        // Those below U+0020 are escaped by the serializer already; a newline or a tab
        // here is the pretty-printer's.
        if hidden(c) && u32::from(c) >= 0x20 {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(local: &str) -> Conn {
        Conn {
            local: local.parse().unwrap(),
            peer: "127.0.0.1:50000".parse().unwrap(),
        }
    }

    #[test]
    fn host_and_port_split() {
        assert_eq!(split_host_port("a.example"), Some(("a.example", None)));
        assert_eq!(
            split_host_port("a.example:80"),
            Some(("a.example", Some(80)))
        );
        assert_eq!(split_host_port("[::1]:8080"), Some(("[::1]", Some(8080))));
        assert_eq!(split_host_port("[::1]"), Some(("[::1]", None)));
        for bad in [
            "", ":80", "a:", "a:+80", "a:99999", "::1", "[::1]x", "a:1:2",
        ] {
            assert_eq!(split_host_port(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_hosts_are_the_address_reached_and_the_loopback_names() {
        let hosts = Hosts::new(vec![parse_allowed_host("Dash.Example").unwrap()]);
        let lo = conn("127.0.0.2:8080");
        for ok in [
            "127.0.0.2:8080",
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "dash.example",
            "DASH.example:1",
        ] {
            assert!(hosts.serves(&lo, ok, 80), "{ok}");
        }
        for bad in [
            "attacker.example:8080",
            "127.0.0.2:8081",
            "localhost",
            "localhost.:8080",
            "127.0.0.3:8080",
            "dash.example.attacker.example",
        ] {
            assert!(!hosts.serves(&lo, bad, 80), "{bad}");
        }
        let public = conn("192.0.2.7:8080");
        assert!(hosts.serves(&public, "192.0.2.7:8080", 80));
        assert!(!hosts.serves(&public, "localhost:8080", 80));
        assert!(!hosts.serves(&public, "127.0.0.1:8080", 80));
        let mapped = conn("[::ffff:127.0.0.1]:8080");
        assert!(hosts.serves(&mapped, "127.0.0.1:8080", 80));
        let port = Hosts::new(vec![parse_allowed_host("dash.example:443").unwrap()]);
        assert!(port.serves(&public, "dash.example", 443));
        assert!(!port.serves(&public, "dash.example:8080", 80));
    }

    #[test]
    fn origins_must_name_a_served_host() {
        let hosts = Hosts::new(vec![]);
        let lo = conn("127.0.0.1:8080");
        let check = |origin: &str| hosts.same_origin(&lo, Some(origin.as_bytes()), None);
        assert!(check("http://127.0.0.1:8080").is_ok());
        assert!(check("http://localhost:8080").is_ok());
        for bad in [
            "http://evil.example",
            "null",
            "http://127.0.0.1:8081",
            "ftp://127.0.0.1:8080",
            "http://x@127.0.0.1:8080",
        ] {
            assert!(check(bad).is_err(), "{bad}");
        }
        let referer = |r: &str| hosts.same_origin(&lo, None, Some(r.as_bytes()));
        assert!(referer("http://127.0.0.1:8080/subscriptions/x").is_ok());
        assert!(referer("http://127.0.0.1:8080.evil.example/").is_err());
        assert!(hosts.same_origin(&lo, None, None).is_ok());
    }

    #[test]
    fn bad_allowed_hosts_are_refused() {
        for bad in ["", "a b", "http://x", "x/y", "x:99999", "[zz]", "x@y"] {
            assert!(parse_allowed_host(bad).is_err(), "{bad:?}");
        }
        assert!(parse_allowed_host("[::1]:80").is_ok());
    }

    #[test]
    fn wrong_passwords_wait_longer_each_time() {
        let mut guesses = Guesses::default();
        let client = client_key("127.0.0.1".parse().unwrap());
        let now = Instant::now();
        for _ in 0..FREE_FAILURES {
            assert_eq!(guesses.failed(client, now), None);
        }
        assert_eq!(guesses.failed(client, now), Some(FIRST_WAIT));
        assert_eq!(guesses.failed(client, now), Some(FIRST_WAIT * 2));
        assert!(guesses.waiting(client, now).is_some());
        for _ in 0..100 {
            guesses.failed(client, now);
        }
        assert_eq!(guesses.waiting(client, now), Some(LONGEST_WAIT));
        guesses.succeeded(client);
        assert_eq!(guesses.waiting(client, now), None);
        assert_eq!(
            client_key("2001:db8::1".parse().unwrap()),
            client_key("2001:db8::2".parse().unwrap())
        );
    }

    #[test]
    fn outcomes_are_read_once_by_their_subscription() {
        let mut outcomes = Outcomes::default();
        outcomes.put("id1".into(), "a", "retried 1".into());
        assert_eq!(outcomes.take("id1", "b"), None);
        assert_eq!(outcomes.take("id1", "a").as_deref(), Some("retried 1"));
        assert_eq!(outcomes.take("id1", "a"), None);
    }

    #[test]
    fn hidden_characters_are_marked() {
        assert_eq!(plain("a\u{202E}b"), "a<U+202E>b");
        assert_eq!(plain("line\nnext\ttab"), "line\nnext\ttab");
        let html = maud::Render::render(&Shown("<x>\u{200B}\u{E0041}")).into_string();
        assert_eq!(
            html,
            "&lt;x&gt;<span class=\"cc\" title=\"an invisible or control character\">\
             &lt;U+200B&gt;</span><span class=\"cc\" title=\"an invisible or control \
             character\">&lt;U+E0041&gt;</span>"
        );
        let json =
            serde_json::to_string(&serde_json::json!({ "a": "x\u{202E}\u{E0041}\u{7}" })).unwrap();
        let escaped = escape_json(json);
        assert_eq!(escaped, r#"{"a":"x\u202e\udb40\udc41\u0007"}"#);
        let back: serde_json::Value = serde_json::from_str(&escaped).unwrap();
        assert_eq!(back["a"], "x\u{202E}\u{E0041}\u{7}");
    }
}
