//! `taskgate-bench`: the load benchmark (BENCHMARKS.md), the soak test's
//! client process and the ceiling the benchmark compares against. A
//! workspace member of its own: none of it ships in the service binary.

mod scenarios;
mod soak;

use std::{net::SocketAddr, process::ExitCode};

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "taskgate-bench",
    version,
    about = "Benchmark taskgate: start servers of the taskgate binary and measure them (BENCHMARKS.md)",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    tool: Option<Tool>,
    #[command(flatten)]
    bench: scenarios::BenchConfig,
}

#[derive(Debug, Subcommand)]
enum Tool {
    /// One client process of the soak test (bench/tests/soak.rs).
    #[command(hide = true)]
    SoakClient(soak::SoakConfig),
    /// A bare axum 200 handler: the ceiling the benchmark compares against.
    #[command(hide = true)]
    Ceiling {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
    },
}

/// What a tool runs.
type Run = std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<()>>>>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (name, run): (&str, Run) = match cli.tool {
        None => ("bench", Box::pin(scenarios::run(cli.bench))),
        Some(Tool::SoakClient(config)) => ("soak-client", Box::pin(soak::run(config))),
        Some(Tool::Ceiling { listen }) => {
            tracing_subscriber::fmt().with_ansi(false).init();
            ("ceiling", Box::pin(scenarios::ceiling(listen)))
        }
    };
    match tokio::runtime::Runtime::new().and_then(|rt| rt.block_on(run)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("taskgate-bench {name}: {e}");
            ExitCode::FAILURE
        }
    }
}
