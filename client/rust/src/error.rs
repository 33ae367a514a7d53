//! The crate's error: a gRPC status code and a message.
//!
//! Errors the daemon returns carry its code and message unchanged; failures on this side are
//! mapped onto the code gRPC itself would use (an unreachable daemon is `Unavailable`, a
//! deadline is `DeadlineExceeded`, bad arguments given to this crate are `InvalidArgument`).

use std::fmt;

use crate::tls::TlsFailure;

/// gRPC status codes (<https://grpc.github.io/grpc/core/md_doc_statuscodes.html>).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

impl Code {
    /// The code for a `grpc-status` number (unknown numbers are `Unknown`, as gRPC says).
    pub fn from_i32(v: i32) -> Code {
        use Code::*;
        match v {
            0 => Ok,
            1 => Cancelled,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            _ => Unknown,
        }
    }

    /// The canonical upper-case name, e.g. `NOT_FOUND`.
    pub fn name(self) -> &'static str {
        use Code::*;
        match self {
            Ok => "OK",
            Cancelled => "CANCELLED",
            Unknown => "UNKNOWN",
            InvalidArgument => "INVALID_ARGUMENT",
            DeadlineExceeded => "DEADLINE_EXCEEDED",
            NotFound => "NOT_FOUND",
            AlreadyExists => "ALREADY_EXISTS",
            PermissionDenied => "PERMISSION_DENIED",
            ResourceExhausted => "RESOURCE_EXHAUSTED",
            FailedPrecondition => "FAILED_PRECONDITION",
            Aborted => "ABORTED",
            OutOfRange => "OUT_OF_RANGE",
            Unimplemented => "UNIMPLEMENTED",
            Internal => "INTERNAL",
            Unavailable => "UNAVAILABLE",
            DataLoss => "DATA_LOSS",
            Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

/// A failed call: the daemon's status (code and message), or a local failure mapped onto a code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    code: Code,
    message: String,
    tls: Option<TlsFailure>,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error { code, message: message.into(), tls: None }
    }
    pub(crate) fn with_tls_failure(mut self, failure: TlsFailure) -> Error {
        self.tls = Some(failure);
        self
    }
    pub fn code(&self) -> Code {
        self.code
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    /// Why TLS failed, for a connection the TLS handshake (or the daemon's TLS alert) ended;
    /// such errors are `Unavailable` but not transient.
    pub fn tls_failure(&self) -> Option<TlsFailure> {
        self.tls
    }
    /// Worth retrying the same idempotent call (the daemon or the connection went away; a TLS
    /// failure is not: the same certificates fail the same way).
    pub fn is_transient(&self) -> bool {
        self.tls.is_none() && matches!(self.code, Code::Unavailable | Code::DeadlineExceeded)
    }
    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_their_numbers() {
        for v in 0..=16 {
            assert_eq!(Code::from_i32(v) as i32, v);
        }
        assert_eq!(Code::from_i32(17), Code::Unknown);
        assert_eq!(Code::from_i32(-1), Code::Unknown);
        let e = Error::new(Code::NotFound, "session x");
        assert_eq!(e.to_string(), "NOT_FOUND: session x");
    }
}
