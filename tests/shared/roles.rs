//! Login roles of a test's own, shared by the tests of pgbus's privileges
//! (`tests/security.rs`, `tests/hostile_neighbour.rs`). Roles are the cluster's, not the
//! database's: their names carry a random suffix, and they are dropped, with everything
//! they own and every privilege granted to them, when the test ends, even when it fails.

use tokio_postgres::{Config, NoTls};

/// Roles named `pgbus_<kind>_<suffix>`, in the order of the kinds asked for (a kind may
/// hold any character: the names are quoted).
pub(crate) struct Roles {
    /// The roles' names.
    pub(crate) names: Vec<String>,
    /// The connection settings of the role that made them (and drops them).
    admin: Config,
}

impl Roles {
    /// Creates one LOGIN role per kind, with nothing else granted.
    pub(crate) async fn create(admin: Config, kinds: &[&str]) -> Roles {
        let suffix = format!("{:016x}", fastrand::u64(..));
        let names: Vec<String> = kinds
            .iter()
            .map(|k| format!("pgbus_{k}_{suffix}"))
            .collect();
        let (client, connection) = admin.connect(NoTls).await.unwrap();
        tokio::spawn(connection);
        for name in &names {
            client
                .batch_execute(&format!("CREATE ROLE {} LOGIN", quote_ident(name)))
                .await
                .unwrap();
        }
        Roles { names, admin }
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (names, admin) = (self.names.clone(), self.admin.clone());
        // A runtime of its own: the test's may be gone or inside its own block_on.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let Ok((client, connection)) = admin.connect(NoTls).await else {
                    return;
                };
                tokio::spawn(connection);
                for name in names {
                    let _ = client
                        .execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                             WHERE usename = $1",
                            &[&name],
                        )
                        .await;
                    let role = quote_ident(&name);
                    let _ = client
                        .batch_execute(&format!("DROP OWNED BY {role} CASCADE; DROP ROLE {role}"))
                        .await;
                }
            });
        })
        .join();
    }
}

/// `name` as a quoted SQL identifier: a kind may hold any character.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
