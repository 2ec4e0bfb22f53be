use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ember_dashboard::{Dashboard, Options};

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
    /// A host name the page may be opened under besides localhost and the listening address
    /// (e.g. the machine's DNS name with --host 0.0.0.0); repeatable. Other names get 403, which
    /// keeps web pages from reading the runs through DNS rebinding.
    #[arg(long = "allow-host", value_name = "NAME")]
    allow_hosts: Vec<String>,
}

/// Starts serving `logdir`; the server runs on threads of its own, at a lower priority (only on
/// otherwise idle CPU time when it is `ember train --dashboard`'s, `trainer_of` the run it trains:
/// the page then says so, and the server answers until a watching page has the final metrics).
pub fn start(
    logdir: &std::path::Path,
    host: IpAddr,
    port: u16,
    allow_hosts: &[String],
    trainer_of: Option<&str>,
) -> anyhow::Result<Dashboard> {
    let mut allowed = allow_hosts.to_vec();
    if !host.is_unspecified() {
        allowed.push(host.to_string());
    }
    let options = Options {
        threads: 2,
        allowed_hosts: allowed,
        idle_priority: trainer_of.is_some(),
        trainer_of: trainer_of.map(str::to_string),
        ..Options::default()
    };
    let dashboard = ember_dashboard::start(logdir, SocketAddr::new(host, port), options)
        .with_context(|| format!("starting the dashboard over {}", logdir.display()))?;
    if !host.is_loopback() {
        tracing::warn!("the dashboard listens on {host}: other machines can read the runs");
    }
    eprintln!("dashboard: http://{} (log directory {})", dashboard.addr(), logdir.display());
    Ok(dashboard)
}

pub fn run(args: DashboardArgs) -> anyhow::Result<()> {
    start(&args.logdir, args.host, args.port, &args.allow_hosts, None)?.wait();
    Ok(())
}
