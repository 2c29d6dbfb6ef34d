//! Log setup of the agent (the CLI sets up the same): a level from `KEEL_LOG`
//! (error, warn, info, debug, trace), to stderr, colour only on a terminal.

/// Installs the global subscriber; `default` applies when `KEEL_LOG` is unset or invalid.
pub fn init(default: tracing::Level) {
    let level = std::env::var("KEEL_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(default);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
