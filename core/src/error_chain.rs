//! An error and its causes on one line, for logs.
//!
//! kvpick's errors print their own message only and leave the cause to
//! [`std::error::Error::source`], so a chain never repeats a cause; a log line
//! that shows one error shows its whole chain through [`ErrorChain`].

use std::error::Error;
use std::fmt;

/// Displays an error, then each of its sources after `": "`.
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn each_cause_is_printed_once_in_order() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(ErrorChain(&e).to_string(), "outer: inner");
        let plain = std::io::Error::other("alone");
        assert_eq!(ErrorChain(&plain).to_string(), "alone");
    }
}
