use clap::Parser;
use kvpick::config::Args;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kvpick::telemetry::init_logging(args.log_format);
    kvpick::server::run(args).await?;
    Ok(())
}
