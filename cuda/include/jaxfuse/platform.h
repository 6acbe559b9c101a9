// Macros that let one header serve the C++ CPU handlers (g++) and the CUDA kernels (nvcc).
#pragma once

#if defined(__CUDACC__)
#define JAXFUSE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAXFUSE_HOST_DEVICE inline
#endif
