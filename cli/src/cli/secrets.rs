//! Secrets on the command line and in messages: a password in `--database-url`,
//! `--listen-url` or `--nats-url` is refused (any user of the machine reads a process's
//! arguments with `ps`), and every message pgbus prints has the passwords and tokens of
//! the URLs it was given replaced by `****`.

use clap::ArgMatches;
use clap::parser::ValueSource;

use super::{Failure, usage};

/// What a secret is replaced with in messages.
pub(crate) const MASK: &str = "****";

/// The password in a PostgreSQL connection string, URL (`postgres://user:pw@host`,
/// `?password=pw`) or `key=value` pairs (`password=pw`), as written (and, for a URL,
/// percent-decoded too). Malformed strings are searched all the same: their error
/// messages must not show it either.
pub(crate) fn pg_secrets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(rest) = after_scheme(text) {
        let (authority, query) = match rest.find('?') {
            Some(q) => (&rest[..q], Some(&rest[q + 1..])),
            None => (rest, None),
        };
        if let Some(at) = authority.rfind('@')
            && let Some((_, password)) = authority[..at].split_once(':')
        {
            push_secret(&mut out, password);
        }
        for pair in query.unwrap_or_default().split('&') {
            if let Some((key, value)) = pair.split_once('=')
                && key.trim().eq_ignore_ascii_case("password")
            {
                push_secret(&mut out, value);
            }
        }
    } else {
        keyword_passwords(text, &mut out);
    }
    out
}

/// The credentials in a NATS server URL: `nats://user:password@host` (the password) or
/// `nats://token@host` (the token).
pub(crate) fn nats_secrets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(rest) = after_scheme(text) {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        // A malformed URL may hold a '/' in its password: look up to the last '@'.
        let userinfo = rest
            .rfind('@')
            .map(|at| &rest[..at])
            .or_else(|| authority.rfind('@').map(|at| &authority[..at]));
        if let Some(userinfo) = userinfo {
            match userinfo.split_once(':') {
                Some((_, password)) => push_secret(&mut out, password),
                None => push_secret(&mut out, userinfo),
            }
        }
    }
    out
}

/// `text` with every one of `secrets` replaced by [`MASK`].
pub(crate) fn redact(text: &str, secrets: &[String]) -> String {
    let mut text = text.to_string();
    // Longest first: a secret that contains another is masked whole.
    let mut secrets: Vec<&String> = secrets.iter().filter(|s| !s.is_empty()).collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    for secret in secrets {
        if text.contains(secret.as_str()) {
            text = text.replace(secret.as_str(), MASK);
        }
    }
    text
}

/// The part after `scheme://`, if `text` is a URL.
fn after_scheme(text: &str) -> Option<&str> {
    let (scheme, rest) = text.trim().split_once("://")?;
    (!scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)))
    .then_some(rest)
}

/// Adds `raw` and its percent-decoded form.
fn push_secret(out: &mut Vec<String>, raw: &str) {
    for secret in [raw.to_string(), percent_decode(raw)] {
        if !secret.is_empty() && !out.contains(&secret) {
            out.push(secret);
        }
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The values of `password` keys in libpq `key=value` pairs (quoted or not).
fn keyword_passwords(text: &str, out: &mut Vec<String>) {
    let mut rest = text;
    while let Some(pos) = find_ignore_case(rest, "password") {
        let before_ok = pos == 0 || rest.as_bytes()[pos - 1].is_ascii_whitespace();
        let after = rest[pos + "password".len()..].trim_start();
        rest = &rest[pos + "password".len()..];
        let Some(value) = after.strip_prefix('=').filter(|_| before_ok) else {
            continue;
        };
        let value = value.trim_start();
        let secret = if let Some(quoted) = value.strip_prefix('\'') {
            let mut secret = String::new();
            let mut end = quoted.len();
            let mut chars = quoted.char_indices();
            while let Some((at, c)) = chars.next() {
                match c {
                    '\\' => secret.extend(chars.next().map(|(_, c)| c)),
                    '\'' => {
                        end = at;
                        break;
                    }
                    c => secret.push(c),
                }
            }
            // As written, too (with its backslashes).
            push_secret(out, &quoted[..end]);
            secret
        } else {
            value
                .split(|c: char| c.is_ascii_whitespace())
                .next()
                .unwrap_or_default()
                .to_string()
        };
        push_secret(out, &secret);
    }
}

fn find_ignore_case(haystack: &str, needle: &str) -> Option<usize> {
    haystack
        .as_bytes()
        .windows(needle.len())
        .position(|w| w.eq_ignore_ascii_case(needle.as_bytes()))
}

/// Whether the argument `id` of `matches` was given on the command line (not taken from
/// its environment variable or its default).
fn on_command_line(matches: &ArgMatches, id: &str) -> bool {
    // Asked only of an argument the command has (clap panics otherwise).
    matches.try_get_raw(id).is_ok_and(|v| v.is_some())
        && matches.value_source(id) == Some(ValueSource::CommandLine)
}

/// The string values of the argument `id`, if it exists and was given.
fn values<'a>(matches: &'a ArgMatches, id: &str) -> Vec<&'a String> {
    matches
        .try_get_many::<String>(id)
        .ok()
        .flatten()
        .map(|v| v.collect())
        .unwrap_or_default()
}

