use clap::Parser;
use kvpick::config::{Args, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Command::Crd) = args.command {
        print!("{}", kvpick::discovery::pool::CRD_YAML);
        return Ok(());
    }
    kvpick::telemetry::init_logging(args.log_format(), args.log_level());
    for warning in args.gie.warnings() {
        tracing::warn!("{warning}");
    }
    kvpick::server::run(args).await?;
    Ok(())
}
