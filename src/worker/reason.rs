use std::fmt;

/// A terminal reason code: CamelCase, `^[A-Z][A-Za-z0-9]{0,62}$`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reason(String);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid terminal reason code {0:?}: it must be CamelCase, match ^[A-Z][A-Za-z0-9]{{0,62}}$ (e.g. RecordNotFound)"
)]
pub struct InvalidReason(pub String);

impl Reason {
    pub fn new(code: &str) -> Result<Reason, InvalidReason> {
        let mut chars = code.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_uppercase())
            && code.len() <= 63
            && chars.all(|c| c.is_ascii_alphanumeric());
        if valid { Ok(Reason(code.to_string())) } else { Err(InvalidReason(code.to_string())) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_camel_case_codes() {
        assert_eq!(Reason::new("RecordNotFound").unwrap().as_str(), "RecordNotFound");
        assert!(Reason::new("X").is_ok());
        assert!(Reason::new(&format!("A{}", "b".repeat(62))).is_ok());
    }

    #[test]
    fn refuses_anything_else_with_a_message_that_says_the_rule() {
        for bad in ["", "recordNotFound", "Record_Not_Found", "Record Not", "Ünicode", &format!("A{}", "b".repeat(63))]
        {
            let error = Reason::new(bad).unwrap_err();
            assert!(error.to_string().contains("^[A-Z][A-Za-z0-9]{0,62}$"), "{error}");
        }
    }
}
