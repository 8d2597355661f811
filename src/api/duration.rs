use std::time::Duration;

/// Parses the durations the CRD admits (`90s`, `5m`, `1h30m`, `250ms`). The API server already checked the
/// pattern; this guards against objects written before a schema change.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("invalid duration {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_style_durations() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn rejects_prose() {
        assert!(parse_duration("5 minutes of fun").is_err());
    }
}
