//! The harness of the tests that need PostgreSQL: pgbus-testkit's (a database of each
//! test's own, the throwaway cluster, waiting with deadlines), shared with the library's
//! tests in `tests/`.

#![allow(unused_imports, unreachable_pub)]

pub use pgbus_testkit::*;
