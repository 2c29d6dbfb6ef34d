//! The one error type: what was being done and why it failed, printed on
//! the console before the machine powers off.

use std::fmt;

/// A failed step of the hand-over.
#[derive(Debug)]
pub struct Error(String);

impl Error {
    /// An error with this description.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// Adds what was being done to a failure's cause.
pub trait Context<T> {
    /// `what: cause`.
    fn context(self, what: &str) -> Result<T, Error>;
    /// `what(): cause`, for descriptions built only on failure.
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T, Error>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: &str) -> Result<T, Error> {
        self.map_err(|cause| Error(format!("{what}: {cause}")))
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T, Error> {
        self.map_err(|cause| Error(format!("{}: {cause}", what())))
    }
}
