//! The statements `migrate` sends: the checks before it writes, the bootstrap, the lock
//! and the record of each migration.

/// What `migrate` asks of the server before it writes anything: `version`, its
/// `server_version_num`, and `encoding`, the database's. Sent outside a transaction, so
/// every name in it is qualified.
pub(crate) const SERVER: &str = "SELECT pg_catalog.current_setting('server_version_num')::int4 \
     AS version, (SELECT pg_catalog.pg_encoding_to_char(d.encoding) FROM pg_catalog.pg_database AS d \
     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) AS encoding";

/// The first statements of each of `migrate`'s transactions, for this transaction only
/// (so that it works behind a transaction-mode pooler):
///
/// - the pinned search_path ([`PINNED_SEARCH_PATH`](crate::schema::PINNED_SEARCH_PATH)): the migrations' statements, and the
///   expressions they store (constraints, defaults, trigger conditions, bound to their
///   operators when created), find only pg_catalog's and pgbus's objects;
/// - `client_min_messages = warning`: the server's notices (`schema "pgbus" already
///   exists, skipping`, `drop cascades to ...`) are not sent, where the client's driver
///   would log each one at INFO (tokio-postgres and sqlx do) on every start. Warnings and
///   errors still are. `migrate` logs what it applied itself.
pub(crate) const PIN: &str = "SET LOCAL search_path = pg_catalog, pgbus, pg_temp; \
     SET LOCAL client_min_messages = warning";

/// What in the `pgbus` schema the migrating role did not create and must not run or
/// adopt, one row (`problem text`) each: the schema and every object in it (relations,
/// functions, types, operators, ...) owned by a role that is neither the migrating role,
/// nor a role it is granted (transitively), nor a superuser; a trigger on a pgbus table
/// whose function is owned by such a role or lives outside the schema; CREATE on the
/// schema, or TRIGGER on one of its tables, granted to such a role or to PUBLIC. No row
/// when the schema does not exist. Run with [`PIN`]'s search_path.
///
/// A superuser's `pg_has_role` answers true for every role, so membership is read from
/// `pg_auth_members` itself: a superuser migrating trusts only its own objects, its
/// roles' and other superusers'.
pub(crate) const UNSAFE_OBJECTS: &str = r#"
WITH RECURSIVE member_of(oid) AS (
    SELECT r.oid FROM pg_catalog.pg_roles AS r WHERE r.rolname = current_user
  UNION
    SELECT m.roleid FROM pg_catalog.pg_auth_members AS m JOIN member_of ON m.member = member_of.oid
),
trusted(oid) AS (
    SELECT oid FROM member_of
  UNION
    SELECT r.oid FROM pg_catalog.pg_roles AS r WHERE r.rolsuper
),
ns AS (
    SELECT n.oid, n.nspowner, n.nspacl FROM pg_catalog.pg_namespace AS n WHERE n.nspname = 'pgbus'
),
owned(what, owner) AS (
    SELECT 'schema pgbus', ns.nspowner FROM ns
  UNION ALL
    SELECT CASE c.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'table' WHEN 'S' THEN 'sequence'
                          WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view'
                          WHEN 'f' THEN 'foreign table' WHEN 'c' THEN 'composite type'
                          WHEN 'i' THEN 'index' WHEN 'I' THEN 'index' ELSE 'relation' END
           || ' pgbus.' || quote_ident(c.relname), c.relowner
    FROM pg_catalog.pg_class AS c JOIN ns ON c.relnamespace = ns.oid
    WHERE c.relkind NOT IN ('i', 'I') -- an index is its table's
  UNION ALL
    SELECT CASE p.prokind WHEN 'p' THEN 'procedure' WHEN 'a' THEN 'aggregate' ELSE 'function' END
           || ' pgbus.' || quote_ident(p.proname) || '(' || pg_get_function_identity_arguments(p.oid) || ')',
           p.proowner
    FROM pg_catalog.pg_proc AS p JOIN ns ON p.pronamespace = ns.oid
  UNION ALL
    SELECT 'type pgbus.' || quote_ident(t.typname), t.typowner
    FROM pg_catalog.pg_type AS t JOIN ns ON t.typnamespace = ns.oid
    -- not a relation's row type, nor an array type made with its element type
    WHERE t.typrelid = 0
      AND NOT EXISTS (SELECT FROM pg_catalog.pg_type AS e WHERE e.typarray = t.oid)
  UNION ALL
    SELECT 'operator pgbus.' || o.oprname || '(' || coalesce(format_type(o.oprleft, NULL), 'NONE')
           || ', ' || coalesce(format_type(o.oprright, NULL), 'NONE') || ')', o.oprowner
    FROM pg_catalog.pg_operator AS o JOIN ns ON o.oprnamespace = ns.oid
  UNION ALL
    SELECT 'collation pgbus.' || quote_ident(x.collname), x.collowner
    FROM pg_catalog.pg_collation AS x JOIN ns ON x.collnamespace = ns.oid
  UNION ALL
    SELECT 'conversion pgbus.' || quote_ident(x.conname), x.conowner
    FROM pg_catalog.pg_conversion AS x JOIN ns ON x.connamespace = ns.oid
  UNION ALL
    SELECT 'operator class pgbus.' || quote_ident(x.opcname), x.opcowner
    FROM pg_catalog.pg_opclass AS x JOIN ns ON x.opcnamespace = ns.oid
  UNION ALL
    SELECT 'operator family pgbus.' || quote_ident(x.opfname), x.opfowner
    FROM pg_catalog.pg_opfamily AS x JOIN ns ON x.opfnamespace = ns.oid
  UNION ALL
    SELECT 'text search configuration pgbus.' || quote_ident(x.cfgname), x.cfgowner
    FROM pg_catalog.pg_ts_config AS x JOIN ns ON x.cfgnamespace = ns.oid
  UNION ALL
    SELECT 'text search dictionary pgbus.' || quote_ident(x.dictname), x.dictowner
    FROM pg_catalog.pg_ts_dict AS x JOIN ns ON x.dictnamespace = ns.oid
  UNION ALL
    SELECT 'statistics object pgbus.' || quote_ident(x.stxname), x.stxowner
    FROM pg_catalog.pg_statistic_ext AS x JOIN ns ON x.stxnamespace = ns.oid
),
grantee(oid, name) AS (
    SELECT a.grantee, a.privilege_type || ' on schema pgbus'
    FROM ns, aclexplode(ns.nspacl) AS a WHERE a.privilege_type = 'CREATE'
  UNION ALL
    SELECT a.grantee, a.privilege_type || ' on pgbus.' || quote_ident(c.relname)
    FROM pg_catalog.pg_class AS c JOIN ns ON c.relnamespace = ns.oid, aclexplode(c.relacl) AS a
    WHERE a.privilege_type = 'TRIGGER'
)
SELECT o.what || ' is owned by ' || quote_ident(pg_get_userbyid(o.owner)) AS problem
FROM owned AS o WHERE o.owner NOT IN (SELECT oid FROM trusted)
UNION ALL
SELECT 'trigger ' || quote_ident(tg.tgname) || ' on pgbus.' || quote_ident(c.relname) || ' runs '
       || quote_ident(fn.nspname) || '.' || quote_ident(p.proname) || '(), owned by '
       || quote_ident(pg_get_userbyid(p.proowner))
