//! Placeholder: the publish benchmarks.
fn main() {}
