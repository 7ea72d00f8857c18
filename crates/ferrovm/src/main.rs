//! `ferrovm`: the command-line program.
//!
//! Exit status of `run`: `(v << 1) | 1` when the guest writes `v` to the debug-exit port,
//! 0 on guest reset or power-off, 2 on any error (one line on stderr naming the cause),
//! 128 + signal number when stopped by SIGINT or SIGTERM.

mod cli;
mod ctl;
mod report;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command};

/// Status for every VMM error, so scripts can tell a broken setup from a guest result.
const STATUS_ERROR: u8 = 2;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("FERROVM_LOG", "warn"))
        .format_timestamp_micros()
        .init();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match cli::firecracker_args(&args) {
        Some(Ok(translated)) => args = translated,
        Some(Err(err)) => {
            eprintln!("ferrovm: {}", one_line(&err));
            return ExitCode::from(STATUS_ERROR);
        }
        None => {}
    }
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => return cli::report_usage_error(err),
    };
    match run(cli) {
        Ok(status) => ExitCode::from(status),
        Err(err) => {
            eprintln!("ferrovm: {}", one_line(&err));
            ExitCode::from(STATUS_ERROR)
        }
    }
}

/// The error and its causes on one line, each cause once: many errors already print their
/// source in their own message.
fn one_line(err: &anyhow::Error) -> String {
    let mut line = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    // Messages may carry text from a migration peer: no control characters reach the
    // terminal.
    ctl::printable(&line.replace('\n', " "))
}

fn run(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Run(args) => {
            let config = (*args).into_config()?;
            let outcome = vmm::run(config)?;
            Ok(outcome.exit_status())
        }
        Command::Accel(args) => {
            cli::print_accel(&args)?;
            Ok(0)
        }
        Command::Ctl(args) => ctl::run(&args),
    }
}
