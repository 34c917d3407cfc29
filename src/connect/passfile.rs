//! The password file (`~/.pgpass`, `passfile`, `PGPASSFILE`), read as libpq reads it.

use std::path::Path;

use tokio_postgres::config::Host;

use super::ConnectConfig;
use super::startup::Target;

impl ConnectConfig {
    /// The password for `target` from the password file, when no password was given:
    /// libpq reads the file for each host it tries.
    pub(super) fn passfile_password(
        &self,
        pg: &tokio_postgres::Config,
        target: &Target,
    ) -> Option<String> {
        if pg.get_password().is_some() {
            return None;
        }
        let user = pg.get_user()?;
        password_from_file(
            self.passfile.as_deref()?,
            target,
            pg.get_dbname().unwrap_or(user),
            user,
        )
    }
}

/// The password of the first line of a password file that matches the host, its port,
/// the database and the user; `None` when none does, or the file cannot be read, or
/// others may read it (as libpq, which warns and ignores such a file).
fn password_from_file(file: &Path, target: &Target, dbname: &str, user: &str) -> Option<String> {
    let meta = std::fs::metadata(file).ok()?;
    if !meta.is_file() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            crate::warn_limited!(
                file = %file.display(),
                "pgbus ignores the password file: group or others may read it (chmod 0600)"
            );
            return None;
        }
    }
    let text = std::fs::read_to_string(file).ok()?;
    let hosts: Vec<String> = match &target.host {
        Host::Tcp(h) => vec![h.clone()],
        #[cfg(unix)]
        Host::Unix(path) => vec![path.display().to_string(), "localhost".to_string()],
    };
    let port = target.port.to_string();
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(pgpass_fields)
        .find(|f| {
            let ok = |field: &str, value: &str| field == "*" || field == value;
            hosts.iter().any(|h| ok(&f[0], h))
                && ok(&f[1], &port)
                && ok(&f[2], dbname)
                && ok(&f[3], user)
        })
        .map(|f| f[4].clone())
}

/// A password file line's five fields, `\:` and `\\` unescaped.
fn pgpass_fields(line: &str) -> Option<[String; 5]> {
    let mut fields: Vec<String> = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut()?.push(chars.next().unwrap_or('\\')),
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut()?.push(c),
        }
    }
    fields.try_into().ok()
}
