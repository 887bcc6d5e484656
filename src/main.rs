use clap::Parser;
use kvpick::config::{Args, Command};

kvpick::global_allocator!();

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(Command::Crd) = args.command {
        print!("{}", kvpick::discovery::pool::CRD_YAML);
        return Ok(());
    }
    if let Some(Command::Explain(e)) = &args.command {
        let body = if e.file.as_os_str() == "-" {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)?;
            b
        } else {
            std::fs::read(&e.file)?
        };
        let request = kvpick::server::admin::ExplainRequest {
            body,
            path: e.path.clone(),
            session_id: e.session_id.clone().unwrap_or_default(),
            subset: Vec::new(),
        };
        let answer = kvpick::server::admin::call_explain(e.admin.clone(), request).await?;
        println!(
            "{}",
            serde_json::to_string_pretty(&kvpick::server::admin::to_json(&answer))?
        );
        return Ok(());
    }
    let picker_config = args.apply_endpoint_picker_config()?;
    let mut warnings = args.gie.warnings();
    warnings.extend(picker_config.iter().flat_map(|m| m.warnings.clone()));
    if let Some(Command::CheckArgs) = args.command {
        for warning in &warnings {
            eprintln!("warning: {warning}");
        }
        let weights = picker_config.as_ref().map(|m| &m.weights);
        println!(
            "ok: cost weights {}",
            weights.unwrap_or(&args.scheduling.weights.0)
        );
        return Ok(());
    }
    // Inside the runtime: the OTLP client runs on it.
    let traces = kvpick::telemetry::tracing_export::TraceSettings::from_env(args.gie.tracing)?
        .map(|s| kvpick::telemetry::tracing_export::Exporter::start(&s))
        .transpose()?;
    kvpick::telemetry::init_logging(args.log_format(), args.log_level(), traces.as_ref());
    if traces.is_some() {
        tracing::info!("exporting OpenTelemetry traces over OTLP/gRPC");
    }
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    if let Some(m) = &picker_config {
        tracing::info!(scorers = ?m.mapped, weights = %m.weights, "EndpointPickerConfig mapped");
    }
    kvpick::server::run(args).await?;
    // Dropping the exporter flushes the spans still queued.
    drop(traces);
    Ok(())
}
