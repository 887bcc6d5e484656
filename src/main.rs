use clap::Parser;
use kvpick::config::{Args, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(Command::Crd) = args.command {
        print!("{}", kvpick::discovery::pool::CRD_YAML);
        return Ok(());
    }
    let picker_config = args.apply_endpoint_picker_config()?;
    let mut warnings = args.gie.warnings();
    warnings.extend(picker_config.iter().flat_map(|m| m.warnings.clone()));
    if let Some(Command::CheckArgs) = args.command {
        for warning in &warnings {
            eprintln!("warning: {warning}");
        }
        let w = args.scheduler(Vec::new()).weights;
        println!("ok: cost weights {w:?}");
        return Ok(());
    }
    kvpick::telemetry::init_logging(args.log_format(), args.log_level());
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    if let Some(m) = &picker_config {
        tracing::info!(scorers = ?m.mapped, weights = ?m.weights, "EndpointPickerConfig mapped");
    }
    kvpick::server::run(args).await?;
    Ok(())
}