/// The subcommand's own matches (the innermost).
fn innermost(matches: &ArgMatches) -> &ArgMatches {
    let mut m = matches;
    while let Some((_, sub)) = m.subcommand() {
        m = sub;
    }
    m
}

/// Refuses a password (or NATS token) written on the command line: exit 2, naming the
/// environment variable and the password file to use instead. Nothing is printed of the
/// password itself.
pub(crate) fn refuse_on_command_line(matches: &ArgMatches) -> Result<(), Failure> {
    let sub = innermost(matches);
    let database_url = [matches, sub]
        .into_iter()
        .filter(|m| on_command_line(m, "database_url"))
        .flat_map(|m| values(m, "database_url"))
        .any(|url| !pg_secrets(url).is_empty());
    if database_url {
        return Err(password_refused("--database-url", "DATABASE_URL"));
    }
    if on_command_line(sub, "listen_url")
        && values(sub, "listen_url")
            .iter()
            .any(|url| !pg_secrets(url).is_empty())
    {
        return Err(password_refused("--listen-url", "PGBUS_LISTEN_URL"));
    }
    if on_command_line(sub, "urls")
        && values(sub, "urls")
            .iter()
            .any(|url| !nats_secrets(url).is_empty())
    {
        return Err(usage(
            "error: --nats-url holds credentials (a password or a token), which any user of \
             this machine can read in the process list (ps): give the URL in the NATS_URL \
             environment variable instead, or use --nats-creds FILE or --nats-nkey FILE",
        ));
    }
    Ok(())
}

fn password_refused(flag: &str, variable: &str) -> Failure {
    usage(format!(
        "error: {flag} holds a password, which any user of this machine can read in the \
         process list (ps): give the URL in the {variable} environment variable instead, \
         or leave the password out and put it in a password file (PGPASSFILE, by default \
         ~/.pgpass)"
    ))
}

/// Every secret pgbus may have been given, by its command line or its environment: what
/// [`redact`] masks in every message.
pub(crate) fn known(matches: &ArgMatches) -> Vec<String> {
    let sub = innermost(matches);
    let mut out = Vec::new();
    for m in [matches, sub] {
        for url in values(m, "database_url")
            .into_iter()
            .chain(values(m, "listen_url"))
        {
            out.extend(pg_secrets(url));
        }
        for url in values(m, "urls") {
            out.extend(nats_secrets(url));
        }
    }
    for var in ["DATABASE_URL", "PGBUS_LISTEN_URL"] {
        if let Ok(url) = std::env::var(var) {
            out.extend(pg_secrets(&url));
        }
    }
    if let Ok(urls) = std::env::var("NATS_URL") {
        for url in urls.split(',') {
            out.extend(nats_secrets(url));
        }
    }
    if let Ok(password) = std::env::var("PGPASSWORD") {
        push_secret(&mut out, &password);
    }
    // Too short to mask without garbling every message: a one-letter "password".
    out.retain(|s| s.chars().count() >= 3);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_found_in_urls_and_key_value_pairs() {
        assert_eq!(pg_secrets("postgres://app:s3cret@db/app"), ["s3cret"]);
        assert_eq!(
            pg_secrets("postgresql://app:p%40ss@db,db2:5433/app?sslmode=require"),
            ["p%40ss", "p@ss"]
        );
        assert_eq!(
            pg_secrets("postgres://app@db/app?password=hunter2&sslmode=disable"),
            ["hunter2"]
        );
        assert_eq!(
            pg_secrets("host=db user=app password=hunter2 dbname=x"),
            ["hunter2"]
        );
        assert_eq!(pg_secrets("host=db password = 'x y' user=app"), ["x y"]);
        assert_eq!(
            pg_secrets("host=db password='a b\\'c'"),
            ["a b\\'c", "a b'c"]
        );
        // Malformed, still found.
        assert_eq!(pg_secrets("postgres://app:pa/ss@db:notaport/x"), ["pa/ss"]);
        for none in [
            "postgres://app@db/app",
            "postgres://db/app",
            "host=/tmp user=postgres dbname=x",
            "host=db passwordless=1",
        ] {
            assert!(pg_secrets(none).is_empty(), "{none}");
        }
    }

    #[test]
    fn nats_passwords_and_tokens_are_found() {
        assert_eq!(nats_secrets("nats://relay:pw123@nats:4222"), ["pw123"]);
        assert_eq!(nats_secrets("nats://tok3n@nats:4222"), ["tok3n"]);
        assert_eq!(
            nats_secrets("nats://relay:pw/123@nats:99999999"),
            ["pw/123"]
        );
        assert!(nats_secrets("nats://nats:4222").is_empty());
        assert!(nats_secrets("tls://nats.example:4222").is_empty());
    }

    #[test]
    fn redaction_masks_every_occurrence() {
        let secrets = vec!["pw123".to_string(), "pw".to_string()];
        assert_eq!(
            redact("nats://u:pw123@h: bad port in \"pw123\"", &secrets),
            "nats://u:****@h: bad port in \"****\""
        );
    }
}
