use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ember_dashboard::Dashboard;

#[derive(Args, Debug)]
pub struct DashboardArgs {
    /// The folder of run directories (each with a metrics.jsonl), searched a few levels deep.
    #[arg(long, default_value = "runs")]
    logdir: PathBuf,
    #[arg(long, default_value_t = 8686)]
    port: u16,
    /// Address to listen on; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
}

/// Starts serving `logdir`; the server runs on background threads.
pub fn start(logdir: &std::path::Path, host: IpAddr, port: u16) -> anyhow::Result<Dashboard> {
    let dashboard = Dashboard::start(logdir, SocketAddr::new(host, port), 2)
        .with_context(|| format!("starting the dashboard over {}", logdir.display()))?;
    if !host.is_loopback() {
        tracing::warn!("the dashboard listens on {host}: other machines can read the runs");
    }
    eprintln!("dashboard: http://{} (log directory {})", dashboard.addr(), logdir.display());
    Ok(dashboard)
}

pub fn run(args: DashboardArgs) -> anyhow::Result<()> {
    start(&args.logdir, args.host, args.port)?.wait();
    Ok(())
}
