//! KEDA's external scaler API (`proto/externalscaler.proto`) as Rust: server and client, compiled with protox, so
//! no `protoc` is needed. Only the operator serves it; the worker SDK builds without.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("CARGO_FEATURE_OPERATOR").is_none() {
        return Ok(());
    }
    #[cfg(feature = "operator")]
    {
        let proto = "proto/externalscaler.proto";
        println!("cargo:rerun-if-changed={proto}");
        let descriptors = protox::compile([proto], ["proto"])?;
        tonic_prost_build::configure().compile_fds(descriptors)?;
    }
    Ok(())
}
