//! Benchmark workloads, shared by `pgbus bench` and the criterion benches in `benches/`.

use crate::error::Result;

/// Arguments of `pgbus bench`.
#[derive(Debug, Clone, clap::Args)]
#[non_exhaustive]
pub struct BenchArgs {
    /// Print one JSON object per workload instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs the workloads `args` names and prints their figures.
///
/// # Errors
///
/// When PostgreSQL cannot be reached or a workload fails.
pub async fn run(args: BenchArgs, database_url: Option<&str>) -> Result<()> {
    let _ = (args, database_url);
    Ok(())
}
