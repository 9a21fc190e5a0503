// Stand-in for the header torch's CUDA builds generate (c10/cuda/impl/cuda_cmake_macros.h.in)
// and its CPU wheels leave out, so that scripts/check_bindings.sh can compile the bindings' CUDA
// branches against a CPU torch. Only for that syntax check: never on a real build's path.
#pragma once

#define C10_CUDA_BUILD_SHARED_LIBS