FROM pg_catalog.pg_trigger AS tg
JOIN pg_catalog.pg_class AS c ON c.oid = tg.tgrelid
JOIN ns ON c.relnamespace = ns.oid
JOIN pg_catalog.pg_proc AS p ON p.oid = tg.tgfoid
JOIN pg_catalog.pg_namespace AS fn ON fn.oid = p.pronamespace
WHERE NOT tg.tgisinternal
  AND (p.proowner NOT IN (SELECT oid FROM trusted) OR p.pronamespace <> ns.oid)
UNION ALL
SELECT g.name || ' is granted to '
       || CASE WHEN g.oid = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.oid)) END
FROM grantee AS g WHERE g.oid NOT IN (SELECT oid FROM trusted)
ORDER BY 1"#;

/// Creates the schema and the table that records migrations where they do not exist,
/// and never touches them where they do (their owners were checked first, with
/// [`UNSAFE_OBJECTS`]). Two first migrations at once: one creates each, the other fails
/// with `duplicate_schema` or `unique_violation` and starts again (see `crate::schema`). Run with
/// [`PIN`]'s search_path.
pub(crate) const BOOTSTRAP: &str = "\
DO $bootstrap$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = 'pgbus') THEN
        CREATE SCHEMA pgbus;
    END IF;
    IF pg_catalog.to_regclass('pgbus.schema_migrations') IS NULL THEN
        CREATE TABLE pgbus.schema_migrations (
            version    integer     PRIMARY KEY,
            name       text        NOT NULL,
            checksum   text        NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now()
        );
    END IF;
END
$bootstrap$";

/// Serializes migrations: a lock on the table that records them, which only its owner
/// (and roles granted UPDATE, DELETE or TRUNCATE on it, which pgbus grants nobody) can
/// take, held to the end of the transaction. A role that can merely connect cannot hold
/// it, as it could hold an advisory lock on a fixed key. Readers of the table
/// (`schema_version`) are not blocked.
pub(crate) const LOCK: &str = "LOCK TABLE pgbus.schema_migrations IN SHARE ROW EXCLUSIVE MODE";

/// Whether a migration is recorded, and with the same content: no row, or `same`.
/// `$1 int4` version, `$2 text` its SQL.
pub(crate) const RECORDED: &str = "SELECT checksum = md5($2::text) AS same \
     FROM pgbus.schema_migrations WHERE version = $1";

/// Records an applied migration. `$1 int4` version, `$2 text` name, `$3 text` its SQL.
pub(crate) const RECORD: &str = "INSERT INTO pgbus.schema_migrations (version, name, checksum) \
     VALUES ($1, $2, md5($3::text))";

/// Asks for the role `migrate` runs as, to name it in [`Error::UnsafeSchema`](crate::Error::UnsafeSchema).
pub(crate) const CURRENT_ROLE: &str = "SELECT current_user::text AS role";

/// Whether this database was ever migrated: `migrated`.
pub(crate) const MIGRATED: &str =
    "SELECT pg_catalog.to_regclass('pgbus.schema_migrations') IS NOT NULL AS migrated";

/// The newest migration applied: `version` (NULL when none is recorded).
pub(crate) const SCHEMA_VERSION: &str =
    "SELECT pg_catalog.max(version) AS version FROM pgbus.schema_migrations";
