// The names a build's Python module is made under: the extension's and each step kernel module's (Python's C API, no
// pybind11). `TORCH_EXTENSION_NAME` is the build's name, which torch's cpp_extension defines.
#pragma once
#define MIXEDPREC_STR2(x) #x
#define MIXEDPREC_STR(x) MIXEDPREC_STR2(x)
#define MIXEDPREC_CAT2(a, b) a##b
#define MIXEDPREC_CAT(a, b) MIXEDPREC_CAT2(a, b)
#define MIXEDPREC_MODULE_NAME MIXEDPREC_STR(TORCH_EXTENSION_NAME)
#define MIXEDPREC_PYINIT MIXEDPREC_CAT(PyInit_, TORCH_EXTENSION_NAME)
