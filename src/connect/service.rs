//! libpq's connection service file: `service=name` (or `PGSERVICE`) takes the settings
//! of the section `[name]` of `servicefile` (or `PGSERVICEFILE`, else
//! `~/.pg_service.conf`), else of `pg_service.conf` in `PGSYSCONFDIR` (else
//! `/etc/postgresql-common`, Debian's). The connection string wins over the service,
//! and the service over the `PG*` variables, as in libpq.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The settings of service `name`, in file order.
pub(super) fn lookup(
    name: &str,
    what: &'static str,
    file: Option<PathBuf>,
    home: Option<PathBuf>,
    sysconfdir: Option<PathBuf>,
) -> Result<Vec<(String, String)>> {
    let user_file = file.or_else(|| home.map(|h| h.join(".pg_service.conf")));
    let system_file = sysconfdir
        .unwrap_or_else(|| PathBuf::from("/etc/postgresql-common"))
        .join("pg_service.conf");
    for path in user_file.into_iter().chain([system_file]) {
        if let Some(settings) = section(&path, name, what)? {
            return Ok(settings);
        }
    }
    Err(Error::invalid(
        what,
        format!("definition of service {name:?} not found"),
    ))
}

/// The section `[name]` of the file at `path`; `None` when the file does not exist or
/// has no such section.
fn section(path: &Path, name: &str, what: &'static str) -> Result<Option<Vec<(String, String)>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::invalid(what, format!("{}: {e}", path.display())));
        }
    };
    let mut inside = false;
    let mut found = None::<Vec<(String, String)>>;
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if inside {
                break;
            }
            inside = section == name;
            if inside {
                found = Some(Vec::new());
            }
            continue;
        }
        if !inside {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(Error::invalid(
                what,
                format!("{} line {}: no '=' in {line:?}", path.display(), number + 1),
            ));
        };
        let key = key.trim();
        if key == "service" {
            return Err(Error::invalid(
                what,
                format!(
                    "{} line {}: a service cannot name another service",
                    path.display(),
                    number + 1
                ),
            ));
        }
        if let Some(settings) = found.as_mut() {
            settings.push((key.to_string(), value.trim().to_string()));
        }
    }
    Ok(found)
}
