// The Python binding of a kernel module (PYBIND11_MODULE with torch::wrap_pybind_function),
// included only by the one source of each module that binds its functions: the rest of the
// module compiles against ATen alone (common.h), about a third of the parse time.
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
