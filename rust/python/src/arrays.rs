//! numpy inputs: a contiguous view of an array, and the dispatch on its dtype.

use numpy::{Element, PyReadonlyArrayDyn, PyUntypedArrayMethods};

/// A contiguous view of a numpy array (copied only when the input is not C-contiguous).
pub(crate) struct View<'py, T: Element> {
    arr: PyReadonlyArrayDyn<'py, T>,
    owned: Option<Vec<T>>,
}

impl<'py, T: Element + Copy> View<'py, T> {
    pub(crate) fn new(arr: PyReadonlyArrayDyn<'py, T>) -> Self {
        let owned = if arr.as_slice().is_ok() { None } else { Some(arr.as_array().iter().copied().collect()) };
        View { arr, owned }
    }
    pub(crate) fn slice(&self) -> &[T] {
        match &self.owned {
            Some(v) => v,
            None => self.arr.as_slice().unwrap(),
        }
    }
    pub(crate) fn shape(&self) -> &[usize] {
        self.arr.shape()
    }
}

/// Call `$f::<T>(View<T>, args...)` for the dtype in the list that `$obj` has. The dtype is
/// compared first, so a mismatch costs no failed extraction (and no Python exception).
/// (Declared before the modules that use it: lib.rs lists this module first.)
macro_rules! dispatch {
    ($obj:expr, $what:expr, $f:ident, [$($t:ty),*] $(, $arg:expr)*) => {{
        // the traits of the methods called here, whatever the caller imports
        use ::numpy::{PyArrayDescrMethods as _, PyUntypedArrayMethods as _};
        use ::pyo3::types::PyAnyMethods as _;
        let obj = $obj;
        let names = stringify!($($t),*);
        match obj.cast::<::numpy::PyUntypedArray>() {
            Ok(arr) => {
                let dt = arr.dtype();
                dispatch!(@try obj, dt, $what, names, $f, [$($t),*], ($($arg),*))
            }
            Err(_) => Err(::pyo3::exceptions::PyTypeError::new_err(format!(
                "{}: expected a numpy array of one of: {}, got {}", $what, names, obj.get_type()
            ))),
        }
    }};
    (@try $obj:ident, $dt:ident, $what:expr, $names:ident, $f:ident, [$t0:ty $(, $t:ty)*], $args:tt) => {
        if $dt.is_equiv_to(&::numpy::dtype::<$t0>($obj.py())) {
            let a = $obj.extract::<::numpy::PyReadonlyArrayDyn<$t0>>()?;
            dispatch!(@call $f, $t0, a, $args)
        } else {
            dispatch!(@try $obj, $dt, $what, $names, $f, [$($t),*], $args)
        }
    };
    (@try $obj:ident, $dt:ident, $what:expr, $names:ident, $f:ident, [], $args:tt) => {
        Err(::pyo3::exceptions::PyTypeError::new_err(format!("{}: unsupported input {}; pass a numpy array of one of: {}", $what, $dt, $names)))
    };
    (@call $f:ident, $t:ty, $a:ident, ($($arg:expr),*)) => {
        $f::<$t>($crate::arrays::View::new($a) $(, $arg)*)
    };
}
