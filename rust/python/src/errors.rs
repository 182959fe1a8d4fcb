//! Errors. Every eldr-core error type maps onto one Python class, with one match arm per
//! variant: a new variant does not compile until it is given its class here, and nothing reads
//! a message to choose one. Argument and parameter errors are ValueError (Python's idiom).

use eldr_core::experts;
use eldr_core::policies::UnknownPolicy;
use eldr_core::router::ParamError;
use eldr_core::signature::SpecError;
use eldr_core::{BuildError, NoSignature, RouteError, SizeError};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(_core, CentroidFileError, PyValueError, "A centroid file is truncated, corrupt, of another version or mismatched.");
create_exception!(_core, NoSignatureError, PyValueError, "No usable signature; `reason` says why.");
create_exception!(_core, NoHealthyWorker, PyRuntimeError, "Every decode worker is marked unhealthy.");
create_exception!(_core, PayloadError, PyValueError, "A counts payload (the `eldr_signature` field) is malformed; the message says what is wrong.");
create_exception!(_core, ProfileError, PyValueError, "An expert profile cannot be built from these cells, or counted on this worker (e.g. it predates a change of layer selection).");

/// An eldr-core error as the Python exception it maps onto.
pub(crate) trait ToPyErr: std::fmt::Display + Sized {
    fn to_py(self) -> PyErr;
}

impl ToPyErr for NoSignature {
    fn to_py(self) -> PyErr {
        use NoSignature::*;
        match self {
            Missing | Timeout | Malformed | PrefillNone | PrefillNoSignature | Empty | NonFinite | Negative | OutOfRange | Shape => Python::attach(|py| {
                let err = NoSignatureError::new_err(format!("no usable signature: {self}"));
                let _ = err.value(py).setattr("reason", self.as_str());
                err
            }),
        }
    }
}

impl ToPyErr for eldr_core::CentroidFileError {
    fn to_py(self) -> PyErr {
        use eldr_core::CentroidFileError::*;
        match &self {
            Io { .. } | NotRegular { .. } | WontReplace { .. } | TooLarge { .. } | Truncated { .. } | BadMagic { .. } | Version { .. }
            | Checksum { .. } | Field { .. } | Mismatch { .. } | Invalid(_) => CentroidFileError::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for eldr_core::PayloadError {
    fn to_py(self) -> PyErr {
        use eldr_core::PayloadError::*;
        match &self {
            TooLarge { .. } | NotJson(_) | NotObject(_) | Version(_) | Field { .. } | RepeatedLayer | TooManyEntries { .. } | Encoding(_)
            | Base64(_) | DataLength { .. } | SparseLength { .. } | SparseIndex | LogBits | Experts { .. } | Layers { .. } => {
                PayloadError::new_err(self.to_string())
            }
        }
    }
}

impl ToPyErr for RouteError {
    fn to_py(self) -> PyErr {
        match self {
            RouteError::NoHealthyWorker => NoHealthyWorker::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for eldr_core::policies::ProfileError {
    fn to_py(self) -> PyErr {
        use eldr_core::policies::ProfileError::*;
        match &self {
            Dims { .. } | Lengths { .. } | NoTokens | IndexOutOfRange { .. } | BadCount(_) | WorkerOutOfRange { .. } | OtherSelection { .. }
            | Stale => ProfileError::new_err(self.to_string()),
        }
    }
}

impl ToPyErr for BuildError {
    fn to_py(self) -> PyErr {
        match self {
            BuildError::Centroids(e) => e.to_py(),
            BuildError::Size(e) => e.to_py(),
            BuildError::Spec(e) => e.to_py(),
            BuildError::Param(e) => e.to_py(),
            BuildError::NoWorkerCount => PyValueError::new_err(self.to_string()),
        }
    }
}

/// The argument errors: ValueError, each variant named so a new one is a compile error here.
macro_rules! value_errors {
    ($($t:ty => |$e:ident| $arms:pat),* $(,)?) => {$(
        impl ToPyErr for $t {
            fn to_py(self) -> PyErr {
                let $e = &self;
                match $e {
                    $arms => PyValueError::new_err(self.to_string()),
                }
            }
        }
    )*};
}
value_errors! {
    SizeError => |e| SizeError::OutOfRange { .. } | SizeError::TooLarge { .. } | SizeError::Alloc { .. },
    ParamError => |e| ParamError::Tau(_) | ParamError::LoadFactor(_),
    SpecError => |e| SpecError::NoLayers | SpecError::IdfShape { .. } | SpecError::BadWeight { .. } | SpecError::BadIdf { .. } | SpecError::NoneSelected,
    UnknownPolicy => |e| UnknownPolicy { .. },
    eldr_core::RouterSpecError => |e| eldr_core::RouterSpecError::Policy(_) | eldr_core::RouterSpecError::NotFinite { .. } | eldr_core::RouterSpecError::Range { .. }
        | eldr_core::RouterSpecError::NotLocality { .. } | eldr_core::RouterSpecError::Bind(_) | eldr_core::RouterSpecError::EldrNeedsCentroids
        | eldr_core::RouterSpecError::LocalityNeedsCentroids | eldr_core::RouterSpecError::ArmNeedsCentroids(_),
    experts::OutOfRange => |e| experts::OutOfRange { .. },
}

pub(crate) fn py_err<E: ToPyErr>(e: E) -> PyErr {
    e.to_py()
}
