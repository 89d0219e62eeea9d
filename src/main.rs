#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::{io::IsTerminal, process::ExitCode};

use clap::Parser;
use taskgate::{
    app::Application,
    cli::{Cli, Command},
    config::LogFormat,
    telemetry::Telemetry,
};
use tracing_subscriber::EnvFilter;

/// Runs an operator command (`alloc`, `semaphore`, `barrier`) on one
/// thread; its exit code.
fn operate(command: impl Future<Output = i32>) -> ExitCode {
    let code = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map(|rt| rt.block_on(command))
        .unwrap_or(3);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn main() -> ExitCode {
    let cli = Cli::try_parse().unwrap_or_else(|e| {
        // `taskgate agent` ends a usage error with its code for a
        // configuration error, as every other one (its exit code table).
        if e.use_stderr() && std::env::args_os().nth(1).is_some_and(|a| a == "agent") {
            let _ = e.print();
            std::process::exit(taskgate::agent::exit::CONFIG);
        }
        e.exit()
    });
    match cli.command {
        Command::Openapi => {
            print!("{}", taskgate::http::openapi::document());
            ExitCode::SUCCESS
        }
        Command::Alloc(args) => operate(taskgate::operator::run(args)),
        Command::Semaphore(args) => operate(taskgate::operator::semaphores::run(args)),
        Command::Barrier(args) => operate(taskgate::operator::barriers::run(args)),
        Command::Health(config) => {
            let healthy = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .is_ok_and(|rt| rt.block_on(taskgate::health::run(config)));
            if healthy {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::AgentCheck(config) => {
            let code = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map(|rt| rt.block_on(taskgate::agent_check::run(config)))
                .unwrap_or(2);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Command::AgentExec(args) => ExitCode::from(taskgate::agent::exec(&args)),
        Command::Agent(config) => {
            // First: from here on a process of the same user (the task)
            // can read neither the token in the agent's environment nor
            // its memory.
            let hidden = taskgate::agent::forbid_inspection();
            let filter = EnvFilter::try_new(&config.log).unwrap_or_else(|e| {
                eprintln!("taskgate agent: bad --log filter {:?}: {e}", config.log);
                std::process::exit(taskgate::agent::exit::CONFIG)
            });
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .init();
            if let Err(e) = hidden {
                tracing::warn!(
                    error = %e,
                    "cannot mark the agent non-dumpable: a process of the same user may read \
                     its environment (the token) in /proc"
                );
            }
            let code = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map(|rt| rt.block_on(taskgate::agent::run(config)))
                .unwrap_or(2);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Command::Dump(config) if config.salvage.is_some() => {
            let to = config.salvage.clone().unwrap_or_default();
            match taskgate::dump::salvage(&config, &to, &mut std::io::stdout().lock()) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(3),
                Err(e) => {
                    eprintln!("taskgate dump --salvage: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Dump(config) => {
            match taskgate::dump::run(&config, &mut std::io::stdout().lock()) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("taskgate dump: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Serve(mut config) => {
            // Before the heap grows: the setting holds for pages touched
            // from now on.
            let huge_pages = if config.transparent_huge_pages {
                Ok(())
            } else {
                taskgate::app::no_transparent_huge_pages()
            };
            let filter = match EnvFilter::try_new(&config.log) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("taskgate: bad --log filter {:?}: {e}", config.log);
                    return ExitCode::FAILURE;
                }
            };
            let telemetry = match Telemetry::from_env() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("taskgate: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match &telemetry {
                // Without traces, logs as before: nothing of them is in
                // the subscriber.
                None => {
                    let logs = tracing_subscriber::fmt().with_env_filter(filter);
                    match config.log_format {
                        LogFormat::Text => logs
                            .fmt_fields(taskgate::logs::LogFields)
                            .with_ansi(std::io::stdout().is_terminal())
                            .init(),
                        LogFormat::Json => logs.json().with_current_span(true).init(),
                    }
                }
                Some(t) => with_traces(t, filter, config.log_format),
            }
            if let Some(t) = &telemetry {
                config.traces = Some(t.traces.clone());
                tracing::info!(endpoint = %t.endpoint, "traces on: exporting spans over OTLP/HTTP");
            }
            if let Err(e) = huge_pages {
                tracing::warn!(error = %e, "cannot turn transparent huge pages off; memory per connection will be higher");
            }
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("taskgate: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let code = runtime.block_on(serve(config));
            // After the store is closed: every span of a committed change
            // is queued by now.
            if let Some(t) = telemetry
                && let Err(e) = t.shutdown()
            {
                tracing::warn!(error = %e, "the last spans could not be exported");
            }
            code
        }
    }
}

/// The subscriber with traces on: the logs as without them (their filter
/// is `--log`'s alone), and the request spans (whatever `--log` says) to
/// OpenTelemetry.
fn with_traces(telemetry: &Telemetry, filter: EnvFilter, format: LogFormat) {
    use tracing_subscriber::{
        Layer, filter::filter_fn, layer::SubscriberExt, util::SubscriberInitExt,
    };
    let spans = tracing_opentelemetry::layer()
        .with_tracer(telemetry.tracer())
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        // Nothing in a request makes OpenTelemetry spans of its own.
        .with_context_activation(false)
        .with_filter(filter_fn(|m| {
            m.is_span() && m.name() == "request" && m.target().starts_with("taskgate")
        }));
    let registry = tracing_subscriber::registry().with(spans);
    match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .fmt_fields(taskgate::logs::LogFields)
                    .with_ansi(std::io::stdout().is_terminal())
                    .with_filter(filter),
            )
            .init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_filter(filter),
            )
            .init(),
    }
}

/// Runs a subcommand's future on a new runtime; an error is printed and
/// makes the exit code 1.
async fn serve(config: taskgate::config::ServeConfig) -> ExitCode {
    let app = match Application::build(config).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("taskgate: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Before saying it listens: whoever reads that may stop it at once.
    let stop = taskgate::signals::terminated();
    tracing::info!(addr = %app.local_addr(), "taskgate listening");
    match app.run_until_stopped(stop).await {
        Ok(()) => {
            tracing::info!("taskgate stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "server failed");
            ExitCode::FAILURE
        }
    }
}
