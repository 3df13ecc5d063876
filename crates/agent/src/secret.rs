//! Tokens and other secrets: compared and sent, never printed.

use serde::Deserialize;

/// A secret string (a user's token). Its `Debug` shows no character of it,
/// so a config or client printed in a log or a panic leaks nothing.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps `s`.
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The secret itself, for the one place that sends or hashes it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// `(key, value)` options of an object store, printed without their values
/// (they hold credentials).
pub struct RedactedOptions<'a>(pub &'a [(String, String)]);

impl std::fmt::Debug for RedactedOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| format!("{k}=<redacted>")))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_no_secret() {
        let s = Secret::new("tok-alice-0123456789");
        assert!(!format!("{s:?}").contains("alice"));
        assert_eq!(s.expose(), "tok-alice-0123456789");
        let o = vec![("aws_secret_access_key".to_string(), "hunter2".to_string())];
        let shown = format!("{:?}", RedactedOptions(&o));
        assert!(shown.contains("aws_secret_access_key") && !shown.contains("hunter2"));
    }
}
